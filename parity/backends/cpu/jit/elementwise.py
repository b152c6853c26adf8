"""exp, SILU/SWIGLU, GELU/GEGLU, RMS_NORM (and RMS_NORM_MUL), ROPE, KV_WRITE and ARGMAX,
compiled: the numpy definitions of ``ops.py`` and ``parity.numerics`` one float32 operation at
a time, in the same order (docs/numerics.md).

Row kernels take a row range ``lo..hi`` so that the same code runs serially (one range) or in
parallel (``*_parallel``: ranges in a ``prange``); a row's result never depends on which.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from parity.backends.cpu.jit.compile import kernel
from parity.backends.cpu.jit.reduce import next_pow2, tree_sum
from parity.backends.cpu.jit.simd import bits_to_f32
from parity.numerics import EXP_HI, EXP_LO, EXP_POLY, GELU_A, GELU_S, LN2_HI, LN2_LO, LOG2E

F32 = np.float32
C7, C6, C5, C4, C3, C2, C1, C0 = EXP_POLY


@kernel(inline=True)
def pow2(n: int) -> np.float32:
    """2**n as float32 from the exponent bits; n in [-126, 127]."""
    return bits_to_f32(np.int32((n + 127) << 23))


@kernel(inline=True)
def exp32(x: np.float32) -> np.float32:
    """The contract's exp (``parity.numerics.exp``) of one float32, step by step."""
    xc = x
    if x != x:
        xc = F32(0)
    elif x < EXP_LO:
        xc = EXP_LO
    elif x > EXP_HI:
        xc = EXP_HI
    kf = np.rint(xc * LOG2E)  # round half to even; kf in [-150, 128]
    r = xc - kf * LN2_HI
    r = r - kf * LN2_LO
    p = r * C7  # Horner: fl(C7 * r), fl(p + C6), fl(p * r), ...
    p = p + C6
    p = p * r
    p = p + C5
    p = p * r
    p = p + C4
    p = p * r
    p = p + C3
    p = p * r
    p = p + C2
    p = p * r
    p = p + C1
    p = p * r
    p = p + C0
    k = np.int32(kf)
    k1 = k >> 1  # floor(k / 2)
    y = (p * pow2(k1)) * pow2(k - k1)
    if x > EXP_HI:
        return F32(np.inf)
    if x < EXP_LO:
        return F32(0)
    if x != x:
        return x
    return y


