// RMS_NORM [MUL] [QUANTIZE] [ADD] by one block a row (docs/numerics.md, "RMS_NORM"): rows.cu's
// rms_norm_f32, and the last block of a product that norms its output (matmul.cu's
// gemv_q_norm).
#pragma once
#include "common.cuh"

// TREE over P values held by threads 0..P-1 in order (P a power of two, <= blockDim.x), each
// already the sum of an aligned run of leaves. Every thread gets the result. ``smem``: 33
// floats.
__device__ float block_tree(float v, int P, float* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_tree(v, P < 32 ? P : 32);
    if (P > 32) {
        if (lane == 0) smem[warp] = v;
        __syncthreads();
        if (warp == 0) {
            float w = lane < (P >> 5) ? smem[lane] : 0.0f;
            w = warp_tree(w, P >> 5);
            if (lane == 0) smem[32] = w;
        }
    } else if (threadIdx.x == 0) {
        smem[32] = v;
    }
    __syncthreads();
    float r = smem[32];
    __syncthreads();  // smem may be reused at once
    return r;
}

// A row a block (of a power of two threads: rms_norm_f32's 1,024, or the 128 of a product
// whose last block norms its output, matmul.cu's gemv_q_norm). Thread t takes the aligned run
// [tR, tR + R) of the next_pow2(width) slots of the squares' TREE (R = max(1, W /
// blockDim.x)), so the block's tree is the contract's whatever its size. y = x * scale (* w
// when w is given); the row is also quantized when q is given (the Q8A a matrix product reads:
// RMS_NORM + MUL + QUANTIZE in one launch), and added to a residual when sum is given (sum =
// fl(res + y)). Gemma 3 norms the sum again at once (the norm after attention, the ADD, the
// norm before the FFN; the norm after the FFN, the ADD, the next layer's first norm): y2
// given, the same block norms the sum's row with w2 and eps2, quantized into q2 (norm_job).
// rms_norm_f32 takes up to two jobs of one width in one launch: job b takes the rows after
// job a's (Gemma 3's q and k head norms).
#define NORM_THREADS 1024  // a warp per Q8 block of rows up to 32768 wide: one quantize round
#define NORM_MAXL 9  // runs of up to 256 slots a thread: widths up to 256 blockDim.x
#define NORM_REGS 8  // runs of up to this many slots held in registers (norm_row_regs; 16
                     // would spill rms_norm_f32, bound to 64 registers by its 1,024 threads)

struct NormJob {
    float* y;
    i8* q;  // null: not quantized
    float* qd;
    float* qs;
    float* sum;  // null: no ADD
    const float* x;
    const float* w;  // null: RMS_NORM
    const float* res;
    float* y2;  // null: the sum not normed
    i8* q2;
    float* qd2;
    float* qs2;
    const float* w2;
    float eps;
    float eps2;
    int rows;
};
struct NormRows {
    NormJob a, b;  // b.rows = 0: one job
    int width;
};

// 1 / sqrt(mean + eps) from the squares' TREE ss of a row of ``width`` (docs/numerics.md,
// "RMS_NORM")
__device__ __forceinline__ float rms_scale(float ss, int width, float eps) {
    const float mean = __fdiv_rn(ss, (float)width);
    const float r = __fsqrt_rn(__fadd_rn(mean, eps));
    return __fdiv_rn(1.0f, r);
}

