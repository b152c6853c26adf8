"""MATMUL (and MATMUL_ADD's epilogue) in ``fast`` numerics, for many tokens at once: one program
computes a ``BM x BN`` tile of ``y`` on tensor cores, reading each weight once for ``BM``
tokens (the exact kernels read it once a token).

- quantized W, repacked (dequant.repack), against x's Q8 quants: per sub-block ``s`` of ``L``
  elements the integer dot ``isum_s`` of the quants as one ``tl.dot`` on int8 into int32 (on
  float16 for Q6_K's 16: every partial sum is an integer below 2^24, so exact), then
  ``term_s = (a * d_x) * isum_s`` (Q4_1 ``+ m * s_x``, Q4_K ``- m * s_x``), summed over the
  sub-blocks in order rather than as the TREE: only the order of the float additions differs
  from the oracle;
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
def gemm_q(y, xq, xd, xs, wq, wa, wm, bias, res, t, k, n_out, MIN: tl.constexpr,
           L: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_RES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y for a repacked quantized W (dequant.repack)."""
    after_previous(PDL)
    m = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    n = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mm = m < t
    nm = n < n_out
    m0 = tl.where(mm, m, 0)
    n0 = tl.where(nm, n, 0)
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
    _tile_epilogue(y, acc, bias, res, m, n, mm, nm, n_out, HAS_BIAS, HAS_RES)


@triton.jit
def gemm_f(y, x, w, bias, res, t, k, n_out, row_bytes, TYPE: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
           PRECISION: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    after_previous(PDL)
    m = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    n = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    mm = m < t
    nm = n < n_out
    m0 = tl.where(mm, m, 0)
    n0 = tl.where(nm, n, 0)
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
