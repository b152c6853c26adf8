"""MATMUL in ``exact`` numerics (docs/numerics.md, "MATMUL"), with MATMUL_ADD's bias and residual
as its epilogue. One program computes ``BN`` outputs ``y[t, n0 .. n0 + BN)`` of one token:

- quantized W, ``G`` sub-blocks at a time: per sub-block ``s`` the exact integer ``isum_s`` of
  the weight's quants and x's Q8 quants (``tl.sum`` over int32: exact in any order), then
  ``term_s = fl(fl(a * d_x) * isum_s)`` (Q4_1 ``+ fl(m * s_x)``, Q4_K ``- fl(m * s_x)``), +0.0
  past the last sub-block, and the TREE over the padded sub-blocks (each group's TREE, then the
  TREE of the groups': the same levels);
- float W: ``fl(x_k * w_k)`` per element, +0.0 past K, and the TREE over them.

The TREE is ``tree_rows``: the contract's adjacent pairs, level by level, along the last axis.
Then ``fl(y + bias)`` and ``fl(r + y)`` where the node has them. Written for exactness first;
the speed work is the speed issue's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.dequant import Q4_1, Q4_K, dequant, quants, scales


@triton.jit
def tree_rows(x, R: tl.constexpr, P: tl.constexpr, LOG: tl.constexpr):
    """TREE along the last axis of an (R, P) block, P = 2^LOG: (R,)."""
    for level in tl.static_range(LOG):
        a, b = tl.split(tl.reshape(x, (R, P >> (level + 1), 2)))
        x = a + b
    return tl.reshape(x, (R,))


@triton.jit
def _epilogue(y, v, bias, res, t, n, nm, n_out, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    if HAS_BIAS:
        v = v + tl.load(bias + n, mask=nm)
    if HAS_RES:
        v = tl.load(res + t * n_out + n, mask=nm) + v
    tl.store(y + t * n_out + n, v, mask=nm)


@triton.jit
def matmul_q(y, xq, xd, xs, w, bias, res, k, n_out, row_bytes, TYPE: tl.constexpr,
             L: tl.constexpr, P: tl.constexpr, LOG: tl.constexpr, G: tl.constexpr,
             LOGG: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_RES: tl.constexpr):  # fmt: skip
    """y[t, n] for a quantized W (L elements a sub-block, P = next_pow2(K / L) = 2^LOG), G =
    2^LOGG sub-blocks at a time: the TREE of P terms is the TREE of the P / G groups' TREEs."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    nm = n < n_out
    n0 = tl.where(nm, n, 0)
    NG: tl.constexpr = P // G
    groups = tl.arange(0, NG)
    parts = tl.zeros((BN, NG), tl.float32)
    for i in range(0, NG):
        s = i * G + tl.arange(0, G)
        sm = s < k // L
        s0 = tl.where(sm, s, 0)
        e = s0[:, None] * L + tl.arange(0, L)[None, :]  # (G, L) element indices
        qx = tl.load(xq + t * k + e).to(tl.int32)  # (G, L)
        qw = quants(w, row_bytes, n0[:, None, None], e[None, :, :], TYPE)  # (BN, G, L)
        isum = tl.sum(qw * qx[None, :, :], 2)  # (BN, G), exact
        b = (s0 * L) // 32  # the activation block of each sub-block
        dx = tl.load(xd + t * (k // 32) + b)
        a, m = scales(w, row_bytes, n0[:, None], s0[None, :], TYPE)  # (BN, G)
        term = (a * dx[None, :]) * isum.to(tl.float32)
        if TYPE == Q4_1:
            term = term + m * tl.load(xs + t * (k // 32) + b)[None, :]
        elif TYPE == Q4_K:
            term = term - m * tl.load(xs + t * (k // 32) + b)[None, :]
        term = tl.where(sm[None, :], term, 0.0)
        parts = tl.where(groups[None, :] == i, tree_rows(term, BN, G, LOGG)[:, None], parts)
    v = tree_rows(parts, BN, NG, LOG - LOGG)
    _epilogue(y, v, bias, res, t, n, nm, n_out, HAS_BIAS, HAS_RES)


@triton.jit
def matmul_f(y, x, w, bias, res, k, n_out, row_bytes, TYPE: tl.constexpr, P: tl.constexpr,
             LOG: tl.constexpr, G: tl.constexpr, LOGG: tl.constexpr, BN: tl.constexpr,
             HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """y[t, n] for a float W (F32, F16, BF16): the TREE of fl(x_k * w_k), P = next_pow2(K), G
    elements at a time."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    nm = n < n_out
    n0 = tl.where(nm, n, 0)
    NG: tl.constexpr = P // G
    groups = tl.arange(0, NG)
    parts = tl.zeros((BN, NG), tl.float32)
    for i in range(0, NG):
        e = i * G + tl.arange(0, G)
        em = e < k
        e0 = tl.where(em, e, 0)
        xv = tl.load(x + t * k + e0)
        wv = dequant(w, row_bytes, n0[:, None], e0[None, :], TYPE)  # (BN, G)
        prod = tl.where(em[None, :], xv[None, :] * wv, 0.0)
        parts = tl.where(groups[None, :] == i, tree_rows(prod, BN, G, LOGG)[:, None], parts)
    v = tree_rows(parts, BN, NG, LOG - LOGG)
    _epilogue(y, v, bias, res, t, n, nm, n_out, HAS_BIAS, HAS_RES)