// norm_row where a thread's run is at most NORM_REGS slots (rows up to 8 blockDim.x wide): the
// run's x and w loaded at once into registers and kept there for the scaling and the
// quantization, whose 32-value blocks then span 32 / R lanes (the max and the integer sum are
// exact in any order: quantize_block's values). The operations are norm_row's.
__device__ __forceinline__ void norm_row_regs(float* y, i8* q, float* qd, float* qs, float* sum,
                                              const float* xr, const float* w, const float* res,
                                              float eps, int width, i64 row, int R, int P,
                                              float* tmp) {
    const int start = threadIdx.x * R;  // this thread's run [start, start + R) of the W slots
    const int n = max(0, min(R, width - start));  // ... of which the row's
    float v[NORM_REGS], wv[NORM_REGS];
#pragma unroll
    for (int i = 0; i < NORM_REGS; ++i) {
        v[i] = 0.0f;
        wv[i] = 1.0f;
        if (i < n) {
            v[i] = __ldcg(xr + start + i);
            if (w != nullptr) wv[i] = w[start + i];
        }
    }
    float part = 0.0f;
    if ((int)threadIdx.x < P) {
        float st[NORM_MAXL];
#pragma unroll
        for (int i = 0; i < NORM_REGS; ++i) {
            if (i < n) tree_push<NORM_MAXL>(st, i, __fmul_rn(v[i], v[i]));
        }
        part = tree_finish<NORM_MAXL>(st, n, R);
    }
    const float scale = rms_scale(block_tree(part, P, tmp), width, eps);
    const i64 at = row * width + start;
#pragma unroll
    for (int i = 0; i < NORM_REGS; ++i) {
        if (i < n) {
            float u = __fmul_rn(v[i], scale);
            if (w != nullptr) u = __fmul_rn(u, wv[i]);
            v[i] = u;
            if (y != nullptr) y[at + i] = u;
            if (sum != nullptr) sum[at + i] = __fadd_rn(res[at + i], u);
        }
    }
    if (q == nullptr) return;
    // a block's 32 values on lanes [32 b / R, 32 (b + 1) / R) of a warp (R divides 32); every
    // lane takes part in the shuffles, a group past the row's end writes nothing
    float amax = 0.0f;  // (+0.0: |x| >= +0, and a NaN wins max_nan)
#pragma unroll
    for (int i = 0; i < NORM_REGS; ++i) {
        if (i < n) amax = max_nan(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const float o = __shfl_xor_sync(FULL_MASK, amax, off);
        if (off * R < 32) amax = max_nan(amax, o);
    }
    const float d = __fdiv_rn(amax, 127.0f);
    int isum = 0;
#pragma unroll
    for (int i = 0; i < NORM_REGS; ++i) {
        if (i < n) {
            const int qi = quant_value(v[i], d);
            q[at + i] = (i8)qi;
            isum += qi;
        }
    }
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_xor_sync(FULL_MASK, isum, off);
        if (off * R < 32) isum += o;
    }
    if (n > 0 && start % 32 == 0) {  // the block's first lane
        const int blocks = width >> 5;
        const i64 b = row * blocks + start / 32;
        qd[b] = d;
        qs[b] = __fmul_rn(d, (float)isum);
    }
}

// row ``row`` of one norm, by the whole block (srow: width floats when quantizing; tmp: 33).
// x is read at L2 (__ldcg): it may have been written by other blocks of this grid.
__device__ void norm_row(float* y, i8* q, float* qd, float* qs, float* sum, const float* x,
                         const float* w, const float* res, float eps, int width, i64 row,
                         float* srow, float* tmp) {
    const float* xr = x + row * width;
    const int W = next_pow2(width);
    const int R = W > (int)blockDim.x ? W / (int)blockDim.x : 1;
    const int P = W / R;
    if (R > 1 && R <= NORM_REGS) {  // (a slot a thread: the loop below holds it in registers)
        norm_row_regs(y, q, qd, qs, sum, xr, w, res, eps, width, row, R, P, tmp);
        return;
    }
    // a row no wider than the block: this thread's x and w, both loaded before any result
    const bool one = width <= (int)blockDim.x;
    float x1 = 0.0f, w1 = 1.0f;
    if (one && (int)threadIdx.x < width) {
        x1 = __ldcg(xr + threadIdx.x);
        if (w != nullptr) w1 = w[threadIdx.x];
    }
    float part = 0.0f;
    if ((int)threadIdx.x < P) {
        float st[NORM_MAXL];
        const int start = threadIdx.x * R;
        int n = width - start;
        n = n < 0 ? 0 : (n > R ? R : n);
        for (int i = 0; i < n; ++i) {
            float v = one ? x1 : __ldcg(xr + start + i);
            tree_push<NORM_MAXL>(st, i, __fmul_rn(v, v));
        }
        part = tree_finish<NORM_MAXL>(st, n, R);
    }
    const float scale = rms_scale(block_tree(part, P, tmp), width, eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = __fmul_rn(one ? x1 : __ldcg(xr + i), scale);
        if (w != nullptr) v = __fmul_rn(v, one ? w1 : w[i]);
        if (y != nullptr) y[row * width + i] = v;
        if (sum != nullptr) sum[row * width + i] = __fadd_rn(res[row * width + i], v);
        if (q != nullptr) srow[i] = v;
    }
    if (q == nullptr) return;
    __syncthreads();
    const int blocks = width >> 5, warps = blockDim.x >> 5;
    for (int b = threadIdx.x >> 5; b < blocks; b += warps) {
        quantize_block(srow[b * 32 + (threadIdx.x & 31)], q + row * width + b * 32,
                       qd + row * blocks + b, qs + row * blocks + b);
    }
}

