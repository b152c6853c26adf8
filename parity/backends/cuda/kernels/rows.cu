// Row-wise and elementwise ops: ADD, MUL, SILU, SWIGLU, GELU, GEGLU, SCALE, RMS_NORM (and its
// MUL, and the Q8 activation quantization or the residual ADD that may follow it), QUANTIZE,
// ROPE, KV_WRITE, GET_ROWS, ARGMAX.
// Each is docs/numerics.md's listing; rows are independent, so a row's bits never depend on
// how many rows a launch covers.
#include "common.cuh"
#include "norm.cuh"
#include "quant.cuh"

// ---- elementwise -------------------------------------------------------------------------

enum { OP_ADD = 0, OP_MUL = 1 };

// y = a (op) b, b of a's shape or a (width,) row broadcast over the rows
template <int OP>
__global__ void binary_f32(float* y, const float* a, const float* b, i64 n, int width,
                           int b_row) {
    pdl_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        float bv = b[b_row ? i % width : i];
        y[i] = OP == OP_ADD ? __fadd_rn(a[i], bv) : __fmul_rn(a[i], bv);
    }
}

__global__ void silu_f32(float* y, const float* x, i64 n) {
    pdl_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x)
        y[i] = p_silu(x[i]);
}

// SWIGLU (ACT 0) or GEGLU (ACT 1): y = fl(act(g) * u), and its QUANTIZE when q is given (n a
// multiple of 32 and blocks of 256 threads: each warp's 32 elements are one Q8 block)
template <int ACT>
__global__ void glu_f32(float* y, i8* q, float* qd, float* qs, const float* g, const float* u,
                        i64 n) {
    pdl_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        const float v = __fmul_rn(ACT ? p_gelu(g[i]) : p_silu(g[i]), u[i]);
        y[i] = v;
        if (q != nullptr) quantize_block(v, q + (i & ~(i64)31), qd + (i >> 5), qs + (i >> 5));
    }
}

__global__ void gelu_f32(float* y, const float* x, i64 n) {
    pdl_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x)
        y[i] = p_gelu(x[i]);
}

__global__ void scale_f32(float* y, const float* x, i64 n, float c) {
    pdl_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x)
        y[i] = __fmul_rn(x[i], c);
}

// x += by: the positions a decode step keeps on the device, advanced after each run
__global__ void advance_i32(int* x, int n, int by) {
    pdl_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] += by;
}

// ---- Q8 activation quantization --------------------------------------------------------------

// x (rows, K) -> Q8A (q (rows, K), d and s (rows, K/32)); one warp per block
__global__ void quantize_q8(i8* q, float* d, float* s, const float* x, i64 n_blocks) {
    pdl_begin();
    const int warps = blockDim.x >> 5;
    for (i64 b = blockIdx.x * (i64)warps + (threadIdx.x >> 5); b < n_blocks;
         b += (i64)gridDim.x * warps) {
        quantize_block(x[b * 32 + (threadIdx.x & 31)], q + b * 32, d + b, s + b);
    }
}

// ---- RMS_NORM [MUL] [QUANTIZE] [ADD]: norm.cuh's rows, a block each --------------------------

__global__ void __launch_bounds__(NORM_THREADS) rms_norm_f32(NormRows args) {
    pdl_begin();
    extern __shared__ float srow[];  // width floats, when quantizing
    __shared__ float tmp[33];
    // this block's job (fields selected, not indexed: an index would copy the args to memory)
    const bool second = (int)blockIdx.x >= args.a.rows;
    const NormJob& ja = args.a;
    const NormJob& jb = args.b;
    const i64 row = second ? blockIdx.x - args.a.rows : blockIdx.x;
    float* sum = second ? jb.sum : ja.sum;
    norm_row(second ? jb.y : ja.y, second ? jb.q : ja.q, second ? jb.qd : ja.qd,
             second ? jb.qs : ja.qs, sum, second ? jb.x : ja.x, second ? jb.w : ja.w,
             second ? jb.res : ja.res, second ? jb.eps : ja.eps, args.width, row, srow, tmp);
    float* y2 = second ? jb.y2 : ja.y2;
    if (y2 == nullptr) return;
    __syncthreads();  // the sum's row: written by the block's threads, read across them
    norm_row(y2, second ? jb.q2 : ja.q2, second ? jb.qd2 : ja.qd2, second ? jb.qs2 : ja.qs2,
             nullptr, sum, second ? jb.w2 : ja.w2, nullptr, second ? jb.eps2 : ja.eps2,
             args.width, row, srow, tmp);
}

