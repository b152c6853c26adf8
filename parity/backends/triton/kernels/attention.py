"""ATTENTION in ``exact`` numerics (docs/numerics.md, "ATTENTION"), sliding window included, as
flash decoding: the contract's two passes split over parts of the 256-slot chunks, three
launches. A chunk is cut into ``PARTS`` parts of ``PER`` sub-tiles of ``SUB`` slots (``SUB * D``
products in registers); a 256-leaf TREE is the TREE of its parts' sub-trees, each the TREE of
its sub-tiles', which is the same sum, level for level. Many parts give a decode step (a few
tokens) enough programs; one part a chunk keeps a prefill's scratch small.

1. ``chunk_max``, one program per (token, head, part): the scores of the part's slots in the
   window ``lo .. p``, ``fl(TREE_d(fl(q_d * k_jd)) * scale)``, and their exact max (``tl.max``;
   a NaN score makes the outputs NaN through its weight either way).
2. ``chunk_sums``, the same grid: the max over the token's parts, the part's weights
   ``e_j = exp(fl(s_j - m))`` (+0.0 literally outside ``lo .. p``), their TREE and per value
   dimension the TREE of ``fl(e_j * v_ji)`` (+0.0 outside).
3. ``fold``, one program per (token, head): per chunk the TREE of its parts' sums (``D_c`` and
   ``N_c``), then ``den = D_c0; den = fl(den + D_c) ...`` and the same for ``num``, left to
   right from the first chunk holding a window position, then ``fl(num / den)`` (and, where a
   QUANTIZE of the attention follows, its Q8A value).

Parts that hold no position of the token's window exit at once and count as +0.0 (the grid
covers every part of the cache, so one launch serves any position and a graph can be
captured). Rows outside ``lo .. p`` are never loaded. Sub-tiles are a loop, not unrolled: the
code stays small whatever ``D``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.elementwise import p_exp
from parity.backends.triton.kernels.matmul import tree_rows
from parity.backends.triton.kernels.pdl import after_previous
from parity.backends.triton.kernels.rows import store_q8

CHUNK = tl.constexpr(256)


@triton.jit
def _window(positions, t, window):
    p = tl.load(positions + t)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    return p, lo


@triton.jit
def _scores(qv, k, kv_width, g, j, lo, p, scale, D: tl.constexpr, LOGD: tl.constexpr,
            SUB: tl.constexpr):  # fmt: skip
    """Scores of slots ``j`` (SUB of them; garbage where not seen) and which are seen."""
    seen = (j >= lo) & (j <= p)
    d = tl.arange(0, D)
    rows = tl.load(k + j.to(tl.int64)[:, None] * kv_width + g * D + d[None, :],
                   mask=seen[:, None], other=0.0)  # fmt: skip
    return tree_rows(rows * qv[None, :], SUB, D, LOGD) * scale, seen


@triton.jit
def chunk_max(mx, q, k, positions, n_head, group, kv_width, window, scale, n_parts,
              D: tl.constexpr, LOGD: tl.constexpr, SUB: tl.constexpr,
              PER: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    part = tl.program_id(2)
    p, lo = _window(positions, t, window)
    if (part * (PER * SUB) <= p) & (part * (PER * SUB) + PER * SUB > lo):
        qv = tl.load(q + t * n_head * D + h * D + tl.arange(0, D))
        m = -float("inf")
        for i in range(PER):
            j = part * (PER * SUB) + i * SUB + tl.arange(0, SUB)
            s, seen = _scores(qv, k, kv_width, h // group, j, lo, p, scale, D, LOGD, SUB)
            m = tl.maximum(m, tl.max(tl.where(seen, s, -float("inf")), 0))
        tl.store(mx + (t * n_head + h) * n_parts + part, m)


@triton.jit
def chunk_sums(dens, nums, mx, q, k, v, positions, n_head, group, kv_width, window, scale,
               n_parts, D: tl.constexpr, LOGD: tl.constexpr, SUB: tl.constexpr,
               LOGSUB: tl.constexpr, PER: tl.constexpr, LOGPER: tl.constexpr,
               NPP: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The part's sub-tree sums (NPP: n_parts rounded up to a power of two)."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    part = tl.program_id(2)
    p, lo = _window(positions, t, window)
    SPAN: tl.constexpr = PER * SUB
    if (part * SPAN <= p) & (part * SPAN + SPAN > lo):
        row = (t * n_head + h) * n_parts
        ps = tl.arange(0, NPP)
        mine = (ps < n_parts) & (ps * SPAN <= p) & (ps * SPAN + SPAN > lo)
        m = tl.max(tl.load(mx + row + ps, mask=mine, other=-float("inf")), 0)
        g = h // group
        qv = tl.load(q + t * n_head * D + h * D + tl.arange(0, D))
        d = tl.arange(0, D)
        subs = tl.arange(0, PER)
        den_parts = tl.zeros((PER,), tl.float32)
        num_parts = tl.zeros((PER, D), tl.float32)
        for i in range(PER):
            j = part * SPAN + i * SUB + tl.arange(0, SUB)
            s, seen = _scores(qv, k, kv_width, g, j, lo, p, scale, D, LOGD, SUB)
            e = tl.where(seen, p_exp(s - m), 0.0)
            vals = tl.load(v + j.to(tl.int64)[:, None] * kv_width + g * D + d[None, :],
                           mask=seen[:, None], other=0.0)  # fmt: skip
            prod = tl.where(seen[:, None], e[:, None] * vals, 0.0)
            sub = tree_rows(tl.trans(prod), D, SUB, LOGSUB)  # (D,): each dimension's sub-tree
            dsub = tl.reshape(tree_rows(tl.reshape(e, (1, SUB)), 1, SUB, LOGSUB), ())
            den_parts = tl.where(subs == i, dsub, den_parts)
            num_parts = tl.where(subs[:, None] == i, sub[None, :], num_parts)
        den = tl.reshape(tree_rows(tl.reshape(den_parts, (1, PER)), 1, PER, LOGPER), ())
        num = tree_rows(tl.trans(num_parts), D, PER, LOGPER)
        tl.store(dens + row + part, den)
        tl.store(nums + (row + part) * D + d, num)


@triton.jit
def _chunk(dens, nums, row, c, lo, p, D: tl.constexpr, PARTS: tl.constexpr,
           LOGPARTS: tl.constexpr, SPAN: tl.constexpr):  # fmt: skip
    """D_c and N_c: the TREE of chunk c's parts (+0.0 for those that hold no position)."""
    ps = c * PARTS + tl.arange(0, PARTS)
    live = (ps * SPAN <= p) & (ps * SPAN + SPAN > lo)
    d = tl.arange(0, D)
    dc = tl.load(dens + row + ps, mask=live, other=0.0)
    nc = tl.load(nums + (row + ps)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    dc = tl.reshape(tree_rows(tl.reshape(dc, (1, PARTS)), 1, PARTS, LOGPARTS), ())
    return dc, tree_rows(tl.trans(nc), D, PARTS, LOGPARTS)


@triton.jit
def fold(out, yq, yd, ys, dens, nums, positions, n_head, window, n_parts, D: tl.constexpr,
         PARTS: tl.constexpr, LOGPARTS: tl.constexpr, QUANT: tl.constexpr,
         PDL: tl.constexpr):  # fmt: skip
    """With QUANT (D a multiple of 32) also the output's Q8A value (yq, yd, ys): a QUANTIZE of
    the attention in the same launch."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p, lo = _window(positions, t, window)
    SPAN: tl.constexpr = CHUNK // PARTS
    row = (t * n_head + h) * n_parts
    den, num = _chunk(dens, nums, row, lo // CHUNK, lo, p, D, PARTS, LOGPARTS, SPAN)
    for c in range(lo // CHUNK + 1, p // CHUNK + 1):
        dc, nc = _chunk(dens, nums, row, c, lo, p, D, PARTS, LOGPARTS, SPAN)
        den = den + dc
        num = num + nc
    y = tl.math.div_rn(num, den)
    tl.store(out + t * n_head * D + h * D + tl.arange(0, D), y)
    if QUANT:
        store_q8(yq, yd, ys, tl.reshape(y, (D // 32, 32)), t, n_head * D, h * (D // 32), D // 32)
