// MATMUL y = x W^T (docs/numerics.md, "MATMUL"), with the epilogues of the fused ops: bias
// (its own rounding), residual (MATMUL_ADD: fl(r + y) after the product's TREE) and SWIGLU
// (MATMUL_SWIGLU: both products' TREEs in full, then fl(silu(g) * u)).
//
// Quantized W: per output (t, n) and sub-block s, isum_s is an exact int32 dot product of the
// weight's quants with x's Q8 quants (__dp4a: integer sums are exact in any order), then
// term_s = fl(fl(a * d_x) * isum_s) [+- fl(m * s_x)], and y = TREE(term_0 .. term_{S-1}).
// Float W: y = TREE(fl(x_k * w_k)) over K. Both kernels below build the same TREE, so a token's
// result does not depend on which kernel, or how many tokens, computed it.
//
// gemv: one warp per output row, every token of the step in registers (few tokens). Lane l
//   owns the aligned run of R = W/32 slots [lR, lR + R) of the row's TREE (or slot l when
//   W < 32), builds its subtree with tree_push, and the xor butterfly adds the 32 subtrees.
// gemm: a block computes a tile of tokens x rows (prefill); each thread keeps its outputs'
//   TREEs as binary counters in registers while the sub-blocks stream through shared memory.
#include "common.cuh"
#include "quant.cuh"

enum { EPI_BIAS = 1, EPI_RESIDUAL = 2, EPI_SWIGLU = 4 };

struct Q8 {  // a Q8A value on the device: quants (T, K), and per 32-block d and s (T, K/32)
    const i8* q;
    const float* d;
    const float* s;
};

// exact isum of one sub-block: n words of 4 weight quants times 4 activation quants
template <int WORDS>
__device__ __forceinline__ int dot_words(const int (&wq)[8], const int* xq) {
    int acc = 0;
#pragma unroll
    for (int w = 0; w < WORDS; ++w) acc = __dp4a(wq[w], xq[w], acc);
    return acc;
}

// the contract's term of one sub-block
template <int QT>
__device__ __forceinline__ float sub_term(float a, float m, float dx, float sx, int isum) {
    float term = __fmul_rn(__fmul_rn(a, dx), (float)isum);
    if (Layout<QT>::MIN == 1) term = __fadd_rn(term, __fmul_rn(m, sx));
    if (Layout<QT>::MIN == -1) term = __fsub_rn(term, __fmul_rn(m, sx));
    return term;
}

template <int EPI>
__device__ __forceinline__ float epilogue(float y, float y2, const float* bias, const float* res,
                                          int t, int n, int N) {
    if (EPI & EPI_SWIGLU) return __fmul_rn(p_silu(y), y2);
    if (EPI & EPI_BIAS) y = __fadd_rn(y, bias[n]);
    if (EPI & EPI_RESIDUAL) y = __fadd_rn(res[(i64)t * N + n], y);
    return y;
}

// ---- gemv ------------------------------------------------------------------------------------

#define GEMV_WARPS 4
#define GEMV_MAXL 8  // rounds of a warp's TREE: up to 128 rounds of 32 sub-blocks each

// The bytes of round r of a row: 32 sub-blocks, whole blocks of the type (a super-block holds 8
// sub-blocks of Q4_K and 16 of Q6_K, so a round is 4 or 2 super-blocks), contiguous in the row.
template <int QT>
struct Round {
    enum { SUBS = 32, BYTES = 32 * Layout<QT>::L / Layout<QT>::BE * Layout<QT>::BB };
    enum { VECS = (BYTES + 15) / 16 + 1 };  // 16-byte loads covering it from an aligned start
    enum { PER_LANE = (VECS + 31) / 32 };
};

// A warp's copy of one round of a row into shared memory: 16-byte loads from the aligned address
// at or below the round's first byte (weights are padded by 16 bytes on upload, so the last
// load stays inside the buffer), issued for round r+1 before round r is computed.
template <int QT>
struct Stage {
    int4 v[Round<QT>::PER_LANE];
    int offset;  // the round's first byte within the copy