// A decode step's norms a slot a thread (the lowering's NORM_SLOTS): a row of ``width`` (a
// multiple of 32, at most 1,024) a block of ``width`` threads, thread i holding x[i], where
// rms_norm_f32 gives a row 1,024 threads and four barriers. The squares' TREE: a warp's
// butterfly over its 32 slots (levels 1 to 5), then each warp's own butterfly over the
// block's subtrees from shared memory (the levels above, every run of P lanes holding the P
// subtrees, so that every lane ends with the sum; the slots past the row are +0.0, and a
// subtree of them is +0.0: a sum of squares, never -0.0, plus +0.0 is itself), so one barrier
// a norm. ``parts``: 32 floats, one array a norm of the block (no barrier between them).
__device__ __forceinline__ float norm_slot(float x, const float* w, float wi, int width,
                                           float eps, float* parts) {
    const int lane = threadIdx.x & 31;
    const float sub = warp_tree(__fmul_rn(x, x), 32);
    if (lane == 0) parts[threadIdx.x >> 5] = sub;
    __syncthreads();
    const int P = next_pow2(width) >> 5, k = lane & (P - 1);  // (each P lanes: the P subtrees)
    const float ss = warp_tree(k < (int)(blockDim.x >> 5) ? parts[k] : 0.0f, P);
    float u = __fmul_rn(x, rms_scale(ss, width, eps));
    if (w != nullptr) u = __fmul_rn(u, wi);
    return u;
}

// Each warp's 32 values are a Q8 block of the row (quantize_block). EARLY: the norms' weights
// (NORM_EARLY_W) and the ADD's residual (NORM_EARLY_RES) loaded before PDL's wait, where the
// kernel before cannot be writing them (the lowering's EARLY_LOADS).
#define NORM_EARLY_W 1
#define NORM_EARLY_RES 2
template <int EARLY>
__global__ void __launch_bounds__(NORM_THREADS) rms_norm_slots(NormRows args) {
    __shared__ float parts[2][32];
    const bool second = (int)blockIdx.x >= args.a.rows;
    const NormJob j = pick_job(args, second);
    const int width = args.width, i = threadIdx.x;
    const i64 row = second ? blockIdx.x - args.a.rows : blockIdx.x;
    const i64 at = row * width + i, block = row * (width >> 5) + (i >> 5);
    float w = 1.0f, w2 = 1.0f, r = 0.0f;
    if (EARLY & NORM_EARLY_W) {
        if (j.w != nullptr) w = __ldcg(j.w + i);
        if (j.w2 != nullptr) w2 = __ldcg(j.w2 + i);
    }
    if ((EARLY & NORM_EARLY_RES) && j.sum != nullptr) r = __ldcg(j.res + at);
    pdl_begin();
    if (!(EARLY & NORM_EARLY_W)) {
        if (j.w != nullptr) w = j.w[i];
        if (j.w2 != nullptr) w2 = j.w2[i];
    }
    if (!(EARLY & NORM_EARLY_RES) && j.sum != nullptr) r = j.res[at];
    const float u = norm_slot(__ldcg(j.x + at), j.w, w, width, j.eps, parts[0]);
    if (j.y != nullptr) j.y[at] = u;
    if (j.q != nullptr) quantize_block(u, j.q + (at & ~(i64)31), j.qd + block, j.qs + block);
    if (j.sum == nullptr) return;  // (the block's whole job: no barrier follows)
    const float s = __fadd_rn(r, u);
    j.sum[at] = s;
    if (j.y2 == nullptr) return;
    const float u2 = norm_slot(s, j.w2, w2, width, j.eps2, parts[1]);
    j.y2[at] = u2;
    if (j.q2 != nullptr) quantize_block(u2, j.q2 + (at & ~(i64)31), j.qd2 + block, j.qs2 + block);
}