// ---- a row a warp (a prefill's rows) ------------------------------------------------------

// Job ``second`` of ``a`` as a value: its fields selected one by one (indexing the launch's
// argument, or a reference to one of its two jobs, would copy it to local memory)
__device__ __forceinline__ NormJob pick_job(const NormRows& a, bool second) {
    const NormJob &ja = a.a, &jb = a.b;
    NormJob j;
    j.y = second ? jb.y : ja.y;
    j.q = second ? jb.q : ja.q;
    j.qd = second ? jb.qd : ja.qd;
    j.qs = second ? jb.qs : ja.qs;
    j.sum = second ? jb.sum : ja.sum;
    j.x = second ? jb.x : ja.x;
    j.w = second ? jb.w : ja.w;
    j.res = second ? jb.res : ja.res;
    j.y2 = second ? jb.y2 : ja.y2;
    j.q2 = second ? jb.q2 : ja.q2;
    j.qd2 = second ? jb.qd2 : ja.qd2;
    j.qs2 = second ? jb.qs2 : ja.qs2;
    j.w2 = second ? jb.w2 : ja.w2;
    j.eps = second ? jb.eps : ja.eps;
    j.eps2 = second ? jb.eps2 : ja.eps2;
    j.rows = second ? jb.rows : ja.rows;
    return j;
}

// A lane's run of R values of a row of ``width`` (``row``: its first), from slot ``start``: the
// slots past the row read as +0.0. Four at a time where the row is 16-byte aligned and its
// width a multiple of four, so that each group of four is inside the row or past it whole.
// That choice is the row's, the same for every lane of the warp: lanes of one warp taking the
// two paths apart (a choice made per lane, by whether its own run is whole) gave wrong rows
// and writes past the buffer on an H200 and not in the emulator (docs/perf.md, ninth session).
template <int R>
__device__ __forceinline__ bool run_in_fours(const float* row, int width) {
    return R % 4 == 0 && width % 4 == 0 && (reinterpret_cast<size_t>(row) & 15) == 0;
}