    __device__ __forceinline__ void load(const u8* row, int r, int S) {
        const int lane = threadIdx.x & 31;
        const int subs = min(32, S - 32 * r);
        const u8* first = row + (i64)r * Round<QT>::BYTES;
        const int bytes = subs * Layout<QT>::L / Layout<QT>::BE * Layout<QT>::BB;
        const u8* base = reinterpret_cast<const u8*>(reinterpret_cast<size_t>(first) & ~(size_t)15);
        offset = (int)(first - base);
        const int vecs = (offset + bytes + 15) / 16;
#pragma unroll
        for (int j = 0; j < Round<QT>::PER_LANE; ++j) {
            const int k = j * 32 + lane;
            if (k < vecs) v[j] = __ldg(reinterpret_cast<const int4*>(base) + k);
        }
    }
    __device__ __forceinline__ void store(u8* smem) const {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int j = 0; j < Round<QT>::PER_LANE; ++j) {
            const int k = j * 32 + lane;
            if (k < Round<QT>::VECS) reinterpret_cast<int4*>(smem)[k] = v[j];
        }
    }
};

// the Q8A quants of sub-block s of token t (L / 4 words), loaded 16 bytes at a time
template <int L>
__device__ __forceinline__ void load_x(const Q8& x, int t, int K, int s, int (&xw)[8]) {
    const int4* p = reinterpret_cast<const int4*>(x.q + (i64)t * K + s * L);
    const int4 a = p[0];
    xw[0] = a.x; xw[1] = a.y; xw[2] = a.z; xw[3] = a.w;
    if (L == 32) {
        const int4 b = p[1];
        xw[4] = b.x; xw[5] = b.y; xw[6] = b.z; xw[7] = b.w;
    }
}