// A prefill's norms: a row a warp (norm.cuh's norm_job_warp, runs of R = next_pow2(width) / 32
// slots a lane), blockDim.x / 32 rows a block (the lowering's NORM_WARP_ROWS): no barrier, and
// a row narrower than rms_norm_f32's 1,024 threads (Gemma 3's heads of 256) takes a warp, not
// a block
template <int R>
__global__ void __launch_bounds__(256) rms_norm_warps(NormRows args) {
    pdl_begin();
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (i64)args.a.rows + args.b.rows) return;  // (a whole warp: no barrier follows)
    const bool second = row >= args.a.rows;
    norm_job_warp<R>(pick_job(args, second), args.width, second ? row - args.a.rows : row);
}

// ---- ROPE, KV_WRITE ----------------------------------------------------------------------------

// Up to two ROPEs of one step's rows (q and k: the same positions and tables) and one more
// KV_WRITE (v) in one launch. Rope r rotates x_r (T, heads_r * head_dim) into y_r and, when
// cache_r is given, also writes the rotated row into cache_r row positions[t] (ROPE + its
// KV_WRITE); dims n_rot.. of each head are copied. ``v`` rows (T, v_width), when given, go to
// ``v_cache`` rows positions[t]. One thread per (token, head, pair) of each rope, then one per
// v element.
struct RopeArgs {
    float* y0;
    const float* x0;
    float* cache0;
    float* y1;
    const float* x1;
    float* cache1;
    const float* v;
    float* v_cache;
    const int* positions;
    const float* cos_t;
    const float* sin_t;
    int heads0, heads1, v_width, n_tokens, head_dim, n_rot;
};

template <int NEOX>
__device__ __forceinline__ void rope_pair(const RopeArgs& a, float* y, const float* x,
                                          float* cache, int heads, i64 k) {
    const int half = a.n_rot >> 1;
    const int per_head = half + (a.head_dim - a.n_rot);  // pairs, then copied dims
    const int width = heads * a.head_dim;
    const int t = (int)(k / ((i64)heads * per_head));
    const int rem = (int)(k % ((i64)heads * per_head));
    const int h = rem / per_head, i = rem % per_head;
    const i64 base = (i64)t * width + h * a.head_dim;
    const int p = a.positions[t];
    float* crow = cache != nullptr ? cache + (i64)p * width + h * a.head_dim : nullptr;
    if (i < half) {
        const int i0 = NEOX ? i : 2 * i, i1 = NEOX ? i + half : 2 * i + 1;
        const float c = a.cos_t[(i64)p * half + i], s = a.sin_t[(i64)p * half + i];
        const float x0 = x[base + i0], x1 = x[base + i1];
        const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
        y[base + i0] = y0;
        y[base + i1] = y1;
        if (crow != nullptr) {
            crow[i0] = y0;
            crow[i1] = y1;
        }
    } else {
        const int d = a.n_rot + (i - half);
        y[base + d] = x[base + d];
        if (crow != nullptr) crow[d] = x[base + d];
    }
}

template <int NEOX>
__global__ void rope_f32(RopeArgs a) {
    pdl_begin();
    const i64 per_head = (a.n_rot >> 1) + (a.head_dim - a.n_rot);
    const i64 n0 = (i64)a.n_tokens * a.heads0 * per_head;
    const i64 n1 = (i64)a.n_tokens * a.heads1 * per_head;
    const i64 nv = a.v != nullptr ? (i64)a.n_tokens * a.v_width : 0;
    for (i64 k = blockIdx.x * (i64)blockDim.x + threadIdx.x; k < n0 + n1 + nv;
         k += (i64)gridDim.x * blockDim.x) {
        if (k < n0) {
            rope_pair<NEOX>(a, a.y0, a.x0, a.cache0, a.heads0, k);
        } else if (k < n0 + n1) {
            rope_pair<NEOX>(a, a.y1, a.x1, a.cache1, a.heads1, k - n0);
        } else {
            const i64 e = k - n0 - n1;
            const int t = (int)(e / a.v_width), i = (int)(e % a.v_width);
            a.v_cache[(i64)a.positions[t] * a.v_width + i] = a.v[e];
        }
    }
}

// cache[positions[t], :] = rows[t, :]
__global__ void kv_write_f32(float* cache, const float* rows, const int* positions, int n_tokens,
                             int width) {
    pdl_begin();
    const i64 total = (i64)n_tokens * width;
    for (i64 k = blockIdx.x * (i64)blockDim.x + threadIdx.x; k < total;
         k += (i64)gridDim.x * blockDim.x) {
        const int t = (int)(k / width), i = (int)(k % width);
        cache[(i64)positions[t] * width + i] = rows[k];
    }
}

