// Weight storage types in their GGUF layouts (docs/numerics.md, "Weights"): every quantized
// row is a sequence of sub-blocks of L elements (16 for Q6_K, 32 otherwise) with integer quants
// qw, a binary32 scale a and, for Q4_1 and Q4_K, a min m. ``load_sub`` gives one sub-block's
// quants packed four to an int32 word (for __dp4a) with its a and m; ``dequant_element`` gives
// one element of dequantize(W) bit for bit. Type codes are ggml's (parity.core.dtypes.DType).
#pragma once
#include "common.cuh"

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q6_K = 14, T_BF16 = 30
};

template <int QT> struct Layout;
template <> struct Layout<T_Q4_0> { enum { BE = 32, BB = 18, L = 32, MIN = 0, ALIGN = 2 }; };
template <> struct Layout<T_Q4_1> { enum { BE = 32, BB = 20, L = 32, MIN = 1, ALIGN = 4 }; };
template <> struct Layout<T_Q5_0> { enum { BE = 32, BB = 22, L = 32, MIN = 0, ALIGN = 2 }; };
template <> struct Layout<T_Q8_0> { enum { BE = 32, BB = 34, L = 32, MIN = 0, ALIGN = 2 }; };
template <> struct Layout<T_Q4_K> { enum { BE = 256, BB = 144, L = 32, MIN = -1, ALIGN = 16 }; };
template <> struct Layout<T_Q6_K> { enum { BE = 256, BB = 210, L = 16, MIN = 0, ALIGN = 2 }; };