// Output row n of a quantized product, computed by WPR warps (``part`` is this warp's index
// among them). The row's S sub-blocks are the leaves of TREE, padded to W = next_pow2(S).
// W <= 32: one round, lane l holds leaf l, and the butterfly adds them. Else the W/32 rounds
// of 32 leaves are each summed by the butterfly (an aligned subtree of 32 leaves), and those
// round sums are TREE leaves one level up: warp ``part`` owns the aligned run of W/32/WPR of
// them, and the WPR warps' subtrees meet in shared memory in tree order. Lanes read their
// sub-blocks from the warp's shared copy of the round (``smem``), loaded coalesced.
template <int QT, int TMAX, int EPI, int WPR>
__device__ __forceinline__ void gemv_q_row(float* y, const Q8& x, const u8* w, const u8* w2,
                                           const float* bias, const float* res, int T, int N,
                                           int K, i64 row_bytes, int n, int part, bool live,
                                           u8* smem, float* red) {
    constexpr int L = Layout<QT>::L;
    constexpr bool GATED = (EPI & EPI_SWIGLU) != 0;
    constexpr int NM = GATED ? 2 : 1;
    const int lane = threadIdx.x & 31;
    const int S = K / L, W = next_pow2(S);
    const int NR = W > 32 ? W / 32 : 1;  // rounds, padding ones included
    const int per = NR / WPR;            // rounds of this warp
    const int r0 = part * per;
    const int real = live ? max(0, min(per, (S + 31) / 32 - r0)) : 0;  // rounds holding a leaf
    const int width = W > 32 ? 32 : W;  // leaves a round's butterfly adds
    const u8* rows[2] = {w + (i64)n * row_bytes, GATED ? w2 + (i64)n * row_bytes : nullptr};
    const int nb = K / 32;
    float st[NM][TMAX][GEMV_MAXL];
    Stage<QT> stage[NM];
    // one token (decode): this lane's activation quants of a round are loaded with the round's
    // weights, not after them
    constexpr bool XPRE = TMAX == 1;
    int xn[8];
    float dxn = 0.0f, sxn = 0.0f;
    auto load_xs = [&](int r) {
        const int s = 32 * r + lane;
        if (XPRE && s < S) {
            load_x<L>(x, 0, K, s, xn);
            dxn = x.d[s * L / 32];
            sxn = x.s[s * L / 32];
        }
    };
    if (real > 0) {
#pragma unroll
        for (int m = 0; m < NM; ++m) stage[m].load(rows[m], r0, S);
        load_xs(r0);
    }
    for (int i = 0; i < real; ++i) {
        const int r = r0 + i;
        int offset[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            stage[m].store(smem + m * Round<QT>::VECS * 16);
            offset[m] = stage[m].offset;
        }
        int xc[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) xc[k] = xn[k];
        const float dxc = dxn, sxc = sxn;
        __syncwarp();
        if (i + 1 < real) {
#pragma unroll
            for (int m = 0; m < NM; ++m) stage[m].load(rows[m], r + 1, S);
            load_xs(r + 1);
        }
        const int s = 32 * r + lane;  // this lane's sub-block
        const bool leaf = s < S;
        int wq[NM][8];
        float a[NM], mn[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            if (leaf)
                load_sub<QT>(smem + m * Round<QT>::VECS * 16 + offset[m], lane, wq[m], a[m], mn[m]);
        }
        __syncwarp();
        const int b = s * L / 32;  // the activation block
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
            if (t < T) {
                float term[NM];
#pragma unroll
                for (int m = 0; m < NM; ++m) term[m] = 0.0f;  // padding leaves: +0.0
                if (leaf) {
                    int xw[8];
                    float dx = dxc, sx = sxc;
                    if (XPRE) {
#pragma unroll
                        for (int k = 0; k < 8; ++k) xw[k] = xc[k];
                    } else {
                        load_x<L>(x, t, K, s, xw);
                        dx = x.d[(i64)t * nb + b];
                        sx = x.s[(i64)t * nb + b];
                    }
#pragma unroll
                    for (int m = 0; m < NM; ++m)
                        term[m] = sub_term<QT>(a[m], mn[m], dx, sx, dot_words<L / 4>(wq[m], xw));
                }
#pragma unroll
                for (int m = 0; m < NM; ++m)
                    tree_push<GEMV_MAXL>(st[m][t], i, warp_tree(term[m], width));
            }
        }
    }
    // this warp's subtree, then the row's: WPR subtrees in tree order
    const int row_in_block = (threadIdx.x >> 5) / WPR;
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
        if (t < T) {
            float v[NM];
#pragma unroll
            for (int m = 0; m < NM; ++m) {
                v[m] = tree_finish<GEMV_MAXL>(st[m][t], real, per);
                if (WPR > 1) {
                    if (lane == 0) red[((row_in_block * TMAX + t) * NM + m) * WPR + part] = v[m];
                }
            }
            if (WPR > 1) {
                __syncthreads();
                if (part == 0) {
#pragma unroll
                    for (int m = 0; m < NM; ++m) {
                        const float* rr = red + ((row_in_block * TMAX + t) * NM + m) * WPR;
                        v[m] = WPR == 2 ? __fadd_rn(rr[0], rr[1])
                                        : __fadd_rn(__fadd_rn(rr[0], rr[1]), __fadd_rn(rr[2], rr[3]));
                    }
                }
            }
            if (live && part == 0 && lane == 0)
                y[(i64)t * N + n] = epilogue<EPI>(v[0], v[NM - 1], bias, res, t, n, N);
        }
    }
}

// the shared memory of a gemv block: each warp's round copies, and the WPR subtrees of a row
template <int QT, int TMAX, int EPI, int WPR>
struct GemvShared {
    enum { NM = (EPI & EPI_SWIGLU) ? 2 : 1 };
    int4 stage[GEMV_WARPS][NM * Round<QT>::VECS];
    float red[GEMV_WARPS / WPR * TMAX * NM * WPR];
};

