"""A loaded model: file, tokenizer, chat template and a runtime on the configured backends.

Everything runs through the graph IR and the scheduler, so any backend serves these models
unchanged. ``parity.load`` is the front door; the CLI is built on the same calls.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from parity.arch.decoder import DecoderGraphs, DecoderSpec
from parity.arch.model_file import ModelFile, read_model_file
from parity.arch.params import GraphParams
from parity.core.config import Config, load_config, make_backends
from parity.core.plugins import load_backends
from parity.core.runtime import Runtime
from parity.core.scheduler import Plan, schedule
from parity.errors import ConfigError
from parity.generation.generate import Generation
from parity.generation.sampling import SamplingParams
from parity.generation.session import DEFAULT_BATCH, Session
from parity.hub.registry import DEFAULT_MODEL, resolve_model
from parity.text.chat import ChatTemplate
from parity.text.tokenizer import Tokenizer

DEFAULT_CTX = 4096  # KV positions unless asked otherwise (capped by the model's own)
DEFAULT_MAX_TOKENS = 256


class Model:
    """A model ready to run. One sequence at a time: each call continues from the KV cache's
    longest common prefix with its prompt (so chat turns only evaluate what is new)."""

    def __init__(
        self,
        file: ModelFile,
        config: Config,
        *,
        n_ctx: int | None = None,
        n_batch: int = DEFAULT_BATCH,
        capture: bool = True,
    ) -> None:
        spec = file.spec
        n_ctx = min(DEFAULT_CTX, spec.n_ctx_train) if n_ctx is None else n_ctx
        if not 1 <= n_ctx <= spec.n_ctx_train:
            raise ConfigError(
                f"context size {n_ctx} is outside 1..{spec.n_ctx_train} (the model's trained "
                "context); choose a size in that range"
            )
        self.file = file
        self.config = config
        self.tokenizer = Tokenizer.from_metadata(file.metadata)
        spec, weights = file.spec, file.weights
        self.backends = make_backends(config, load_backends())
        self.runtime = Runtime(self.backends, weights, strict=config.strict, capture=capture)
        self.graphs = DecoderGraphs(spec)
        self.session = Session(self.runtime, self.graphs, n_ctx, n_batch)

    @property
    def spec(self) -> DecoderSpec:
        return self.graphs.spec

    @property
    def name(self) -> str:
        return str(self.file.metadata.get("general.name") or self.file.path.stem)

    @property
    def n_ctx(self) -> int:
        return self.session.n_ctx

    @cached_property
    def template(self) -> ChatTemplate:
        return ChatTemplate.from_metadata(self.file.metadata)

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
        return self.session.logits(token_ids, n_out)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        **sampling_options: object,
    ) -> Generation:
        """Continue ``prompt`` (text, or token ids). Returns a streaming ``Generation``:
        iterate it for pieces of text, or call ``.complete()``. Sampling is given as a
        ``SamplingParams`` or as its fields (``temperature=0`` for greedy, ``top_k``,
        ``top_p``, ``min_p``, ``repetition_penalty``, ``seed``, ...)."""
        if sampling is None:
            sampling = SamplingParams(**sampling_options)  # type: ignore[arg-type]
        elif sampling_options:
            raise TypeError("pass sampling= or sampling fields, not both")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return Generation(
            self.session,
            self.tokenizer,
            ids,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=stop,
            ignore_eos=ignore_eos,
        )

    def render_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def chat(self, messages: Sequence[Mapping[str, str]], **options: object) -> Generation:
        """The assistant's reply to ``messages`` (dicts with ``role`` and ``content``), rendered
        with the model's own chat template; options as for ``generate``."""
        return self.generate(self.render_chat(messages), **options)  # type: ignore[arg-type]

    def reset(self) -> None:
        """Start the next call from an empty cache."""
        self.session.reset()

    def plan(self, n_tokens: int = 1) -> Plan:
        """Where each op of a decode step (or an ``n_tokens`` prefill) runs, and why."""
        graph = self.graphs(GraphParams(n_tokens=n_tokens, n_ctx=self.n_ctx))
        return schedule(graph, self.backends, strict=False)

    def close(self) -> None:
        self.runtime.clear_states()
        for backend in self.backends:
            backend.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
) -> Model:
    """Open a model by registry name (pulled on first use unless ``pull=False``) or by path to
    a ``.gguf`` file, on the configured backend (``backend="auto"`` picks per device).
    Arguments left as None come from the environment, then the config file, then defaults."""
    path = resolve_model(os.fspath(model), pull_missing=pull)
    cfg = load_config(
        backend=backend,
        device=device,
        numerics=numerics,
        strict=strict,
        path=Path(config) if config is not None else None,
    )
    return Model(read_model_file(path), cfg, n_ctx=n_ctx, n_batch=n_batch)
