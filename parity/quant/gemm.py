"""MATMUL: y = x · Wᵀ by the contract (docs/numerics.md), for quantized and float weights.

Speed tricks, none of which changes an operation of the contract:

- ``isum`` (exact integers) comes from BLAS: batched float32 ``sgemm``/``sgemv`` over the
  block-major (n_sub, L, N) planes; every partial sum is an integer below 2^24, so any
  summation order gives the same, exact value.
- Activation quantization (``activation.quantize_rows``) runs in a dozen whole-array numpy
  calls; its module docstring says why each shortcut is exact.
- T = 1 (decode) skips the chunk machinery, the workspace and the fancy indexing: one
  (n_sub, 1, N) terms array, a handful of whole-array ufunc calls, then the same tree.
- T > 1 works in (T, N) chunks so that temporaries stay bounded.
- The tree over sub-blocks is ``numerics.tree_sum_leading``: the contract's +0.0-padded
  tree without the pad, levels ping-ponging through the workspace.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from parity.numerics import tree_sum_leading
from parity.quant.activation import Q8Activations, quantize_rows
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


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, total)) for i in range(0, total, size)]


def _chunk_sizes(n_terms: int, t: int, n: int) -> tuple[int, int]:
    """(rows of x, columns of W) per chunk so that n_terms * rows * cols <= CHUNK_ELEMENTS."""
    tc = max(1, min(t, CHUNK_ELEMENTS // (n_terms * min(n, 512))))
    nc = max(1, min(n, CHUNK_ELEMENTS // (n_terms * tc)))
    return tc, nc


def matmul(x: np.ndarray | Q8Activations, w: PreparedWeight) -> np.ndarray:
    """y = x · Wᵀ: x float32 (T, K), or already quantized (``Q8Activations``, for a quantized
    W), W (N, K) -> float32 (T, N). No bias."""
    k = w.shape[1]
    if isinstance(x, Q8Activations):
        if w.wt is not None or x.q.ndim != 2 or x.q.shape[1] != k:
            raise ValueError(
                f"matmul of quantized activations {x.q.shape} needs a quantized weight of "
                f"{k} columns; got {w.dtype.name} {w.shape}"
            )
        qx = (x.q, x.d, x.s)  # int8: widened to float32 exactly where the sums need it
    else:
        x = np.asarray(x)
        if x.dtype != F32 or x.ndim != 2 or x.shape[1] != k:
            raise ValueError(
                f"matmul needs float32 x of shape (T, {k}) for a {w.dtype.name} weight of "
                f"shape {w.shape}; got {x.dtype} {x.shape}"
            )
        qx = None
    # non-finite inputs propagate by IEEE rules; numpy's warnings about them are noise here
    with np.errstate(invalid="ignore", over="ignore"):
        if w.wt is not None:
            return _matmul_float(x, w.wt)
        q, d, s = quantize_rows(x) if qx is None else qx
        if q.shape[0] == 1:
            return _matvec_quant(q, d, s, w)
        return _matmul_quant(q, d, s, w)


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


def _matmul_quant(q: np.ndarray, d: np.ndarray, s: np.ndarray, w: PreparedWeight) -> np.ndarray:
    """Sub-block terms fl(fl(a * d_x) * isum) (+/- fl(m * s_x)), tree-summed in K order, of the
    quantized activations (q holding the integers as float64, d, s)."""
    n_sub, sub_len, n = w.qw.shape
    t = q.shape[0]
    qx = np.empty((n_sub, t, sub_len), F32)  # exact integers
    qx[...] = q.reshape(t, n_sub, sub_len).transpose(1, 0, 2)
    dx = d.T[w.block_of_sub][:, :, None]  # (n_sub, T, 1): the 32-block each sub-block is in
    sx = s.T[w.block_of_sub][:, :, None]
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


def _matvec_quant(q: np.ndarray, d: np.ndarray, s: np.ndarray, w: PreparedWeight) -> np.ndarray:
    """T = 1: the same terms and tree as ``_matmul_quant``, in far fewer numpy calls."""
    n_sub, sub_len, _ = w.qw.shape
    per_block = 32 // sub_len  # sub-blocks per activation block: 1, or 2 for Q6_K
    dx = d[0] if per_block == 1 else np.repeat(d[0], per_block)  # d_x of each sub-block
    # integer dot products below 2^24 are exact in float32 in any order: BLAS is safe here
    terms = np.matmul(q.astype(F32).reshape(n_sub, 1, sub_len), w.qw)  # isum (n_sub, 1, N)
    np.multiply(terms, np.multiply(w.a, dx[:, None, None]), out=terms)  # fl(fl(a * d_x) * isum)
    if w.min_sign:
        sx = s[0] if per_block == 1 else np.repeat(s[0], per_block)
        combine = np.add if w.min_sign > 0 else np.subtract
        combine(terms, np.multiply(w.m, sx[:, None, None]), out=terms)  # +/- fl(m * s_x)
    return tree_sum_leading(terms)  # (1, N)
