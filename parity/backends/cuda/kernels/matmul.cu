// MATMUL y = x W^T (docs/numerics.md, "MATMUL"), with the epilogues of the fused ops: bias
// (its own rounding), residual (MATMUL_ADD: fl(r + y) after the product's TREE) and SWIGLU
// (MATMUL_SWIGLU: both products' TREEs in full, then fl(silu(g) * u)), or GEGLU (the gate and
// up products and the GEGLU that reads them, Gemma 3's: fl(gelu(g) * u)).
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
#include "norm.cuh"
#include "quant.cuh"

enum { EPI_BIAS = 1, EPI_RESIDUAL = 2, EPI_SWIGLU = 4, EPI_GEGLU = 8, EPI_RES_EARLY = 16,
       EPI_ONE_FENCE = 32 };
// (EPI_RES_EARLY, with EPI_RESIDUAL, a GEMV's (gemv_q_row): the residual loaded at L2 before
// PDL's wait, the lowering's EARLY_LOADS where a kernel two launches back or earlier wrote it;
// EPI_ONE_FENCE, gemv_q_q8's: its tickets taken with one fence a block, last_block<true>)
#define EPI_GATED (EPI_SWIGLU | EPI_GEGLU)  // two matrices, y = act(x Wg^T) * (x Wu^T)

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

// (``r``: the residual res[t, n] where EPI_RES_EARLY loaded it already)
template <int EPI>
__device__ __forceinline__ float epilogue(float y, float y2, const float* bias, const float* res,
                                          int t, int n, int N, float r = 0.0f) {
    if (EPI & EPI_SWIGLU) return __fmul_rn(p_silu(y), y2);
    if (EPI & EPI_GEGLU) return __fmul_rn(p_gelu(y), y2);
    if (EPI & EPI_BIAS) y = __fadd_rn(y, bias[n]);
    if (EPI & EPI_RESIDUAL) y = __fadd_rn((EPI & EPI_RES_EARLY) ? r : res[(i64)t * N + n], y);
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
// load stays inside the buffer), issued for round r+1 before round r is computed. PER: the
// loads a lane holds, enough for a whole round unless the caller knows its rounds are shorter.
template <int QT, int PER = Round<QT>::PER_LANE>
struct Stage {
    int4 v[PER];
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
        for (int j = 0; j < PER; ++j) {
            const int k = j * 32 + lane;
            if (k < vecs) v[j] = __ldg(reinterpret_cast<const int4*>(base) + k);
        }
    }
    __device__ __forceinline__ void store(u8* smem) const {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
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
// sub-blocks from the warp's shared copy of the round (``smem``), loaded coalesced. The first
// round's weights are asked for before PDL's wait (pdl_begin): no kernel writes them.
// (gated: ``g_out`` and ``u_out``, when given, also get the two products, the values of the
// gate and up nodes a launch-level GLU fusion computes)
// (``keep``, when given: shared memory where each row's lane 0 also leaves its outputs, at [t
// ROWS + the row's place in the block], ROWS = GEMV_WARPS / WPR: gemv_q_sq's. ``pro``: run by
// every thread right after PDL's wait, before x is read: gemv_q_normed's norm, which makes x)
struct NoPrologue {
    __device__ __forceinline__ void operator()() const {}
};

template <int QT, int TMAX, int EPI, int WPR, typename Pro = NoPrologue>
__device__ __forceinline__ void gemv_q_row(float* y, const Q8& x, const u8* w, const u8* w2,
                                           const float* bias, const float* res, int T, int N,
                                           int K, i64 row_bytes, int n, int part, bool live,
                                           u8* smem, float* red, float* g_out,
                                           float* u_out, float* keep = nullptr,
                                           const Pro& pro = Pro()) {
    constexpr int L = Layout<QT>::L;
    constexpr bool GATED = (EPI & EPI_GATED) != 0;
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
    // weights, not after them; not for two matrices, whose staged rounds hold enough registers
    // (Qwen's gate/up: 232 us a step without, 284 with)
    constexpr bool XPRE = TMAX == 1 && !GATED;
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
        for (int m = 0; m < NM; ++m) stage[m].load(rows[m], r0, S);  // weights: no kernel writes them
    }
    constexpr bool RES_EARLY = (EPI & EPI_RES_EARLY) && (EPI & EPI_RESIDUAL);
    float r_early[TMAX];  // (RES_EARLY: the row's residuals, by the lane that adds them)
    if (RES_EARLY && live && part == 0 && lane == 0) {
#pragma unroll
        for (int t = 0; t < TMAX; ++t) r_early[t] = t < T ? __ldcg(res + (i64)t * N + n) : 0.0f;
    }
    pdl_begin();  // (every thread of the block)
    pro();
    if (real > 0) load_xs(r0);
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
            if (live && part == 0 && lane == 0) {
                const float out = epilogue<EPI>(v[0], v[NM - 1], bias, res, t, n, N,
                                                RES_EARLY ? r_early[t] : 0.0f);
                y[(i64)t * N + n] = out;
                if (keep != nullptr) keep[t * (GEMV_WARPS / WPR) + row_in_block] = out;
                if (GATED && g_out != nullptr) {
                    g_out[(i64)t * N + n] = v[0];
                    u_out[(i64)t * N + n] = v[NM - 1];
                }
            }
        }
    }
}

// the shared memory of a gemv block: each warp's round copies, and the WPR subtrees of a row
template <int QT, int TMAX, int EPI, int WPR>
struct GemvShared {
    enum { NM = (EPI & EPI_GATED) ? 2 : 1 };
    int4 stage[GEMV_WARPS][NM * Round<QT>::VECS];
    float red[GEMV_WARPS / WPR * TMAX * NM * WPR];
};

#define GEMV_ROW(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, n, live)                   \
    GEMV_ROW_OUT(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, n, live, nullptr, nullptr)
#define GEMV_ROW_OUT(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, n, live, go, uo)       \
    GEMV_ROW_ALL(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, n, live, go, uo, nullptr,  \
                 NoPrologue())
#define GEMV_ROW_ALL(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, n, live, go, uo, keep, \
                     pro)                                                                          \
    gemv_q_row<QT, TMAX, EPI, WPR>(y, x, w, w2, bias, res, T, N, K, row_bytes, n,                  \
                                   (threadIdx.x >> 5) % WPR, live,                                 \
                                   reinterpret_cast<u8*>(sh.stage[threadIdx.x >> 5]), sh.red,      \
                                   go, uo, keep, pro)

template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
       int T, int N, int K, i64 row_bytes) {
    __shared__ GemvShared<QT, TMAX, EPI, WPR> sh;
    const int n = blockIdx.x * (GEMV_WARPS / WPR) + (threadIdx.x >> 5) / WPR;
    GEMV_ROW(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, min(n, N - 1), n < N);
}

