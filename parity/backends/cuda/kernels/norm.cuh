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

// row ``row`` of a job: its norm, and the norm of the sum after it when the job has one
__device__ __forceinline__ void norm_job(const NormJob& j, int width, i64 row, float* srow,
                                         float* tmp) {
    norm_row(j.y, j.q, j.qd, j.qs, j.sum, j.x, j.w, j.res, j.eps, width, row, srow, tmp);
    if (j.y2 == nullptr) return;
    __syncthreads();  // the sum's row: written by the block's threads, read across them
    norm_row(j.y2, j.q2, j.qd2, j.qs2, nullptr, j.sum, j.w2, nullptr, j.eps2, width, row, srow,
             tmp);
}
