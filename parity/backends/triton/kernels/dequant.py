"""Weight dequantization as docs/numerics.md ("Weights: storage and dequantization") writes it:
``w[j] = fl(a * qw[j])`` (Q4_0, Q5_0, Q8_0, Q6_K), ``fl(fl(a * qw[j]) + m)`` (Q4_1),
``fl(fl(a * qw[j]) - m)`` (Q4_K), with each type's scales, mins and quants read from the GGUF
bytes; float types widened exactly. Element-wise: ``dequant`` gives the values of elements
``e`` of row ``row`` from the row's bytes, so any kernel can read any weight as float32.

The type codes are ``parity.core.dtypes.DType`` values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from parity.backends.triton.kernels.pdl import after_previous

F32 = tl.constexpr(0)
F16 = tl.constexpr(1)
Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q8_0 = tl.constexpr(8)
Q4_K = tl.constexpr(12)
Q6_K = tl.constexpr(14)
BF16 = tl.constexpr(30)


@triton.jit
def _u8(w, p):
    return tl.load(w + p).to(tl.int32)


@triton.jit
def _f16(w, p):
    """The binary16 at byte p (little-endian), exactly as binary32."""
    bits = _u8(w, p) | (_u8(w, p + 1) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def quants(w, row_bytes, row, e, TYPE: tl.constexpr):
    """The integer quants ``qw`` (int32) of elements ``e`` of row ``row`` of a quantized type."""
    if TYPE == Q4_0:
        base = row * row_bytes + (e // 32) * 18
        j = e % 32
        byte = _u8(w, base + 2 + j % 16)
        return tl.where(j < 16, byte & 0xF, byte >> 4) - 8
    elif TYPE == Q4_1:
        base = row * row_bytes + (e // 32) * 20
        j = e % 32
        byte = _u8(w, base + 4 + j % 16)
        return tl.where(j < 16, byte & 0xF, byte >> 4)
    elif TYPE == Q5_0:
        base = row * row_bytes + (e // 32) * 22
        j = e % 32
        qh = (_u8(w, base + 2) | (_u8(w, base + 3) << 8) | (_u8(w, base + 4) << 16)
              | (_u8(w, base + 5) << 24))  # fmt: skip
        byte = _u8(w, base + 6 + j % 16)
        nib = tl.where(j < 16, byte & 0xF, byte >> 4)
        return (nib | (((qh >> j) & 1) << 4)) - 16
    elif TYPE == Q8_0:
        base = row * row_bytes + (e // 32) * 34
        return tl.load(w + base + 2 + e % 32).to(tl.int8, bitcast=True).to(tl.int32)
    elif TYPE == Q4_K:
        base = row * row_bytes + (e // 256) * 144
        s = (e % 256) // 32
        byte = _u8(w, base + 16 + 32 * (s // 2) + e % 32)
        return tl.where(s % 2 == 0, byte & 0xF, byte >> 4)
    else:  # Q6_K
        base = row * row_bytes + (e // 256) * 210
        r = e % 256
        h = r // 128
        c = (r % 128) // 32
        i = r % 32
        lo = (_u8(w, base + 64 * h + 32 * (c % 2) + i) >> (4 * (c // 2))) & 0xF
        hi = (_u8(w, base + 128 + 32 * h + i) >> (2 * c)) & 3
        return (lo | (hi << 4)) - 32


@triton.jit
def scales(w, row_bytes, row, s, TYPE: tl.constexpr):
    """The binary32 scale ``a`` and min ``m`` of sub-blocks ``s`` of row ``row`` (m is 0 for
    the types without one)."""
    if TYPE == Q4_0:
        a = _f16(w, row * row_bytes + s * 18)
        return a, a * 0.0
    elif TYPE == Q4_1:
        base = row * row_bytes + s * 20
        return _f16(w, base), _f16(w, base + 2)
    elif TYPE == Q5_0:
        a = _f16(w, row * row_bytes + s * 22)
        return a, a * 0.0
    elif TYPE == Q8_0:
        a = _f16(w, row * row_bytes + s * 34)
        return a, a * 0.0
    elif TYPE == Q4_K:
        base = row * row_bytes + (s // 8) * 144
        b = s % 8
        sc_b = _u8(w, base + 4 + b)
        sc_b4 = _u8(w, base + 4 + b + 4)
        sc_m4 = _u8(w, base + 4 + tl.maximum(b - 4, 0))
        low = b < 4
        scale = tl.where(low, sc_b & 63, (sc_b4 & 0xF) | ((sc_m4 >> 6) << 4))
        mn = tl.where(low, sc_b4 & 63, (sc_b4 >> 4) | ((sc_b >> 6) << 4))
        return _f16(w, base) * scale.to(tl.float32), _f16(w, base + 2) * mn.to(tl.float32)
    else:  # Q6_K
        base = row * row_bytes + (s // 16) * 210
        sc = tl.load(w + base + 192 + s % 16).to(tl.int8, bitcast=True)
        a = _f16(w, base + 208) * sc.to(tl.float32)
        return a, a * 0.0


@triton.jit
def dequant(w, row_bytes, row, e, TYPE: tl.constexpr):
    """Elements ``e`` (int32 indices inside the row) of row ``row`` as float32; for the float
    types ``w`` points at the row data in its own type, else at bytes."""
    if TYPE == F32:
        return tl.load(w + row * (row_bytes // 4) + e)
    elif TYPE == F16:
        return tl.load(w + row * (row_bytes // 2) + e).to(tl.float32)
    elif TYPE == BF16:
        bits = tl.load(w + row * (row_bytes // 2) + e).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        a, m = scales(w, row_bytes, row, e // (16 if TYPE == Q6_K else 32), TYPE)
        y = a * quants(w, row_bytes, row, e, TYPE).to(tl.float32)
        if TYPE == Q4_1:
            y = y + m
        elif TYPE == Q4_K:
            y = y - m
        return y


@triton.jit
def get_rows(out, w, ids, k, row_bytes, TYPE: tl.constexpr, BLOCK: tl.constexpr,
             PDL: tl.constexpr):  # fmt: skip
    """out[t, :] = dequantize(w)[ids[t], :]; one program per (token, BLOCK elements)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = e < k
    after_previous(PDL)
    row = tl.load(ids + t).to(tl.int64)
    e = tl.where(m, e, 0)  # (padding lanes read element 0, and store nothing)
    tl.store(out + t * k + e, dequant(w, row_bytes, row, e, TYPE), mask=m)