// ---- GET_ROWS ------------------------------------------------------------------------------------

// y[t, :] = dequantize(W)[ids[t], :]; one thread per output element's sub-block element
template <int QT>
__global__ void get_rows(float* y, const u8* w, const int* ids, int n_tokens, int K,
                         i64 row_bytes) {
    pdl_begin();
    const i64 total = (i64)n_tokens * K;
    for (i64 k = blockIdx.x * (i64)blockDim.x + threadIdx.x; k < total;
         k += (i64)gridDim.x * blockDim.x) {
        const int t = (int)(k / K), e = (int)(k % K);
        y[k] = dequant_element<QT>(w + (i64)ids[t] * row_bytes, e);
    }
}

// y = dequantize(W) (rows, K), the right operand of a fast product on the tensor cores
// (lowering.FAST_GEMM): row blockIdx.y, blockDim.x * DEQ_RUN elements a block, each thread a
// run of DEQ_RUN from one sub-block, written four at a time (K a multiple of 32)
#define DEQ_RUN 8
template <int QT>
__global__ void dequant_rows(float* y, const u8* w, int K, i64 row_bytes) {
    pdl_begin();
    const int e = (blockIdx.x * blockDim.x + threadIdx.x) * DEQ_RUN;
    if (e >= K) return;
    const u8* row = w + (i64)blockIdx.y * row_bytes;
    float v[DEQ_RUN];
#pragma unroll
    for (int i = 0; i < DEQ_RUN; ++i) v[i] = dequant_element<QT>(row, e + i);
    float4* out = reinterpret_cast<float4*>(y + (i64)blockIdx.y * K + e);
#pragma unroll
    for (int i = 0; i < DEQ_RUN; i += 4) out[i / 4] = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
}

// y = q * d of a Q8A value (T, K), as floats: the left operand of a fast product on the tensor
// cores (lowering.FAST_GEMM). flags[t] = 1 where row t has a block scale that is not finite or
// above 2^40: values no model's activations reach (the conformance suite's +-1e30), a few huge
// values whose integer sums may cancel exactly where float products leave a residue (under a
// SWIGLU, a sign), so gemm_mma recomputes their tiles exactly (MmaMore.flagged). A warp a
// row's flag.
__global__ void q8_to_f32(float* y, int* flags, const i8* q, const float* d, int T, int K) {
    pdl_begin();
    const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = first; i < (i64)T * K; i += stride) y[i] = __fmul_rn((float)q[i], d[i >> 5]);
    const int blocks = K >> 5, lane = threadIdx.x & 31;
    for (i64 t = first >> 5; t < T; t += stride >> 5) {  // (blockDim.x a multiple of 32)
        int bad = 0;
        for (int b = lane; b < blocks; b += 32) bad |= !(fabsf(d[t * blocks + b]) <= 0x1p40f);
        bad = __any_sync(FULL_MASK, bad);
        if (lane == 0) flags[t] = bad;
    }
}

// ---- fast products on float16 tensor cores (lowering.FAST_GEMM_HALF) -----------------------
//
// x's Q8A values and dequantize(W) as float16 rows, each row times 2^s, s = half_shift(top)
// for a bound ``top`` on its magnitudes (kept per row: ``tops``), which puts the row below 2^15:
// no value overflows, and float16's normals reach 2^-29 of a row's largest. cuBLAS's GEMM of
// them sums in float32; unscale_f32 (and glu_unscale_f32 for gate and up) then multiplies each
// sum by 2^-(sx + sw), exactly.

// The shift putting values of magnitude at most ``top`` below 2^15: 15 - e for top = f 2^e, f
// in [0.5, 1) (frexpf's e, from the bits: a normal's biased exponent - 126, a subnormal's
// highest set bit - 148); 0 for a row of zeros, or one with a scale not finite (top inf)
__device__ __forceinline__ int half_shift(float top) {
    if (!(top > 0.0f) || !isfinite(top)) return 0;
    const u32 b = __float_as_uint(top);
    return 15 - (b >= 0x00800000u ? (int)(b >> 23) - 126 : 31 - __clz((int)b) - 148);
}