// Q4_K's six-bit scale and min of sub-block s (ggml get_scale_min_k4)
__device__ __forceinline__ void scale_min_k4(const u8* sc, int s, int& scale, int& mn) {
    if (s < 4) {
        scale = sc[s] & 63;
        mn = sc[s + 4] & 63;
    } else {
        scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
        mn = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

// Q5_0's four quants of a word as int8: byte i is nibble i of ``nib`` (its high bits ignored)
// plus 16 times bit i of ``bits`` (0..15), minus 16. One multiply moves bit i to bit 8i + 4
// (shifts 4, 11, 18, 25: no two of the 16 products share a bit, so nothing carries); a byte
// whose fifth bit is set is its nibble, one whose bit is clear its nibble - 16 (0xF0 | the
// nibble): __vsub4(nibble | fifth bit, 0x10101010) in about half the instructions (ptxas:
// gemm_mma's Q5_0 unpacking 159 -> 88)
__device__ __forceinline__ u32 q5_bytes(u32 nib, u32 bits) {
    const u32 fifth = (bits * 0x02040810u) & 0x10101010u;
    return (nib | 0xF0F0F0F0u) ^ (fifth * 15u);
}

// a little-endian u32 at an address aligned to ALIGN bytes (2 or more): blocks of 18, 22, 34
// or 210 bytes are only 2-aligned, those of 20 and 144 bytes 4- and 16-aligned
template <int ALIGN>
__device__ __forceinline__ u32 load_u32a(const u8* p) {
    if (ALIGN >= 4) return *reinterpret_cast<const u32*>(p);
    const u16* h = reinterpret_cast<const u16*>(p);
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Sub-block ``s`` of a row (``row``: the row's first byte): q[0 .. L/4) the quants four per
// word, a the scale, m the min (0 for types without one).
template <int QT>
__device__ __forceinline__ void load_sub(const u8* row, int s, int (&q)[8], float& a, float& m) {
    typedef Layout<QT> Lt;
    m = 0.0f;
    if (QT == T_Q4_0 || QT == T_Q4_1 || QT == T_Q5_0 || QT == T_Q8_0) {
        const u8* b = row + (i64)s * Lt::BB;
        a = f16_to_f32(*reinterpret_cast<const u16*>(b));
        if (QT == T_Q8_0) {
#pragma unroll
            for (int w = 0; w < 8; ++w) q[w] = (int)load_u32a<Lt::ALIGN>(b + 2 + 4 * w);
            return;
        }
        const u8* qs = b + (QT == T_Q4_0 ? 2 : QT == T_Q4_1 ? 4 : 6);
        if (QT == T_Q4_1) m = f16_to_f32(*reinterpret_cast<const u16*>(b + 2));
        const u32 qh = QT == T_Q5_0 ? load_u32a<Lt::ALIGN>(b + 2) : 0u;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const u32 v = load_u32a<Lt::ALIGN>(qs + 4 * (w & 3));
            if (QT == T_Q5_0) {
                q[w] = (int)q5_bytes(w < 4 ? v : v >> 4, (qh >> (4 * w)) & 0xFu);
                continue;
            }
            u32 nib = w < 4 ? (v & 0x0F0F0F0Fu) : ((v >> 4) & 0x0F0F0F0Fu);
            if (QT == T_Q4_0) nib = __vsub4(nib, 0x08080808u);
            q[w] = (int)nib;
        }
    } else if (QT == T_Q4_K) {
        const u8* b = row + (i64)(s >> 3) * Lt::BB;
        const int sb = s & 7;
        int scale, mn;
        scale_min_k4(b + 4, sb, scale, mn);
        a = __fmul_rn(f16_to_f32(*reinterpret_cast<const u16*>(b)), (float)scale);
        m = __fmul_rn(f16_to_f32(*reinterpret_cast<const u16*>(b + 2)), (float)mn);
        const u8* qs = b + 16 + 32 * (sb >> 1);
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const u32 v = load_u32a<Lt::ALIGN>(qs + 4 * w);
            q[w] = (int)((sb & 1 ? v >> 4 : v) & 0x0F0F0F0Fu);
        }
    } else if (QT == T_Q6_K) {
        const u8* b = row + (i64)(s >> 4) * Lt::BB;
        const int sb = s & 15;
        const int h = sb >> 3, c = (sb & 7) >> 1, i0 = 16 * (sb & 1);
        a = __fmul_rn(f16_to_f32(*reinterpret_cast<const u16*>(b + 208)), (float)(i8)b[192 + sb]);
        const u8* ql = b + 64 * h + 32 * (c & 1) + i0;
        const u8* qh = b + 128 + 32 * h + i0;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const u32 low = (load_u32a<Lt::ALIGN>(ql + 4 * w) >> (4 * (c >> 1))) & 0x0F0F0F0Fu;
            const u32 high = (load_u32a<Lt::ALIGN>(qh + 4 * w) >> (2 * c)) & 0x03030303u;
            q[w] = (int)__vsub4(low | (high << 4), 0x20202020u);
        }
#pragma unroll
        for (int w = 4; w < 8; ++w) q[w] = 0;
    }
}

// qw of element j (0 <= j < BE) of a block, as an int
template <int QT>
__device__ __forceinline__ int quant_of(const u8* b, int j) {
    if (QT == T_Q4_0 || QT == T_Q4_1 || QT == T_Q5_0) {
        const u8* qs = b + (QT == T_Q4_0 ? 2 : QT == T_Q4_1 ? 4 : 6);
        int v = j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
        if (QT == T_Q4_0) v -= 8;
        if (QT == T_Q5_0) v = (v | (((load_u32(b + 2) >> j) & 1u) << 4)) - 16;
        return v;
    }
    if (QT == T_Q8_0) return (int)(i8)b[2 + j];
    if (QT == T_Q4_K) {
        const int s = j >> 5, i = j & 31;
        const u8 v = b[16 + 32 * (s >> 1) + i];
        return s & 1 ? v >> 4 : v & 0xF;
    }
    // Q6_K: element j = 128h + 32c + i
    const int h = j >> 7, c = (j >> 5) & 3, i = j & 31;
    const int low = (b[64 * h + 32 * (c & 1) + i] >> (4 * (c >> 1))) & 0xF;
    const int high = (b[128 + 32 * h + i] >> (2 * c)) & 3;
    return (low | (high << 4)) - 32;
}

// element e of a row of dequantize(W), bit for bit
template <int QT>
__device__ __forceinline__ float dequant_element(const u8* row, int e) {
    if constexpr (QT == T_F32) {
        return reinterpret_cast<const float*>(row)[e];
    } else if constexpr (QT == T_F16) {
        return f16_to_f32(load_u16(row + 2 * e));
    } else if constexpr (QT == T_BF16) {
        return bits_f32((u32)load_u16(row + 2 * e) << 16);
    } else {
        typedef Layout<QT> Lt;
        const u8* b = row + (i64)(e / Lt::BE) * Lt::BB;
        const int j = e % Lt::BE;
        const float qw = (float)quant_of<QT>(b, j);
        if constexpr (QT == T_Q4_K) {
            int scale, mn;
            scale_min_k4(b + 4, j >> 5, scale, mn);
            const float a = __fmul_rn(f16_to_f32(load_u16(b)), (float)scale);
            const float m = __fmul_rn(f16_to_f32(load_u16(b + 2)), (float)mn);
            return __fsub_rn(__fmul_rn(a, qw), m);
        } else if constexpr (QT == T_Q6_K) {
            const float a = __fmul_rn(f16_to_f32(load_u16(b + 208)), (float)(i8)b[192 + (j >> 4)]);
            return __fmul_rn(a, qw);
        } else if constexpr (QT == T_Q4_1) {
            return __fadd_rn(__fmul_rn(f16_to_f32(load_u16(b)), qw), f16_to_f32(load_u16(b + 2)));
        } else {
            return __fmul_rn(f16_to_f32(load_u16(b)), qw);
        }
    }
}
