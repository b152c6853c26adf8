"""ATTENTION in ``exact`` numerics (docs/numerics.md, "ATTENTION"), sliding window included. One
program per (token, head) walks the 256-slot chunks ``lo // 256 .. p // 256`` twice:

1. the scores of each chunk's slots, ``fl(TREE_d(fl(q_d * k_jd)) * scale)``, for their exact
   max (``tl.max``; a NaN score makes the outputs NaN through its weight either way);
2. again, with that max: the weights ``e_j = exp(fl(s_j - m))`` (+0.0 literally outside
   ``lo .. p``), the chunk's TREE of weights ``D_c`` and per value dimension the TREE of
   ``fl(e_j * v_ji)`` (+0.0 outside), folded left to right from the first chunk; then
   ``fl(num / den)``.

Rows outside ``lo .. p`` are never loaded (masked). The TREEs are ``tree_rows`` along the last
axis (the values' transposed first). Exactness first; the flash-decoding split and the speed
are the speed issue's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.elementwise import p_exp
from parity.backends.triton.kernels.matmul import tree_rows

CHUNK = tl.constexpr(256)


@triton.jit
def _scores(q, k, kv_width, g, c, lo, p, scale, D: tl.constexpr, LOGD: tl.constexpr):
    """The scores of chunk c's 256 slots (garbage outside lo .. p) and which slots are seen."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    seen = (j >= lo) & (j <= p)
    d = tl.arange(0, D)
    rows = tl.load(k + j.to(tl.int64)[:, None] * kv_width + g * D + d[None, :],
                   mask=seen[:, None], other=0.0)  # fmt: skip
    s = tree_rows(rows * q[None, :], CHUNK, D, LOGD) * scale
    return s, seen, j


@triton.jit
def attention_f32(out, q, k, v, positions, n_head, group, kv_width, window, scale,
                  D: tl.constexpr, LOGD: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // group
    p = tl.load(positions + t)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    c0 = lo // CHUNK
    c1 = p // CHUNK + 1
    d = tl.arange(0, D)
    qv = tl.load(q + t * n_head * D + h * D + d)
    m = -float("inf")
    for c in range(c0, c1):
        s, seen, _ = _scores(qv, k, kv_width, g, c, lo, p, scale, D, LOGD)
        m = tl.maximum(m, tl.max(tl.where(seen, s, -float("inf")), 0))
    den = 0.0
    num = tl.zeros((D,), tl.float32)
    for c in range(c0, c1):
        s, seen, j = _scores(qv, k, kv_width, g, c, lo, p, scale, D, LOGD)
        e = tl.where(seen, p_exp(s - m), 0.0)
        dc = tl.reshape(tree_rows(tl.reshape(e, (1, CHUNK)), 1, CHUNK, 8), ())
        vals = tl.load(v + j.to(tl.int64)[:, None] * kv_width + g * D + d[None, :],
                       mask=seen[:, None], other=0.0)  # fmt: skip
        prod = tl.where(seen[:, None], e[:, None] * vals, 0.0)
        nc = tree_rows(tl.trans(prod), D, CHUNK, 8)  # (D,): each dimension's TREE over slots
        first = c == c0
        den = tl.where(first, dc, den + dc)
        num = tl.where(first, nc, num + nc)
    tl.store(out + t * n_head * D + h * D + d, tl.math.div_rn(num, den))
