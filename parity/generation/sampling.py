"""Picking the next token from one position's logits: llama.cpp's default sampler chain.

The chain runs in llama.cpp's order (``common/sampling.cpp``): repetition penalty, top-k,
top-p, min-p, temperature, then one draw. top-k, top-p and min-p judge the *untempered*
logits; temperature only reshapes what they kept (llama.cpp's semantics; Hugging Face applies
temperature first). Temperature 0 is greedy: the first id of the largest penalised logit.

Every choice is defined so that the same seed and the same logits give the same token on any
machine: a cut between equal logits keeps the lower token id, probabilities use the contract's
``exp`` (``parity.numerics``) and a sequential float64 cumulative sum, and the draw walks the
survivors in token-id order with one uniform number from a seeded numpy ``Generator`` (PCG64).
The random stream itself differs from llama.cpp's (mt19937), so seeds are not interchangeable.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NoReturn

import attrs
import numpy as np

from parity.errors import BackendError, ConfigError
from parity.numerics import exp

F32 = np.float32
NUCLEUS_GUESS = 256  # top-p without top-k first tries this many best tokens (as llama.cpp does)
NUCLEUS_GROWTH = 8  # ... then 8 times as many, until the vocabulary is sorted
TOP_COLUMNS = 1024  # a small top-k bounds the k-th logit by column maxima of a (rows, 1024) view


@attrs.frozen
class SamplingParams:
    """How each next token is picked (llama.cpp's defaults); checked when constructed, so a bad
    value fails before any model is loaded."""

    temperature: float = 0.8  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repetition_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64  # how many past tokens the penalty looks at (0 disables, -1 all)
    seed: int | None = None  # None: a fresh random seed

    def __attrs_post_init__(self) -> None:
        t, k, p, mp = self.temperature, self.top_k, self.top_p, self.min_p
        pen, last_n, seed = self.repetition_penalty, self.repeat_last_n, self.seed
        if not (_real(t) and math.isfinite(t) and t >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if not (_integer(k) and k >= 0):
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        if not (_real(p) and 0 < p <= 1):
            raise ConfigError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")
        if not (_real(mp) and 0 <= mp <= 1):
            raise ConfigError(f"min_p must be in [0, 1] (0 disables it), got {mp!r}")
        if not (_real(pen) and math.isfinite(pen) and pen > 0):
            raise ConfigError(
                f"repetition_penalty must be a finite number > 0 (1 disables it), got {pen!r}"
            )
        if not (_integer(last_n) and last_n >= -1):
            raise ConfigError(
                f"repeat_last_n must be an integer >= -1 (0 disables the penalty, -1 looks at "
                f"the whole history), got {last_n!r}"
            )
        if seed is not None and not (_integer(seed) and seed >= 0):
            raise ConfigError(
                f"seed must be an integer >= 0, or None for a random one, got {seed!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _integer(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class Sampler:
    """Picks next tokens for one sequence. Build one per generation: it owns the seeded random
    stream. Work buffers are allocated once; the caller's logits are never written. A call
    costs about 0.1 ms on a 152k vocabulary with top-k on (the default), a few ms without it
    (then every token's probability is needed)."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        if not (_integer(n_vocab) and n_vocab >= 1):
            raise ConfigError(f"n_vocab must be a positive integer, got {n_vocab!r}")
        self.params = params
        self.n_vocab = int(n_vocab)
        # the seed actually used, so a random-seeded run can be repeated
        self.seed: int = (
            params.seed if params.seed is not None else np.random.SeedSequence().entropy
        )
        self._rng = np.random.default_rng(self.seed)
        self._penalised = np.empty(self.n_vocab, F32)  # the logits after the penalty
        self._mask = np.empty(self.n_vocab, np.bool_)
        self._penalty = F32(params.repetition_penalty)
        self._uses_penalty = params.repetition_penalty != 1 and params.repeat_last_n != 0
        self._top_k = params.top_k if params.top_k < self.n_vocab else 0
        self._log_min_p = F32(math.log(params.min_p)) if params.min_p > 0 else None
        self._temperature = F32(params.temperature)

    def __call__(self, logits: np.ndarray, history: Sequence[int]) -> int:
        """The next token id. ``logits``: (n_vocab,) float32 scores of the next position;
        ``history``: the token ids so far (prompt, then generated), which the penalty reads."""
        x = self._prepare(logits, history)
        if self.params.greedy:
            return _first_max(x)
        top = _max(x)
        ids, vals = self._survivors(x, top)
        return self._draw(ids, vals, top)

    def candidates(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The ids the draw would choose among, ascending (greedy: the one pick). For
        inspection and tests; it consumes no randomness."""
        x = self._prepare(logits, history)
        if self.params.greedy:
            return np.array([_first_max(x)])
        ids, _ = self._survivors(x, _max(x))
        return np.arange(self.n_vocab) if ids is None else np.sort(ids)

    def _prepare(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        x = np.asarray(logits, dtype=F32)
        if x.shape != (self.n_vocab,):
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {x.shape}")
        return self._apply_penalty(x, history) if self._uses_penalty else x

    def _apply_penalty(self, x: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's repeat penalty: each distinct recent token's logit is divided by the
        penalty when positive, multiplied when not (so it always becomes less likely)."""
        last_n = self.params.repeat_last_n
        recent = np.asarray(history[-last_n:] if last_n > 0 else history, dtype=np.int64)
        if recent.size == 0:
            return x
        if recent.ndim != 1 or recent.min() < 0 or recent.max() >= self.n_vocab:
            raise ValueError(f"history must be a flat sequence of ids in 0..{self.n_vocab - 1}")
        out = self._penalised
        np.copyto(out, x)
        v = out[recent]  # a repeated id gets the same value twice: penalised once
        out[recent] = np.where(v <= 0, v * self._penalty, v / self._penalty)
        return out

    def _survivors(self, x: np.ndarray, top: np.float32) -> tuple[np.ndarray | None, np.ndarray]:
        """The ids (None: all of them) and logits that top-k, top-p and min-p keep. Every
        stage keeps the largest logit, so ``top`` stays the maximum of what survives."""
        ids: np.ndarray | None = None
        vals = x
        if self._top_k:
            ids = self._top(x, self._top_k)
            vals = x[ids]
        if self.params.top_p < 1:
            ids = self._nucleus(x, top, ids, vals)
            vals = x[ids]
        if self._log_min_p is not None:
            floor = top + self._log_min_p  # p >= min_p * p_max, in logits as llama.cpp does
            if ids is None:
                ids = np.flatnonzero(np.greater_equal(x, floor, out=self._mask))
                vals = x[ids]
            else:
                keep = vals >= floor
                ids, vals = ids[keep], vals[keep]
        return ids, vals

    def _top(self, x: np.ndarray, k: int) -> np.ndarray:
        """The ids of the k largest logits, largest first, equal logits by lower id."""
        cand = self._reaching_floor(x, k)
        return cand[np.lexsort((cand, -x[cand]))[:k]]  # by logit descending, then by id

    def _reaching_floor(self, x: np.ndarray, k: int) -> np.ndarray:
        """The ids of every logit at or above a floor that at least k logits reach.

        For small k, column j of the (rows, m) view holds the logits j, j + m, ...; the k-th
        largest of the m column maxima is such a floor (k columns each hold a value at least
        that big) and costs one pass, far less than a partition of the whole vocabulary; the
        values reaching it are looked for in those k columns and the tail past the view."""
        n = x.size
        m = TOP_COLUMNS
        if k * 4 > m or n < 2 * m:  # the exact k-th largest logit
            floor = np.partition(x, n - k)[n - k]
            return np.flatnonzero(np.greater_equal(x, floor, out=self._mask))
        rows = n // m
        grid = x[: rows * m].reshape(rows, m)  # (rows, m)
        maxima = grid.max(axis=0)  # (m,)
        floor = np.partition(maxima, m - k)[m - k]
        cols = np.flatnonzero(maxima >= floor)
        r, c = np.divmod(np.flatnonzero(np.take(grid, cols, axis=1) >= floor), cols.size)
        tail = np.flatnonzero(x[rows * m :] >= floor) + rows * m
        return np.concatenate((r * m + cols[c], tail))

    def _nucleus(
        self, x: np.ndarray, top: np.float32, ids: np.ndarray | None, vals: np.ndarray
    ) -> np.ndarray:
        """top-p: the smallest best-first prefix whose probability (softmax over the current
        candidates, untempered) reaches top_p; at least one token."""
        top_p = self.params.top_p
        if ids is not None:  # top-k ran: the candidates are already best first
            cum = np.cumsum(exp(vals - top), dtype=np.float64)
            return ids[: _cut(cum, top_p * cum[-1])]
        p = exp(x - top)  # (n_vocab,)
        target = top_p * float(np.cumsum(p, dtype=np.float64)[-1])
        guess = NUCLEUS_GUESS
        while guess < self.n_vocab:  # the best few usually suffice; a flat tail takes more
            best = self._top(x, guess)
            cum = np.cumsum(p[best], dtype=np.float64)
            if cum[-1] >= target:
                return best[: _cut(cum, target)]
            guess *= NUCLEUS_GROWTH
        best = np.lexsort((np.arange(self.n_vocab), -x))  # everything, best first
        return best[: _cut(np.cumsum(p[best], dtype=np.float64), target)]

    def _draw(self, ids: np.ndarray | None, vals: np.ndarray, top: np.float32) -> int:
        """Temperature, softmax and one uniform draw over the survivors in token-id order."""
        if ids is not None:
            order = np.argsort(ids)
            ids, vals = ids[order], vals[order]
        z = vals - top  # <= 0: no overflow however small the temperature
        if self._temperature != 1:
            z = z / self._temperature
        p = exp(z)
        cum = np.cumsum(p, dtype=np.float64)
        i = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
        if i == cum.size:  # the uniform number rounded up to the total
            i = int(np.flatnonzero(p)[-1])
        return i if ids is None else int(ids[i])


def _first_max(x: np.ndarray) -> int:
    best = int(x.argmax())  # the first maximum; a NaN anywhere wins and is caught here
    if not math.isfinite(x[best]):
        _invalid(x)
    return best


def _max(x: np.ndarray) -> np.float32:
    top = x.max()  # NaN if any logit is NaN
    if not math.isfinite(top):
        _invalid(x)
    return top


def _cut(cum: np.ndarray, target: float) -> int:
    """How many leading entries it takes for the cumulative sum to reach target (>= 1)."""
    return min(int(np.searchsorted(cum, target, side="left")) + 1, cum.size)


def _invalid(x: np.ndarray) -> NoReturn:
    nan = np.flatnonzero(np.isnan(x))
    if nan.size:
        what = f"NaN (first at token {nan[0]}, {nan.size} in all)"
    elif np.isposinf(x).any():
        what = f"+inf (at token {int(np.flatnonzero(np.isposinf(x))[0])})"
    else:
        what = "-inf everywhere, so no token can be picked"
    raise BackendError(
        f"the logits hold {what}: the model or backend produced invalid numbers; check the "
        "model file and compare the backend with the cpu oracle (parity.core.compare)"
    )
