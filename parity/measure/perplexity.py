"""Perplexity with llama.cpp's protocol (``llama-perplexity``), so the figures compare directly.

The text is tokenized once (BOS only where the model asks for it, special tokens not parsed)
and cut into ``n_chunk = n_tokens // n_ctx`` chunks of ``n_ctx`` tokens; the rest is dropped.
Each chunk is a fresh sequence whose first token becomes BOS when the model adds one. The first
half is context only; every position ``j`` from ``n_ctx // 2`` to ``n_ctx - 2`` scores the
negative log-likelihood of token ``j + 1``. PPL = exp(mean NLL), and the ``+/-`` is llama.cpp's:
``sqrt(var(NLL) / (count - 1)) * PPL``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np

from parity.errors import ContextLengthError

if TYPE_CHECKING:
    from parity.model import Model


@attrs.frozen
class PerplexityResult:
    ppl: float
    uncertainty: float
    n_ctx: int
    n_chunks: int
    n_tokens: int  # of the whole tokenized text
    scored: int  # predictions that entered the mean
    chunk_ppl: tuple[float, ...]  # running PPL after each chunk, as llama.cpp prints them
    seconds: float

    def line(self) -> str:
        return f"PPL = {self.ppl:.4f} +/- {self.uncertainty:.5f}"


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64 from the float32 logits."""
    rows = logits.astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    return lse - rows[np.arange(len(targets)), targets]


def perplexity(
    model: Model,
    text: str,
    n_ctx: int,
    *,
    max_chunks: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``text`` in chunks of
    ``n_ctx`` tokens. ``progress(done, total, running_ppl)`` is called after each chunk."""
    if n_ctx < 4 or n_ctx % 2:
        raise ValueError(f"the perplexity context must be an even number >= 4, got {n_ctx}")
    if n_ctx > model.n_ctx:
        raise ContextLengthError(
            f"perplexity context {n_ctx} exceeds the model's context {model.n_ctx}; "
            "load the model with a larger n_ctx"
        )
    tok = model.tokenizer
    tokens = np.asarray(tok.encode(text, parse_special=False), dtype=np.int32)
    n_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if len(tokens) < 2 * n_ctx:
        raise ContextLengthError(
            f"the text is {len(tokens)} tokens; perplexity with context {n_ctx} needs at least "
            f"{2 * n_ctx} (two chunks): use a longer text or a smaller --ctx"
        )
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    t0 = time.perf_counter()
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx].copy()
        if tok.add_bos and tok.bos_id is not None:
            chunk[0] = tok.bos_id
        logits = model.logits(chunk, n_out=n_ctx - first)  # rows for positions first..
        nll = token_nll(logits[:-1], chunk[first + 1 :])  # rows j = first..n_ctx-2
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        running.append(math.exp(nll_sum / count))
        if progress is not None:
            progress(i + 1, n_chunks, running[-1])
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return PerplexityResult(
        ppl, err, n_ctx, n_chunks, len(tokens), count, tuple(running), time.perf_counter() - t0
    )
