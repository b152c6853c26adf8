"""The HTTP side: FastAPI routes over one ``Engine``.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as server-sent events
ending in ``data: [DONE]``, or whole), ``GET /v1/models``, ``GET /health`` and ``GET
/metrics``. With an API key, the ``/v1`` routes need ``Authorization: Bearer KEY``. Bodies are
read up to a limit (413 beyond it); every error is OpenAI's ``{"error": {...}}`` shape, never a
traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from parity.errors import ChatTemplateError, ContextLengthError, ParityError
from parity.generation.generate import Piece, TokenLogprob
from parity.server.engine import DONE, Engine, Job
from parity.server.metrics import Metrics
from parity.server.protocol import ApiError, CompletionRequest, parse_request

MAX_BODY = 1 << 20  # bytes
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class Server:
    """What the routes share: the model, its served name, the engine, the settings."""

    def __init__(
        self,
        model: Any,
        name: str,
        *,
        slots: int = 1,
        queue: int = 16,
        api_key: str | None = None,
        max_body: int = MAX_BODY,
    ) -> None:
        self.model = model
        self.name = name
        self.api_key = api_key
        self.max_body = max_body
        self.metrics = Metrics()
        self.engine = Engine(model, slots=slots, queue=queue, metrics=self.metrics)
        self.created = int(time.time())


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="parity", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)  # fmt: skip

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        server.metrics.count_request(request.url.path, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        print(f"parity serve: {request.url.path}: {type(e).__name__}: {e}", file=sys.stderr)
        error = ApiError(500, "internal server error", type="server_error")
        return await _api_error(request, error)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "waiting": server.engine.waiting}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _authorize(server, request)
        return {
            "object": "list",
            "data": [
                {"id": server.name, "object": "model", "created": server.created,
                 "owned_by": "parity"}
            ],
        }  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(server, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(server, request, chat=False)

    return app


def _authorize(server: Server, request: Request) -> None:
    if server.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), server.api_key):
        raise ApiError(
            401,
            "a valid API key is needed: send 'Authorization: Bearer KEY'",
            type="authentication_error",
            code="invalid_api_key",
        )


async def _read_json(server: Server, request: Request) -> Any:
    declared = request.headers.get("content-length")
    too_big = ApiError(
        413, f"the request body is over {server.max_body} bytes", code="request_too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > server.max_body:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > server.max_body:
            raise too_big
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(
            400, f"the request body is not valid JSON: {e}", code="invalid_json"
        ) from None


def _prompt_ids(server: Server, req: CompletionRequest) -> list[int]:
    model = server.model
    try:
        text = model.render_chat(req.messages) if req.chat else req.prompt
        ids = model.tokenize(text)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), code="chat_template_error") from None
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", code="invalid_value",
                       param="prompt")  # fmt: skip
    if len(ids) >= model.n_ctx:
        raise ApiError(
            400,
            f"the prompt is {len(ids)} tokens but the context holds {model.n_ctx} (and one "
            "more is needed to answer); shorten it",
            code="context_length_exceeded",
            param="messages" if req.chat else "prompt",
        )
    return ids


async def _complete(server: Server, request: Request, *, chat: bool) -> Response:
    endpoint = request.url.path
    _authorize(server, request)
    req = parse_request(await _read_json(server, request), chat=chat)
    if req.model is not None and req.model != server.name:
        raise ApiError(
            404,
            f"the model {req.model!r} does not exist here; this server runs {server.name!r}",
            code="model_not_found",
            param="model",
        )
    ids = _prompt_ids(server, req)
    room = server.model.n_ctx - len(ids)
    job = Job(
        prompt=ids,
        max_tokens=room if req.max_tokens is None else min(req.max_tokens, room),
        sampling=req.sampling,
        stop=req.stop,
        logprobs=req.top_logprobs if req.logprobs else None,
        loop=asyncio.get_running_loop(),
        ignore_eos=req.ignore_eos,
    )
    server.engine.submit(job)  # ApiError 429 when the queue is full
    answer = _Answer(server, req, job)
    if req.stream:
        server.metrics.count_request(endpoint, 200)
        return StreamingResponse(
            answer.events(request), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )  # fmt: skip
    try:
        body = await answer.whole(request)
    finally:
        job.cancel()  # a no-op once it has finished; frees the slot if the client left
    server.metrics.count_request(endpoint, 200)
    return JSONResponse(body)


class _Answer:
    """A job's pieces as OpenAI objects: chunks for a stream, or one whole response."""

    def __init__(self, server: Server, req: CompletionRequest, job: Job) -> None:
        self.server, self.req, self.job = server, req, job
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"

    async def _pieces(self, request: Request | None) -> AsyncIterator[Piece]:
        """The job's pieces as they come; raises ApiError for a failed generation. With the
        ``request`` (a whole answer), ends early, cancelling the job, when the client
        disconnects; a stream needs no polling: Starlette cancels it on disconnect."""
        while True:
            if request is None:
                item = await self.job.out.get()
            else:
                try:
                    item = await asyncio.wait_for(self.job.out.get(), timeout=0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.job.cancel()
                        return
                    continue
            if item is DONE:
                return
            if isinstance(item, Exception):
                raise _as_api_error(item)
            yield item

    def _usage(self) -> dict:
        gen = self.job.generation
        prompt = len(self.job.prompt)
        done = len(gen.tokens) if gen is not None else 0
        cached = gen.stats.reused_tokens if gen is not None else 0  # the slot's prefix reuse
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip

    def _logprobs(self, lp: TokenLogprob | None) -> Any:
        if lp is None:
            return None
        tok = self.server.model.tokenizer

        def entry(token: int, logprob: float) -> dict:
            text = tok.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        if self.req.chat:
            return {"content": [{**entry(lp.token, lp.logprob),
                                 "top_logprobs": [entry(t, p) for t, p in lp.top]}]}  # fmt: skip
        return {
            "tokens": [tok.decode([lp.token])],
            "token_logprobs": [lp.logprob],
            "top_logprobs": [{tok.decode([t]): p for t, p in lp.top}],
            "text_offset": [],
        }

    def _choice(self, text: str, finish: str | None, lp: Any, *, delta: bool) -> dict:
        reason = None if finish is None else FINISH[finish]
        if not self.req.chat:
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
        key = "delta" if delta else "message"
        content: dict = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: content, "logprobs": lp, "finish_reason": reason}

    def _object(self, choices: list, **extra: Any) -> dict:
        kind = self.object + (".chunk" if self.req.stream and self.req.chat else "")
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.server.name, "choices": choices, **extra}  # fmt: skip

    def _lp_of(self, piece: Piece) -> TokenLogprob | None:
        gen = self.job.generation
        if not self.req.logprobs or gen is None or piece.token is None:
            return None
        return gen.last_logprob

    def _count(self) -> None:
        usage = self._usage()
        self.server.metrics.count_tokens(usage["prompt_tokens"], usage["completion_tokens"])

    async def whole(self, request: Request) -> dict:
        text, finish, lps = [], None, []
        async for piece in self._pieces(request):
            text.append(piece.text)
            finish = piece.finish or finish
            if (lp := self._lp_of(piece)) is not None:
                lps.append(lp)
        self._count()
        lp: Any = None
        if self.req.logprobs:
            parts = [self._logprobs(x) for x in lps]
            if self.req.chat:
                lp = {"content": [c for p in parts for c in p["content"]]}
            else:
                lp = {k: [v for p in parts for v in p[k]] for k in
                      ("tokens", "token_logprobs", "top_logprobs", "text_offset")}  # fmt: skip
        choice = self._choice("".join(text), finish or "length", lp, delta=False)
        return self._object([choice], usage=self._usage())

    async def events(self, request: Request) -> AsyncIterator[str]:
        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if self.req.chat:  # the first chunk opens the assistant's message
                first = {"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
                yield sse(self._object([first]))
            async for piece in self._pieces(None):
                lp = self._logprobs(self._lp_of(piece))
                if piece.text or piece.finish or lp is not None:
                    choice = self._choice(piece.text, piece.finish, lp, delta=True)
                    yield sse(self._object([choice]))
            self._count()
            if self.req.include_usage:
                yield sse(self._object([], usage=self._usage()))
            yield "data: [DONE]\n\n"
        except ApiError as e:  # the status line is sent: the error goes in the stream
            yield sse(e.body())
            yield "data: [DONE]\n\n"
        finally:
            self.job.cancel()  # the client left, or the stream ended: the slot is free


def _as_api_error(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ContextLengthError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, ParityError):
        return ApiError(400, str(e), code="invalid_value")
    return ApiError(500, "the generation failed; the server log says why", type="server_error")
