"""MATMUL (and MATMUL_ADD's epilogue) in ``fast`` numerics, for many tokens at once: one program
computes a ``BM x BN`` tile of ``y`` on tensor cores, reading each weight once for ``BM``
tokens (the exact kernels read it once a token).

- quantized W, repacked (dequant.repack), against x's Q8 quants: per sub-block ``s`` of ``L``
  elements the integer dot ``isum_s`` of the quants as one ``tl.dot`` on int8 into int32 (on
  float16 for Q6_K's 16: every partial sum is an integer below 2^24, so exact), then
  ``term_s = (a * d_x) * isum_s`` (Q4_1 ``+ m * s_x``, Q4_K ``- m * s_x``), summed over the
  sub-blocks in order rather than as the TREE: only the order of the float additions differs
  from the oracle;
- quantized W on float16 tensor cores (PARITY_TRITON_HALF_GEMM=1): ``to_half`` makes x's
  values ``d_x q_x`` and W's ``a q (+-) m`` float16 rows, once a product, each divided by its
  row's largest block scale (x) or sub-block scale or min (W), so at most 127 and 128 in
  magnitude: nothing overflows; ``gemm_h`` is then a plain float16 GEMM, ``BK`` elements a
  ``tl.dot`` summed in float32, times the two rows' scales (rows float16 cannot hold take
  the integer dots: ``to_half``). The integer-dot kernel's float
  work for every output and sub-block (a scale, a product, an addition) goes; NMSE about
  2 x (2^-11)^2 / 3 = 1.6e-7 from the two roundings to float16;
- float W: ``tl.dot`` of float32 tiles to ``PRECISION`` (attention_fast.py), ``BK`` elements a
  step.

Then ``fl(y + bias)`` and ``fl(r + y)`` as in the exact kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.dequant import dequant
from parity.backends.triton.kernels.matmul import MINUS_MIN, PLUS_MIN
from parity.backends.triton.kernels.pdl import after_previous


@triton.jit
def _tile(t, n_out, i, j, BM: tl.constexpr, BN: tl.constexpr):
    """Tile (i, j)'s tokens m and outputs n (int64), whether each is one (of t, of n_out), and
    both clamped to a valid row (0) for loads."""
    m = i.to(tl.int64) * BM + tl.arange(0, BM)
    n = j.to(tl.int64) * BN + tl.arange(0, BN)
    mm = m < t
    nm = n < n_out
    return m, n, mm, nm, tl.where(mm, m, 0), tl.where(nm, n, 0)


@triton.jit
def gemm_q(y, xq, xd, xs, wq, wa, wm, bias, res, t, k, n_out, MIN: tl.constexpr,
           L: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_RES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y for a repacked quantized W (dequant.repack)."""
    after_previous(PDL)
    m, n, mm, nm, m0, n0 = _tile(t, n_out, tl.program_id(0), tl.program_id(1), BM, BN)
    acc = _integer_dots(xq, xd, xs, wq, wa, wm, m0, n0, k, MIN, L, BM, BN)
    _tile_epilogue(y, acc, bias, res, m, n, mm, nm, n_out, HAS_BIAS, HAS_RES)


