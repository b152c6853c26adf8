"""Row ops in ``exact`` numerics (docs/numerics.md): ROPE, KV_WRITE, ARGMAX and the activation
quantization (QUANTIZE). Same rules as ``elementwise``: each float operation is one correctly
rounded binary32 operation as written, ``div_rn`` for divisions, no libdevice call; integer
sums and maxima are exact in any order, so ``tl.sum`` and ``tl.max`` serve there (with NaN
tested apart: ``tl.maximum`` drops it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.pdl import after_previous


@triton.jit
def _rope_head(out, x, src, dst, p, cos, sin, half, head_dim, NEOX: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    """One head of ROPE, read at ``x + src``, written at ``out + dst``: x0' = fl(fl(x0 c) -
    fl(x1 s)), x1' = fl(fl(x0 s) + fl(x1 c)) over the n_rot = 2 half rotated dims, the rest
    copied."""
    d = tl.arange(0, BLOCK)
    keep = d < head_dim
    v = tl.load(x + src + d, mask=keep)
    tl.store(out + dst + d, v, mask=keep & (d >= 2 * half))  # dims past n_rot pass through
    i = tl.arange(0, BLOCK)
    m = i < half
    if NEOX:
        i0, i1 = i, i + half
    else:
        i0, i1 = 2 * i, 2 * i + 1
    x0 = tl.load(x + src + i0, mask=m)
    x1 = tl.load(x + src + i1, mask=m)
    c = tl.load(cos + p * half + i, mask=m)
    s = tl.load(sin + p * half + i, mask=m)
    tl.store(out + dst + i0, x0 * c - x1 * s, mask=m)
    tl.store(out + dst + i1, x0 * s + x1 * c, mask=m)


@triton.jit
def rope_f32(out, x, positions, cos, sin, n_head, head_dim, half, width,
             NEOX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """ROPE, one program per (token, head)."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.load(positions + t).to(tl.int64)
    base = t * width + h * head_dim
    _rope_head(out, x, base, base, p, cos, sin, half, head_dim, NEOX, BLOCK)


@triton.jit
def rope_kv_f32(q_out, q, k_out, k, v, k_cache, v_cache, positions, cos, sin, n_head, n_kv,
                head_dim, half, NEOX: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr):  # fmt: skip
    """A layer's ROPE of q and of k and its two KV_WRITEs in one launch, one program per
    (token, head of q, k or v): q's heads rotated into ``q_out``; k's into ``k_out`` and
    into the cache row ``positions[t]``; v's copied into theirs. The same operations as the
    four launches, so the same bits."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.load(positions + t).to(tl.int64)
    kv_width = n_kv * head_dim
    if h < n_head:
        base = t * (n_head * head_dim) + h * head_dim
        _rope_head(q_out, q, base, base, p, cos, sin, half, head_dim, NEOX, BLOCK)
    elif h < n_head + n_kv:
        col = (h - n_head) * head_dim
        _rope_head(k_out, k, t * kv_width + col, t * kv_width + col, p, cos, sin, half,
                   head_dim, NEOX, BLOCK)  # fmt: skip
        _rope_head(k_cache, k, t * kv_width + col, p * kv_width + col, p, cos, sin, half,
                   head_dim, NEOX, BLOCK)  # fmt: skip
    else:
        col = (h - n_head - n_kv) * head_dim
        d = tl.arange(0, BLOCK)
        m = d < head_dim
        tl.store(v_cache + p * kv_width + col + d, tl.load(v + t * kv_width + col + d, mask=m),
                 mask=m)  # fmt: skip


@triton.jit
def kv_write_f32(cache, rows, positions, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """cache[positions[t], :] = rows[t, :], one program per (token, BLOCK columns)."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < width
    p = tl.load(positions + t).to(tl.int64)
    tl.store(cache + p * width + c, tl.load(rows + t * width + c, mask=m), mask=m)


