"""`parity serve` as clients meet it: a real uvicorn process on 127.0.0.1 with an ephemeral
port, driven by the official ``openai`` client (and httpx for what the client hides)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the server's tests need the openai client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="pip install 'parity[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'parity[serve]'")

import parity  # noqa: E402
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf  # noqa: E402
from parity.gguf.writer import tiny_bpe_tokenizer  # noqa: E402

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NAME = "tiny"
# a streamed request that runs until the context is full (seconds on the tiny model)
LONG = {"model": NAME, "prompt": "hello", "max_tokens": 100000, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    spec, weights = synthetic_model(tiny_spec("llama", n_ctx_train=4096), seed=5)
    path = tmp_path_factory.mktemp("serve") / f"{NAME}.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer(), chat_template=CHATML)
    return str(path)


class Served:
    def __init__(self, model_path: str, *args: str, ctx: int = 256) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PARITY_CPU_KERNELS": "numpy"}  # no JIT compile at start-up
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "parity", "serve", "-m", model_path, "-b", "cpu",
             "--port", str(self.port), "--ctx", str(ctx), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("the server did not come up in 60 s")

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def stop(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


@pytest.fixture(scope="module")
def server(model_path):
    s = Served(model_path, "--slots", "2", "--queue", "64", "--max-body", "65536")
    yield s
    out = s.stop()
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def reference(model_path):
    """The same model in this process: what `parity run --temperature 0` gives."""
    m = parity.load(model_path, backend="cpu", n_ctx=256, progress=False)
    yield m
    m.close()


def _greedy(reference, text: str, n: int) -> str:
    reference.reset()
    return reference.generate(text, max_tokens=n, temperature=0.0).complete().text


def _chat(client, content: str, **kw):
    return client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], **kw
    )


# -- the happy paths -------------------------------------------------------------------------


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_completion_is_the_greedy_run(server, reference):
    r = server.client().completions.create(model=NAME, prompt="hello world", max_tokens=12,
                                           temperature=0)  # fmt: skip
    assert r.object == "text_completion" and r.model == NAME
    assert r.choices[0].text == _greedy(reference, "hello world", 12)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(reference.tokenize("hello world"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_whole_and_streamed_agree(server, reference):
    client = server.client()
    whole = _chat(client, "hi there", max_tokens=10, temperature=0, seed=1)
    prompt = reference.render_chat([{"role": "user", "content": "hi there"}])
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == _greedy(reference, prompt, 10)
    chunks = list(_chat(client, "hi there", max_tokens=10, temperature=0, stream=True,
                        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streamed_completion_ends_with_done(server):
    body = {"model": NAME, "prompt": "a b", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    objects = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(o["object"] == "text_completion" for o in objects)


def test_logprobs_of_the_greedy_tokens(server):
    r = _chat(server.client(), "hello", max_tokens=4, temperature=0, logprobs=True,
              top_logprobs=3)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy picks the likeliest


def test_stop_strings_and_unknown_fields(server, reference):
    full = _greedy(reference, "hello world", 16)
    stop = full[3:5] if len(full) >= 5 else None
    r = server.client().completions.create(
        model=NAME, prompt="hello world", max_tokens=16, temperature=0, stop=stop,
        extra_body={"frobnicate": 3, "top_k": 1, "min_p": 0.0, "repeat_penalty": 1.0},
    )  # fmt: skip
    if stop:
        assert r.choices[0].text == full[: full.index(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_a_growing_chat_reuses_its_slots_cache(server):
    client = server.client()
    turns = [{"role": "system", "content": "be brief and kind"},
             {"role": "user", "content": "hello there"}]  # fmt: skip
    first = client.chat.completions.create(model=NAME, messages=turns, max_tokens=6,
                                           temperature=0)  # fmt: skip
    turns += [{"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "and again"}]  # fmt: skip
    second = client.chat.completions.create(model=NAME, messages=turns, max_tokens=6,
                                            temperature=0)  # fmt: skip
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1  # the first turn was not evaluated again


# -- concurrency -----------------------------------------------------------------------------


def test_sixteen_concurrent_streams_each_get_their_answer(server, reference):
    prompts = [f"word{i} hello" for i in range(16)]
    want = {p: _greedy(reference, p, 12) for p in prompts}

    def stream(p: str) -> str:
        chunks = server.client().completions.create(model=NAME, prompt=p, max_tokens=12,
                                                    temperature=0, stream=True)  # fmt: skip
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(16) as pool:
        got = dict(zip(prompts, pool.map(stream, prompts), strict=True))
    assert got == want


def test_a_disconnect_frees_the_slot(model_path):
    s = Served(model_path, "--slots", "1", "--queue", "4", ctx=2048)
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json=LONG) as r:
            next(r.iter_lines())  # the generation has started; now go away (closes it)
        t0 = time.monotonic()
        r = s.client().completions.create(model=NAME, prompt="x", max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop")
        # served at once, not after the ~2000 abandoned tokens (seconds on this model)
        assert time.monotonic() - t0 < 3
    finally:
        assert "Traceback" not in s.stop()


def test_health_answers_during_a_generation_and_a_full_queue_is_429(model_path):
    s = Served(model_path, "--slots", "1", "--queue", "0", ctx=2048)
    try:
        with httpx.stream("POST", s.url + "/v1/completions", json=LONG) as r:
            lines = r.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)
            waits = []
            for _ in range(3):  # the best of three, on a machine that may be busy
                t0 = time.monotonic()
                assert httpx.get(s.url + "/health").status_code == 200
                waits.append(time.monotonic() - t0)
            assert min(waits) < 0.1, waits
            busy = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert busy.status_code == 429, busy.text
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "server_busy"
    finally:
        assert "Traceback" not in s.stop()


def test_a_bounded_load_run_loses_no_request(server):
    """64 requests from 12 threads within a time bound: each completes or gets a clear 429."""
    results: list[tuple[str, float]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.monotonic()
        try:
            chunks = server.client().completions.create(
                model=NAME, prompt=f"load {i}", max_tokens=8, temperature=0.5, seed=i,
                stream=True)  # fmt: skip
            first = None
            for _ in chunks:
                first = first or time.monotonic() - t0
            outcome = "ok"
        except openai.RateLimitError:
            outcome, first = "429", 0.0
        with lock:
            results.append((outcome, first or 0.0))

    t0 = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(64)))
    elapsed = time.monotonic() - t0
    assert len(results) == 64 and {o for o, _ in results} <= {"ok", "429"}
    ttft = sorted(t for o, t in results if o == "ok")
    print(f"\nload: 64 requests in {elapsed:.1f} s, {len(ttft)} ok, "
          f"{64 - len(ttft)} refused (429), TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms, "
          f"p99 {ttft[int(0.99 * (len(ttft) - 1))] * 1e3:.0f} ms")  # fmt: skip
    assert elapsed < 120


# -- bad input -------------------------------------------------------------------------------


def _post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes | str):
        return httpx.post(server.url + path, content=body,
                          headers={"content-type": "application/json"}, **kw)  # fmt: skip
    return httpx.post(server.url + path, json=body, **kw)


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_value"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
         "invalid_value"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "invalid_value"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "invalid_value"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "invalid_value"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "invalid_value"),
        ("/v1/completions", {"prompt": 7}, 400, "invalid_value"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model_not_found"),
        ("/v1/completions", {"prompt": "hello " * 300}, 400, "context_length_exceeded"),
        ("/v1/completions", {"prompt": "x" * 70000}, 413, "request_too_large"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(server, path, body, status, code):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and "Traceback" not in r.text


def test_the_client_sees_a_context_error_as_a_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client().completions.create(model=NAME, prompt="hello " * 300, max_tokens=4)


def _chat_400(tmp_path, chat_template: str | None) -> tuple[str, str]:
    """Serve a tiny model with ``chat_template`` (None: none), send one chat request, check it
    is a 400 chat_template_error and that completions still work; (its message, the log)."""
    spec, weights = synthetic_model(tiny_spec("llama"), seed=5)
    path = tmp_path / "tiny.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer(),
                     chat_template=chat_template)  # fmt: skip
    s = Served(str(path))
    try:
        r = httpx.post(s.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_error"
        done = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert done.status_code == 200
    finally:
        out = s.stop()
    assert "Traceback" not in out
    return r.json()["error"]["message"], out


def test_a_hostile_chat_template_is_a_clear_400(tmp_path):
    message, _ = _chat_400(tmp_path, "{{ 'a' * 10**10 }}")
    assert "too large" in message


def test_a_model_without_a_chat_template_warns_and_answers_chat_with_a_400(tmp_path):
    message, log = _chat_400(tmp_path, None)
    assert "--template FILE" in message and "has no chat template" in log


def test_binding_beyond_loopback_without_a_key_warns(model_path):
    s = Served(model_path, "--host", "0.0.0.0")
    out = s.stop()
    assert "without --api-key" in out and "Traceback" not in out


def test_api_key(model_path):
    s = Served(model_path, "--api-key", "sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert [m.id for m in s.client("sesame").models.list()] == [NAME]
        assert s.client("sesame").completions.create(model=NAME, prompt="x", max_tokens=1)
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()