template <int R>
__device__ __forceinline__ void load_run(float (&v)[R], const float* row, int start, int width) {
    const float* p = row + start;
    if (run_in_fours<R>(row, width)) {
#pragma unroll
        for (int i = 0; i < R; i += 4) {
            float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (start + i < width) f = *reinterpret_cast<const float4*>(p + i);
            v[i] = f.x, v[i + 1] = f.y, v[i + 2] = f.z, v[i + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) v[i] = start + i < width ? p[i] : 0.0f;
    }
}

template <int R>
__device__ __forceinline__ void store_run(float* row, const float (&v)[R], int start, int width) {
    float* p = row + start;
    if (run_in_fours<R>(row, width)) {
#pragma unroll
        for (int i = 0; i < R; i += 4) {
            if (start + i < width)
                *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) {
            if (start + i < width) p[i] = v[i];
        }
    }
}

// norm_row by one warp: lane l holds in v the aligned run [lR, lR + R) of the W =
// next_pow2(width) slots, R = W / 32 (or 1, lanes < W, when W < 32), the slots from ``width``
// on +0.0, so its squares' pairwise sums are the TREE's subtree of those slots (a padding
// subtree is +0.0, and adding +0.0 to a sum of squares leaves it as it is, as tree_finish's
// padding does), and the butterfly over the P = W / R lanes adds the subtrees. The run stays in registers: v
// becomes the row's y, and its quantization's 32-value blocks are whole runs (R >= 32: R / 32
// blocks a lane) or span 32 / R lanes (the max and the integer sum: exact in any order,
// quantize_block's values). The operations are norm_row's, in its order.
template <int R>
__device__ __forceinline__ void norm_run(float (&v)[R], i8* q, float* qd, float* qs,
                                         const float* w, float eps, int width, i64 row) {
    const int lane = threadIdx.x & 31, start = lane * R, P = next_pow2(width) / R;
    float sq[R];
#pragma unroll
    for (int i = 0; i < R; ++i) sq[i] = __fmul_rn(v[i], v[i]);
#pragma unroll
    for (int step = 1; step < R; step <<= 1) {
#pragma unroll
        for (int i = 0; i < R; i += 2 * step) sq[i] = __fadd_rn(sq[i], sq[i + step]);
    }
    const float scale = rms_scale(warp_tree(lane < P ? sq[0] : 0.0f, P), width, eps);
    if (w != nullptr) {
        float wv[R];
        load_run<R>(wv, w, start, width);
#pragma unroll
        for (int i = 0; i < R; ++i) v[i] = __fmul_rn(__fmul_rn(v[i], scale), wv[i]);
    } else {
#pragma unroll
        for (int i = 0; i < R; ++i) v[i] = __fmul_rn(v[i], scale);
    }
    if (q == nullptr) return;
    const i64 at = row * width + start;
    const int blocks = width >> 5;
    constexpr int B = R >= 32 ? R / 32 : 1;  // the blocks of this lane's run
    constexpr int E = R >= 32 ? 32 : R;      // ... and this lane's values of each
#pragma unroll
    for (int k = 0; k < B; ++k) {
        float amax = 0.0f;  // (+0.0: |x| >= +0, and a NaN wins max_nan)
#pragma unroll
        for (int i = 0; i < E; ++i) amax = max_nan(amax, fabsf(v[k * E + i]));
        if (R < 32) {  // (a block on 32 / R lanes)
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const float o = __shfl_xor_sync(FULL_MASK, amax, off);
                if (off * R < 32) amax = max_nan(amax, o);
            }
        }
        const float d = __fdiv_rn(amax, 127.0f);
        int isum = 0, qv[E];
#pragma unroll
        for (int i = 0; i < E; ++i) {
            qv[i] = quant_value(v[k * E + i], d);
            isum += qv[i];
        }
        if (R < 32) {
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int o = __shfl_xor_sync(FULL_MASK, isum, off);
                if (off * R < 32) isum += o;
            }
        }
        if (start + k * E < width) {
            i8* out = q + at + k * E;
            if (E % 4 == 0) {  // (rows of a multiple of 32 bytes: 4-byte aligned runs)
#pragma unroll
                for (int i = 0; i < E; i += 4)
                    *reinterpret_cast<u32*>(out + i) =
                        (u32)(qv[i] & 0xff) | (u32)(qv[i + 1] & 0xff) << 8 |
                        (u32)(qv[i + 2] & 0xff) << 16 | (u32)(qv[i + 3] & 0xff) << 24;
            } else {
#pragma unroll
                for (int i = 0; i < E; ++i) out[i] = (i8)qv[i];
            }
            if ((start + k * E) % 32 == 0) {  // the block's first lane
                const i64 b = row * blocks + (start + k * E) / 32;
                qd[b] = d;
                qs[b] = __fmul_rn(d, (float)isum);
            }
        }
    }
}