@triton.jit
def argmax_parts(best, at, x, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """ARGMAX's first pass, one program per (row, BLOCK columns): the part's answer, its first
    NaN or else the first index of its maximum, and that value (NaN for a NaN). Integer minima
    and float maxima are exact in any order; ``tl.maximum`` would drop a NaN, so NaN is tested
    apart."""
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    i = part * BLOCK + tl.arange(0, BLOCK)
    m = i < width
    v = tl.load(x + row * width + i, mask=m, other=-float("inf"))
    nan = (v != v) & m
    first_nan = tl.min(tl.where(nan, i, width), 0)
    top = tl.max(tl.where(nan, -float("inf"), v), 0)
    first_top = tl.min(tl.where((v == top) & m, i, width), 0)
    found_nan = first_nan < width
    tl.store(at + row * n_parts + part, tl.where(found_nan, first_nan, first_top).to(tl.int32))
    tl.store(best + row * n_parts + part, tl.where(found_nan, float("nan"), top))


@triton.jit
def argmax_fold(out, best, at, n_parts, NP: tl.constexpr, PDL: tl.constexpr):
    """ARGMAX's second pass, one program a row over its parts (NP: n_parts rounded up to a
    power of two): the first NaN above every number (the lowest part holding one), else the
    first index of the maximum (the lowest part holding it: the parts are in column order)."""
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    m = j < n_parts
    v = tl.load(best + row * n_parts + j, mask=m, other=-float("inf"))
    idx = tl.load(at + row * n_parts + j, mask=m, other=0)
    nan = (v != v) & m
    top = tl.max(tl.where(nan, -float("inf"), v), 0)
    any_nan = tl.max(nan.to(tl.int32), 0) > 0
    pick = tl.where(any_nan, nan, (v == top) & m)
    tl.store(out + row, tl.min(tl.where(pick, idx, 2147483647), 0))


@triton.jit
def add_i32(x, n, by, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """x += by in place (int32: the decode positions a step keeps on the device)."""
    after_previous(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(x + i, tl.load(x + i, mask=m) + by, mask=m)


@triton.jit
def q8_blocks(v):
    """Q8A quantization of the rows of ``v`` (blocks of 32, docs/numerics.md, "Activation
    quantization"): d = fl(amax / 127), q = round-half-away(fl(x / d)) clamped to [-127, 127]
    (0 where d is 0 or the quotient NaN), s = fl(d * sum(q)). Returns (q as int32, d, s)."""
    has_nan = tl.max((v != v).to(tl.int32), 1) > 0
    amax = tl.where(has_nan, float("nan"), tl.max(tl.abs(v), 1))
    dq = tl.math.div_rn(amax, 127.0)
    quot = tl.math.div_rn(v, dq[:, None])
    ok = (dq[:, None] != 0.0) & (quot == quot)
    a = tl.where(ok, tl.abs(quot), 0.0)
    a = tl.minimum(a, 255.0)  # (|quot| <= 190.5 when d is finite and not 0; keeps the cast safe)
    whole = a.to(tl.int32)  # truncation: exact
    r = whole + ((a - whole.to(tl.float32)) >= 0.5).to(tl.int32)  # a - whole is exact
    r = tl.minimum(r, 127)
    qi = tl.where(quot < 0.0, -r, r)
    total = tl.sum(qi, 1)  # exact: at most 32 * 127
    return qi, dq, dq * total.to(tl.float32)


@triton.jit
def store_q8(q, d, s, v, row, k, b0, NB: tl.constexpr):
    """Blocks ``b0 .. b0 + NB`` of the Q8A value of row ``row`` (k elements) from ``v``, their
    elements as (NB, 32); blocks past k // 32 are not stored."""
    b = b0 + tl.arange(0, NB)
    inside = b < k // 32
    qi, dq, sq = q8_blocks(v)
    tl.store(q + row * k + b[:, None] * 32 + tl.arange(0, 32)[None, :], qi.to(tl.int8),
             mask=inside[:, None])  # fmt: skip
    tl.store(d + row * (k // 32) + b, dq, mask=inside)
    tl.store(s + row * (k // 32) + b, sq, mask=inside)


@triton.jit
def quantize_q8(q, d, s, x, k, nb, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """Q8A quantization (``q8_blocks``) of ``BLOCKS`` 32-element blocks of one row a program."""
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    inside = b < nb
    idx = row * k + b[:, None] * 32 + tl.arange(0, 32)[None, :]
    m = inside[:, None]
    qi, dq, sq = q8_blocks(tl.load(x + idx, mask=m, other=0.0))
    tl.store(q + idx, qi.to(tl.int8), mask=m)
    tl.store(d + row * nb + b, dq, mask=inside)
    tl.store(s + row * nb + b, sq, mask=inside)