// x 2^s rounded once, as scalbnf: a product by 2^s where that is a normal float (s in
// -126 .. 127: a row's shift unless its bound is below 2^-112), scalbnf beyond (such rows, and
// the sums' two shifts together)
__device__ __forceinline__ float scale_pow2(float x, int s) {
    return s >= -126 && s <= 127 ? __fmul_rn(x, __int_as_float((127 + s) << 23)) : scalbnf(x, s);
}

// the largest of the block's threads' ``top`` (none NaN), inf where any set ``bad``, to every
// thread; one call a kernel
__device__ __forceinline__ float block_top(float top, int bad) {
    __shared__ float tops[32];
    __shared__ int bads[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL_MASK, top, off));
    bad = __any_sync(FULL_MASK, bad);
    if (lane == 0) {
        tops[warp] = top;
        bads[warp] = bad;
    }
    __syncthreads();
    top = 0.0f;
    bad = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        top = fmaxf(top, tops[w]);
        bad |= bads[w];
    }
    return bad ? __int_as_float(0x7f800000) : top;
}

// eight float values as float16, in one 16-byte store
__device__ __forceinline__ void store_f16x8(u16* y, const float (&v)[8]) {
    uint4 o;
    o.x = (u32)f32_to_f16(v[0]) | ((u32)f32_to_f16(v[1]) << 16);
    o.y = (u32)f32_to_f16(v[2]) | ((u32)f32_to_f16(v[3]) << 16);
    o.z = (u32)f32_to_f16(v[4]) | ((u32)f32_to_f16(v[5]) << 16);
    o.w = (u32)f32_to_f16(v[6]) | ((u32)f32_to_f16(v[7]) << 16);
    *reinterpret_cast<uint4*>(y) = o;
}

// x (T, K) as float16: row t (block t) is fl(q d) 2^half_shift(tops[t]), tops[t] = 128 max|d|,
// or inf where a scale is above 2^40 or not finite: then flags[t] = 1, as q8_to_f32's (such a
// row's tiles are gemm_mma's). Eight values a thread at a time.
__global__ void __launch_bounds__(256)
q8_to_f16(u16* y, float* tops, int* flags, const i8* q, const float* d, int K) {
    pdl_begin();
    const int t = blockIdx.x, blocks = K >> 5;
    const float* dt = d + (i64)t * blocks;
    float top = 0.0f;
    int bad = 0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
        const float a = fabsf(dt[b]);
        bad |= !(a <= 0x1p40f);
        top = fmaxf(top, a);
    }
    top = __fmul_rn(block_top(top, bad), 128.0f);
    const int s = half_shift(top);
    if (threadIdx.x == 0) {
        tops[t] = top;
        flags[t] = !isfinite(top);
    }
    const i8* qt = q + (i64)t * K;
    for (int e = threadIdx.x * 8; e < K; e += blockDim.x * 8) {
        const uint2 raw = *reinterpret_cast<const uint2*>(qt + e);
        const float de = dt[e >> 5];
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const i8 qj = (i8)(((j < 4 ? raw.x : raw.y) >> (8 * (j & 3))) & 0xffu);
            v[j] = scale_pow2(__fmul_rn((float)qj, de), s);
        }
        store_f16x8(y + (i64)t * K + e, v);
    }
}

// a bound on sub-block s's values: 128 |a| + |m|, or 0 where that is not finite
template <int QT>
__device__ __forceinline__ float sub_top(const u8* row, int s) {
    int q[8];  // (unused: only the scales are read)
    float a, m;
    load_sub<QT>(row, s, q, a, m);
    const float b = __fadd_rn(__fmul_rn(fabsf(a), 128.0f), fabsf(m));
    return isfinite(b) ? b : 0.0f;
}

