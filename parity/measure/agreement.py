"""Agreement with llama.cpp's logits, teacher-forced, on the very tokens llama.cpp scored.

``llama-perplexity --kl-divergence-base FILE`` runs llama.cpp's perplexity protocol and saves,
for every scored position, the log-probabilities it computed. This module reads that file and
runs the same chunks through a parity model (each chunk a fresh sequence, its first token
replaced by BOS when the model adds one, as llama.cpp did), then compares position by
position:

- **top-1 agreement**: our most likely next token is llama.cpp's most likely one;
- **KL divergence** ``sum_v p_base(v) (log p_base(v) - log p_ours(v))`` over the tokens with
  ``log p_base(v) > -16``, as llama.cpp's KLD sums it;
- **perplexity** of both on the targets.

The file (llama.cpp's ``perplexity.cpp``): ``"_logits_"``, int32 ``n_ctx``, int32 ``n_vocab``,
int32 ``n_chunk``, the ``n_chunk * n_ctx`` int32 tokens, then per chunk one record for each
position ``j`` in ``n_ctx // 2 .. n_ctx - 2`` (predicting token ``j + 1``) of
``nv = 2 * ((n_vocab + 1) // 2) + 4`` uint16: float32 ``scale`` and ``min_log_prob`` in the
first four, then ``q[v]`` with ``log p(v) = min_log_prob + scale * q[v]`` (llama.cpp clips the
logits at 16 below the max and quantizes the rest to 16 bits). A top token is therefore known
to ``scale / 2 <= 16 / 131070`` nats: where several tokens share the record's largest ``q``
(a tie at the file's resolution), our top token agrees when it is one of them, and the number
of such positions is reported.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import numpy as np

from parity.errors import ParityError

if TYPE_CHECKING:
    from parity.model import Model

MAGIC = b"_logits_"
HEADER = len(MAGIC) + 3 * 4


class BaseLogitsError(ParityError):
    """A llama.cpp logits file that cannot be read, or does not fit the model."""


@attrs.frozen
class BaseLogits:
    """llama-perplexity's saved log-probabilities, memory-mapped."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray = attrs.field(repr=False)  # (n_chunk, n_ctx) int32
    records: np.ndarray = attrs.field(repr=False)  # (n_chunk, n_ctx - 1 - n_ctx // 2, nv) uint16

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    def log_probs(self, chunk: int) -> np.ndarray:
        """The chunk's stored log-probabilities, (positions, n_vocab) float64."""
        rec = self.records[chunk]
        head = np.ascontiguousarray(rec[:, :4]).view(np.float32).astype(np.float64)
        scale, low = head[:, 0:1], head[:, 1:2]
        return low + scale * rec[:, 4 : 4 + self.n_vocab].astype(np.float64)

    def top_quants(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """Per position: the largest stored ``q`` and the ``q`` of every token (views)."""
        q = self.records[chunk][:, 4 : 4 + self.n_vocab]
        return q.max(axis=1), q


def record_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def read_base(path: str | os.PathLike) -> BaseLogits:
    """Open a ``--kl-divergence-base`` file, checking its header and its exact size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(HEADER)
    except OSError as e:
        raise BaseLogitsError(f"cannot read llama.cpp's logits file {path}: {e}") from None
    if len(head) < HEADER or head[: len(MAGIC)] != MAGIC:
        raise BaseLogitsError(
            f"{path} is not a llama.cpp logits file (it does not start with {MAGIC!r}); make one "
            "with `llama-perplexity -m MODEL -f TEXT --kl-divergence-base FILE`"
        )
    n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(head[len(MAGIC) :], np.int32))
    if n_ctx < 4 or n_ctx % 2 or n_vocab < 1 or n_chunk < 1:
        raise BaseLogitsError(
            f"{path}: header says n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}, which "
            "no llama-perplexity run writes"
        )
    rows = n_ctx - 1 - n_ctx // 2
    nv = record_width(n_vocab)
    want = HEADER + n_chunk * n_ctx * 4 + n_chunk * rows * nv * 2
    if size != want:
        what = "truncated" if size < want else "longer than its header says"
        raise BaseLogitsError(
            f"{path} is {what}: {size} bytes, but {n_chunk} chunks of {n_ctx} tokens over a "
            f"vocabulary of {n_vocab} take {want} (did llama-perplexity finish?)"
        )
    tokens = np.memmap(path, np.int32, "r", HEADER, (n_chunk, n_ctx))
    records = np.memmap(path, np.uint16, "r", HEADER + n_chunk * n_ctx * 4, (n_chunk, rows, nv))
    return BaseLogits(path, n_ctx, n_vocab, n_chunk, tokens, records)


@attrs.frozen
class AgreementResult:
    n_ctx: int
    n_chunks: int
    scored: int  # positions compared
    top1: int  # of them, where our top token is llama.cpp's (one of its tied top tokens)
    top1_strict: int  # llama.cpp's own rule ("same top"): the first index of each maximum
    ties: int  # positions where llama.cpp's top is shared at the file's resolution
    kld: float  # mean KL(llama.cpp || ours), nats
    ppl: float  # ours on the targets
    base_ppl: float  # llama.cpp's, from its stored log-probabilities
    seconds: float

    @property
    def top1_share(self) -> float:
        return self.top1 / self.scored

    def lines(self) -> list[str]:
        return [
            f"PPL = {self.ppl:.4f} (llama.cpp's logits: {self.base_ppl:.4f})",
            f"top-1 agreement with llama.cpp: {100 * self.top1_share:.2f} % "
            f"({self.top1}/{self.scored}; {self.ties} ties at the file's resolution)",
            f"mean KL divergence from llama.cpp: {self.kld:.6f}",
        ]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    rows = logits.astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))


def agreement(
    model: Model,
    base: BaseLogits,
    *,
    max_chunks: int | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> AgreementResult:
    """``model`` against llama.cpp's saved log-probabilities, chunk by chunk.
    ``progress(done, total, top1_share)`` is called after each chunk."""
    tok = model.tokenizer
    if base.n_vocab != tok.n_vocab:
        raise BaseLogitsError(
            f"{base.path} holds logits over {base.n_vocab} tokens, but {model.name} has a "
            f"vocabulary of {tok.n_vocab}: it was made with another model"
        )
    if base.n_ctx > model.n_ctx:
        raise BaseLogitsError(
            f"{base.path} scores chunks of {base.n_ctx} tokens; load the model with n_ctx >= "
            f"{base.n_ctx}"
        )
    n_chunks = base.n_chunk if max_chunks is None else min(base.n_chunk, max_chunks)
    first = base.first
    scored = top1 = strict = ties = 0
    kld = nll = base_nll = 0.0
    t0 = time.perf_counter()
    for c in range(n_chunks):
        chunk = np.array(base.tokens[c])
        targets = chunk[first + 1 :].copy()  # the text's own tokens (position 0 may be BOS)
        if tok.add_bos and tok.bos_id is not None:
            chunk[0] = tok.bos_id
        ours = log_softmax(model.logits(chunk, n_out=base.n_ctx - first)[:-1])
        theirs = base.log_probs(c)
        rows = np.arange(len(targets))
        qmax, q = base.top_quants(c)
        mine = ours.argmax(axis=1)
        top1 += int((q[rows, mine] == qmax).sum())
        strict += int((q.argmax(axis=1) == mine).sum())
        ties += int(((q == qmax[:, None]).sum(axis=1) > 1).sum())
        seen = theirs > -16.0  # llama.cpp's KLD leaves out the clipped tail
        kld += float(np.where(seen, np.exp(theirs) * (theirs - ours), 0.0).sum())
        nll -= float(ours[rows, targets].sum())
        base_nll -= float(theirs[rows, targets].sum())
        scored += len(targets)
        if progress is not None:
            progress(c + 1, n_chunks, top1 / scored)
    return AgreementResult(
        base.n_ctx,
        n_chunks,
        scored,
        top1,
        strict,
        ties,
        kld / scored,
        math.exp(nll / scored),
        math.exp(base_nll / scored),
        time.perf_counter() - t0,
    )