@triton.jit
def _integer_dots(xq, xd, xs, wq, wa, wm, m0, n0, k, MIN: tl.constexpr, L: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """The (BM, BN) tile of tokens m0 and rows n0: sub-block by sub-block, the integer dot of
    the quants on the tensor cores, then its float term."""
    nb = k // 32  # activation blocks a row
    nsub = k // L
    acc = tl.zeros((BM, BN), tl.float32)
    for s in range(0, nsub):
        e = s * L + tl.arange(0, L)
        qx = tl.load(xq + m0[:, None] * k + e[None, :])  # (BM, L)
        qw = tl.load(wq + n0[None, :] * k + e[:, None])  # (L, BN)
        if L >= 32:  # (an int8 dot takes K >= 32)
            isum = tl.dot(qx, qw, out_dtype=tl.int32).to(tl.float32)  # exact
        else:  # exact too: integers below 2^24
            isum = tl.dot(qx.to(tl.float16), qw.to(tl.float16), out_dtype=tl.float32)
        b = (s * L) // 32
        dx = tl.load(xd + m0 * nb + b)  # (BM,)
        a = tl.load(wa + n0 * nsub + s)  # (BN,)
        term = (a[None, :] * dx[:, None]) * isum
        if MIN == PLUS_MIN:
            term = term + tl.load(wm + n0 * nsub + s)[None, :] * tl.load(xs + m0 * nb + b)[:, None]
        elif MIN == MINUS_MIN:
            term = term - tl.load(wm + n0 * nsub + s)[None, :] * tl.load(xs + m0 * nb + b)[:, None]
        acc += term
    return acc


@triton.jit
def _row_range(p, rows, rm, count, BR: tl.constexpr, BC: tl.constexpr):
    """(max |p[row, j]|, min of the nonzero |p[row, j]|) over j < count for ``BR`` rows (masked
    by rm), ``BC`` columns a step (rows of zeros: (0, inf))."""
    top = tl.zeros((BR,), tl.float32)
    low = tl.full((BR,), float("inf"), tl.float32)
    for c0 in range(0, count, BC):
        c = c0 + tl.arange(0, BC)
        v = tl.load(p + rows[:, None] * count + c[None, :], mask=rm[:, None] & (c < count)[None, :],
                    other=0.0)  # fmt: skip
        v = tl.abs(v)
        top = tl.maximum(top, tl.max(v, axis=1))
        low = tl.minimum(low, tl.min(tl.where(v > 0.0, v, float("inf")), axis=1))
    return top, low


# to_half's rows: a row's largest value becomes at most 2^15 (float16's largest is 65504), and
# a row is marked ``wide`` (its scale stored as -1) where float16 cannot hold it: its block
# scales span more than 2^20 (below that every nonzero quant's value is a normal float16, 11
# bits), or its largest is outside 2^-60 .. 2^60 (its scale factors, and gemm_h's sums times
# them, then stay inside float32), or NaN; gemm_h takes the integer dots for the tiles that
# hold one
HALF_TOP = tl.constexpr(32768.0)
HALF_SPAN = tl.constexpr(1048576.0)
HALF_LOW = tl.constexpr(8.673617379884035e-19)  # 2^-60
HALF_HIGH = tl.constexpr(1.152921504606847e18)  # 2^60


@triton.jit
def to_half(out, scale, q, a, m, rows, k, MIN: tl.constexpr, L: tl.constexpr, BR: tl.constexpr,
            BK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Rows of quants with a scale (and a min) a sub-block of L as float16 values: a repacked
    weight (q, a, m) or x's Q8 activations (q, d; MIN 0, L 32). The row's values times c, c =
    2^15 / (Q top) (top: the row's largest scale or min; Q: 127 for x, 128 for W, bounds on
    |q| (+ 1)), and ``scale`` = 1 / c: 0 for a row of zeros, -1 for a wide one."""
    after_previous(PDL)
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = r < rows
    r0 = tl.where(rm, r, 0)
    nsub = k // L
    top, low = _row_range(a, r0, rm, nsub, BR, 32)
    bound = 127.0
    if MIN != 0:
        top_m, _ = _row_range(m, r0, rm, nsub, BR, 32)
        top = tl.maximum(top, top_m)
        bound = 128.0
    wide = (top > 0.0) & ((top > HALF_SPAN * low) | (top < HALF_LOW) | (top > HALF_HIGH))
    wide = wide | (top != top)
    c = tl.where((top > 0.0) & ~wide, HALF_TOP / (bound * top), 0.0)
    u = tl.where((top > 0.0) & ~wide, bound * top / HALF_TOP, 0.0)
    tl.store(scale + r, tl.where(wide, -1.0, u), mask=rm)
    for k0 in range(0, k, BK):
        e = k0 + tl.arange(0, BK)
        em = rm[:, None] & (e < k)[None, :]
        at = r0[:, None] * k + e[None, :]
        s = r0[:, None] * nsub + (e // L)[None, :]
        v = tl.load(q + at, mask=em, other=0).to(tl.float32) * tl.load(a + s, mask=em, other=0.0)
        if MIN == PLUS_MIN:
            v = v + tl.load(m + s, mask=em, other=0.0)
        elif MIN == MINUS_MIN:
            v = v - tl.load(m + s, mask=em, other=0.0)
        tl.store(out + at, (v * c[:, None]).to(tl.float16), mask=em)


@triton.jit
def gemm_h(y, xh, sx, wh, sw, xq, xd, xs, wq, wa, wm, bias, res, t, k, n_out,
           MIN: tl.constexpr, L: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
           PDL: tl.constexpr):  # fmt: skip
    """y from x and W made float16 by to_half: their tiles' products summed in float32 on the
    tensor cores, times the two rows' scales; a tile that holds a wide row (to_half) takes the
    integer dots of gemm_q instead."""
    after_previous(PDL)
    m, n, mm, nm, m0, n0 = _tile(t, n_out, tl.program_id(0), tl.program_id(1), BM, BN)
    ux = tl.load(sx + m0)
    uw = tl.load(sw + n0)
    if (tl.min(ux, axis=0) < 0.0) | (tl.min(uw, axis=0) < 0.0):
        # the integer dots a quarter of the tile at a time, in a loop (unrolled, or the
        # whole tile at once, the kernel spills)
        for part in range(4):
            i = tl.program_id(0) * 2 + part // 2
            j = tl.program_id(1) * 2 + part % 2
            mq, nq, mqm, nqm, mq0, nq0 = _tile(t, n_out, i, j, BM // 2, BN // 2)
            quarter = _integer_dots(xq, xd, xs, wq, wa, wm, mq0, nq0, k, MIN, L, BM // 2, BN // 2)
            _tile_epilogue(y, quarter, bias, res, mq, nq, mqm, nqm, n_out, HAS_BIAS, HAS_RES)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
        e = tl.arange(0, BK)
        xp = xh + m0[:, None] * k + e[None, :]  # (K: a multiple of 32, and of BK)
        wp = wh + n0[:, None] * k + e[None, :]
        for _ in range(0, k, BK):
            acc = tl.dot(tl.load(xp), tl.trans(tl.load(wp)), acc)
            xp += BK
            wp += BK
        acc = acc * ux[:, None] * uw[None, :]  # (|acc| < 2^45, |u| < 2^53: no overflow)
        _tile_epilogue(y, acc, bias, res, m, n, mm, nm, n_out, HAS_BIAS, HAS_RES)


@triton.jit
def gemm_f(y, x, w, bias, res, t, k, n_out, row_bytes, TYPE: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
           PRECISION: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    after_previous(PDL)
    m, n, mm, nm, m0, n0 = _tile(t, n_out, tl.program_id(0), tl.program_id(1), BM, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, k, BK):
        e = k0 + tl.arange(0, BK)
        em = e < k
        e0 = tl.where(em, e, 0)
        xv = tl.load(x + m0[:, None] * k + e0[None, :], mask=em[None, :], other=0.0)
        wv = dequant(w, row_bytes, n0[None, :], e0[:, None], TYPE)  # (BK, BN)
        wv = tl.where(em[:, None], wv, 0.0)
        acc += tl.dot(xv, wv, input_precision=PRECISION)
    _tile_epilogue(y, acc, bias, res, m, n, mm, nm, n_out, HAS_BIAS, HAS_RES)


@triton.jit
def _tile_epilogue(y, v, bias, res, m, n, mm, nm, n_out, HAS_BIAS: tl.constexpr,
                   HAS_RES: tl.constexpr):  # fmt: skip
    ok = mm[:, None] & nm[None, :]
    at = m[:, None] * n_out + n[None, :]
    if HAS_BIAS:
        v = v + tl.load(bias + n, mask=nm)[None, :]
    if HAS_RES:
        v = tl.load(res + at, mask=ok) + v
    tl.store(y + at, v, mask=ok)