// dequantize(W) (rows, K) as float16: row r times 2^half_shift(tops[r]), tops[r] the largest
// 128 |a| + |m| of its sub-blocks whose scales are finite (a sub-block's that are not gives inf
// or NaN values, as dequantize does, and leaves the others' shift alone). A sub-block of L
// elements a thread: thread i takes sub-block i % (K / L) of row i / (K / L), its quants in a
// few word loads (load_sub) and its values as dequant_element's, fl(a q), fl(fl(a q) + m) for
// Q4_1 and fl(fl(a q) - m) for Q4_K, written eight to a 16-byte store. A weight's rows do not
// change: ``tops`` (zeros at first, the weight's own) keeps each row's bound once a launch has
// found it, so later launches read one float a row; in the weight's first launch each thread
// finds its row's from all the row's scales. (The thirteenth session's form, a block a row
// and eight elements a thread one at a time, took 1.8x as long on an H100: docs/perf.md.)
template <int QT>
__global__ void __launch_bounds__(128)
dequant_subs_half(u16* y, float* tops, const u8* w, int K, i64 row_bytes, int subs) {
    pdl_begin();
    typedef Layout<QT> Lt;
    const int i = blockIdx.x * blockDim.x + threadIdx.x, per_row = K / Lt::L;
    if (i >= subs) return;
    const int r = i / per_row, s = i % per_row;
    const u8* row = w + (i64)r * row_bytes;
    int q[8];
    float a, m;
    load_sub<QT>(row, s, q, a, m);
    float top = tops[r];
    if (top == 0.0f) {  // not found yet (or a row of zeros, found again)
        for (int j = 0; j < per_row; ++j) top = fmaxf(top, sub_top<QT>(row, j));
        tops[r] = top;  // (every thread of the row: the same)
    }
    const int sh = half_shift(top);
    u16* out = y + (i64)r * K + s * Lt::L;
#pragma unroll
    for (int k = 0; k < Lt::L / 8; ++k) {  // (the quants of words 2k, 2k + 1: elements 8k ..)
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float qw = (float)(i8)((u32)q[2 * k + j / 4] >> (8 * (j & 3)));
            float x = __fmul_rn(a, qw);
            if (Lt::MIN > 0) x = __fadd_rn(x, m);
            if (Lt::MIN < 0) x = __fsub_rn(x, m);
            v[j] = scale_pow2(x, sh);
        }
        store_f16x8(out + 8 * k, v);
    }
}

// y (T, N) from a GEMM of q8_to_f16's and dequant_subs_half's rows: each float32 sum times
// 2^-(sx + sw), the shifts of x's row t and W's row n from their tops, then fl(y + b[n]) with
// a bias, fl(r + y) with a residual. Grid (N / blockDim.x, T)
__global__ void unscale_f32(float* y, const float* xtops, const float* wtops, const float* b,
                            const float* r, int width) {
    pdl_begin();
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    const i64 i = (i64)t * width + c;
    float v = scale_pow2(y[i], -(half_shift(xtops[t]) + half_shift(wtops[c])));
    if (b != nullptr) v = __fadd_rn(v, b[c]);
    if (r != nullptr) v = __fadd_rn(r[i], v);
    y[i] = v;
}

// glu_f32 after two such GEMMs, gate's sums in g and up's in u: each unscaled (W's tops: gtops,
// utops), written back where ``keep`` (the graph's values), then y = fl(act(g) u) and its
// QUANTIZE when q is given (width a multiple of 32). Grid (N / blockDim.x, T)
template <int ACT>
__global__ void glu_unscale_f32(float* y, i8* q, float* qd, float* qs, float* g, float* u,
                                const float* xtops, const float* gtops, const float* utops,
                                int width, int keep) {
    pdl_begin();
    const int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;  // (a whole warp, where q is given)
    const i64 i = (i64)t * width + c;
    const int sx = half_shift(xtops[t]);
    const float gv = scale_pow2(g[i], -(sx + half_shift(gtops[c])));
    const float uv = scale_pow2(u[i], -(sx + half_shift(utops[c])));
    if (keep) {
        g[i] = gv;
        u[i] = uv;
    }
    const float v = __fmul_rn(ACT ? p_gelu(gv) : p_silu(gv), uv);
    y[i] = v;
    if (q != nullptr) quantize_block(v, q + (i & ~(i64)31), qd + (i >> 5), qs + (i >> 5));
}

