"""One sequence on a runtime: which tokens the KV cache holds, and the forward steps that extend it.

A new prompt reuses the cache's longest common prefix (chat turns, repeated prompts): batch
invariance makes that bit-identical to evaluating the whole prompt again. Stale cache rows past
the prefix are never read, because attention only looks at positions up to the query's own and
KV_WRITE overwrites a position before any query at that position reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parity.arch.decoder import DecoderGraphs
from parity.arch.params import GraphParams
from parity.core.runtime import Runtime
from parity.errors import ContextLengthError

DEFAULT_BATCH = 512  # prefill tokens per graph


class Session:
    """The KV cache of one sequence and the steps that grow it. Host buffers for inputs and
    outputs are allocated once, so a decode step allocates nothing of its own."""

    def __init__(
        self, runtime: Runtime, graphs: DecoderGraphs, n_ctx: int, n_batch: int = DEFAULT_BATCH
    ) -> None:
        if n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {n_batch}")
        self.runtime = runtime
        self.graphs = graphs
        self.n_ctx = n_ctx
        self.n_batch = min(n_batch, n_ctx)
        self.n_vocab = graphs.spec.n_vocab
        self.tokens: list[int] = []  # what the cache holds, position by position
        self.reused = 0  # prompt tokens the last prefill took from the cache
        self._logits = np.empty((1, self.n_vocab), np.float32)
        self._argmax = np.empty((1,), np.int32)
        self._step_tokens = np.empty((1,), np.int32)
        self._step_pos = np.empty((1,), np.int32)
        self._step_inputs = {"tokens": self._step_tokens, "positions": self._step_pos}
        self._step_graphs = {g: graphs(self._graph_params(1, 1, g)) for g in (False, True)}

    def reset(self) -> None:
        """Forget the cached tokens; the next prompt is evaluated from position 0."""
        self.tokens = []

    def check_fits(self, n_tokens: int, what: str = "the prompt") -> None:
        if n_tokens > self.n_ctx:
            raise ContextLengthError(
                f"{what} is {n_tokens} tokens but the context holds {self.n_ctx}; shorten it "
                f"or raise the context size (--ctx / n_ctx, up to the model's "
                f"{self.graphs.spec.n_ctx_train})"
            )
        if n_tokens == 0:
            raise ContextLengthError(f"{what} is empty: nothing to evaluate")

    def _ids(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or np.any((ids < 0) | (ids >= self.n_vocab)):
            raise ValueError(f"token ids must be a flat sequence of ints in 0..{self.n_vocab - 1}")
        return ids.astype(np.int32)

    def _graph_params(self, n: int, n_out: int, greedy: bool) -> GraphParams:
        output = "argmax" if greedy else "logits"
        return GraphParams(n_tokens=n, n_ctx=self.n_ctx, n_out=n_out, output=output)

    def _run(self, tokens: np.ndarray, start: int, n_out: int, greedy: bool) -> np.ndarray:
        graph = self.graphs(self._graph_params(len(tokens), n_out, greedy))
        inputs = {
            "tokens": tokens,
            "positions": np.arange(start, start + len(tokens), dtype=np.int32),
        }
        return self.runtime.run(graph, inputs)[graph.outputs[0]]

    def prefill(self, prompt: Sequence[int], *, greedy: bool) -> np.ndarray | int:
        """Evaluate ``prompt`` as the whole sequence, reusing the cached common prefix.
        Returns the last position's logits (n_vocab,), or its argmax id when ``greedy``."""
        self.check_fits(len(prompt))
        keep = 0
        for a, b in zip(self.tokens, prompt, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(prompt) - 1)  # the last token must run to produce output
        ids = self._ids(prompt)
        self.tokens = list(self.tokens[:keep])
        self.reused = keep
        out: np.ndarray | None = None
        for start in range(keep, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last = start + len(chunk) == len(ids)
            out = self._run(chunk, start, 1, greedy or not last)  # earlier chunks: argmax only
            self.tokens.extend(int(t) for t in chunk)
        assert out is not None
        return int(out[0]) if greedy else out[0]

    def step(self, token: int, *, greedy: bool) -> np.ndarray | int:
        """Append one token; returns the next position's logits (a view of a buffer reused by
        the next step) or, when ``greedy``, the argmax id (only 4 bytes are read back)."""
        pos = len(self.tokens)
        self.check_fits(pos + 1, "the sequence")
        self._step_tokens[0] = token
        self._step_pos[0] = pos
        graph = self._step_graphs[greedy]  # built once: a step allocates no graph params
        out_buf = self._argmax if greedy else self._logits
        self.runtime.run(graph, self._step_inputs, out={graph.outputs[0]: out_buf})
        self.tokens.append(int(token))
        return int(out_buf[0]) if greedy else out_buf[0]

    def logits(self, tokens: Sequence[int], n_out: int | None = None) -> np.ndarray:
        """Evaluate ``tokens`` from position 0 and return the logits of the last ``n_out``
        positions (all of them by default) as an (n_out, n_vocab) float32 array."""
        self.check_fits(len(tokens), "the token sequence")
        n = len(tokens)
        n_out = n if n_out is None else n_out
        if not 1 <= n_out <= n:
            raise ValueError(f"n_out must be in 1..{n}, got {n_out}")
        ids = self._ids(tokens)
        self.tokens = []
        result = np.empty((n_out, self.n_vocab), np.float32)
        first_out = n - n_out  # positions >= first_out produce rows
        for start in range(0, n, self.n_batch):
            chunk = ids[start : start + self.n_batch]
            end = start + len(chunk)
            rows = end - max(start, first_out)
            if rows > 0:
                result[max(start, first_out) - first_out : end - first_out] = self._run(
                    chunk, start, rows, greedy=False
                )
            else:
                self._run(chunk, start, 1, greedy=True)
            self.tokens.extend(int(t) for t in chunk)
        return result
