"""One weight row in the contract's sub-block form, read from the packed GGUF bytes.

The same values as ``parity.quant.blocks`` (scales ``a``, mins ``m``, quants ``qw``) and
``parity.quant.dequantize``, for one row at a time: fp16 fields go through ``F16_TABLE``
(numpy's own conversion of every bit pattern), Q4_K / Q6_K scales are ``fl(d * scale)``.
Type codes are the ggml type numbers of ``parity.core.dtypes.DType``.
"""

from __future__ import annotations

import numpy as np
from numba import literally

from parity.backends.cpu.jit import simd
from parity.backends.cpu.jit.compile import kernel
from parity.backends.cpu.jit.simd import bits_to_f32, load_u16

F32 = np.float32
F32_, F16_, BF16_ = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
QUANT_CODES = (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
FLOAT_CODES = (F32_, F16_, BF16_)

F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32)
"""float32 of every fp16 bit pattern, by numpy's exact conversion (what ``parity.quant`` uses)."""


@kernel(inline=True)
def block_layout(code: int) -> tuple[int, int, int]:
    """(elements per block, bytes per block, sub-block length L) of a quantized type."""
    if code == Q4_0:
        return 32, 18, 32
    if code == Q4_1:
        return 32, 20, 32
    if code == Q5_0:
        return 32, 22, 32
    if code == Q8_0:
        return 32, 34, 32
    if code == Q4_K:
        return 256, 144, 32
    return 256, 210, 16


