"""A loaded model: file, tokenizer, chat template and a runtime on a list of backends.

This is the one place a model is assembled: ``Model(file, backends)`` from an opened file and
backend instances, ``load`` from a model reference and the configuration; the CLI's commands
all open models through it. At load every weight the model's graphs
read is registered on the backends that read it (one batch per backend, with a progress bar
for slow uploads) and the decode steps are prepared, so the first request neither uploads nor
allocates. Everything runs through the graph IR and the scheduler, so any backend serves these
models unchanged.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from parity.arch.decoder import DecoderGraphs, DecoderSpec
from parity.arch.model_file import ModelFile, read_model_file
from parity.arch.params import GraphParams
from parity.core.backend import Backend, Progress
from parity.core.config import load_config
from parity.core.plugins import load_backends
from parity.core.runtime import Runtime
from parity.core.scheduler import Plan
from parity.core.selection import make_backends
from parity.errors import BackendError, ChatTemplateError, ConfigError
from parity.generation.generate import Generation
from parity.generation.sampling import SamplingParams
from parity.generation.session import DEFAULT_BATCH, Session, session_graphs
from parity.hub.registry import DEFAULT_MODEL, resolve_model
from parity.text.chat import ChatTemplate
from parity.text.tokenizer import Tokenizer

DEFAULT_CTX = 4096  # KV positions unless asked otherwise (capped by the model's own)
DEFAULT_MAX_TOKENS = 256
PROGRESS_AFTER_S = 0.5  # an upload shows a progress bar once it has taken this long


class Model:
    """A model ready to run on ``backends`` (priority order; the runtime falls back to the
    last), or, with no backends, a model opened for its tokenizer and chat template only. One
    sequence at a time: each call continues from the KV cache's longest common prefix with its
    prompt (so chat turns only evaluate what is new).

    ``capture`` and ``capture_prefill`` allow graph capture (decode, and prefill) where a
    backend offers it; ``verify_capture`` compares each first replay with the eager run, bit
    for bit. ``progress`` shows weight uploads that take a while (on stderr). ``prepare=False``
    opens it for ``plan`` alone: no weight uploaded, no cache allocated."""

    def __init__(
        self,
        file: ModelFile,
        backends: Sequence[Backend],
        *,
        strict: bool = False,
        n_ctx: int | None = None,
        n_batch: int = DEFAULT_BATCH,
        capture: bool = True,
        capture_prefill: bool = True,
        verify_capture: bool = False,
        progress: bool = True,
        prepare: bool = True,
    ) -> None:
        spec = file.spec
        n_ctx = min(DEFAULT_CTX, spec.n_ctx_train) if n_ctx is None else n_ctx
        if not 1 <= n_ctx <= spec.n_ctx_train:
            raise ConfigError(
                f"context size {n_ctx} is outside 1..{spec.n_ctx_train} (the model's trained "
                "context); choose a size in that range"
            )
        self.file = file
        self.tokenizer = Tokenizer.from_metadata(file.metadata)
        self.graphs = DecoderGraphs(spec)
        self.backends = list(backends)
        self._n_ctx = n_ctx
        self.runtime: Runtime | None = None
        self.session: Session | None = None
        if not self.backends:
            return
        self.runtime = Runtime(
            self.backends,
            file.weights,
            strict=strict,
            capture=capture,
            verify_capture=verify_capture,
        )
        if not prepare:
            return
        self.runtime.register(
            session_graphs(self.graphs, n_ctx, n_batch), _upload_progress if progress else None
        )
        self.session = Session(
            self.runtime, self.graphs, n_ctx, n_batch, capture_prefill=capture_prefill
        )

    @property
    def spec(self) -> DecoderSpec:
        return self.graphs.spec

    @property
    def name(self) -> str:
        """The model as users name it: its registry name (the cache keeps NAME.gguf), or the
        file's name without .gguf; the GGUF's own ``general.name`` is ``title``."""
        return self.file.path.stem

    @property
    def title(self) -> str:
        return str(self.file.metadata.get("general.name") or self.file.path.stem)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @cached_property
    def template(self) -> ChatTemplate:
        """The chat template: the file's, or the one given with ``use_template``. A file
        without one is an error here (no silent ChatML)."""
        template = ChatTemplate.from_metadata(self.file.metadata)
        if template.is_fallback:
            raise ChatTemplateError(
                f"{self.name} has no chat template (no tokenizer.chat_template in its file; it "
                "may be a base model): give one with --template FILE (parity chat, parity "
                "serve) or Model.use_template(source), or use plain completion (parity run)"
            )
        return template

    def use_template(self, source: str) -> ChatTemplate:
        """Chat with ``source`` (Jinja, as in ``tokenizer.chat_template``) instead of the
        file's template; the file's BOS and EOS text fill ``bos_token`` and ``eos_token``."""
        template = ChatTemplate.with_tokens(source, self.file.metadata)
        self.__dict__["template"] = template  # (the cached_property's slot)
        return template

    def _running(self) -> Session:
        if self.session is None:
            why = "for plan() alone" if self.runtime else "for its tokenizer and chat template"
            raise BackendError(
                f"{self.name} was opened {why}; load it with parity.load(...) to run it"
            )
        return self.session

    # -- text ------------------------------------------------------------------------------

    def tokenize(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- running ---------------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int], *, n_out: int | None = None) -> np.ndarray:
        """Prefill logits of ``token_ids`` as a fresh sequence: (n_tokens, n_vocab) float32,
        or only the last ``n_out`` rows (the head runs for those rows alone)."""
        return self._running().logits(token_ids, n_out)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        session: Session | None = None,
        logprobs: int | None = None,
        **sampling_options: object,
    ) -> Generation:
        """Continue ``prompt`` (text, or token ids). Returns a streaming ``Generation``:
        iterate it for pieces of text, or call ``.complete()``. Sampling is given as a
        ``SamplingParams`` or as its fields (``temperature=0`` for greedy, ``top_k``,
        ``top_p``, ``min_p``, ``repetition_penalty``, ``seed``, ...). ``session``: another
        sequence's (``new_session``) instead of ``model.session``. ``logprobs`` (the number
        of alternatives, 0 or more) records each token's log-probability
        (``Generation.last_logprob`` after each piece)."""
        session = session or self._running()
        if sampling is None:
            sampling = SamplingParams(**sampling_options)  # type: ignore[arg-type]
        elif sampling_options:
            raise TypeError("pass sampling= or sampling fields, not both")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return Generation(
            session,
            self.tokenizer,
            ids,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def chat(self, messages: Sequence[Mapping[str, str]], **options: object) -> Generation:
        """The assistant's reply to ``messages`` (dicts with ``role`` and ``content``), rendered
        with the model's own chat template; options as for ``generate``."""
        return self.generate(self.render_chat(messages), **options)  # type: ignore[arg-type]

    def new_session(self, slot: int) -> Session:
        """Another sequence on this model's runtime, with KV caches of its own (``slot`` >= 1;
        slot 0 is ``model.session``'s). Its graphs are prepared when it first runs."""
        session = self._running()
        if slot < 1:
            raise ValueError(f"slot 0 is model.session's; give a slot >= 1, got {slot}")
        return Session(
            self.runtime, self.graphs, self.n_ctx, session.n_batch,
            capture_prefill=session.capture_prefill is None, slot=slot,
        )  # fmt: skip

    def reset(self) -> None:
        """Start the next call from an empty cache."""
        self._running().reset()

    def plan(self, n_tokens: int = 1, *, greedy: bool = True) -> Plan:
        """Where each op of a decode step (or an ``n_tokens`` prefill) runs, after the first
        backend's rewrite, and why."""
        if self.runtime is None:
            self._running()  # no backends: the error says so
        output = "argmax" if greedy else "logits"
        graph = self.graphs(GraphParams(n_tokens=n_tokens, n_ctx=self.n_ctx, output=output))
        return self.runtime.plan(graph)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.clear_states()
        for backend in self.backends:
            backend.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _upload_progress(backend: str) -> Progress:
    """A progress bar on stderr for weights uploaded to ``backend``, shown only once the upload
    has taken PROGRESS_AFTER_S (a zero-copy registration never shows one)."""
    from tqdm import tqdm

    bar: list[tqdm] = []

    def report(done: int, total: int) -> None:
        if not bar:
            bar.append(
                tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    desc=f"weights to {backend}",
                    delay=PROGRESS_AFTER_S,
                    file=sys.stderr,
                    leave=False,
                )
            )
        bar[0].update(done - bar[0].n)
        if done >= total:
            bar[0].close()

    return report