@kernel()
def swiglu_rows(gate: np.ndarray, up: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """out = fl(silu(gate) * up), silu(g) = fl(g / fl(1 + exp(-g))), rows lo..hi-1."""
    for t in range(lo, hi):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            out[t, i] = (g / (F32(1) + exp32(-g))) * up[t, i]


@kernel()
def silu_rows(x: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """out = fl(x / fl(1 + exp(-x))), rows lo..hi-1."""
    for t in range(lo, hi):
        for i in range(x.shape[1]):
            v = x[t, i]
            out[t, i] = v / (F32(1) + exp32(-v))


@kernel(inline=True)
def gelu32(x: np.float32) -> np.float32:
    """The contract's GELU (``parity.numerics.gelu``) of one float32, step by step."""
    c = GELU_A * (x * x)
    c = c + F32(1)
    u = GELU_S * (x * c)
    v = u * F32(-2)
    if v > F32(0):  # x < 0: the exp of -v, at most 1
        e = exp32(-v)
        return (x * e) / (F32(1) + e)
    return x / (F32(1) + exp32(v))


@kernel()
def geglu_rows(gate: np.ndarray, up: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """out = fl(gelu(gate) * up), rows lo..hi-1."""
    for t in range(lo, hi):
        for i in range(gate.shape[1]):
            out[t, i] = gelu32(gate[t, i]) * up[t, i]


@kernel()
def gelu_rows(x: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """out = gelu(x), rows lo..hi-1."""
    for t in range(lo, hi):
        for i in range(x.shape[1]):
            out[t, i] = gelu32(x[t, i])


@kernel(inline=True)
def rms_scale(
    x: np.ndarray, t: int, eps: np.float32, sq: np.ndarray, tmp: np.ndarray
) -> np.float32:
    """Row t's ss = TREE(fl(x * x)), mean = fl(ss / W), scale = fl(1 / fl(sqrt(fl(mean + eps))));
    ``sq`` holds next_pow2(W) slots whose padding stays +0.0, ``tmp`` the tree's scratch."""
    width = x.shape[1]
    for i in range(width):
        sq[i] = x[t, i] * x[t, i]
    ss = tree_sum(sq, width, tmp)
    mean = ss / F32(width)
    r = np.sqrt(mean + eps)
    return F32(1) / r


@kernel()
def rms_norm_rows(x: np.ndarray, eps: np.float32, out: np.ndarray, lo: int, hi: int) -> None:
    """Per row: out = fl(x * scale) (``rms_scale``); rows lo..hi-1."""
    sq = np.zeros(next_pow2(x.shape[1]), F32)
    tmp = np.empty(max(sq.size // 32, 1), F32)
    for t in range(lo, hi):
        scale = rms_scale(x, t, eps, sq, tmp)
        for i in range(x.shape[1]):
            out[t, i] = x[t, i] * scale


@kernel()
def rms_norm_mul_rows(
    x: np.ndarray, eps: np.float32, w: np.ndarray, out: np.ndarray, lo: int, hi: int
) -> None:
    """RMS_NORM_MUL: out = fl(fl(x * scale) * w), both roundings of the composition kept."""
    sq = np.zeros(next_pow2(x.shape[1]), F32)
    tmp = np.empty(max(sq.size // 32, 1), F32)
    for t in range(lo, hi):
        scale = rms_scale(x, t, eps, sq, tmp)
        for i in range(x.shape[1]):
            out[t, i] = (x[t, i] * scale) * w[i]


@kernel()
def kv_write_rows(cache: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> None:
    """cache[positions[t]] = rows[t] (positions checked by the runtime: in range, distinct)."""
    for t in range(rows.shape[0]):
        p = positions[t]
        for i in range(rows.shape[1]):
            cache[p, i] = rows[t, i]


@kernel()
def argmax_rows(x: np.ndarray, out: np.ndarray) -> None:
    """Per row, the first index of the maximum; the first NaN beats every number."""
    for t in range(x.shape[0]):
        best = 0
        top = x[t, 0]
        if top == top:
            for i in range(1, x.shape[1]):
                v = x[t, i]
                if v != v:
                    best = i
                    break
                if v > top:
                    top = v
                    best = i
        out[t] = best


@kernel()
def rope_rows(
    x: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    n_head: int,
    head_dim: int,
    n_rot: int,
    neox: bool,
    out: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """Rotate pairs (2i, 2i+1) ("normal") or (i, i + n_rot/2) ("neox") of every head by table
    column i of the token's position: fl(fl(x0 c) - fl(x1 s)), fl(fl(x0 s) + fl(x1 c)); dims
    past n_rot are copied. Rows lo..hi-1; positions already checked."""
    half = n_rot // 2
    for t in range(lo, hi):
        p = positions[t]
        for i in range(x.shape[1]):
            out[t, i] = x[t, i]
        for h in range(n_head):
            o = h * head_dim
            for i in range(half):
                i0 = o + i if neox else o + 2 * i
                i1 = i0 + half if neox else i0 + 1
                c, s = cos[p, i], sin[p, i]
                x0, x1 = x[t, i0], x[t, i1]
                out[t, i0] = x0 * c - x1 * s
                out[t, i1] = x0 * s + x1 * c


@kernel(parallel=True)
def swiglu_parallel(gate: np.ndarray, up: np.ndarray, out: np.ndarray, chunks: int) -> None:
    n = gate.shape[0]
    for c in prange(chunks):
        swiglu_rows(gate, up, out, c * n // chunks, (c + 1) * n // chunks)


@kernel(parallel=True)
def silu_parallel(x: np.ndarray, out: np.ndarray, chunks: int) -> None:
    n = x.shape[0]
    for c in prange(chunks):
        silu_rows(x, out, c * n // chunks, (c + 1) * n // chunks)


@kernel(parallel=True)
def geglu_parallel(gate: np.ndarray, up: np.ndarray, out: np.ndarray, chunks: int) -> None:
    n = gate.shape[0]
    for c in prange(chunks):
        geglu_rows(gate, up, out, c * n // chunks, (c + 1) * n // chunks)


@kernel(parallel=True)
def gelu_parallel(x: np.ndarray, out: np.ndarray, chunks: int) -> None:
    n = x.shape[0]
    for c in prange(chunks):
        gelu_rows(x, out, c * n // chunks, (c + 1) * n // chunks)


@kernel(parallel=True)
def rms_norm_parallel(x: np.ndarray, eps: np.float32, out: np.ndarray, chunks: int) -> None:
    n = x.shape[0]
    for c in prange(chunks):
        rms_norm_rows(x, eps, out, c * n // chunks, (c + 1) * n // chunks)


@kernel(parallel=True)
def rms_norm_mul_parallel(
    x: np.ndarray, eps: np.float32, w: np.ndarray, out: np.ndarray, chunks: int
) -> None:
    n = x.shape[0]
    for c in prange(chunks):
        rms_norm_mul_rows(x, eps, w, out, c * n // chunks, (c + 1) * n // chunks)


@kernel(parallel=True)
def rope_parallel(
    x: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    n_head: int,
    head_dim: int,
    n_rot: int,
    neox: bool,
    out: np.ndarray,
    chunks: int,
) -> None:
    n = x.shape[0]
    for c in prange(chunks):
        lo, hi = c * n // chunks, (c + 1) * n // chunks
        rope_rows(x, positions, cos, sin, n_head, head_dim, n_rot, neox, out, lo, hi)
