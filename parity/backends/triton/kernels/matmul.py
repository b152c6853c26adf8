"""MATMUL in ``exact`` numerics (docs/numerics.md, "MATMUL"), with MATMUL_ADD's bias and residual
as its epilogue. One program computes ``BN`` outputs ``y[t, n0 .. n0 + BN)`` of one token
(program ids: rows, then tokens):

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

from parity.backends.triton.kernels.dequant import dequant
from parity.backends.triton.kernels.elementwise import p_silu
from parity.backends.triton.kernels.pdl import after_previous

# a product's min term: none (Q4_0, Q5_0, Q8_0, Q6_K), + m * s_x (Q4_1), - m * s_x (Q4_K)
NO_MIN = tl.constexpr(0)
PLUS_MIN = tl.constexpr(1)
MINUS_MIN = tl.constexpr(2)


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
def _group_weights(wq, wa, wm, k, n0, i, MIN: tl.constexpr, L: tl.constexpr, G: tl.constexpr):
    """Group ``i``'s G sub-blocks of the rows ``n0`` of a repacked weight (dequant.repack):
    quants (BN, G, L) (0 past the last sub-block: not loaded), scales and mins (BN, G)."""
    nsub = k // L
    s = i * G + tl.arange(0, G)
    sm = s < nsub
    s0 = tl.where(sm, s, 0)
    e = s0[:, None] * L + tl.arange(0, L)[None, :]  # (G, L) element indices
    qw = tl.load(wq + n0[:, None, None] * k + e[None, :, :], mask=sm[None, :, None], other=0)
    at = n0[:, None] * nsub + s0[None, :]
    a = tl.load(wa + at)
    if MIN == NO_MIN:  # noqa: SIM108 (a compile-time branch: no load)
        mn = a
    else:
        mn = tl.load(wm + at)
    return qw, a, mn


@triton.jit
def _group_tree(xq, xd, xs, qw, a, mn, t, k, i, MIN: tl.constexpr, L: tl.constexpr,
                G: tl.constexpr, LOGG: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The TREE of group ``i``'s G sub-block terms (+0.0 past the last sub-block), from its
    weights (``_group_weights``): (BN,)."""
    nsub = k // L
    s = i * G + tl.arange(0, G)
    sm = s < nsub
    s0 = tl.where(sm, s, 0)
    e = s0[:, None] * L + tl.arange(0, L)[None, :]
    qx = tl.load(xq + t * k + e, mask=sm[:, None], other=0).to(tl.int32)
    isum = tl.sum(qw.to(tl.int32) * qx[None, :, :], 2)  # (BN, G), exact
    b = (s0 * L) // 32  # the activation block of each sub-block
    dx = tl.load(xd + t * (k // 32) + b)
    term = (a * dx[None, :]) * isum.to(tl.float32)
    if MIN == PLUS_MIN:
        term = term + mn * tl.load(xs + t * (k // 32) + b)[None, :]
    elif MIN == MINUS_MIN:
        term = term - mn * tl.load(xs + t * (k // 32) + b)[None, :]
    return tree_rows(tl.where(sm[None, :], term, 0.0), BN, G, LOGG)


@triton.jit
def matmul_q(y, xq, xd, xs, wq, wa, wm, uq, ua, um, bias, res, k, n_out, MIN: tl.constexpr,
             L: tl.constexpr, P: tl.constexpr, LOG: tl.constexpr, G: tl.constexpr,
             LOGG: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_RES: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y[t, n] for a repacked quantized W (L elements a sub-block, P = next_pow2(K / L) =
    2^LOG), G = 2^LOGG sub-blocks at a time: the TREE of P terms is the TREE of the P / G
    groups' TREEs (groups past the last sub-block are +0.0 and not computed). With GLU, a
    second product by U (same L and MIN) and ``y = fl(silu(x W) * x U)``: MATMUL_SWIGLU. The
    first group's weights are loaded before the previous kernel has ended (``PDL``)."""
    t = tl.program_id(1).to(tl.int64)  # (rows on axis 0, whose grid may exceed 65535)
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    nm = n < n_out
    n0 = tl.where(nm, n, 0)
    NG: tl.constexpr = P // G
    groups = tl.arange(0, NG)
    wq0, wa0, wm0 = _group_weights(wq, wa, wm, k, n0, 0, MIN, L, G)
    if GLU:
        uq0, ua0, um0 = _group_weights(uq, ua, um, k, n0, 0, MIN, L, G)
    after_previous(PDL)
    g = _group_tree(xq, xd, xs, wq0, wa0, wm0, t, k, 0, MIN, L, G, LOGG, BN)
    parts = tl.where(groups[None, :] == 0, g[:, None], 0.0)
    if GLU:
        u = _group_tree(xq, xd, xs, uq0, ua0, um0, t, k, 0, MIN, L, G, LOGG, BN)
        up = tl.where(groups[None, :] == 0, u[:, None], 0.0)
    for i in range(1, tl.cdiv(k // L, G)):
        qw, a, mn = _group_weights(wq, wa, wm, k, n0, i, MIN, L, G)
        g = _group_tree(xq, xd, xs, qw, a, mn, t, k, i, MIN, L, G, LOGG, BN)
        parts = tl.where(groups[None, :] == i, g[:, None], parts)
        if GLU:
            qw, a, mn = _group_weights(uq, ua, um, k, n0, i, MIN, L, G)
            u = _group_tree(xq, xd, xs, qw, a, mn, t, k, i, MIN, L, G, LOGG, BN)
            up = tl.where(groups[None, :] == i, u[:, None], up)
    v = tree_rows(parts, BN, NG, LOG - LOGG)
    if GLU:
        v = p_silu(v) * tree_rows(up, BN, NG, LOG - LOGG)
    _epilogue(y, v, bias, res, t, n, nm, n_out, HAS_BIAS, HAS_RES)


@triton.jit
def _float_weights(w, row_bytes, n0, k, i, TYPE: tl.constexpr, G: tl.constexpr):
    """Elements ``i * G ..`` of the rows ``n0`` of a float W, as float32 (BN, G)."""
    e = i * G + tl.arange(0, G)
    return dequant(w, row_bytes, n0[:, None], tl.where(e < k, e, 0)[None, :], TYPE)


@triton.jit
def _float_tree(x, wv, t, k, i, G: tl.constexpr, LOGG: tl.constexpr, BN: tl.constexpr):
    """The TREE of fl(x_k * w_k) over elements ``i * G ..`` (+0.0 past K): (BN,)."""
    e = i * G + tl.arange(0, G)
    em = e < k
    xv = tl.load(x + t * k + tl.where(em, e, 0))
    return tree_rows(tl.where(em[None, :], xv[None, :] * wv, 0.0), BN, G, LOGG)


@triton.jit
def matmul_f(y, x, w, bias, res, k, n_out, row_bytes, TYPE: tl.constexpr, P: tl.constexpr,
             LOG: tl.constexpr, G: tl.constexpr, LOGG: tl.constexpr, BN: tl.constexpr,
             HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y[t, n] for a float W (F32, F16, BF16): the TREE of fl(x_k * w_k), P = next_pow2(K), G
    elements at a time (the first G loaded before the previous kernel has ended)."""
    t = tl.program_id(1).to(tl.int64)  # (rows on axis 0, whose grid may exceed 65535)
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    nm = n < n_out
    n0 = tl.where(nm, n, 0)
    NG: tl.constexpr = P // G
    groups = tl.arange(0, NG)
    w0 = _float_weights(w, row_bytes, n0, k, 0, TYPE, G)
    after_previous(PDL)
    g = _float_tree(x, w0, t, k, 0, G, LOGG, BN)
    parts = tl.where(groups[None, :] == 0, g[:, None], 0.0)
    for i in range(1, NG):
        g = _float_tree(x, _float_weights(w, row_bytes, n0, k, i, TYPE, G), t, k, i, G, LOGG, BN)
        parts = tl.where(groups[None, :] == i, g[:, None], parts)
    v = tree_rows(parts, BN, NG, LOG - LOGG)
    _epilogue(y, v, bias, res, t, n, nm, n_out, HAS_BIAS, HAS_RES)