// gemv_q, and for each token the squares of the block's rows summed as their aligned subtree of
// a norm's TREE (the ROWS = GEMV_WARPS / WPR rows of block b are the norm's slots [b ROWS, b
// ROWS + ROWS); rows past N are its +0.0 padding), into parts[t gridDim.x + b]: the norm that
// reads the output (a residual sum) is then made by the products that read it
// (gemv_q_normed's kernels, norm.cuh's NormIn) with the squares made once.
template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_sq(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
          int T, int N, int K, i64 row_bytes, float* parts) {
    constexpr int ROWS = GEMV_WARPS / WPR;
    __shared__ GemvShared<QT, TMAX, EPI, WPR> sh;
    __shared__ float kept[TMAX * ROWS];
    const int n = blockIdx.x * ROWS + (threadIdx.x >> 5) / WPR;
    GEMV_ROW_ALL(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, min(n, N - 1), n < N,
                 nullptr, nullptr, kept, NoPrologue());
    __syncthreads();  // the rows' outputs, kept by each row's lane 0
    if ((int)threadIdx.x >= T) return;
    const int t = threadIdx.x;
    float sq[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float v = kept[t * ROWS + r];
        sq[r] = blockIdx.x * ROWS + r < N ? __fmul_rn(v, v) : 0.0f;
    }
#pragma unroll
    for (int step = 1; step < ROWS; step <<= 1) {  // the subtree, level by level
#pragma unroll
        for (int r = 0; r + step < ROWS; r += 2 * step) sq[r] = __fadd_rn(sq[r], sq[r + step]);
    }
    parts[(i64)t * gridDim.x + blockIdx.x] = sq[0];
}

// x of a gemv_q_normed kernel: the Q8A its prologue (norm.cuh's norm_in_x) writes into the
// block's dynamic shared memory, T rows of K quants, then the d of each 32-block, then its s
__device__ __forceinline__ Q8 normed_q8(const u8* smem, int T, int K) {
    Q8 x;
    x.q = reinterpret_cast<const i8*>(smem);
    x.d = reinterpret_cast<const float*>(smem + T * K);
    x.s = x.d + T * (K / 32);
    return x;
}

// The kernels whose x is the norm they make first (NormIn ``in``): x in shared memory, made by
// every thread after PDL's wait, and ``pro`` the step that makes it
#define NORMED_X                                                                                  \
    extern __shared__ int4 normed_smem[];                                                          \
    __shared__ float normed_tmp[33];                                                               \
    const Q8 x = normed_q8(reinterpret_cast<const u8*>(normed_smem), T, K);                        \
    const auto pro = [&]() {                                                                       \
        norm_in_x(in, T, K, reinterpret_cast<u8*>(normed_smem), normed_tmp);                       \
    }

template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_normed(float* y, NormIn in, const u8* w, const u8* w2, const float* bias, const float* res,
              int T, int N, int K, i64 row_bytes) {
    __shared__ GemvShared<QT, TMAX, EPI, WPR> sh;
    NORMED_X;
    const int n = blockIdx.x * (GEMV_WARPS / WPR) + (threadIdx.x >> 5) / WPR;
    GEMV_ROW_ALL(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, min(n, N - 1), n < N,
                 nullptr, nullptr, nullptr, pro);
}

// A long product of short rows, one token (the output head: 49,152 to 262,144 rows of one
// round each): warp w of the grid takes rows w, w + G, w + 2G, ... (G the grid's warps, a few
// per multiprocessor) and asks for each row's weights AHEAD rows before it computes it, so
// a warp keeps several rows' bytes in flight, where gemv_q's warps take one row and their block
// then exits, and x's quants are loaded once a warp. A row's leaves and butterfly are gemv_q's
// (one round: lane l holds leaf l): the same bits. ARG: the ARGMAX of the row too (greedy
// decoding's token, into ``arg``): each warp keeps the largest (value, index) key of its rows
// (rows.cu's keys: the same answer as argmax_f32), each block writes its own to ``keys``, and
// the last block to finish (an atomic ticket) takes their max and resets ``ticket``.
template <int QT, int EPI, int AHEAD, int PER = Round<QT>::PER_LANE, int ARG = 0>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_wide(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
            int T, int N, int K, i64 row_bytes, int* arg, unsigned long long* keys, int* ticket) {
    static_assert(AHEAD >= 1, "a ring of one slot would compute a row before loading it");
    constexpr int L = Layout<QT>::L;
    __shared__ int4 copies[GEMV_WARPS][Round<QT>::VECS];
    u8* smem = reinterpret_cast<u8*>(copies[threadIdx.x >> 5]);
    const int lane = threadIdx.x & 31;
    const int S = K / L, width = next_pow2(S);  // S <= 32 (the lowering's)
    const int step = gridDim.x * GEMV_WARPS;
    const int first = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    unsigned long long best = 0;  // ARG: below every real key
    Stage<QT, PER> ring[AHEAD + 1];  // (PER: a row's loads, given by the lowering)
#pragma unroll
    for (int j = 0; j < AHEAD; ++j) {  // weights: no kernel writes them
        const int n = first + j * step;
        if (n < N) ring[j].load(w + (i64)n * row_bytes, 0, S);
    }
    pdl_begin();
    const bool leaf = lane < S;
    int xw[8];
    float dx = 0.0f, sx = 0.0f;
    if (leaf) {
        load_x<L>(x, 0, K, lane, xw);
        dx = x.d[lane * L / 32];
        sx = x.s[lane * L / 32];
    }
    for (int base = first; base < N; base += (AHEAD + 1) * step) {
#pragma unroll
        for (int j = 0; j <= AHEAD; ++j) {  // ring slot j: a compile-time index
            const int n = base + j * step;
            if (n >= N) break;
            const int ahead = n + AHEAD * step;
            ring[j].store(smem);
            const int offset = ring[j].offset;
            if (ahead < N) ring[(j + AHEAD) % (AHEAD + 1)].load(w + (i64)ahead * row_bytes, 0, S);
            __syncwarp();
            int wq[8];
            float a = 0.0f, mn = 0.0f;
            if (leaf) load_sub<QT>(smem + offset, lane, wq, a, mn);
            __syncwarp();
            const float term = leaf ? sub_term<QT>(a, mn, dx, sx, dot_words<L / 4>(wq, xw)) : 0.0f;
            const float v = warp_tree(term, width);
            if (lane == 0) {
                const float out = epilogue<EPI>(v, v, bias, res, 0, n, N);
                y[n] = out;
                if (ARG) best = key_max(best, arg_key(out, n));
            }
        }
    }
    if (!ARG) return;
    __shared__ unsigned long long wkeys[GEMV_WARPS];
    __shared__ int last;
    best = block_key_max(best, wkeys);  // (lane 0's keys; the others hold 0, below every key)
    if (threadIdx.x == 0) keys[blockIdx.x] = best;
    if (!last_block(ticket, gridDim.x, last)) return;
    best = keys_max(keys, gridDim.x, wkeys);
    if (threadIdx.x == 0) {
        *arg = key_index(best);
        *ticket = 0;  // ready for the next launch or replay
    }
}

