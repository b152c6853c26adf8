"""ATTENTION in ``fast`` numerics for many tokens (a prefill): flash attention with an online
softmax. One program takes ``BM`` tokens of one head and walks the cache ``BN`` slots at a time
from the lowest window start of its tokens to their highest position: scores as one
``tl.dot`` (float32 to ``PRECISION``: "ieee", or "tf32x3", three TF32 products on the tensor
cores, about as accurate; never plain TF32), the running max and sum rescaled with ``tl.exp``, the
weighted values as a second ``tl.dot``, one division at the end. Slots outside a token's window
``lo .. p`` weigh +0.0; rows no token of the block sees are never loaded, so stale cache rows
never count. (A row one token sees and another does not enters the second one's value product
with weight +0.0, which an inf or NaN in it turns into NaN: in a model every such row was
written this step.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.pdl import after_previous


@triton.jit
def flash(out, q, k, v, positions, t, n_head, group, kv_width, window, scale, D: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
          PDL: tl.constexpr):  # fmt: skip
    after_previous(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    h = tl.program_id(1)
    rm = rows < t
    r0 = tl.where(rm, rows, 0).to(tl.int64)
    p = tl.load(positions + r0, mask=rm, other=0)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    first = tl.min(tl.where(rm, lo, 1 << 30), 0)
    start = (first // BN) * BN
    end = tl.max(tl.where(rm, p, -1), 0) + 1
    g = h // group
    d = tl.arange(0, D)
    qt = tl.load(q + r0[:, None] * (n_head * D) + h * D + d[None, :])  # (BM, D)
    m_i = tl.full((BM,), -float("inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for j0 in range(start, end, BN):
        j = j0 + tl.arange(0, BN)
        jm = (j >= first) & (j < end)  # rows some token of the block sees
        at = j.to(tl.int64)[:, None] * kv_width + g * D + d[None, :]
        kt = tl.load(k + at, mask=jm[:, None], other=0.0)  # (BN, D)
        s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION) * scale  # (BM, BN)
        seen = (j[None, :] >= lo[:, None]) & (j[None, :] <= p[:, None]) & rm[:, None]
        s = tl.where(seen, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        none = m_new == -float("inf")  # (no slot seen yet: nothing to rescale)
        alpha = tl.where(none, 1.0, tl.exp(m_i - m_new))
        w = tl.where(seen, tl.exp(s - tl.where(none, 0.0, m_new)[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(w, 1)
        vt = tl.load(v + at, mask=jm[:, None], other=0.0)  # (BN, D)
        acc = acc * alpha[:, None] + tl.dot(w, vt, input_precision=PRECISION)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out + r0[:, None] * (n_head * D) + h * D + d[None, :], o, mask=rm[:, None])
