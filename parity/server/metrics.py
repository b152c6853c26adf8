"""The server's counters and histograms, written in Prometheus' text format (``/metrics``)."""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {self.sum}", f"{name}_count {total}"]


class Metrics:
    """Requests by endpoint and status, tokens in and out, the queue, TTFT and per-token
    latency. Updated from the event loop and the engine thread, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.queue_depth = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.token = Histogram(TOKEN_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def count_tokens(self, prompt: int, generated: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_token(self, seconds: float) -> None:
        with self._lock:
            self.token.observe(seconds)

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP parity_requests_total HTTP requests by endpoint and status.",
                "# TYPE parity_requests_total counter",
                *(f'parity_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.requests.items())),
                "# HELP parity_prompt_tokens_total Prompt tokens of finished requests.",
                "# TYPE parity_prompt_tokens_total counter",
                f"parity_prompt_tokens_total {self.prompt_tokens}",
                "# HELP parity_generated_tokens_total Tokens generated.",
                "# TYPE parity_generated_tokens_total counter",
                f"parity_generated_tokens_total {self.generated_tokens}",
                "# HELP parity_queue_depth Requests waiting for a slot.",
                "# TYPE parity_queue_depth gauge",
                f"parity_queue_depth {self.queue_depth}",
                "# HELP parity_time_to_first_token_seconds From arrival to the first token.",
                "# TYPE parity_time_to_first_token_seconds histogram",
                *self.ttft.lines("parity_time_to_first_token_seconds"),
                "# HELP parity_time_per_token_seconds Each decode step of a request.",
                "# TYPE parity_time_per_token_seconds histogram",
                *self.token.lines("parity_time_per_token_seconds"),
            ]  # fmt: skip
        return "\n".join(lines) + "\n"