@triton.jit
def repack(q, a, m, w, n_rows, k, row_bytes, TYPE: tl.constexpr, L: tl.constexpr,
           HAS_MIN: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """A quantized weight in the layout the products read: ``q`` its integer quants (int8, one
    a byte, row-major N x K), ``a`` and ``m`` each sub-block's binary32 scale and min (N x K/L,
    ``m`` only with HAS_MIN): the values ``quants`` and ``scales`` give, so a product reading
    them computes the same bits, with loads that are contiguous and aligned. One program per
    R rows x BLOCK elements (BLOCK a multiple of L)."""
    row = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    rm = row < n_rows
    row0 = tl.where(rm, row, 0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    em = e < k
    e0 = tl.where(em, e, 0)
    qv = quants(w, row_bytes, row0[:, None], e0[None, :], TYPE)
    tl.store(q + row0[:, None] * k + e[None, :], qv.to(tl.int8), mask=rm[:, None] & em[None, :])
    S: tl.constexpr = BLOCK // L
    s = tl.program_id(1) * S + tl.arange(0, S)
    sm = s < k // L
    av, mv = scales(w, row_bytes, row0[:, None], tl.where(sm, s, 0)[None, :], TYPE)
    at = row0[:, None] * (k // L) + s[None, :]
    tl.store(a + at, av, mask=rm[:, None] & sm[None, :])
    if HAS_MIN:
        tl.store(m + at, mv, mask=rm[:, None] & sm[None, :])
