"""Activation quantization: float32 rows -> int8 per 32-block with a scale and a block sum."""

from __future__ import annotations

import attrs
import numpy as np

F32 = np.float32
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


def quantize_activations(x: np.ndarray) -> Q8Activations:
    """Quantize (T, K) float32 activations per row and 32-block, as docs/numerics.md states."""
    x = np.asarray(x)
    if x.dtype != F32 or x.ndim != 2:
        raise ValueError(f"quantize_activations needs float32 (T, K), got {x.dtype} {x.shape}")
    t, k = x.shape
    if k % QK:
        raise ValueError(f"quantize_activations needs K a multiple of {QK}, got K = {k}")
    xb = x.reshape(t, k // QK, QK)  # (T, nb, 32)
    amax = np.max(np.abs(xb), axis=-1)  # np.max propagates NaN: a NaN block gets d = NaN
    d = amax / F32(127)  # (T, nb)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = xb / d[..., None]  # correctly rounded division, not x * (1/d)
    v = np.where(np.isnan(v) | (d == 0)[..., None], F32(0), v)
    q = np.clip(round_half_away(v), F32(-127), F32(127)).astype(np.int8)  # (T, nb, 32)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 = NaN, huge d * sum = inf
        s = d * q.sum(axis=-1, dtype=np.int32).astype(F32)  # the integer sum is exact
    return Q8Activations(q=q.reshape(t, k), d=d, s=s)
