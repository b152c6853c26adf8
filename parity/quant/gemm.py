"""MATMUL: y = x · Wᵀ by the contract (docs/numerics.md), for quantized and float weights."""

from __future__ import annotations

import math
import threading

import numpy as np

from parity.quant.activation import quantize_activations
from parity.quant.prepare import PreparedWeight

F32 = np.float32

CHUNK_ELEMENTS = 1 << 20
"""Elements of one (terms, T, N) chunk: 4 MiB per float32 buffer, bounding memory."""

_local = threading.local()


def _workspace(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two flat float32 buffers of >= n elements, kept per thread.

    Fresh multi-MiB arrays on every call cost page faults that rival the arithmetic itself.
    """
    bufs = getattr(_local, "bufs", None)
    if bufs is None or bufs[0].size < n:
        bufs = _local.bufs = (np.empty(n, F32), np.empty(n, F32))
    return bufs


def _view(buf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return buf[: math.prod(shape)].reshape(shape)


def tree_sum_leading(a: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """``numerics.tree_sum(a, axis=0)`` bit for bit, without the padded copy.

    An odd level's last value is added to +0.0 (its padded partner), so -0.0 becomes +0.0
    exactly as in the padded tree. With ``scratch`` (flat, >= half of ``a``'s size), levels
    ping-pong between ``scratch`` and ``a`` (contiguous; clobbered) instead of allocating.
    """
    rest = a.shape[1:]
    targets = (scratch, a.reshape(-1)) if scratch is not None else None
    level = 0
    while a.shape[0] > 1:
        half, odd = divmod(a.shape[0], 2)
        shape = (half + odd, *rest)
        out = np.empty(shape, F32) if targets is None else _view(targets[level % 2], shape)
        np.add(a[0 : 2 * half : 2], a[1 : 2 * half : 2], out=out[:half])
        if odd:
            np.add(a[-1], F32(0), out=out[half])
        a = out
        level += 1
    return a[0]


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, total)) for i in range(0, total, size)]


def _chunk_sizes(n_terms: int, t: int, n: int) -> tuple[int, int]:
    """(rows of x, columns of W) per chunk so that n_terms * rows * cols <= CHUNK_ELEMENTS."""
    tc = max(1, min(t, CHUNK_ELEMENTS // (n_terms * min(n, 512))))
    nc = max(1, min(n, CHUNK_ELEMENTS // (n_terms * tc)))
    return tc, nc


def matmul(x: np.ndarray, w: PreparedWeight) -> np.ndarray:
    """y = x · Wᵀ: x float32 (T, K), W (N, K) -> float32 (T, N). No bias."""
    x = np.asarray(x)
    k = w.shape[1]
    if x.dtype != F32 or x.ndim != 2 or x.shape[1] != k:
        raise ValueError(
            f"matmul needs float32 x of shape (T, {k}) for a {w.dtype.name} weight of shape "
            f"{w.shape}; got {x.dtype} {x.shape}"
        )
    # non-finite inputs propagate by IEEE rules; numpy's warnings about them are noise here
    with np.errstate(invalid="ignore", over="ignore"):
        if w.wt is not None:
            return _matmul_float(x, w.wt)
        return _matmul_quant(x, w)


def _matmul_float(x: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """y[t, n] = tree_sum over k of fl(x[t, k] * w[n, k]); wt is W transposed (K, N)."""
    k, n = wt.shape
    t = x.shape[0]
    y = np.empty((t, n), F32)
    xt = x.T  # (K, T)
    tc, nc = _chunk_sizes(k, t, n)
    buf, scratch = _workspace(k * tc * nc)
    for n0, n1 in _chunks(n, nc):
        for t0, t1 in _chunks(t, tc):
            prod = _view(buf, (k, t1 - t0, n1 - n0))
            np.multiply(xt[:, t0:t1, None], wt[:, None, n0:n1], out=prod)
            y[t0:t1, n0:n1] = tree_sum_leading(prod, scratch)
    return y


def _matmul_quant(x: np.ndarray, w: PreparedWeight) -> np.ndarray:
    """Sub-block terms fl(fl(a * d_x) * isum) (+/- fl(m * s_x)), tree-summed in K order."""
    n_sub, sub_len, n = w.qw.shape
    t = x.shape[0]
    xq = quantize_activations(x)
    qx = xq.q.reshape(t, n_sub, sub_len).transpose(1, 0, 2).astype(F32)  # (n_sub, T, L)
    dx = xq.d.T[w.block_of_sub][:, :, None]  # (n_sub, T, 1): the 32-block each sub-block is in
    sx = xq.s.T[w.block_of_sub][:, :, None]
    y = np.empty((t, n), F32)
    tc, nc = _chunk_sizes(n_sub, t, n)
    buf, scratch = _workspace(n_sub * tc * nc)
    for n0, n1 in _chunks(n, nc):
        for t0, t1 in _chunks(t, tc):
            shape = (n_sub, t1 - t0, n1 - n0)
            terms, tmp = _view(buf, shape), _view(scratch, shape)
            # integer dot products below 2^24 are exact in float32 in any order: BLAS is safe here
            np.matmul(qx[:, t0:t1], w.qw[:, :, n0:n1], out=terms)  # isum
            np.multiply(w.a[:, :, n0:n1], dx[:, t0:t1], out=tmp)  # fl(a * d_x)
            np.multiply(tmp, terms, out=terms)  # fl(fl(a * d_x) * isum)
            if w.min_sign:
                np.multiply(w.m[:, :, n0:n1], sx[:, t0:t1], out=tmp)  # fl(m * s_x)
                combine = np.add if w.min_sign > 0 else np.subtract
                combine(terms, tmp, out=terms)
            y[t0:t1, n0:n1] = tree_sum_leading(terms, scratch)
    return y
