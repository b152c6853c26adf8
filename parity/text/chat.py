"""Chat templates: a model's Jinja template turning messages into one prompt string.

Templates come from the model file, so they are untrusted code: they run in Jinja's
``ImmutableSandboxedEnvironment``, set up as Hugging Face transformers sets it up for
``apply_chat_template`` (trim_blocks, lstrip_blocks, loop controls, the pass-through
``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII text, ``raise_exception`` and
``strftime_now``; undefined names are empty and false, as there). Touching an unsafe attribute
(``__class__``, ``list.append``, ...) is an error here, where Jinja alone would render it as
empty. Every failure, in compiling or rendering, is a ``ChatTemplateError`` naming the
template's line.

A template is also bounded in what it costs: a render stops with that error past
``MAX_RENDER_S`` seconds or ``MAX_OUTPUT`` characters of prompt, and ``*``/``**``/``+`` refuse
results beyond ``MAX_VALUE`` items (``'a' * 10**10``), as ``range`` refuses huge ranges. Message
content is data: it is never parsed as template code.

``ChatTemplate.from_metadata`` gives a model without a template ChatML, as llama.cpp does
(``common/chat.cpp``), and says so (``is_fallback``); ``Model.template`` refuses that stand-in
and asks for a template instead (``Model.use_template``, ``parity chat --template FILE``).
"""

from __future__ import annotations

import json
import numbers
import operator
import sys
import time
import types
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from parity.errors import ChatTemplateError

ROLES = ("system", "user", "assistant", "tool")

# llama.cpp's CHATML_TEMPLATE_SRC, used when a model has no template
CHATML = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)


class ChatTemplate:
    """A compiled chat template. ``render`` gives the prompt text for a list of messages."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str):
            raise ChatTemplateError(
                f"a chat template must be text, got {type(source).__name__}; pass the Jinja "
                "source (tokenizer.chat_template)"
            )
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = False  # True when the model has no template and ChatML stands in
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(
                f"the chat template has a syntax error at line {err.lineno} "
                f"({_line(source, err.lineno)!r}): {err.message}; fix the template"
            ) from None
        # the compiled code's `~` (string concatenation) joins through these: bound them too
        code_globals = self._template.root_render_func.__globals__
        for name in ("str_join", "markup_join"):
            if name in code_globals:
                code_globals[name] = _bounded_join(code_globals[name])

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, object], tokens: Sequence[str] | None = None
    ) -> ChatTemplate:
        """The template of a GGUF model (``tokenizer.chat_template``), with its BOS and EOS
        token text; ChatML when the model names it (llama.cpp's ``chatml``) or has none
        (``is_fallback`` says which), as llama.cpp does, which also takes the ``tool_use``
        variant before ChatML."""
        source = metadata.get("tokenizer.chat_template")
        if _is_chatml(source):
            source = metadata.get("tokenizer.chat_template.tool_use")
        fallback = _is_chatml(source) and not any(
            metadata.get(key) == "chatml"
            for key in ("tokenizer.chat_template", "tokenizer.chat_template.tool_use")
        )
        if _is_chatml(source):
            source = CHATML
        elif not isinstance(source, str):
            raise ChatTemplateError(
                f"the model's metadata tokenizer.chat_template is a {type(source).__name__}, "
                "not text; the GGUF file is malformed"
            )
        template = cls.with_tokens(source, metadata, tokens)
        template.is_fallback = fallback
        return template

    @classmethod
    def with_tokens(
        cls, source: str, metadata: Mapping[str, object], tokens: Sequence[str] | None = None
    ) -> ChatTemplate:
        """``source`` with a GGUF model's BOS and EOS token text (a template given for a model
        that has none, or a better one)."""
        if tokens is None:
            listed = metadata.get("tokenizer.ggml.tokens")
            tokens = listed if isinstance(listed, Sequence) else ()
        return cls(
            source,
            bos_token=_token_text(metadata, tokens, "tokenizer.ggml.bos_token_id"),
            eos_token=_token_text(metadata, tokens, "tokenizer.ggml.eos_token_id"),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        """The prompt for ``messages`` (mappings with text ``role`` and ``content``; other keys
        pass through to the template). ``add_generation_prompt`` ends it with the opening of
        the assistant's turn; ``extra`` become template variables (``tools``, ...)."""
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": _checked(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return _bounded_render(self._template, context)
        except _Refused as err:
            raise ChatTemplateError(
                f"the chat template refused these messages{_at(err)}: {err}"
            ) from None
        except _OverBudget as err:
            raise ChatTemplateError(
                f"the chat template was stopped{_at(err)}: {err}; it is broken or hostile"
            ) from None
        except SecurityError as err:
            raise ChatTemplateError(
                f"the chat template tried something the sandbox forbids{_at(err)}: {err}; "
                "do not use this template"
            ) from None
        except Exception as err:  # the template is untrusted code: any failure is its failure
            raise ChatTemplateError(
                f"the chat template failed{_at(err)}: {type(err).__name__}: {err}; the "
                "template does not support these messages, or it is broken"
            ) from None


