"""Activation quantization for the compiled MATMUL (``parity.quant.quantize_activations``)."""

from __future__ import annotations

import numpy as np
from numba import prange

from parity.backends.cpu.jit.compile import kernel

F32 = np.float32


@kernel()
def quantize_row(x: np.ndarray, q: np.ndarray, d: np.ndarray, s: np.ndarray) -> None:
    """One row of ``quantize_activations``: per 32-block amax (NaN propagates), d = fl(amax / 127),
    q = round-half-away(fl(x / d)) clamped to +-127, s = fl(d * sum(q)).

    A non-finite quotient gives q = 0: that zeroes exactly the blocks whose d is 0, NaN or Inf
    (``parity.quant.activation`` explains why). Rounding adds +-0.5 in float64, where it is
    exact."""
    for b in range(x.size // 32):
        o = b * 32
        amax = F32(0)
        nan = False
        for i in range(32):
            v = abs(x[o + i])
            if v > amax:
                amax = v
            if v != v:
                nan = True
        if nan:
            amax = F32(np.nan)
        db = amax / F32(127)
        total = 0
        for i in range(32):
            v = x[o + i] / db
            r = 0
            if np.isfinite(v):
                half = 0.5 if v >= 0 else -0.5
                r = int(max(min(np.trunc(np.float64(v) + half), 127.0), -127.0))
            q[o + i] = r
            total += r
        d[b] = db
        s[b] = db * F32(total)


@kernel()
def quantize_rows(x: np.ndarray, q: np.ndarray, d: np.ndarray, s: np.ndarray) -> None:
    """``quantize_row`` for every row of x (T, K)."""
    for t in range(x.shape[0]):
        quantize_row(x[t], q[t], d[t], s[t])


@kernel(parallel=True)
def quantize_parallel(x: np.ndarray, q: np.ndarray, d: np.ndarray, s: np.ndarray) -> None:
    """``quantize_row`` for every row of x (T, K), rows in parallel."""
    for t in prange(x.shape[0]):
        quantize_row(x[t], q[t], d[t], s[t])
