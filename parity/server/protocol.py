"""The OpenAI request bodies parity accepts, checked field by field, and the error shape.

Field names are OpenAI's (``max_tokens``/``max_completion_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options.include_usage``, ``logprobs``,
``top_logprobs``, ``n``, ``user``), plus llama.cpp's ``top_k``, ``min_p``,
``repeat_penalty`` and ``ignore_eos``. Unknown fields are ignored, as OpenAI does; a known
field of the wrong type or range is a 400 that names it. Fields left out take parity's
sampling defaults (llama.cpp's, as llama-server does), so a request with ``temperature: 0``
gives the tokens ``parity run --temperature 0`` gives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from parity.generation.sampling import SamplingParams

MAX_STOPS = 4  # OpenAI's limit on stop strings


class ApiError(Exception):
    """An answer other than 200: its status, and OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # OpenAI's field name
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@attrs.frozen
class CompletionRequest:
    """What one request asks for, checked: a chat (``messages``) or a text ``prompt``."""

    chat: bool
    messages: tuple[Mapping[str, Any], ...] = ()
    prompt: str = ""
    max_tokens: int | None = None  # None: until EOS or the end of the context
    sampling: SamplingParams = attrs.Factory(SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    model: str | None = None
    user: str | None = None
    ignore_eos: bool = False  # llama-server's: generate past end-of-generation tokens


def _bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' {why}", code="invalid_value", param=param)


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _bad(name, f"must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise _bad(name, f"must be in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _bad(name, f"must be {bound}, got {v!r}")
    return v


def _typed(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    v = body.get(name)
    if v is not None and not isinstance(v, kind):
        raise _bad(name, f"must be {what}, got {v!r}")
    return v


def _boolean(body: Mapping[str, Any], name: str) -> bool | None:
    return _typed(body, name, bool, "true or false")


def _string(body: Mapping[str, Any], name: str) -> str | None:
    return _typed(body, name, str, "a string")


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"takes at most {MAX_STOPS} strings, got {len(stops)}")
    return tuple(s for s in stops if s)


def _messages(body: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text ones only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise _bad(f"messages[{i}].content", "parts must be {type: text} objects")
                if not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content", "a text part needs a string 'text'")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("prompt", "must be a string (one prompt per request)")
    return prompt


def parse_request(body: Any, *, chat: bool) -> CompletionRequest:
    """A checked request from a decoded JSON body (``ApiError`` 400 when it is not one)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    n = _integer(body, "n", 1)
    if n is not None and n != 1:
        raise _bad("n", "must be 1: parity returns one choice per request")
    max_tokens = _integer(body, "max_completion_tokens", 0)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 0)
    defaults = SamplingParams()
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = _integer(body, "top_k", 0)
    min_p = _number(body, "min_p", 0.0, 1.0)
    penalty = _number(body, "repeat_penalty", 0.0, 10.0)
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)
    try:
        sampling = SamplingParams(
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None or top_p == 0.0 else top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            min_p=defaults.min_p if min_p is None else min_p,
            repetition_penalty=defaults.repetition_penalty if penalty in (None, 0.0) else penalty,
            seed=None if seed is None else seed % 2**64,
        )
    except ValueError as e:
        raise ApiError(400, f"bad sampling settings: {e}", code="invalid_value") from None
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    include_usage = _boolean(options or {}, "include_usage") or False
    if chat:
        logprobs = _boolean(body, "logprobs") or False
        top = _integer(body, "top_logprobs", 0, 20) or 0
        if top and not logprobs:
            raise _bad("top_logprobs", "needs 'logprobs': true")
    else:
        top_or_none = _integer(body, "logprobs", 0, 5)
        logprobs, top = top_or_none is not None, top_or_none or 0
    return CompletionRequest(
        chat=chat,
        messages=_messages(body) if chat else (),
        prompt="" if chat else _prompt(body),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stops(body),
        stream=_boolean(body, "stream") or False,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top,
        model=_string(body, "model"),
        user=_string(body, "user"),
        ignore_eos=_boolean(body, "ignore_eos") or False,
    )