def open_model(model: str | os.PathLike = DEFAULT_MODEL, *, pull: bool = True) -> ModelFile:
    """A model file by registry name (pulled on first use unless ``pull=False``) or path."""
    return read_model_file(resolve_model(os.fspath(model), pull_missing=pull))


def load(
    model: str | os.PathLike = DEFAULT_MODEL,
    *,
    backend: str | None = None,
    device: int | None = None,
    numerics: str | None = None,
    strict: bool | None = None,
    n_ctx: int | None = None,
    n_batch: int = DEFAULT_BATCH,
    pull: bool = True,
    config: str | os.PathLike | None = None,
    backends: Sequence[Backend] | None = None,
    **options: bool,
) -> Model:
    """Open a model by registry name (pulled on first use unless ``pull=False``) or by path to
    a ``.gguf`` file, on the configured backend (``backend="auto"`` picks per device), or on
    the given ``backends`` instances (``()``: for the tokenizer and chat template only).
    Arguments left as None come from the environment, then the config file, then defaults;
    ``options`` are Model's (``capture``, ``capture_prefill``, ``verify_capture``,
    ``progress``, ``prepare``)."""
    file = open_model(model, pull=pull)
    if backends is not None:
        return Model(file, backends, strict=bool(strict), n_ctx=n_ctx, n_batch=n_batch, **options)
    cfg = load_config(
        backend=backend,
        device=device,
        numerics=numerics,
        strict=strict,
        path=Path(config) if config is not None else None,
    )
    chosen = make_backends(cfg, load_backends())
    return Model(file, chosen, strict=cfg.strict, n_ctx=n_ctx, n_batch=n_batch, **options)
