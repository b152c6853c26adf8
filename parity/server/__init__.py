"""``parity serve``: an OpenAI-compatible HTTP server over one model.

- ``protocol``: request bodies checked and turned into generation requests; OpenAI's error
  shape.
- ``engine``: the model's KV-cache slots, the FIFO queue and the thread that runs the steps.
- ``metrics``: counters and histograms in Prometheus text format.
- ``app``: the FastAPI routes, authentication, body limits and server-sent events.

FastAPI and uvicorn come with the ``serve`` extra; nothing here is imported by the rest of
parity.
"""
