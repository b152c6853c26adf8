"""ATTENTION in ``exact`` numerics (docs/numerics.md, "ATTENTION"), sliding window included, as
flash decoding: the contract's two passes split over the 256-slot chunks, three launches.

1. ``chunk_max``, one program per (token, head, chunk): the scores of the chunk's slots in the
   window ``lo .. p``, ``fl(TREE_d(fl(q_d * k_jd)) * scale)``, and their exact max (``tl.max``;
   a NaN score makes the outputs NaN through its weight either way).
2. ``chunk_sums``, the same grid: the max over the token's chunks, the chunk's weights
   ``e_j = exp(fl(s_j - m))`` (+0.0 literally outside ``lo .. p``), their TREE ``D_c`` and per
   value dimension the TREE of ``fl(e_j * v_ji)`` (+0.0 outside), ``N_c``.
3. ``fold``, one program per (token, head): ``den = D_c0; den = fl(den + D_c) ...`` and the same
   for ``num``, left to right from the first chunk holding a window position, then
   ``fl(num / den)``.

Chunks that hold no position of the token's window exit at once (the grid covers every chunk
of the cache, so one launch serves any position and a graph can be captured). Rows outside
``lo .. p`` are never loaded. A chunk is taken ``SUB`` slots at a time (``SUB * D`` products
in registers); a 256-leaf TREE is the TREE of its ``256 / SUB`` sub-trees, which is the same
sum, level for level.
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.elementwise import p_exp
from parity.backends.triton.kernels.matmul import tree_rows

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
def chunk_max(mx, q, k, positions, n_head, group, kv_width, window, scale, n_chunks,
              D: tl.constexpr, LOGD: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    p, lo = _window(positions, t, window)
    if (c >= lo // CHUNK) & (c <= p // CHUNK):
        qv = tl.load(q + t * n_head * D + h * D + tl.arange(0, D))
        m = -float("inf")
        for i in tl.static_range(CHUNK // SUB):
            j = c * CHUNK + i * SUB + tl.arange(0, SUB)
            s, seen = _scores(qv, k, kv_width, h // group, j, lo, p, scale, D, LOGD, SUB)
            m = tl.maximum(m, tl.max(tl.where(seen, s, -float("inf")), 0))
        tl.store(mx + (t * n_head + h) * n_chunks + c, m)


@triton.jit
def chunk_sums(dens, nums, mx, q, k, v, positions, n_head, group, kv_width, window, scale,
               n_chunks, D: tl.constexpr, LOGD: tl.constexpr, SUB: tl.constexpr,
               LOGSUB: tl.constexpr, NCP: tl.constexpr):  # fmt: skip
    """D_c and N_c of chunk c (NCP: n_chunks rounded up to a power of two)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    p, lo = _window(positions, t, window)
    c0 = lo // CHUNK
    if (c >= c0) & (c <= p // CHUNK):
        row = (t * n_head + h) * n_chunks
        cs = tl.arange(0, NCP)
        mine = (cs >= c0) & (cs <= p // CHUNK)
        m = tl.max(tl.load(mx + row + cs, mask=mine, other=-float("inf")), 0)
        g = h // group
        qv = tl.load(q + t * n_head * D + h * D + tl.arange(0, D))
        d = tl.arange(0, D)
        NSUB: tl.constexpr = CHUNK // SUB
        subs = tl.arange(0, NSUB)
        den_parts = tl.zeros((NSUB,), tl.float32)
        num_parts = tl.zeros((NSUB, D), tl.float32)
        for i in tl.static_range(NSUB):
            j = c * CHUNK + i * SUB + tl.arange(0, SUB)
            s, seen = _scores(qv, k, kv_width, g, j, lo, p, scale, D, LOGD, SUB)
            e = tl.where(seen, p_exp(s - m), 0.0)
            vals = tl.load(v + j.to(tl.int64)[:, None] * kv_width + g * D + d[None, :],
                           mask=seen[:, None], other=0.0)  # fmt: skip
            prod = tl.where(seen[:, None], e[:, None] * vals, 0.0)
            part = tree_rows(tl.trans(prod), D, SUB, LOGSUB)  # (D,): each dimension's sub-tree
            dpart = tl.reshape(tree_rows(tl.reshape(e, (1, SUB)), 1, SUB, LOGSUB), ())
            den_parts = tl.where(subs == i, dpart, den_parts)
            num_parts = tl.where(subs[:, None] == i, part[None, :], num_parts)
        LOGN: tl.constexpr = 8 - LOGSUB
        den = tl.reshape(tree_rows(tl.reshape(den_parts, (1, NSUB)), 1, NSUB, LOGN), ())
        num = tree_rows(tl.trans(num_parts), D, NSUB, LOGN)
        tl.store(dens + row + c, den)
        tl.store(nums + (row + c) * D + d, num)


@triton.jit
def fold(out, dens, nums, positions, n_head, window, n_chunks, D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p, lo = _window(positions, t, window)
    c0 = lo // CHUNK
    row = (t * n_head + h) * n_chunks
    d = tl.arange(0, D)
    den = tl.load(dens + row + c0)
    num = tl.load(nums + (row + c0) * D + d)
    for c in range(c0 + 1, p // CHUNK + 1):
        den = den + tl.load(dens + row + c)
        num = num + tl.load(nums + (row + c) * D + d)
    tl.store(out + t * n_head * D + h * D + d, tl.math.div_rn(num, den))
