"""MATMUL and GET_ROWS on the raw GGUF bytes (docs/numerics.md, "MATMUL", "GET_ROWS").

The numpy definition (``parity.quant``) unpacks weights into float32 planes so that BLAS can
form the exact integer sums; these kernels read the packed blocks where they lie (a zero-copy
view of the mapped file) and do, per output row and token, exactly the contract's steps:

    a, m  = the row's sub-block scales and mins (``blocks.row_scales``)
    isum  = exact int32 sums of quants times int8 activations (``blocks.row_isums``)
    term  = fl(fl(a * d_x) * isum), then fl(term + fl(m * s_x)) (Q4_1) or fl(term - ...) (Q4_K)
    y     = TREE(terms)

Each output element is computed by one call of the same code whatever the thread count or
the batch, so results depend on neither. ``quant_rows`` and ``float_rows`` are compiled once
per weight type, on first use (``literally``: the type is a constant inside, so its branches
fold away); ``quant_parallel`` and ``float_parallel`` run them over row ranges in parallel.
Python calls the per-type entry points in ``QUANT``, ``FLOAT`` and ``GET_ROWS``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import literally, prange

from parity.backends.cpu.jit import simd
from parity.backends.cpu.jit.blocks import (
    FLOAT_CODES,
    Q4_1,
    Q4_K,
    QUANT_CODES,
    block_layout,
    row_isums,
    row_scales,
    row_values,
)
from parity.backends.cpu.jit.compile import kernel
from parity.backends.cpu.jit.reduce import next_pow2, tree_lanes, tree_sum

F32 = np.float32
LANES = simd.LANES
"""Tokens of one row whose terms and trees share vector instructions."""


@kernel()
def quant_rows(
    code: int,
    raw: np.ndarray,
    qx: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    table: np.ndarray,
    y: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """Rows lo..hi-1 of W for every token: y[t, n] = TREE(terms of row n and token t).

    ``raw`` is W's packed bytes (uint8, rows back to back), ``qx`` int8 (T, K), ``dx`` and
    ``sx`` float32 (T, K/32) the quantized activations, ``y`` float32 (T, N). The terms live
    in a next_pow2(nsub)-slot buffer whose slots from nsub on are +0.0 from the start and never
    written: the tree's padding.

    One token (decode): row by row. More: LANES tokens of a row side by side, laid out
    (sub-block, lane), so that the terms (``simd.terms_*``) and the tree levels
    (``reduce.tree_lanes``) of all of them are vector instructions; each lane is still its
    token's own terms and tree."""
    literally(code)
    n_tok, k = qx.shape
    elems, nbytes, sub_len = block_layout(code)
    row_bytes = k // elems * nbytes
    nsub = k // sub_len
    shift = 1 if sub_len == 16 else 0  # sub-block s lies in activation block s >> shift
    width = next_pow2(nsub)
    a = np.empty(nsub, F32)
    m = np.zeros(nsub, F32)
    if n_tok == 1:
        isum = np.zeros(nsub, np.int32)
        terms = np.zeros(width, F32)
        tmp = np.empty(max(width // 32, 1), F32)
        for n in range(lo, hi):
            row_scales(code, raw, n * row_bytes, nsub, table, a, m)
            row_isums(code, raw, n * row_bytes, qx, 0, isum, 0, 4, nsub)
            for s in range(nsub):
                b = s >> shift
                term = (a[s] * dx[0, b]) * F32(isum[s])
                if code == Q4_1:
                    term = term + m[s] * sx[0, b]
                elif code == Q4_K:
                    term = term - m[s] * sx[0, b]
                terms[s] = term
            y[0, n] = tree_sum(terms, width, tmp)  # slots nsub..width-1: the +0.0 padding
        return
    isum = np.zeros(nsub * LANES, np.int32)  # (sub-block, lane)
    terms = np.zeros(width * LANES, F32)  # (sub-block, lane)
    other = np.empty(max(width // 2, 1) * LANES, F32)
    dxt = np.zeros(dx.shape[1] * LANES, F32)  # (activation block, lane): a tile's d_x, s_x
    sxt = np.zeros(dx.shape[1] * LANES, F32)
    row = 4 * LANES  # bytes per (sub-block, lane) row
    for t0 in range(0, n_tok, LANES):
        lanes = min(LANES, n_tok - t0)
        for j in range(lanes):
            for b in range(dx.shape[1]):
                dxt[b * LANES + j] = dx[t0 + j, b]
                sxt[b * LANES + j] = sx[t0 + j, b]
        for n in range(lo, hi):
            row_scales(code, raw, n * row_bytes, nsub, table, a, m)
            for j in range(lanes):
                row_isums(code, raw, n * row_bytes, qx, (t0 + j) * k, isum, 4 * j, row, nsub)
            for s in range(nsub):
                o, bo = s * row, (s >> shift) * row
                if code == Q4_1:
                    simd.terms_plus_m(terms, o, isum, a[s], m[s], dxt, sxt, bo)
                elif code == Q4_K:
                    simd.terms_minus_m(terms, o, isum, a[s], m[s], dxt, sxt, bo)
                else:
                    simd.terms(terms, o, isum, a[s], m[s], dxt, sxt, bo)
            top = tree_lanes(terms, other, width)
            for j in range(lanes):
                y[t0 + j, n] = top[j]


@kernel()
def float_rows(
    code: int, raw: np.ndarray, x: np.ndarray, table: np.ndarray, y: np.ndarray, lo: int, hi: int
) -> None:
    """Float W rows lo..hi-1: y[t, n] = TREE over k of fl(x[t, k] * w[n, k]) (x not quantized)."""
    literally(code)
    n_tok, k = x.shape
    width = next_pow2(k)
    w = np.empty(k, F32)
    prod = np.empty(width, F32)
    tmp = np.empty(max(width // 32, 1), F32)
    for n in range(lo, hi):
        row_values(code, raw, n, k, table, w)
        for t in range(n_tok):
            for i in range(k):
                prod[i] = x[t, i] * w[i]
            y[t, n] = tree_sum(prod, k, tmp)


@kernel(parallel=True)
def quant_parallel(
    code: int,
    raw: np.ndarray,
    qx: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    table: np.ndarray,
    y: np.ndarray,
    chunks: int,
) -> None:
    """``quant_rows`` over all rows of W, cut into ``chunks`` row ranges run in parallel."""
    literally(code)
    n = y.shape[1]
    for c in prange(chunks):
        quant_rows(code, raw, qx, dx, sx, table, y, c * n // chunks, (c + 1) * n // chunks)


@kernel(parallel=True)
def float_parallel(
    code: int, raw: np.ndarray, x: np.ndarray, table: np.ndarray, y: np.ndarray, chunks: int
) -> None:
    """``float_rows`` over all rows of W, cut into ``chunks`` row ranges run in parallel."""
    literally(code)
    n = y.shape[1]
    for c in prange(chunks):
        float_rows(code, raw, x, table, y, c * n // chunks, (c + 1) * n // chunks)


def _quant_entry(code: int) -> Callable:
    """The MATMUL entry point for quantized type ``code``:
    ``f(raw, qx, dx, sx, table, y, chunks)``, serial when ``chunks`` is 1.

    A closure, so that ``code`` is a constant of the compiled code and Python calls it without
    numba's slow literal dispatch."""

    @kernel()
    def matmul(
        raw: np.ndarray,
        qx: np.ndarray,
        dx: np.ndarray,
        sx: np.ndarray,
        table: np.ndarray,
        y: np.ndarray,
        chunks: int,
    ) -> None:
        if chunks == 1:
            quant_rows(code, raw, qx, dx, sx, table, y, 0, y.shape[1])
        else:
            quant_parallel(code, raw, qx, dx, sx, table, y, chunks)

    return matmul


def _float_entry(code: int) -> Callable:
    """The MATMUL entry point for float type ``code``: ``f(raw, x, table, y, chunks)``."""

    @kernel()
    def matmul(
        raw: np.ndarray, x: np.ndarray, table: np.ndarray, y: np.ndarray, chunks: int
    ) -> None:
        if chunks == 1:
            float_rows(code, raw, x, table, y, 0, y.shape[1])
        else:
            float_parallel(code, raw, x, table, y, chunks)

    return matmul


def _get_rows_entry(code: int) -> Callable:
    """The GET_ROWS entry point for type ``code``: ``f(raw, ids, table, out)``."""

    @kernel()
    def rows(raw: np.ndarray, ids: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
        get_rows(code, raw, ids, table, out)

    return rows


@kernel()
def get_rows(
    code: int, raw: np.ndarray, ids: np.ndarray, table: np.ndarray, out: np.ndarray
) -> None:
    """GET_ROWS: out[i] = row ids[i] of the dequantized weight (ids already checked)."""
    literally(code)
    k = out.shape[1]
    for i in range(ids.size):
        row_values(code, raw, ids[i], k, table, out[i])


QUANT = {code: _quant_entry(code) for code in QUANT_CODES}
FLOAT = {code: _float_entry(code) for code in FLOAT_CODES}
GET_ROWS = {code: _get_rows_entry(code) for code in (*QUANT, *FLOAT)}