// The same, and the output quantized (the Q8A x of the next product: SWIGLU's or GEGLU's for
// down). The last of the blocks of each 32-row group to finish (an atomic ticket) quantizes the
// group's rows for every token: the values it reads were written, and fenced, by the group's
// blocks. ``tickets`` (N/32 ints, zero) are reset by the block that used them, ready for a
// replay. Gated: ``g_out`` and ``u_out`` (or null) get the gate and up products too.
template <int QT, int TMAX, int EPI, int WPR, typename Pro>
__device__ __forceinline__ void gemv_q_q8_body(float* y, const Q8& x, const u8* w, const u8* w2,
                                               const float* bias, const float* res, int T, int N,
                                               int K, i64 row_bytes, i8* oq, float* od,
                                               float* os, int* tickets, float* g_out,
                                               float* u_out, const Pro& pro) {
    constexpr int GROUP = 32 / (GEMV_WARPS / WPR);  // blocks per 32 rows
    __shared__ GemvShared<QT, TMAX, EPI, WPR> sh;
    __shared__ int last;
    const int n = blockIdx.x * (GEMV_WARPS / WPR) + (threadIdx.x >> 5) / WPR;
    GEMV_ROW_ALL(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, min(n, N - 1), n < N,
                 g_out, u_out, nullptr, pro);
    const int g = blockIdx.x / GROUP;
    if (!last_block<(EPI & EPI_ONE_FENCE) != 0>(&tickets[g], GROUP, last)) return;
    const int nb = N / 32, lane = threadIdx.x & 31;
    for (int t = threadIdx.x >> 5; t < T; t += GEMV_WARPS) {
        const float v = __ldcg(y + (i64)t * N + g * 32 + lane);  // at L2: other blocks wrote it
        quantize_block(v, oq + (i64)t * N + g * 32, od + (i64)t * nb + g, os + (i64)t * nb + g);
    }
    if (threadIdx.x == 0) tickets[g] = 0;
}

template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_q8(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
          int T, int N, int K, i64 row_bytes, i8* oq, float* od, float* os, int* tickets,
          float* g_out, float* u_out) {
    gemv_q_q8_body<QT, TMAX, EPI, WPR>(y, x, w, w2, bias, res, T, N, K, row_bytes, oq, od, os,
                                       tickets, g_out, u_out, NoPrologue());
}

// gemv_q_q8 of the norm it makes first (NormIn: gemv_q_normed's)
template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_q8_normed(float* y, NormIn in, const u8* w, const u8* w2, const float* bias,
                 const float* res, int T, int N, int K, i64 row_bytes, i8* oq, float* od,
                 float* os, int* tickets, float* g_out, float* u_out) {
    NORMED_X;
    gemv_q_q8_body<QT, TMAX, EPI, WPR>(y, x, w, w2, bias, res, T, N, K, row_bytes, oq, od, os,
                                       tickets, g_out, u_out, pro);
}

// One token's gemv_q_q8 of rows of one round each (S <= 32 sub-blocks), a 32-row group a
// block, or a cluster of C blocks of 32 / C rows each (gemv_q_q8_split): the group's outputs are
// quantized once they are in, with no ticket (gemv_q_q8's last block of a group fences, takes an
// atomic and reloads the group at L2 first). Warp w of the block's WARPS takes its rows w, w +
// WARPS, ...: all its rows' weights are asked for before PDL's wait (PER 16-byte loads a lane)
// and copied to shared memory at once (COPY words a row), so the rows' leaves, butterflies and
// epilogues interleave. A row's leaves and butterfly are gemv_q's (one round: lane l holds leaf
// l), its Q8A block quantize_block's: the same bits. One block quantizes its group from shared
// memory after its barrier; a cluster's last block from y at L2, after the cluster's barrier
// (its other blocks arrive with their rows written, and leave).
template <int QT, int EPI, int RPW, int PER, int COPY, int C>
__device__ __forceinline__ void gemv_q_q8_group_body(float* y, const Q8& x, const u8* w,
                                                     const u8* w2, const float* bias,
                                                     const float* res, int N, int K,
                                                     i64 row_bytes, i8* oq, float* od, float* os,
                                                     float* g_out, float* u_out) {
    constexpr int L = Layout<QT>::L, ROWS = 32 / C, WARPS = ROWS / RPW;
    constexpr int NM = (EPI & EPI_GATED) ? 2 : 1;
    static_assert(PER * 32 >= COPY, "a row's copy larger than its loads");
    static_assert(32 % (C * RPW) == 0, "rows a warp that do not divide the block's rows");
    __shared__ int4 copies[WARPS][RPW * NM][COPY];
    __shared__ float group[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = blockIdx.x / C, first = g * 32 + blockIdx.x % C * ROWS;
    const int S = K / L, width = next_pow2(S);
    const u8* mats[2] = {w, w2};
    Stage<QT, PER> stage[RPW * NM];
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
        const i64 n = first + warp + j * WARPS;
#pragma unroll
        for (int m = 0; m < NM; ++m) stage[j * NM + m].load(mats[m] + n * row_bytes, 0, S);
    }  // (weights: no kernel writes them)
    pdl_begin();
    const bool leaf = lane < S;
    int xw[8];
    float dx = 0.0f, sx = 0.0f;
    if (leaf) {
        load_x<L>(x, 0, K, lane, xw);
        dx = x.d[lane * L / 32];
        sx = x.s[lane * L / 32];
    }
#pragma unroll
    for (int c = 0; c < RPW * NM; ++c) {
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int k = j * 32 + lane;
            if (k < COPY) copies[warp][c][k] = stage[c].v[j];
        }
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
        const int n = first + warp + j * WARPS;
        float v[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            const int c = j * NM + m;
            float term = 0.0f;  // padding leaves: +0.0
            if (leaf) {
                int wq[8];
                float a = 0.0f, mn = 0.0f;
                load_sub<QT>(reinterpret_cast<const u8*>(copies[warp][c]) + stage[c].offset, lane,
                             wq, a, mn);
                term = sub_term<QT>(a, mn, dx, sx, dot_words<L / 4>(wq, xw));
            }
            v[m] = warp_tree(term, width);
        }
        if (lane == 0) {
            const float out = epilogue<EPI>(v[0], v[NM - 1], bias, res, 0, n, N);
            y[n] = out;
            if (C == 1) group[n - g * 32] = out;
            if (NM == 2 && g_out != nullptr) {
                g_out[n] = v[0];
                u_out[n] = v[NM - 1];
            }
        }
    }
    if (C == 1) {
        __syncthreads();  // the group's outputs, left by each row's lane 0
        if (warp == 0) quantize_block(group[lane], oq + g * 32, od + g, os + g);
        return;
    }
    cluster_arrive_release();  // (y's rows, written by each row's lane 0)
    if (blockIdx.x % C != C - 1 || warp != 0) return;
    cluster_wait_acquire();
    quantize_block(__ldcg(y + g * 32 + lane), oq + g * 32, od + g, os + g);  // (at L2)
}