#define GEMV_ROW(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, n, live)                   \
    gemv_q_row<QT, TMAX, EPI, WPR>(y, x, w, w2, bias, res, T, N, K, row_bytes, n,                  \
                                   (threadIdx.x >> 5) % WPR, live,                                  \
                                   reinterpret_cast<u8*>(sh.stage[threadIdx.x >> 5]), sh.red)

template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
       int T, int N, int K, i64 row_bytes) {
    __shared__ GemvShared<QT, TMAX, EPI, WPR> sh;
    const int n = blockIdx.x * (GEMV_WARPS / WPR) + (threadIdx.x >> 5) / WPR;
    GEMV_ROW(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, min(n, N - 1), n < N);
}

// The same, and the output quantized (the Q8A x of the next product: SWIGLU's for down). The
// last of the blocks of each 32-row group to finish (an atomic ticket) quantizes the group's
// rows for every token: the values it reads were written, and fenced, by the group's blocks.
// ``tickets`` (N/32 ints, zero) are reset by the block that used them, ready for a replay.
template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_q8(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
          int T, int N, int K, i64 row_bytes, i8* oq, float* od, float* os, int* tickets) {
    constexpr int GROUP = 32 / (GEMV_WARPS / WPR);  // blocks per 32 rows
    __shared__ GemvShared<QT, TMAX, EPI, WPR> sh;
    __shared__ int last;
    const int n = blockIdx.x * (GEMV_WARPS / WPR) + (threadIdx.x >> 5) / WPR;
    GEMV_ROW(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, min(n, N - 1), n < N);
    __threadfence();
    __syncthreads();
    const int g = blockIdx.x / GROUP;
    if (threadIdx.x == 0) last = atomicAdd(&tickets[g], 1) == GROUP - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int nb = N / 32, lane = threadIdx.x & 31;
    for (int t = threadIdx.x >> 5; t < T; t += GEMV_WARPS) {
        const float v = __ldcg(y + (i64)t * N + g * 32 + lane);  // at L2: other blocks wrote it
        quantize_block(v, oq + (i64)t * N + g * 32, od + (i64)t * nb + g, os + (i64)t * nb + g);
    }
    if (threadIdx.x == 0) tickets[g] = 0;
}

// Up to three products of one x by weights of one width (q, k and v) in one launch: segment
// k's rows take blocks [first_k, first_k + blocks_k) of the grid. Segments 0 and 1 hold
// weights of type QT, segment 2 of type QT2 (v is often of another type than q and k).
struct GemvSeg {
    float* y;
    const u8* w;
    const float* bias;
    i64 row_bytes;
    int N;
    int blocks;
};
struct GemvSegs {
    GemvSeg s0, s1, s2;
};

template <int QT, int QT2, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_multi(GemvSegs segs, Q8 x, int T, int K) {
    __shared__ union {
        GemvShared<QT, TMAX, EPI, WPR> a;
        GemvShared<QT2, TMAX, EPI, WPR> b;
    } shu;
    int blk = blockIdx.x;
    GemvSeg sg = segs.s0;
    bool second_type = false;
    if (blk >= segs.s0.blocks) {
        blk -= segs.s0.blocks;
        sg = segs.s1;
        if (blk >= segs.s1.blocks) {
            blk -= segs.s1.blocks;
            sg = segs.s2;
            second_type = true;
        }
    }
    const int n = blk * (GEMV_WARPS / WPR) + (threadIdx.x >> 5) / WPR;
    const int row = min(n, sg.N - 1);
    if (QT2 != QT && second_type) {
        auto& sh = shu.b;
        GEMV_ROW(QT2, TMAX, EPI, WPR, sg.y, sg.w, nullptr, sg.bias, nullptr, sg.N, sg.row_bytes,
                 row, n < sg.N);
    } else {
        auto& sh = shu.a;
        GEMV_ROW(QT, TMAX, EPI, WPR, sg.y, sg.w, nullptr, sg.bias, nullptr, sg.N, sg.row_bytes,
                 row, n < sg.N);
    }
}