// row ``row`` of job ``j`` by one warp (norm_job's outputs): the norm, its sum, and the norm
// of the sum from the sum's values in registers
template <int R>
__device__ __forceinline__ void norm_job_warp(const NormJob& j, int width, i64 row) {
    const int start = (threadIdx.x & 31) * R;
    const i64 at = row * width;  // the row's first value
    float v[R];
    load_run<R>(v, j.x + at, start, width);
    norm_run<R>(v, j.q, j.qd, j.qs, j.w, j.eps, width, row);
    if (j.y != nullptr) store_run<R>(j.y + at, v, start, width);
    if (j.sum == nullptr) return;
    float r[R];
    load_run<R>(r, j.res + at, start, width);
#pragma unroll
    for (int i = 0; i < R; ++i) v[i] = start + i < width ? __fadd_rn(r[i], v[i]) : 0.0f;
    store_run<R>(j.sum + at, v, start, width);
    if (j.y2 == nullptr) return;
    norm_run<R>(v, j.q2, j.qd2, j.qs2, j.w2, j.eps2, width, row);
    store_run<R>(j.y2 + at, v, start, width);
}

// row ``row`` of a job: its norm, and the norm of the sum after it when the job has one
__device__ __forceinline__ void norm_job(const NormJob& j, int width, i64 row, float* srow,
                                         float* tmp) {
    norm_row(j.y, j.q, j.qd, j.qs, j.sum, j.x, j.w, j.res, j.eps, width, row, srow, tmp);
    if (j.y2 == nullptr) return;
    __syncthreads();  // the sum's row: written by the block's threads, read across them
    norm_row(j.y2, j.q2, j.qd2, j.qs2, nullptr, j.sum, j.w2, nullptr, j.eps2, width, row, srow,
             tmp);
}

// ---- a decode norm made by the products that read it ------------------------------------------

// (the lowering's NORM_IN_PRODUCT) A decode step's norm before a product, and its QUANTIZE,
// made by every block of that product (matmul.cu's gemv_q_normed kernels) from the output of
// the residual product before it (gemv_q_sq), which also left the subtree of the squares of
// each of its blocks' rows (``parts``: 2^level rows a block, aligned runs of the TREE's
// slots). The TREE is finished from those subtrees, and x's rows are normed, weighted and
// quantized into the block's shared memory: no launch of its own, and the squares of a row
// are made once, by the blocks that wrote it. Block 0 also writes the norm's and the
// QUANTIZE's values, which the graph holds.
struct NormIn {
    const float* x;      // (T, K): the norm's input, the residual product's output
    const float* parts;  // (T, np): that product's subtrees of the squares, a block each
    const float* w;      // RMS_NORM_MUL's weight (K), or null
    float* y;            // the norm's value (T, K), or null: written by block 0
    i8* q;               // the QUANTIZE's value, or null: written by block 0
    float* qd;
    float* qs;
    float eps;
    int np;     // subtrees a token: the producer's blocks
    int level;  // log2 of the slots each one holds
};

#define NORM_IN_RUN 8  // subtrees a thread (the lowering's bound: next_pow2(K) >> level <= 8 x
                       // the block's threads)