template <int QT, int EPI, int RPW, int PER, int COPY>
__global__ void __launch_bounds__(32 * 32 / RPW)
gemv_q_q8_group(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
                int T, int N, int K, i64 row_bytes, i8* oq, float* od, float* os,
                float* g_out, float* u_out) {
    gemv_q_q8_group_body<QT, EPI, RPW, PER, COPY, 1>(y, x, w, w2, bias, res, N, K, row_bytes, oq,
                                                     od, os, g_out, u_out);
}

// The same, a group a cluster of C blocks (sm_90: the lowering's GROUP_Q8_SPLIT), so that the
// groups' work spreads over more multiprocessors, and more evenly, than a block a group does
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
template <int QT, int EPI, int RPW, int PER, int COPY, int C>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(32 * 32 / (RPW * C))
gemv_q_q8_split(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
                int T, int N, int K, i64 row_bytes, i8* oq, float* od, float* os,
                float* g_out, float* u_out) {
    gemv_q_q8_group_body<QT, EPI, RPW, PER, COPY, C>(y, x, w, w2, bias, res, N, K, row_bytes, oq,
                                                     od, os, g_out, u_out);
}
#endif

// The same, and the norm that reads the product's output after it (norm.cuh's job: RMS_NORM
// [MUL], its QUANTIZE, and the ADD and the norm of the sum that may follow, Gemma 3's): the
// last block to finish (an atomic ticket) norms the T rows, so the norm takes no launch of its
// own. Dynamic shared memory: N floats when the job quantizes. ``ticket`` (one int, zero) is
// reset by that block, ready for the next launch that shares it or a replay.
template <int QT, int TMAX, int EPI, int WPR>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_norm(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
            int T, int N, int K, i64 row_bytes, NormJob job, int* ticket) {
    __shared__ GemvShared<QT, TMAX, EPI, WPR> sh;
    __shared__ float tmp[33];
    __shared__ int last;
    extern __shared__ float srow[];
    const int n = blockIdx.x * (GEMV_WARPS / WPR) + (threadIdx.x >> 5) / WPR;
    GEMV_ROW(QT, TMAX, EPI, WPR, y, w, w2, bias, res, N, row_bytes, min(n, N - 1), n < N);
    if (!last_block(ticket, gridDim.x, last)) return;
    for (int t = 0; t < T; ++t) norm_job(job, N, t, srow, tmp);  // (x: y, read at L2)
    if (threadIdx.x == 0) *ticket = 0;
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

// ROPE (1: adjacent pairs, 2: neox) of segments 0 and 1 and the KV_WRITE of their rotated rows
// and of segment 2's rows, in the same launch (q, k and v of a layer's decode step). Each block
// computes both rows of each rotated pair (rope_row orders a segment's rows so), then rotates
// them as rows.cu's rope_pair does: same operations, same bits. A null ``out`` or ``cache``:
// that segment has none. With HEAD_NORM (4, added to the mode) each head of segments 0 and 1
// is first normed (RMS_NORM_MUL over its head_dim values: Gemma 3's q and k norms), so the
// rows keep their order and the last of a head's blocks to finish (an atomic ticket a head)
// norms the head's rows, then rotates them (head_norm_rope). ROPE_EARLY (8, added to the mode;
// the lowering's EARLY_LOADS, where the positions are a step's input and the launch is not its
// split's first): each thread's first rotation's position, cos and sin are loaded before PDL's
// wait, while the kernel before still runs, not after the product (rope_early).
enum { HEAD_NORM = 4, ROPE_EARLY = 8 };
struct RopeSegs {
    float* out[2];    // the ROPE values of segments 0 and 1, (T, N)
    float* cache[3];  // each segment's cache (its rows, rotated for 0 and 1, go to row positions[t])
    const int* positions;
    const float* cos_t;
    const float* sin_t;
    float* normed[2];        // HEAD_NORM: the norms' values, (T, N) (the heads' rows in order)
    const float* norm_w[2];  // ... their weights (head_dim)
    int* tickets;            // ... a ticket a head, segment 0's heads then 1's, zero between
    float eps[2];
    int heads0;  // ... segment 0's heads
    int head_dim, n_rot;
};

// the row a segment's slot-th row computes with ROPE: the two rows of each pair next to each
// other (neox pairs i and i + n_rot/2 of a head; adjacent pairs already are), the copied
// dimensions n_rot.. where they are
template <int ROPE>
__device__ __forceinline__ int rope_row(int slot, const RopeSegs& r) {
    const int h = slot / r.head_dim, o = slot % r.head_dim;
    if (ROPE != 2 || o >= r.n_rot) return slot;
    return h * r.head_dim + (o >> 1) + (o & 1) * (r.n_rot >> 1);
}

// rope_kv_rows' loads for this thread's first (token, slot), k = threadIdx.x, that no kernel
// of the step writes: the token's position and, for the first slot of a rotated pair, its cos
// and sin (p < 0: this thread has no such slot, or they were not loaded early)
struct RopeEarly {
    i64 p;
    float c, s;
};
__device__ __forceinline__ RopeEarly rope_early(const RopeSegs& r, int N, int si, int first,
                                                int rows, int T) {
    RopeEarly e{-1, 0.0f, 0.0f};
    const int k = threadIdx.x, slot = first + k % rows, o = slot % r.head_dim;
    if (k >= T * rows || slot >= N) return e;
    e.p = __ldcg(r.positions + k / rows);  // (at L2, as every load made before the wait)
    if (si < 2 && o < r.n_rot && !(o & 1)) {
        const i64 at = e.p * (r.n_rot >> 1) + (o >> 1);
        e.c = __ldcg(r.cos_t + at);
        e.s = __ldcg(r.sin_t + at);
    }
    return e;
}

// after a block's rows of segment ``si`` are written (slots first .. first + rows - 1): the
// rotation of its pairs and the cache rows (``early``: rope_early's, or none)
template <int ROPE>
__device__ void rope_kv_rows(const RopeSegs& r, const GemvSeg& sg, int si, int first, int rows,
                             int T, RopeEarly early = RopeEarly{-1, 0.0f, 0.0f}) {
    const int D = r.head_dim, half = r.n_rot >> 1, N = sg.N;
    // (selected, not indexed: a run-time index would put the struct in local memory)
    float* cache = si == 0 ? r.cache[0] : si == 1 ? r.cache[1] : r.cache[2];
    float* rotated = si == 0 ? r.out[0] : r.out[1];
    for (int k = threadIdx.x; k < T * rows; k += blockDim.x) {
        const int t = k / rows, slot = first + k % rows;
        if (slot >= N) continue;
        const bool pre = k == (int)threadIdx.x && early.p >= 0;
        const i64 p = pre ? early.p : r.positions[t];
        const float* yr = sg.y + (i64)t * N;
        const int o = slot % D;
        if (si == 2 || o >= r.n_rot) {  // v, or a copied dimension
            const float v = yr[slot];
            if (si < 2) rotated[(i64)t * N + slot] = v;
            if (cache != nullptr) cache[p * N + slot] = v;
            continue;
        }
        if (o & 1) continue;  // a pair is rotated by the thread of its first slot
        const int h = slot / D, i = o >> 1;
        const int i0 = h * D + (ROPE == 2 ? i : 2 * i), i1 = h * D + (ROPE == 2 ? i + half : 2 * i + 1);
        const float c = pre ? early.c : r.cos_t[p * half + i];
        const float s = pre ? early.s : r.sin_t[p * half + i];
        const float x0 = yr[i0], x1 = yr[i1];
        const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
        float* out = rotated + (i64)t * N;
        out[i0] = y0;
        out[i1] = y1;
        if (cache != nullptr) {
            cache[p * N + i0] = y0;
            cache[p * N + i1] = y1;
        }
    }
}

// HEAD_NORM, after a block's rows of segment si < 2 (first .. first + rows - 1, in one head):
// the last of the head's blocks norms the head's rows (norm.cuh's norm_row, the head's D values
// a row) for every token into ``normed``, then rotates them and writes the cache rows
// (rope_kv_rows over the normed head), and resets the head's ticket.
template <int MODE>
__device__ void head_norm_rope(const RopeSegs& r, const GemvSeg& sg, int si, int first, int rows,
                               int T) {
    __shared__ float tmp[33];
    __shared__ int last;
    const int D = r.head_dim, h = first / D;
    int* ticket = r.tickets + (si == 0 ? 0 : r.heads0) + h;
    if (!last_block(ticket, D / rows, last)) return;
    float* normed = si == 0 ? r.normed[0] : r.normed[1];
    const float* w = si == 0 ? r.norm_w[0] : r.norm_w[1];
    const float eps = si == 0 ? r.eps[0] : r.eps[1];
    for (int t = 0; t < T; ++t) {  // (x: the head's rows of y, read at L2)
        const i64 at = (i64)t * sg.N + h * D;
        norm_row(normed + at, nullptr, nullptr, nullptr, nullptr, sg.y + at, w, nullptr, eps, D,
                 0, nullptr, tmp);
    }
    __syncthreads();  // the normed rows: written by the block's threads, read across them
    GemvSeg ns = sg;
    ns.y = normed;
    rope_kv_rows<MODE>(r, ns, si, h * D, D, T);
    if (threadIdx.x == 0) *ticket = 0;
}

template <int QT, int QT2, int TMAX, int EPI, int WPR, int ROPE, typename Pro>
__device__ __forceinline__ void gemv_q_multi_body(const GemvSegs& segs, const Q8& x, int T, int K,
                                                  const RopeSegs& rope, const Pro& pro) {
    constexpr int ROWS = GEMV_WARPS / WPR;  // rows of a block
    constexpr int MODE = ROPE & 3;          // (HEAD_NORM: rows in order, a head's blocks)
    static_assert(!MODE || (ROPE & HEAD_NORM) || ROWS % 2 == 0,
                  "a block computes both rows of a rotated pair");
    __shared__ union {
        GemvShared<QT, TMAX, EPI, WPR> a;
        GemvShared<QT2, TMAX, EPI, WPR> b;
    } shu;
    int blk = blockIdx.x, si = 0;
    GemvSeg sg = segs.s0;
    if (blk >= segs.s0.blocks) {
        blk -= segs.s0.blocks;
        sg = segs.s1;
        si = 1;
        if (blk >= segs.s1.blocks) {
            blk -= segs.s1.blocks;
            sg = segs.s2;
            si = 2;
        }
    }
    const int slot = blk * ROWS + (threadIdx.x >> 5) / WPR;
    const int n = MODE && !(ROPE & HEAD_NORM) && si < 2 ? rope_row<MODE>(slot, rope) : slot;
    const int row = min(n, sg.N - 1);
    constexpr bool EARLY = MODE && (ROPE & ROPE_EARLY) && !(ROPE & HEAD_NORM);
    const RopeEarly early = EARLY ? rope_early(rope, sg.N, si, blk * ROWS, ROWS, T)
                                  : RopeEarly{-1, 0.0f, 0.0f};  // (before the product's wait)
    if (QT2 != QT && si == 2) {
        auto& sh = shu.b;
        GEMV_ROW_ALL(QT2, TMAX, EPI, WPR, sg.y, sg.w, nullptr, sg.bias, nullptr, sg.N,
                     sg.row_bytes, row, slot < sg.N, nullptr, nullptr, nullptr, pro);
    } else {
        auto& sh = shu.a;
        GEMV_ROW_ALL(QT, TMAX, EPI, WPR, sg.y, sg.w, nullptr, sg.bias, nullptr, sg.N,
                     sg.row_bytes, row, slot < sg.N, nullptr, nullptr, nullptr, pro);
    }
    if (!MODE) return;
    if ((ROPE & HEAD_NORM) && si < 2) {
        head_norm_rope<MODE>(rope, sg, si, blk * ROWS, ROWS, T);
        return;
    }
    __syncthreads();  // the block's rows of y, written by each row's lane 0
    rope_kv_rows<MODE>(rope, sg, si, blk * ROWS, ROWS, T, early);
}

template <int QT, int QT2, int TMAX, int EPI, int WPR, int ROPE>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_multi(GemvSegs segs, Q8 x, int T, int K, RopeSegs rope) {
    gemv_q_multi_body<QT, QT2, TMAX, EPI, WPR, ROPE>(segs, x, T, K, rope, NoPrologue());
}

// gemv_q_multi of the norm it makes first (NormIn: gemv_q_normed's)
template <int QT, int QT2, int TMAX, int EPI, int WPR, int ROPE>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_q_multi_normed(GemvSegs segs, NormIn in, int T, int K, RopeSegs rope) {
    NORMED_X;
    gemv_q_multi_body<QT, QT2, TMAX, EPI, WPR, ROPE>(segs, x, T, K, rope, pro);
}

// float weights: K leaves, x not quantized
#define GEMV_F_MAXL 12  // runs of up to 2048 elements per lane: K up to 65536

template <int QT, int TMAX, int EPI>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_f(float* y, const float* x, const u8* w, const u8* w2, const float* bias, const float* res,
       int T, int N, int K, i64 row_bytes) {
    pdl_begin();
    constexpr bool GATED = (EPI & EPI_GATED) != 0;
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
    pdl_begin();
    constexpr int L = Layout<QT>::L;
    constexpr int WPS = L / 4;                      // words per sub-block
    constexpr bool GATED = (EPI & EPI_GATED) != 0;
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

// ---- gemm on tensor cores ----------------------------------------------------------------------

// The same products, the integer dot product of each sub-block on the tensor cores: one
// mma.m16n8k32 (m16n8k16 for Q6_K's 16-element sub-blocks) of int8 quants gives the exact isum
// of one sub-block for a tile of 16 rows x 8 tokens (integer sums: exact in any order; the
// accumulator starts at 0 for every sub-block). The terms and the TREE are gemm_q's.
//
// K streams through in stages of 256 elements (one Q4_K or Q6_K super-block, eight blocks of the
// others): SUBS sub-blocks, an aligned subtree of the TREE, summed pairwise in registers and
// pushed whole at level LOG. The last stage of a row that ends inside one is padded with +0.0
// terms (zero quants, scales and activation blocks), which is the TREE's own padding (its zero
// leaves pair up to +0.0 subtrees); rows need W = next_pow2(S) >= SUBS (lowering sends shorter
// ones to gemm_q). A stage's weight bytes are copied to shared memory with 16-byte loads, issued
// a stage ahead, then unpacked to int8 words (load_sub) in the order the fragments read them:
// lane c of a quad reads the words it needs for JG sub-blocks with one 16-byte load.
//
// A block of BT / 4 warps, 2 x BT / 8 warps of 16 rows x 8 tokens each: 32 rows x BT tokens
// (gated: of both matrices). BT = 32 (8 warps) or 64 (16 warps: a stage's weights unpacked
// once for twice the tokens).
#define MMA_WSTRIDE 80  // words per row of unpacked quants: 64, and 16 so that rows g and g+1
                        // of a 16-byte load's eight lanes fall in different banks

template <int QT, int EPI, int BT_>
struct MmaGeom {
    static_assert(BT_ == 32 || BT_ == 64, "tiles of 32 or 64 tokens");
    enum {
        THREADS = 8 * BT_,
        L = Layout<QT>::L,
        SUBS = 256 / L,           // sub-blocks a stage
        LOG = SUBS == 8 ? 3 : 4,  // their subtree's level
        WPS = L / 4,              // words per sub-block
        JG = L == 32 ? 2 : 4,     // sub-blocks whose fragment words a lane loads at once
        NMAT = (EPI & EPI_GATED) ? 2 : 1,
        BN = 32,
        BT = BT_,
        SBYTES = 256 / Layout<QT>::BE * Layout<QT>::BB,  // a stage of one row
        RAW = (SBYTES + 15 + 15) / 16 * 16,              // its copy from an aligned start
        RV = RAW / 16,
        RAW_PER = (NMAT * BN * RV + THREADS - 1) / THREADS,  // 16-byte loads a thread
        X_PER = BT * 16 / THREADS,
        AM = SUBS + 2,  // (a, m) pairs per row: 16-byte aligned rows, spread over the banks
        DS = 8 + 2,     // (d, s) pairs per token
    };
    // where word k of sub-block j of a stage lies in its row: the words lane c of a quad
    // reads for sub-blocks j .. j + JG - 1 (k = c, and c + 4 when L = 32) are 16 contiguous bytes
    static __device__ __forceinline__ int pos(int j, int k) {
        return (j / JG) * 16 + (k & 3) * 4 + (j % JG) * (4 / JG) + (k >> 2);
    }
};

template <int QT, int EPI, int BT>
struct MmaShared {
    typedef MmaGeom<QT, EPI, BT> G;
    int4 raw[G::NMAT][G::BN][G::RV];
    int wq[G::NMAT][G::BN][MMA_WSTRIDE];
    float2 wam[G::NMAT][G::BN][G::AM];  // (a, m) of each sub-block
    int xq[G::BT][MMA_WSTRIDE];
    float2 xds[G::BT][G::DS];  // (d, s) of each activation block
};

template <bool B>
struct Flag {  // a compile-time bool for a generic lambda's argument
    static constexpr bool value = B;
};

// (PARITY_EMULATOR: the CPU emulator of the tests, tests/cuda_emulator, has its own)
__device__ __forceinline__ void mma_s8_k32(int (&c)[4], int a0, int a1, int a2, int a3, int b0,
                                           int b1) {
#ifdef PARITY_EMULATOR
    emu::mma_s8_k32(c, a0, a1, a2, a3, b0, b1);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
#endif
}

__device__ __forceinline__ void mma_s8_k16(int (&c)[4], int a0, int a1, int b0) {
#ifdef PARITY_EMULATOR
    emu::mma_s8_k16(c, a0, a1, b0);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%7,%7,%7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
#endif
}

__device__ __forceinline__ int word(const int4& v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// The TREE of each output above level LOG, as gemm_q's binary counter, in shared memory after
// MmaShared (one push a stage: no registers held for it): level l of output o of thread tid at
// [((l - LOG) * NOUT + o) * THREADS + tid], levels LOG .. log2(W). ``st`` points at level
// 0 of one output (below the array: levels under LOG are never touched); ``stride``: a level's.
__device__ __forceinline__ void tree_push_at(float* st, int stride, int count, float v, int level) {
    for (int l = level;; ++l) {
        float* at = st + l * stride;
        if ((count >> l) & 1) {
            v = __fadd_rn(*at, v);
        } else {
            *at = v;
            return;
        }
    }
}

__device__ __forceinline__ float tree_finish_at(float* st, int stride, int count, int width) {
    while (count < width) {  // (count is a multiple of 2^LOG, so j >= LOG)
        int j = __ffs(count) - 1;  // as tree_finish
        if (count == 0) j = 31 - __clz(width);
        tree_push_at(st, stride, count >> j << j, 0.0f, j);
        count += 1 << j;
    }
    return st[(31 - __clz(width)) * stride];
}

// What a gemm_mma launch may write besides y (null: not): a gated product's two products (the
// gate and up nodes of the GLU it computes), and y quantized (the Q8A x of the next product:
// quants, and each 32-block's d and s; N a multiple of 32)
struct MmaMore {
    float* gate;
    float* up;
    i8* q;
    float* d;
    float* s;
    const int* flagged;  // given: only the tiles with a token flagged (rows.cu's q8_to_f32)
};

// The tile of rows [32 bx, 32 bx + 32) and tokens [BT by, BT by + BT) of a product: gemm_mma's
// block, and each block of gemm_mma_multi's
template <int QT, int EPI, int BT>
__device__ __forceinline__ void gemm_mma_tile(int bx, int by, float* y, Q8 x, const u8* w,
                                              const u8* w2, const float* bias, const float* res,
                                              int T, int N, int K, i64 row_bytes,
                                              const MmaMore& more) {
    typedef MmaGeom<QT, EPI, BT> G;
    constexpr int THREADS = G::THREADS;
    extern __shared__ int4 smem_raw[];
    static_assert(sizeof(MmaShared<QT, EPI, BT>) >= BT * 33 * 4, "the quantized epilogue's rows");
    MmaShared<QT, EPI, BT>& sh = *reinterpret_cast<MmaShared<QT, EPI, BT>*>(smem_raw);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int n0 = bx * G::BN, t0 = by * G::BT;
    const int S = K / G::L, W = next_pow2(S), nbk = K / 32;
    const int stages = (S + G::SUBS - 1) / G::SUBS;
    const int wr = (warp & 1) * 16, wt = (warp >> 1) * 8;  // this warp's rows and tokens

    int4 raw[G::RAW_PER], xv[G::X_PER];
    float2 xds = make_float2(0.0f, 0.0f);
    // the global loads of stage i: weight bytes from the aligned address at or below the
    // stage's first byte of each row (the upload's 16 bytes of padding keep the last load
    // inside the buffer), the activation quants and (d, s)
    auto fetch = [&](int i) {
#pragma unroll
        for (int u = 0; u < G::RAW_PER; ++u) {
            const int v = tid + u * THREADS;
            const int mat = v / (G::BN * G::RV), r = (v / G::RV) % G::BN, k = v % G::RV;
            const int n = n0 + r;
            if (mat < G::NMAT && n < N) {
                const u8* first = (mat ? w2 : w) + (i64)n * row_bytes + (i64)i * G::SBYTES;
                const int4* base = reinterpret_cast<const int4*>(
                    reinterpret_cast<size_t>(first) & ~(size_t)15);
                const int bytes = (int)min((i64)G::SBYTES, row_bytes - (i64)i * G::SBYTES);
                const int offset = (int)(first - reinterpret_cast<const u8*>(base));
                if (k * 16 < offset + bytes) raw[u] = __ldg(base + k);
            }
        }
#pragma unroll
        for (int u = 0; u < G::X_PER; ++u) {
            const int v = tid + u * THREADS, tt = v / 16, k = v % 16;
            const int t = t0 + tt;
            xv[u] = make_int4(0, 0, 0, 0);
            if (t < T && i * 256 + k * 16 < K)
                xv[u] = *reinterpret_cast<const int4*>(x.q + (i64)t * K + i * 256 + k * 16);
        }
        if (tid < G::BT * 8) {
            const int tt = tid / 8, b = i * 8 + tid % 8, t = t0 + tt;
            xds = t < T && b < nbk ? make_float2(x.d[(i64)t * nbk + b], x.s[(i64)t * nbk + b])
                                   : make_float2(0.0f, 0.0f);
        }
    };

    constexpr int LEVEL = G::NMAT * 4 * THREADS;  // floats of one level of the counters
    float* tree = reinterpret_cast<float*>(&sh + 1) - G::LOG * LEVEL + tid;
    if (tid == 0) {  // the launch must give the counters' shared memory (lowering.py sizes it)
        const u32 need = sizeof(MmaShared<QT, EPI, BT>) + (31 - __clz(W) - G::LOG + 1) * LEVEL * 4;
        if (dynamic_smem_bytes() < need) __trap();
    }
    fetch(0);
    for (int i = 0; i < stages; ++i) {
#pragma unroll
        for (int u = 0; u < G::RAW_PER; ++u) {
            const int v = tid + u * THREADS;
            if (v < G::NMAT * G::BN * G::RV) (&sh.raw[0][0][0])[v] = raw[u];
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < G::X_PER; ++u) {  // words 4k .. 4k+3 of the token's stage
            const int v = tid + u * THREADS, tt = v / 16, k = v % 16;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int wd = 4 * k + e;
                sh.xq[tt][G::pos(wd / G::WPS, wd % G::WPS)] = word(xv[u], e);
            }
        }
        if (tid < G::BT * 8) sh.xds[tid / 8][tid % 8] = xds;
        // the next stage's loads (raw, xv and xds are free again): in flight over the unpacking
        // as well as the products
        if (i + 1 < stages) fetch(i + 1);
        // unpack: one (matrix, row, sub-block) at a time
        for (int v = tid; v < G::NMAT * G::BN * G::SUBS; v += THREADS) {
            const int mat = v / (G::BN * G::SUBS), r = (v / G::SUBS) % G::BN, j = v % G::SUBS;
            const int n = n0 + r, s = i * G::SUBS + j;
            int q[8];
            float a = 0.0f, m = 0.0f;
            if (n < N && s < S) {
                const size_t first = reinterpret_cast<size_t>(
                    (mat ? w2 : w) + (i64)n * row_bytes + (i64)i * G::SBYTES);
                const u8* copy = reinterpret_cast<const u8*>(&sh.raw[mat][r][0]) + (first & 15);
                load_sub<QT>(copy, j, q, a, m);
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) q[k] = 0;
            }
#pragma unroll
            for (int k = 0; k < G::WPS; ++k) sh.wq[mat][r][G::pos(j, k)] = q[k];
            sh.wam[mat][r][j] = make_float2(a, m);
        }
        __syncthreads();
        // this warp's tile, JG sub-blocks at a time, the stage's SUBS terms as a subtree. The
        // last stage of a row that ends inside it (``last``: a Flag<true>) pushes its padding,
        // the +0.0 terms of zero quants, scales and activation blocks, without the products;
        // the other stages' code is not given the test
        float part[G::NMAT][4][G::LOG + 1];
        auto terms = [&](auto last) {
            const int tok = wt + 2 * c;  // this lane's first token of the tile
#pragma unroll
            for (int j0 = 0; j0 < G::SUBS; j0 += G::JG) {
                if (decltype(last)::value && i * G::SUBS + j0 >= S) {  // padding: see above
#pragma unroll
                    for (int jj = 0; jj < G::JG; ++jj) {
#pragma unroll
                        for (int mat = 0; mat < G::NMAT; ++mat) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) tree_push<G::LOG + 1>(part[mat][e], j0 + jj, 0.0f);
                        }
                    }
                    continue;
                }
                const int4 xb = *reinterpret_cast<const int4*>(&sh.xq[wt + g][(j0 / G::JG) * 16 + 4 * c]);
                // (d, s) of the blocks of sub-blocks j0 .. j0+JG-1, for tokens tok and tok + 1
                const int b0 = j0 * G::L / 32;
                const float4 d0 = *reinterpret_cast<const float4*>(&sh.xds[tok][b0]);
                const float4 d1 = *reinterpret_cast<const float4*>(&sh.xds[tok + 1][b0]);
#pragma unroll
                for (int mat = 0; mat < G::NMAT; ++mat) {
                    const int4 lo = *reinterpret_cast<const int4*>(
                        &sh.wq[mat][wr + g][(j0 / G::JG) * 16 + 4 * c]);
                    const int4 hi = *reinterpret_cast<const int4*>(
                        &sh.wq[mat][wr + g + 8][(j0 / G::JG) * 16 + 4 * c]);
                    float4 am_lo[G::JG / 2], am_hi[G::JG / 2];
#pragma unroll
                    for (int h = 0; h < G::JG / 2; ++h) {
                        am_lo[h] = *reinterpret_cast<const float4*>(&sh.wam[mat][wr + g][j0 + 2 * h]);
                        am_hi[h] = *reinterpret_cast<const float4*>(&sh.wam[mat][wr + g + 8][j0 + 2 * h]);
                    }
#pragma unroll
                    for (int jj = 0; jj < G::JG; ++jj) {
                        const int j = j0 + jj;
                        int acc[4];
                        if (G::L == 32) {
                            mma_s8_k32(acc, word(lo, 2 * jj), word(hi, 2 * jj), word(lo, 2 * jj + 1),
                                       word(hi, 2 * jj + 1), word(xb, 2 * jj), word(xb, 2 * jj + 1));
                        } else {
                            mma_s8_k16(acc, word(lo, jj), word(hi, jj), word(xb, jj));
                        }
                        // (a, m) of sub-block j for rows g and g+8; (d, s) of its block for the tokens
                        const float4 al = am_lo[jj / 2], ah = am_hi[jj / 2];
                        const float a_lo = jj & 1 ? al.z : al.x, m_lo = jj & 1 ? al.w : al.y;
                        const float a_hi = jj & 1 ? ah.z : ah.x, m_hi = jj & 1 ? ah.w : ah.y;
                        const int bj = (j * G::L / 32) - b0;  // 0 or 1
                        const float dx0 = bj ? d0.z : d0.x, sx0 = bj ? d0.w : d0.y;
                        const float dx1 = bj ? d1.z : d1.x, sx1 = bj ? d1.w : d1.y;
                        // acc: (row g, tok), (g, tok+1), (g+8, tok), (g+8, tok+1)
                        tree_push<G::LOG + 1>(part[mat][0], j, sub_term<QT>(a_lo, m_lo, dx0, sx0, acc[0]));
                        tree_push<G::LOG + 1>(part[mat][1], j, sub_term<QT>(a_lo, m_lo, dx1, sx1, acc[1]));
                        tree_push<G::LOG + 1>(part[mat][2], j, sub_term<QT>(a_hi, m_hi, dx0, sx0, acc[2]));
                        tree_push<G::LOG + 1>(part[mat][3], j, sub_term<QT>(a_hi, m_hi, dx1, sx1, acc[3]));
                    }
                }
            }
        };
        if (i * G::SUBS + G::SUBS <= S) terms(Flag<false>{});
        else terms(Flag<true>{});
#pragma unroll
        for (int mat = 0; mat < G::NMAT; ++mat)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                tree_push_at(tree + (mat * 4 + e) * THREADS, LEVEL, i * G::SUBS,
                             part[mat][e][G::LOG], G::LOG);
    }
    float out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int n = n0 + wr + g + 8 * (e >> 1), t = t0 + wt + 2 * c + (e & 1);
        const float v = tree_finish_at(tree + e * THREADS, LEVEL, stages * G::SUBS, W);
        const float v2 = G::NMAT == 2 ? tree_finish_at(tree + (4 + e) * THREADS, LEVEL,
                                                        stages * G::SUBS, W)
                                      : 0.0f;
        out[e] = 0.0f;  // (a row or token past the end: no bias or residual to read)
        if (t < T && n < N) {
            out[e] = epilogue<EPI>(v, v2, bias, res, t, n, N);
            y[(i64)t * N + n] = out[e];
            if (G::NMAT == 2 && more.gate != nullptr) {
                more.gate[(i64)t * N + n] = v;
                more.up[(i64)t * N + n] = v2;
            }
        }
    }
    if (more.q == nullptr) return;
    // y quantized: the block's 32 rows are one Q8 block of each of its tokens, gathered in
    // shared memory (the stages' copies: every warp is past its last reads of them at the
    // barrier), a warp a token at a time (quantize_q8's quantize_block: the same bits)
    __syncthreads();
    float* vals = reinterpret_cast<float*>(smem_raw);  // [BT][33]