MAX_RENDER_S = 2.0  # seconds a render may take
MAX_OUTPUT = 4 << 20  # characters a render may produce
MAX_VALUE = 1 << 20  # items (characters, list entries) one * or + may produce; digits of **


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, except that an unsafe attribute is an error at once instead of an
    undefined value that renders as empty, and that operators are bounded in size."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def unsafe_undefined(self, obj: object, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: object, operator_: str, left: object, right: object) -> object:
        if operator_ == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            sized = isinstance(seq, str | list | tuple) and isinstance(n, int)
            if sized and len(seq) * max(n, 0) > MAX_VALUE:  # type: ignore[arg-type, operator]
                raise SecurityError(f"a sequence repeated {n} times is too large")
            return operator.mul(left, right)  # type: ignore[operator]
        if operator_ == "**":
            ints = isinstance(left, int) and isinstance(right, int) and abs(left) > 1
            if ints and right * abs(left).bit_length() > 4 * MAX_VALUE:  # type: ignore[operator]
                raise SecurityError(f"{left} ** {right} is too large")
            return operator.pow(left, right)  # type: ignore[operator]
        seqs = isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple)
        if seqs and len(left) + len(right) > MAX_VALUE:  # type: ignore[arg-type]
            raise SecurityError("a concatenation is too large")
        return operator.add(left, right)  # type: ignore[operator]


def _bounded_join(join):  # type: ignore[no-untyped-def]
    def bounded(seq):  # type: ignore[no-untyped-def]
        parts = [str(x) for x in seq]
        if sum(map(len, parts)) > MAX_VALUE:
            raise SecurityError("a concatenation is too large")
        return join(parts)

    return bounded


class _OverBudget(Exception):
    """A render took too long or produced too much."""


def _bounded_render(template: jinja2.Template, context: Mapping[str, object]) -> str:
    """``template.render(context)`` within MAX_RENDER_S and MAX_OUTPUT: the deadline is checked
    on every line the compiled template runs (a trace on its frames alone)."""
    deadline = time.monotonic() + MAX_RENDER_S

    def on_line(frame: types.FrameType, event: str, arg: object) -> object:
        if time.monotonic() > deadline:
            raise _OverBudget(f"rendering took over {MAX_RENDER_S:g} s")
        return on_line

    def on_call(frame: types.FrameType, event: str, arg: object) -> object:
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        parts, size = [], 0
        for part in template.generate(context):
            size += len(part)
            if size > MAX_OUTPUT:
                raise _OverBudget(f"the prompt would be over {MAX_OUTPUT} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        sys.settrace(previous)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``: marks the assistant's text
    for training masks; rendering just keeps the body."""

    tags = {"generation"}  # noqa: RUF012 (the Extension API's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Refused(Exception):
    """A template called ``raise_exception(message)``."""


def _raise_exception(message: object) -> None:
    raise _Refused(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


def _checked(messages: Sequence[Mapping[str, str]]) -> list[dict[str, object]]:
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': ..., 'content': ...}} mappings, got a "
            f"{type(messages).__name__}"
        )
    if not messages:
        raise ChatTemplateError(
            "there are no messages to render; pass at least one, e.g. "
            "{'role': 'user', 'content': 'Hello'}"
        )
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"message {i} is a {type(message).__name__}, not a mapping with 'role' and "
                "'content'"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatTemplateError(
                f"message {i} has role {role!r}; a role is one of {', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            raise ChatTemplateError(
                f"message {i} ({role}) has content {type(content).__name__}; content must be text"
            )
        checked.append(dict(message))
    return checked


def _is_chatml(source: object) -> bool:
    """No template, or llama.cpp's name for the built-in ChatML one."""
    return source is None or (isinstance(source, str) and source in ("", "chatml"))


def _token_text(metadata: Mapping[str, object], tokens: Sequence[str], key: str) -> str:
    """A special token's text, or "" when the model has none (as llama.cpp does)."""
    i = metadata.get(key)
    if not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < len(tokens):
        return ""
    text = tokens[int(i)]
    return text if isinstance(text, str) else ""


def _line(source: str, lineno: int | None) -> str:
    lines = source.splitlines()
    if lineno is None or not 1 <= lineno <= len(lines):
        return ""
    text = lines[lineno - 1].strip()
    return text if len(text) <= 80 else text[:77] + "..."


def _at(err: BaseException) -> str:
    """ " at line N" of the template where rendering failed: Jinja rewrites tracebacks so that
    template code shows as frames of the file ``<template>``."""
    line = None
    tb: types.TracebackType | None = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line is not None else ""