// x quantized into ``smem`` (Q8A of T rows of K: the quants, then each 32-block's d, then its
// s; matmul.cu's normed_q8), by the whole block; ``tmp``: 33 floats. x and the subtrees were
// written by the kernel before, so plain loads after PDL's wait, through L1, which every block
// of the product reads (at L2, __ldcg, SmolLM2's gate/up launch took 11.2 us on an H100, 9.3
// this way, PDL off; docs/perf.md, sixteenth session). Token t's squares' TREE:
// thread j takes the aligned run [jR, jR + R) of its next_pow2(K) >> level leaves (the
// subtrees, +0.0 past np), the block's tree adds the runs (block_tree: the contract's order).
// Its values then go 8 to a thread, a Q8 block on 4 lanes: scale, weight, the block's max by
// two shuffles, the quants, their sum by two more (norm_row_regs's operations, R = 8).
__device__ void norm_in_x(const NormIn& in, int T, int K, u8* smem, float* tmp) {
    i8* sq = reinterpret_cast<i8*>(smem);
    float* sd = reinterpret_cast<float*>(smem + T * K);
    float* ss = sd + T * (K / 32);
    const int leaves = next_pow2(K) >> in.level;
    const int R = leaves > (int)blockDim.x ? leaves / (int)blockDim.x : 1;
    const int P = leaves / R;
    const int nb = K / 32, slots = K / 8;
    const bool writer = blockIdx.x == 0;
    for (int t = 0; t < T; ++t) {
        const float* xr = in.x + (i64)t * K;
        // this thread's first values and the subtrees, loaded together
        float v[8], wv[8];
        const bool first_live = (int)threadIdx.x < slots;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = 0.0f;
            wv[i] = 1.0f;
            if (first_live) {
                v[i] = xr[threadIdx.x * 8 + i];
                if (in.w != nullptr) wv[i] = in.w[threadIdx.x * 8 + i];
            }
        }
        float part = 0.0f;
        if ((int)threadIdx.x < P) {
            const int start = threadIdx.x * R;
            const int n = max(0, min(R, in.np - start));
            float pv[NORM_IN_RUN], st[NORM_MAXL];
#pragma unroll
            for (int i = 0; i < NORM_IN_RUN; ++i) {
                if (i < n) pv[i] = in.parts[(i64)t * in.np + start + i];
            }
#pragma unroll
            for (int i = 0; i < NORM_IN_RUN; ++i) {
                if (i < n) tree_push<NORM_MAXL>(st, i, pv[i]);
            }
            part = tree_finish<NORM_MAXL>(st, n, R);
        }
        const float scale = rms_scale(block_tree(part, P, tmp), K, in.eps);
        for (int base = 0; base < slots; base += blockDim.x) {  // (uniform: the shuffles)
            const int slot = base + threadIdx.x;
            const bool live = slot < slots;
            if (base > 0) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    v[i] = 0.0f;
                    wv[i] = 1.0f;
                    if (live) {
                        v[i] = xr[slot * 8 + i];
                        if (in.w != nullptr) wv[i] = in.w[slot * 8 + i];
                    }
                }
            }
            float amax = 0.0f;  // (+0.0: |x| >= +0, and a NaN wins max_nan)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float u = __fmul_rn(v[i], scale);
                if (in.w != nullptr) u = __fmul_rn(u, wv[i]);
                v[i] = u;
                amax = max_nan(amax, fabsf(u));
            }
            amax = max_nan(amax, __shfl_xor_sync(FULL_MASK, amax, 1));
            amax = max_nan(amax, __shfl_xor_sync(FULL_MASK, amax, 2));
            const float d = __fdiv_rn(amax, 127.0f);
            int qi[8], isum = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                qi[i] = quant_value(v[i], d);
                isum += qi[i];
            }
            isum += __shfl_xor_sync(FULL_MASK, isum, 1);
            isum += __shfl_xor_sync(FULL_MASK, isum, 2);
            if (!live) continue;
            const u32 lo = (u32)(qi[0] & 255) | (u32)(qi[1] & 255) << 8 | (u32)(qi[2] & 255) << 16 |
                           (u32)(qi[3] & 255) << 24;
            const u32 hi = (u32)(qi[4] & 255) | (u32)(qi[5] & 255) << 8 | (u32)(qi[6] & 255) << 16 |
                           (u32)(qi[7] & 255) << 24;
            const i64 at = (i64)t * K + slot * 8;
            *reinterpret_cast<uint2*>(sq + at) = make_uint2(lo, hi);
            const float s = __fmul_rn(d, (float)isum);
            const i64 b = (i64)t * nb + slot / 4;
            if ((slot & 3) == 0) {
                sd[b] = d;
                ss[b] = s;
            }
            if (!writer) continue;
            if (in.y != nullptr) {
#pragma unroll
                for (int i = 0; i < 8; ++i) in.y[at + i] = v[i];
            }
            if (in.q != nullptr) {
                *reinterpret_cast<uint2*>(in.q + at) = make_uint2(lo, hi);
                if ((slot & 3) == 0) {
                    in.qd[b] = d;
                    in.qs[b] = s;
                }
            }
        }
    }
    __syncthreads();  // x's quants: written by the block's threads, read across them
}