#pragma unroll
    for (int e = 0; e < 4; ++e) vals[(wt + 2 * c + (e & 1)) * 33 + wr + g + 8 * (e >> 1)] = out[e];
    __syncthreads();
    for (int tt = warp; tt < G::BT; tt += THREADS / 32) {
        const i64 t = t0 + tt, blocks = N / 32;
        if (t < T)
            quantize_block(vals[tt * 33 + lane], more.q + t * N + n0,
                           more.d + t * blocks + n0 / 32, more.s + t * blocks + n0 / 32);
    }
}

// (MINB: blocks a multiprocessor, the lowering's; BT: tokens a block)
template <int QT, int EPI, int MINB = 2, int BT = 32>
__global__ void __launch_bounds__(8 * BT, MINB)
gemm_mma(float* y, Q8 x, const u8* w, const u8* w2, const float* bias, const float* res,
         int T, int N, int K, i64 row_bytes, MmaMore more) {
    pdl_begin();
    if (more.flagged != nullptr) {  // the exact tiles of a fast product's extreme rows only
        __shared__ int any;
        if (threadIdx.x == 0) any = 0;
        __syncthreads();
        const int t = blockIdx.y * BT + threadIdx.x;
        if (threadIdx.x < BT && t < T && more.flagged[t]) any = 1;
        __syncthreads();
        if (!any) return;
    }
    gemm_mma_tile<QT, EPI, BT>(blockIdx.x, blockIdx.y, y, x, w, w2, bias, res, T, N, K,
                               row_bytes, more);
}

