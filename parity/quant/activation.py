"""Activation quantization: float32 rows -> int8 per 32-block with a scale and a block sum.

``quantize_rows`` is the implementation, shaped for MATMUL: it returns the quants as float64
holding exact integers (what the BLAS paths multiply), in few numpy calls, since at decode
(T = 1) call overhead, not arithmetic, is its cost. Why its shortcuts are exact:

- A block whose scale ``d`` is 0, NaN or Inf gives a non-finite quotient for at least one
  element (0/0, x/0, NaN/d, Inf/Inf), and a block with a finite non-zero ``d`` gives only finite
  quotients (|x| <= amax, so |x/d| <= 190.5 even for a subnormal ``d``). Setting every
  non-finite quotient to 0 therefore zeroes exactly the blocks the contract zeroes, and only
  single elements where a whole block is zeroed anyway.
- Round half away from zero is ``trunc(v + copysign(0.5, v))`` when the add is exact: done in
  float64, where it is exact for every float32 |v| < 2^29 (binary32's 0.49999997 + 0.5 would
  round to 1.0; in float64 it stays below 1).
- Clamping after rounding equals the contract's clamp of the rounded value; the block sum of
  at most 32 integers of magnitude <= 127 is exact in float64, and converting it to float32 is
  exact, so ``s = fl(d * sum)`` is one float32 multiply as written.
"""

from __future__ import annotations

import attrs
import numpy as np

F32 = np.float32
F64 = np.float64
QK = 32
"""Elements per activation block."""


@attrs.frozen(eq=False)
class Q8Activations:
    """Quantized activations of T rows of K: ``q`` int8 (T, K), ``d`` and ``s`` float32 (T, K/32).

    ``d`` is each block's scale and ``s = fl(d * sum(q))`` its scaled sum (for min types).
    """

    q: np.ndarray
    d: np.ndarray
    s: np.ndarray


def round_half_away(v: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest integer, ties away from zero, with exact float32 steps.

    ``floor(|v| + 0.5)`` would be wrong: |v| + 0.5 itself rounds (0.49999997 -> 1.0).
    """
    a = np.abs(v)
    f = np.floor(a)
    r = f + (a - f >= F32(0.5)).astype(F32)  # a - f is exact
    return np.copysign(r, v)


def _check(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != F32 or x.ndim != 2:
        raise ValueError(f"quantize_activations needs float32 (T, K), got {x.dtype} {x.shape}")
    if x.shape[1] % QK:
        raise ValueError(f"quantize_activations needs K a multiple of {QK}, got K = {x.shape[1]}")
    return x


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, d, s) of ``quantize_activations``, with ``q`` float64 (T, K) holding the integers."""
    x = _check(x)
    t, k = x.shape
    xb = x.reshape(t, k // QK, QK)  # (T, nb, 32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        amax = np.maximum.reduce(np.abs(xb), axis=-1)  # NaN propagates: a NaN block gets d = NaN
        d = amax / F32(127)  # (T, nb)
        v = xb / d[..., None]  # correctly rounded division, not x * (1/d)
        finite = np.isfinite(v)
        if not finite.all():
            v = np.where(finite, v, F32(0))  # d = 0, NaN or Inf: the whole block -> 0
        q = np.add(v, np.copysign(F32(0.5), v), dtype=F64)  # exact in float64
        np.trunc(q, out=q)  # round half away from zero
        np.minimum(q, 127.0, out=q)
        np.maximum(q, -127.0, out=q)
        s = np.multiply(d, np.add.reduce(q, axis=-1), dtype=F32)  # exact sum, exact cast
    return q.reshape(t, k), d, s


def quantize_activations(x: np.ndarray) -> Q8Activations:
    """Quantize (T, K) float32 activations per row and 32-block, as docs/numerics.md states."""
    q, d, s = quantize_rows(x)
    return Q8Activations(q=q.astype(np.int8), d=d, s=s)
