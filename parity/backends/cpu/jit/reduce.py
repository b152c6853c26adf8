"""The contract's fixed reduction tree (docs/numerics.md, "tree_sum") for the compiled kernels."""

from __future__ import annotations

import numpy as np

from parity.backends.cpu.jit import simd
from parity.backends.cpu.jit.compile import kernel

F32 = np.float32
U64 = np.uint64


@kernel(inline=True)
def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    w = 1
    while w < n:
        w *= 2
    return w


@kernel(inline=True)
def tree_sum(buf: np.ndarray, n: int, tmp: np.ndarray) -> np.float32:
    """TREE(buf[:n]): pad with +0.0 to next_pow2(n) slots, add adjacent pairs level by level.

    Levels 1..5 of each run of 32 slots only involve that run, so the tree is done 32 slots
    at a time (``simd.tree32``), then again over the run sums, the last level exactly as wide
    as what is left. ``buf`` (>= next_pow2(n) slots) is clobbered; ``tmp`` holds >= 1/32 of
    them. n = 0 gives +0.0; n = 1 gives buf[0] unchanged."""
    w = next_pow2(n)
    for i in range(n, w):
        buf[i] = F32(0)
    src, dst = buf, tmp
    while w > 32:
        for c in range(w // 32):
            dst[c] = simd.tree32(src, 128 * c)
        w //= 32
        src, dst = dst, src
    if w == 32:
        return simd.tree32(src, 0)
    if w == 16:
        return simd.tree16(src, 0)
    if w == 8:
        return simd.tree8(src, 0)
    if w == 4:
        return simd.tree4(src, 0)
    if w == 2:
        return simd.tree2(src, 0)
    return src[0]


@kernel(inline=True)
def tree_rows(buf: np.ndarray, other: np.ndarray, rows: int, stride: int, n: int) -> np.ndarray:
    """TREE of ``rows`` (a power of 2) rows of n values, row r at ``buf[r * stride:]``: level by
    level, row i = fl(row 2i + row 2i+1), elementwise. Levels alternate between ``buf`` and
    ``other`` (in place, LLVM would not vectorize); returns the one whose row 0 is the result.

    Indices are unsigned: numba then emits no negative-index wraparound, and LLVM vectorizes."""
    src, dst = buf, other
    half = rows // 2
    while half >= 1:
        for r in range(half):
            du, au, bu = U64(r * stride), U64(2 * r * stride), U64((2 * r + 1) * stride)
            for i in range(n):
                iu = U64(i)
                dst[du + iu] = src[au + iu] + src[bu + iu]
        half //= 2
        src, dst = dst, src
    return src


@kernel(inline=True)
def tree_lanes(buf: np.ndarray, other: np.ndarray, rows: int) -> np.ndarray:
    """TREE of ``rows`` (a power of 2) rows of LANES float32, lane by lane: level by level,
    row i = fl(row 2i + row 2i+1) (``simd.add_lanes``), alternating between ``buf`` and
    ``other``; returns the one whose row 0 is the result."""
    src, dst = buf, other
    step = 4 * simd.LANES  # bytes per row
    half = rows // 2
    while half >= 1:
        for r in range(half):
            simd.add_lanes(dst, r * step, src, 2 * r * step, (2 * r + 1) * step)
        half //= 2
        src, dst = dst, src
    return src