// Up to three products of one x by weights of one width (a prefill's q, k and v) in one
// launch, so the small ones (k and v: a few row tiles) run beside the others: gemv_q_multi's
// segments (GemvSegs), segment k's row tiles the blocks [first_k, first_k + blocks_k) of the
// grid's x. Segments 0 and 1 hold weights of type QT, segment 2 of QT2 (the dynamic shared
// memory: the larger type's).
template <int QT, int QT2, int EPI, int MINB = 2, int BT = 32>
__global__ void __launch_bounds__(8 * BT, MINB) gemm_mma_multi(GemvSegs segs, Q8 x, int T, int K) {
    pdl_begin();
    const GemvSeg &a = segs.s0, &b = segs.s1, &c = segs.s2;
    const int bx = blockIdx.x, seg = bx < a.blocks ? 0 : bx < a.blocks + b.blocks ? 1 : 2;
    const MmaMore none = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    // (fields selected one by one: an index into the argument would copy it to local memory)
#define PICK(f) (seg == 0 ? a.f : seg == 1 ? b.f : c.f)
    const int first = seg == 0 ? 0 : seg == 1 ? a.blocks : a.blocks + b.blocks;
    if (QT == QT2 || seg < 2)
        gemm_mma_tile<QT, EPI, BT>(bx - first, blockIdx.y, PICK(y), x, PICK(w), nullptr,
                                   PICK(bias), nullptr, T, PICK(N), K, PICK(row_bytes), none);
    else
        gemm_mma_tile<QT2, EPI, BT>(bx - first, blockIdx.y, c.y, x, c.w, nullptr, c.bias,
                                    nullptr, T, c.N, K, c.row_bytes, none);
#undef PICK
}
