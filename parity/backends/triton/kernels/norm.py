"""RMS_NORM and RMS_NORM_MUL in ``exact`` numerics (docs/numerics.md, "RMS_NORM"): one program a
row, the row's squares loaded as a block of ``P = next_pow2(width)`` slots (+0.0 past the
row), summed as the contract's TREE of adjacent pairs: each level reshapes the block to
``(n / 2, 2)`` and adds the two columns, so slot 2i meets slot 2i + 1 whatever the layout
(``tl.sum``'s order is the compiler's). Then ``div_rn``, ``sqrt_rn`` and ``div_rn``, one
rounding each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.pdl import after_previous
from parity.backends.triton.kernels.rows import store_q8


@triton.jit
def tree_sum(x, P: tl.constexpr, LOG: tl.constexpr):
    """TREE over a (P,) block, P = 2^LOG: adjacent pairs, level by level."""
    for level in tl.static_range(LOG):
        a, b = tl.split(tl.reshape(x, (P >> (level + 1), 2)))
        x = a + b
    return tl.sum(x, 0)  # one element left: exact


@triton.jit
def rms_norm_f32(out, q, d, s, x, w, width, eps, MUL: tl.constexpr, P: tl.constexpr,
                 LOG: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out = fl(x * scale) per row (MUL: fl(fl(x * scale) * w)), scale = 1 / sqrt(mean + eps);
    with QUANT also out's Q8A value (q, d, s): a QUANTIZE of the norm in the same launch."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, P)
    m = i < width
    if MUL:
        wv = tl.load(w + i, mask=m)  # (a weight: read before the previous kernel ends)
    after_previous(PDL)
    v = tl.load(x + row * width + i, mask=m, other=0.0)
    ss = tree_sum(tl.where(m, v * v, 0.0), P, LOG)
    mean = tl.math.div_rn(ss, width.to(tl.float32))
    r = tl.math.sqrt_rn(mean + eps)
    scale = tl.math.div_rn(1.0, r)
    y = v * scale
    if MUL:
        y = y * wv
    tl.store(out + row * width + i, y, mask=m)
    if QUANT:  # (width is a multiple of 32: the blocks past it are padding only)
        store_q8(q, d, s, tl.reshape(y, (P // 32, 32)), row, width, 0, P // 32)