@kernel()
def row_scales(
    code: int, raw: np.ndarray, at: int, nsub: int, table: np.ndarray, a: np.ndarray, m: np.ndarray
) -> None:
    """Scales ``a`` (and mins ``m``, Q4_1 / Q4_K) of the row whose blocks start at byte ``at``.
    fp16 fields go through ``table`` (numpy's conversion of every bit pattern)."""
    literally(code)
    _, nbytes, _ = block_layout(code)
    if code == Q4_K:
        for blk in range(nsub // 8):
            o = at + blk * nbytes
            d = table[load_u16(raw, o)]
            dmin = table[load_u16(raw, o + 2)]
            for j in range(8):  # six-bit scale and min of sub-block j (ggml get_scale_min_k4)
                if j < 4:
                    sc = raw[o + 4 + j] & 63
                    mn = raw[o + 8 + j] & 63
                else:
                    sc = (raw[o + 8 + j] & 0x0F) | ((raw[o + j] >> 6) << 4)
                    mn = (raw[o + 8 + j] >> 4) | ((raw[o + 4 + j] >> 6) << 4)
                a[8 * blk + j] = d * F32(sc)
                m[8 * blk + j] = dmin * F32(mn)
    elif code == Q6_K:
        for blk in range(nsub // 16):
            o = at + blk * nbytes
            d = table[load_u16(raw, o + 208)]
            for j in range(16):
                sc = np.int64(raw[o + 192 + j])
                a[16 * blk + j] = d * F32(sc - 256 if sc > 127 else sc)  # int8 scale
    elif code == Q4_1:
        for blk in range(nsub):
            a[blk] = table[load_u16(raw, at + blk * nbytes)]
            m[blk] = table[load_u16(raw, at + blk * nbytes + 2)]
    else:
        for blk in range(nsub):
            a[blk] = table[load_u16(raw, at + blk * nbytes)]


@kernel()
def row_isums(
    code: int,
    raw: np.ndarray,
    row: int,
    x: np.ndarray,
    x_at: int,
    out: np.ndarray,
    out_at: int,
    stride: int,
    nsub: int,
) -> None:
    """Exact isums of the ``nsub`` sub-blocks of the row at byte ``row`` of ``raw`` against the
    int8 activations at byte ``x_at`` of ``x``, stored as int32 ``stride`` bytes apart from
    byte ``out_at`` of ``out``."""
    literally(code)
    elems, nbytes, sub_len = block_layout(code)
    n_blocks = nsub * sub_len // elems
    if code in (Q4_K, Q6_K):
        for b in range(n_blocks):
            blk, xs, o = (
                row + b * nbytes,
                x_at + b * elems,
                out_at + stride * b * (elems // sub_len),
            )
            if code == Q4_K:
                simd.isums1_q4_k(raw, blk, x, xs, out, o, stride)
            else:
                simd.isums1_q6_k(raw, blk, x, xs, out, o, stride)
        return
    b = 0
    while b < n_blocks:  # 32-element blocks, one sub-block each: 4 at a time, then singles
        blk, xs, o = row + b * nbytes, x_at + b * 32, out_at + stride * b
        four = b + 4 <= n_blocks
        if code == Q4_0:
            if four:
                simd.isums4_q4_0(raw, blk, x, xs, out, o, stride)
            else:
                simd.isums1_q4_0(raw, blk, x, xs, out, o, stride)
        elif code == Q4_1:
            if four:
                simd.isums4_q4_1(raw, blk, x, xs, out, o, stride)
            else:
                simd.isums1_q4_1(raw, blk, x, xs, out, o, stride)
        elif code == Q5_0:
            if four:
                simd.isums4_q5_0(raw, blk, x, xs, out, o, stride)
            else:
                simd.isums1_q5_0(raw, blk, x, xs, out, o, stride)
        elif four:
            simd.isums4_q8_0(raw, blk, x, xs, out, o, stride)
        else:
            simd.isums1_q8_0(raw, blk, x, xs, out, o, stride)
        b += 4 if four else 1


@kernel()
def row_values(
    code: int, raw: np.ndarray, n: int, k: int, table: np.ndarray, out: np.ndarray
) -> None:
    """Row n of the dequantized weight (``parity.quant.dequantize``), into ``out`` (K,):
    fl(a * qw), then fl(w + m) for Q4_1 or fl(w - m) for Q4_K; float types converted exactly."""
    literally(code)
    if code == F32_:
        bits = raw[n * 4 * k : (n + 1) * 4 * k].view(np.uint32)
        for i in range(k):
            out[i] = bits_to_f32(bits[i])
        return
    if code in (F16_, BF16_):
        for i in range(k):
            o = (n * k + i) * 2
            h = np.uint32(raw[o]) | (np.uint32(raw[o + 1]) << 8)
            out[i] = table[h] if code == F16_ else bits_to_f32(np.uint32(h << 16))
        return
    elems, nbytes, sub_len = block_layout(code)
    nsub = k // sub_len
    a = np.empty(nsub, F32)
    m = np.zeros(nsub, F32)
    at = n * (k // elems) * nbytes
    row_scales(code, raw, at, nsub, table, a, m)
    for blk in range(k // elems):
        o = at + blk * nbytes
        e0 = blk * elems
        if code == Q4_K:
            for c in range(4):
                for i in range(32):
                    byte = raw[o + 16 + 32 * c + i]
                    lo, hi = 8 * blk + 2 * c, 8 * blk + 2 * c + 1
                    out[e0 + 64 * c + i] = a[lo] * F32(byte & 0x0F) - m[lo]
                    out[e0 + 64 * c + 32 + i] = a[hi] * F32(byte >> 4) - m[hi]
        elif code == Q6_K:
            for e in range(256):
                h, c, i = e // 128, e % 128 // 32, e % 32
                low = (raw[o + 64 * h + 32 * (c % 2) + i] >> (4 * (c // 2))) & 0x0F
                high = (raw[o + 128 + 32 * h + i] >> (2 * c)) & 3
                qw = np.int64(low | (high << 4)) - 32
                out[e0 + e] = a[16 * blk + e // 16] * F32(qw)
        elif code == Q8_0:
            for j in range(32):
                v = np.int64(raw[o + 2 + j])
                out[e0 + j] = a[blk] * F32(v - 256 if v > 127 else v)
        else:
            qs = o + (4 if code == Q4_1 else 6 if code == Q5_0 else 2)
            qh = 0
            if code == Q5_0:
                for j in range(4):
                    qh |= np.int64(raw[o + 2 + j]) << (8 * j)
            for j in range(32):
                byte = raw[qs + j % 16]
                qw = np.int64(byte & 0x0F if j < 16 else byte >> 4)
                if code == Q4_0:
                    qw -= 8
                elif code == Q5_0:
                    qw = (qw | (((qh >> j) & 1) << 4)) - 16
                w = a[blk] * F32(qw)
                out[e0 + j] = w + m[blk] if code == Q4_1 else w