// glu_unscale_f32 four columns a thread (lowering.GLU_UNSCALE_X4; width a multiple of 32): the
// loads and stores 16 bytes wide, a Q8 block the 8 lanes of an aligned group (its max and sum
// over those 8, so the same bits as quantize_block's). Lanes past the row's end take part in
// their group's shuffles only. Grid (ceil(width / (4 blockDim.x)), T)
template <int ACT>
__global__ void glu_unscale_f32x4(float* y, i8* q, float* qd, float* qs, float* g, float* u,
                                  const float* xtops, const float* gtops, const float* utops,
                                  int width, int keep) {
    pdl_begin();
    const int t = blockIdx.y, c = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    const bool in = c < width;
    const i64 i = (i64)t * width + c;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (in) {
        const int sx = half_shift(xtops[t]);
        const float4 g4 = *reinterpret_cast<const float4*>(g + i);
        const float4 u4 = *reinterpret_cast<const float4*>(u + i);
        const float4 gt = *reinterpret_cast<const float4*>(gtops + c);
        const float4 ut = *reinterpret_cast<const float4*>(utops + c);
        const float gs[4] = {g4.x, g4.y, g4.z, g4.w}, us[4] = {u4.x, u4.y, u4.z, u4.w};
        const float gts[4] = {gt.x, gt.y, gt.z, gt.w}, uts[4] = {ut.x, ut.y, ut.z, ut.w};
        float gv[4], uv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            gv[j] = scale_pow2(gs[j], -(sx + half_shift(gts[j])));
            uv[j] = scale_pow2(us[j], -(sx + half_shift(uts[j])));
            v[j] = __fmul_rn(ACT ? p_gelu(gv[j]) : p_silu(gv[j]), uv[j]);
        }
        if (keep) {
            *reinterpret_cast<float4*>(g + i) = make_float4(gv[0], gv[1], gv[2], gv[3]);
            *reinterpret_cast<float4*>(u + i) = make_float4(uv[0], uv[1], uv[2], uv[3]);
        }
        *reinterpret_cast<float4*>(y + i) = make_float4(v[0], v[1], v[2], v[3]);
    }
    if (q == nullptr) return;  // (for the whole launch)
    float amax = max_nan(max_nan(fabsf(v[0]), fabsf(v[1])), max_nan(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) amax = max_nan(amax, __shfl_xor_sync(FULL_MASK, amax, off));
    const float d = __fdiv_rn(amax, 127.0f);
    int qi[4], sum = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) sum += qi[j] = quant_value(v[j], d);
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off);
    if (!in) return;
    *reinterpret_cast<u32*>(q + i) =
        (u32)(u8)qi[0] | ((u32)(u8)qi[1] << 8) | ((u32)(u8)qi[2] << 16) | ((u32)(u8)qi[3] << 24);
    if ((threadIdx.x & 7) == 0) {
        qd[i >> 5] = d;
        qs[i >> 5] = __fmul_rn(d, (float)sum);
    }
}

// ---- ARGMAX ----------------------------------------------------------------------------------------

// grid (slices, rows): block (s, r) takes ARGMAX_SLICE elements of row r, all its loads issued at
// once, and writes its key; the row's last block to finish (an atomic ticket) takes the max of
// the slices' keys. ``keys`` (rows x slices) and ``tickets`` (rows, zero) are scratch; the
// ticket is reset for the next launch.
#define ARGMAX_THREADS 256
#define ARGMAX_PER 16
#define ARGMAX_SLICE (ARGMAX_THREADS * ARGMAX_PER)

__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_f32(int* out, const float* x, int width, unsigned long long* keys, int* tickets) {
    pdl_begin();
    __shared__ unsigned long long smem[ARGMAX_THREADS / 32];
    __shared__ int last;
    const int row = blockIdx.y, slices = gridDim.x;
    const float* xr = x + (i64)row * width;
    const int first = blockIdx.x * ARGMAX_SLICE + threadIdx.x;
    float v[ARGMAX_PER];
#pragma unroll
    for (int j = 0; j < ARGMAX_PER; ++j) {
        const int i = first + j * ARGMAX_THREADS;
        v[j] = i < width ? xr[i] : 0.0f;
    }
    unsigned long long k = 0;  // below every real key
#pragma unroll
    for (int j = 0; j < ARGMAX_PER; ++j) {
        const int i = first + j * ARGMAX_THREADS;
        if (i < width) k = key_max(k, arg_key(v[j], i));
    }
    k = block_key_max(k, smem);
    if (threadIdx.x == 0) {
        keys[(i64)row * slices + blockIdx.x] = k;
        __threadfence();
        last = atomicAdd(&tickets[row], 1) == slices - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    k = keys_max(keys + (i64)row * slices, slices, smem);
    if (threadIdx.x == 0) {
        out[row] = key_index(k);
        tickets[row] = 0;
    }
}