// float weights: K leaves, x not quantized
#define GEMV_F_MAXL 12  // runs of up to 2048 elements per lane: K up to 65536

template <int QT, int TMAX, int EPI>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_f(float* y, const float* x, const u8* w, const u8* w2, const float* bias, const float* res,
       int T, int N, int K, i64 row_bytes) {
    constexpr bool GATED = (EPI & EPI_SWIGLU) != 0;
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (n >= N) return;
    const int W = next_pow2(K);
    const int R = W >= 32 ? W / 32 : 1;
    const int P = W >= 32 ? 32 : W;
    const int start = lane * R;
    int count = K - start;
    count = lane >= P || count < 0 ? 0 : (count > R ? R : count);
    const u8* row = w + (i64)n * row_bytes;
    const u8* row2 = GATED ? w2 + (i64)n * row_bytes : nullptr;
    float st[TMAX][GEMV_F_MAXL];
    float st2[GATED ? TMAX : 1][GEMV_F_MAXL];
    for (int i = 0; i < count; ++i) {
        const int k = start + i;
        const float wv = dequant_element<QT>(row, k);
        const float wv2 = GATED ? dequant_element<QT>(row2, k) : 0.0f;
#pragma unroll
        for (int t = 0; t < TMAX; ++t) {
            if (t < T) {
                const float xv = x[(i64)t * K + k];
                tree_push<GEMV_F_MAXL>(st[t], i, __fmul_rn(xv, wv));
                if (GATED) tree_push<GEMV_F_MAXL>(st2[GATED ? t : 0], i, __fmul_rn(xv, wv2));
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TMAX; ++t) {
        if (t < T) {
            float v = lane < P ? tree_finish<GEMV_F_MAXL>(st[t], count, R) : 0.0f;
            v = warp_tree(v, P);
            float v2 = 0.0f;
            if (GATED) {
                v2 = lane < P ? tree_finish<GEMV_F_MAXL>(st2[GATED ? t : 0], count, R) : 0.0f;
                v2 = warp_tree(v2, P);
            }
            if (lane == 0) y[(i64)t * N + n] = epilogue<EPI>(v, v2, bias, res, t, n, N);
        }
    }
}

// ---- gemm ------------------------------------------------------------------------------------

// A block of 256 threads computes BT tokens x BN rows: thread (tx, ty) of a 16 x 16 grid owns
// rows tx + 16j (j < TN) and tokens ty + 16i (i < TT). Sub-blocks arrive SB at a time: their
// quants unpacked into shared memory (one word row per weight row, padded against bank
// conflicts), with the activation blocks they read.
#define GEMM_THREADS 256
#define GEMM_SB 4

template <int QT, int MAXL, int EPI>
__global__ void __launch_bounds__(GEMM_THREADS)
gemm_q(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
       int T, int N, int K, i64 row_bytes) {
    constexpr int L = Layout<QT>::L;
    constexpr int WPS = L / 4;                      // words per sub-block
    constexpr bool GATED = (EPI & EPI_SWIGLU) != 0;
    constexpr int TN = 2, TT = GATED ? 2 : 4;
    constexpr int BN = 16 * TN, BT = 16 * TT;
    constexpr int NMAT = GATED ? 2 : 1;
    constexpr int NB = GEMM_SB * L / 32 > 0 ? GEMM_SB * L / 32 : 1;  // activation blocks a stage
    constexpr int WSTRIDE = GEMM_SB * WPS + 1;
    constexpr int XSTRIDE = NB * 8 + 1;
    __shared__ int s_wq[NMAT][BN][WSTRIDE];
    __shared__ float s_wa[NMAT][BN][GEMM_SB], s_wm[NMAT][BN][GEMM_SB];
    __shared__ int s_xq[BT][XSTRIDE];
    __shared__ float s_xd[BT][NB], s_xs[BT][NB];

    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int n0 = blockIdx.x * BN, t0 = blockIdx.y * BT;
    const int S = K / L, W = next_pow2(S), nbk = K / 32;
    float st[NMAT][TT][TN][MAXL];

    for (int s0 = 0; s0 < S; s0 += GEMM_SB) {
        // weights: one (matrix, row, sub-block) per thread
        for (int k = tid; k < NMAT * BN * GEMM_SB; k += GEMM_THREADS) {
            const int mat = k / (BN * GEMM_SB), r = (k / GEMM_SB) % BN, j = k % GEMM_SB;
            const int n = n0 + r, s = s0 + j;
            int wq[8];
            float a = 0.0f, m = 0.0f;
            if (n < N && s < S) {
                load_sub<QT>((mat ? w2 : w) + (i64)n * row_bytes, s, wq, a, m);
            } else {
#pragma unroll
                for (int q = 0; q < 8; ++q) wq[q] = 0;
            }
#pragma unroll
            for (int q = 0; q < WPS; ++q) s_wq[mat][r][j * WPS + q] = wq[q];
            s_wa[mat][r][j] = a;
            s_wm[mat][r][j] = m;
        }
        // activations: the blocks these sub-blocks read, for BT tokens
        const int b0 = s0 * L / 32;
        for (int k = tid; k < BT * NB * 8; k += GEMM_THREADS) {
            const int tt = k / (NB * 8), j = k % (NB * 8);
            const int t = t0 + tt, b = b0 + j / 8;
            int v = 0;
            if (t < T && b < nbk) v = reinterpret_cast<const int*>(x.q + (i64)t * K + b * 32)[j % 8];
            s_xq[tt][j] = v;
        }
        for (int k = tid; k < BT * NB; k += GEMM_THREADS) {
            const int tt = k / NB, j = k % NB;
            const int t = t0 + tt, b = b0 + j;
            const bool ok = t < T && b < nbk;
            s_xd[tt][j] = ok ? x.d[(i64)t * nbk + b] : 0.0f;
            s_xs[tt][j] = ok ? x.s[(i64)t * nbk + b] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < GEMM_SB; ++j) {
            const int s = s0 + j;
            if (s < S) {
                const int bl = j * L / 32;              // block within the stage
                const int off = L == 16 ? (s & 1) * 4 : 0;
#pragma unroll
                for (int i = 0; i < TT; ++i) {
                    const int tt = ty + 16 * i;
                    int xw[8];
#pragma unroll
                    for (int q = 0; q < WPS; ++q) xw[q] = s_xq[tt][bl * 8 + off + q];
                    const float dx = s_xd[tt][bl], sx = s_xs[tt][bl];
#pragma unroll
                    for (int jn = 0; jn < TN; ++jn) {
                        const int r = tx + 16 * jn;
#pragma unroll
                        for (int mat = 0; mat < NMAT; ++mat) {
                            int isum = 0;
#pragma unroll
                            for (int q = 0; q < WPS; ++q)
                                isum = __dp4a(s_wq[mat][r][j * WPS + q], xw[q], isum);
                            tree_push<MAXL>(st[mat][i][jn], s,
                                            sub_term<QT>(s_wa[mat][r][j], s_wm[mat][r][j], dx,
                                                         sx, isum));
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TT; ++i) {
#pragma unroll
        for (int jn = 0; jn < TN; ++jn) {
            const int t = t0 + ty + 16 * i, n = n0 + tx + 16 * jn;
            const float v = tree_finish<MAXL>(st[0][i][jn], S, W);
            const float v2 = GATED ? tree_finish<MAXL>(st[NMAT - 1][i][jn], S, W) : 0.0f;
            if (t < T && n < N) y[(i64)t * N + n] = epilogue<EPI>(v, v2, bias, res, t, n, N);
        }
    }
}
