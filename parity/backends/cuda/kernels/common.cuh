// The numeric contract's primitives in CUDA C (docs/numerics.md). Compiled with --fmad=false
// and without fast-math, so every float expression below is one correctly rounded binary32
// operation in the order written; the explicit __f*_rn intrinsics say so where it matters.
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define FULL_MASK 0xffffffffu

// ---- programmatic dependent launch ---------------------------------------------------------

// A kernel launched with programmatic dependent launch (sm_90+, a decode step's kernels) may
// start while the kernel before it on the stream still runs. Every kernel calls pdl_begin
// before it writes anything, or reads anything the kernel before may still write:
// griddepcontrol.wait returns once the previous grid has finished and its writes are visible
// (at once when it was launched plainly), and launch_dependents then lets the next kernel
// start, which waits for this one in turn, so completion stays ordered along the whole stream.
// That takes two rules of every kernel: it waits before it lets the next one start, and none
// of its blocks returns before pdl_begin (a grid whose blocks all returned without waiting
// would finish before the one before it). So a kernel starts only once every block of the one
// before has passed its wait, and the kernel two launches back has finished: what no kernel
// writes (a product's weights), or what a kernel two launches back or earlier wrote, may be
// loaded before the wait (the lowering's EARLY_LOADS; such loads go at L2, __ldcg, so that no
// line a kernel still writes stays in L1). The bits never depend on it.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#elif defined(PARITY_EMULATOR)
    emu::pdl_wait();  // (where a test's late writes land: tests/cuda_emulator/emu.hpp)
#endif
}

// the dynamic shared memory the launch gave this block, in bytes: a kernel whose layout depends
// on its arguments checks it (and traps) rather than write past it
__device__ __forceinline__ u32 dynamic_smem_bytes() {
#ifdef PARITY_EMULATOR
    return (u32)emu::dynamic_smem_size();
#else
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
#endif
}

// A fence at GPU scope of release and acquire, what a ticket asks (__threadfence() is
// fence.sc.gpu: sequentially consistent, more than that)
__device__ __forceinline__ void fence_acq_rel_gpu() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
    __threadfence();
#endif
}

// A thread block cluster's barrier (sm_90), in two halves: arrive with this thread's writes
// released at cluster scope (every thread of every block of the cluster, each warp all
// together), then wait for the others' and acquire them. A thread that exits counts as arrived,
// so a block may arrive and leave. The emulator runs a grid's blocks one after another, in
// order, so when a cluster's last block (the only one that waits here) arrives, the others have
// finished: its arrival is the block's barrier (every thread of the block arrives).
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#elif defined(PARITY_EMULATOR)
    emu::sync_block();
#endif
}
__device__ __forceinline__ void cluster_wait_acquire() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Whether this block is the last of ``count`` blocks sharing ``ticket`` to get here, every one
// having written its results first: each fences them and takes a ticket; the block that takes
// the last one fences again and may then read what the others wrote (at L2: __ldcg), and must
// set the ticket back to zero when done, for the next launch or replay. ``last``: a __shared__
// int of the caller's. ONE: one fence a block, not one a thread, and of release and acquire:
// thread 0 fences after the barrier, which orders the block's writes before it, and again after
// its ticket, before the barrier that hands ``last`` to the block (cooperative groups' grid
// sync, the same order).
template <bool ONE = false>
__device__ __forceinline__ bool last_block(int* ticket, int count, int& last) {
    if (ONE) {
        __syncthreads();
        if (threadIdx.x == 0) {
            fence_acq_rel_gpu();
            last = atomicAdd(ticket, 1) == count - 1;
            if (last) fence_acq_rel_gpu();
        }
        __syncthreads();
        return last;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == count - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    return true;
}

// ---- ARGMAX keys (rows.cu's argmax_f32, matmul.cu's head with its ARGMAX) ----------------

// (value, index) as one key whose unsigned order is argmax's (docs/numerics.md: NaN above every
// number, the first index on ties): the value's bits made
// order-preserving (every NaN the largest, -0 the same as +0), then the index inverted so that
// the first index wins a tie. The max of keys is exact in any order.
__device__ __forceinline__ unsigned long long arg_key(float v, int i) {
    u32 b = 0xffffffffu;  // NaN
    if (v == v) {
        b = v == 0.0f ? 0u : __float_as_uint(v);
        b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    }
    return ((unsigned long long)b << 32) | (u32)~i;
}

__device__ __forceinline__ unsigned long long key_max(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

__device__ __forceinline__ unsigned long long block_key_max(unsigned long long k,
                                                             unsigned long long* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) k = key_max(k, __shfl_xor_sync(FULL_MASK, k, off));
    if (lane == 0) smem[warp] = k;
    __syncthreads();
    k = smem[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) k = key_max(k, smem[w]);
    return k;
}

// The max of ``count`` keys that other blocks wrote (read at L2), by the whole block, after
// a barrier (``smem`` may have just been read by block_key_max); and the index a key holds.
__device__ __forceinline__ unsigned long long keys_max(const unsigned long long* keys, int count,
                                                       unsigned long long* smem) {
    unsigned long long k = 0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) k = key_max(k, __ldcg(keys + i));
    __syncthreads();
    return block_key_max(k, smem);
}

__device__ __forceinline__ int key_index(unsigned long long k) {
    return (int)~(u32)(k & 0xffffffffu);
}

// ---- bits --------------------------------------------------------------------------------

__device__ __forceinline__ float bits_f32(u32 b) { return __uint_as_float(b); }

// binary16 bits -> binary32, exactly (fp16 subnormals become normal fp32 values)
__device__ __forceinline__ float f16_to_f32(u16 h) {
    const u32 sign = (u32)(h & 0x8000u) << 16;
    const u32 exp = (h >> 10) & 0x1fu;
    const u32 man = h & 0x3ffu;
    // subnormal or zero: man * 2^-24, as (0.5 + man * 2^-24) - 0.5 (exact: an ulp of 0.5 is
    // 2^-24, and the difference of floats within a factor of two is exact); no branch, no
    // integer-to-float conversion. Normal: rebiased; inf, NaN: the payload kept
    const u32 sub = __float_as_uint(__fsub_rn(bits_f32(0x3f000000u | man), 0.5f));
    const u32 norm = ((exp == 0x1fu ? 0xffu : exp + 112u) << 23) | (man << 13);
    return bits_f32(sign | (exp == 0 ? sub : norm));
}

// binary32 -> binary16 bits, rounded to nearest even (inf past 65,504 and a half ulp, NaN a
// quiet NaN). Normal: the exponent rebiased, 13 bits rounded off (a carry into the exponent is
// the right answer); subnormal or zero: |f| + 0.5 leaves |f| / 2^-24 rounded once in the low
// bits (an ulp of 0.5 is 2^-24), 1,024 being the smallest normal's bits
__device__ __forceinline__ u16 f32_to_f16(float f) {
    const u32 x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (u16)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (u16)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {
        const u32 r = ax - 0x38000000u;
        return (u16)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    return (u16)(sign | (__float_as_uint(__fadd_rn(bits_f32(ax), 0.5f)) - 0x3f000000u));
}

// a little-endian u16 at any byte address (blocks of 18 or 22 bytes are only 2-aligned)
__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

__device__ __forceinline__ u32 load_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// ---- exp ---------------------------------------------------------------------------------

// The project's exp, line for line (docs/numerics.md, "exp").
__device__ __forceinline__ float p_exp(float x) {
    const float LOG2E = bits_f32(0x3fb8aa3bu);   // 0x1.715476p+0
    const float LN2_HI = bits_f32(0x3f317200u);  // 0x1.62e400p-1
    const float LN2_LO = bits_f32(0x35bfbe8eu);  // 0x1.7f7d1cp-20
    const float EXP_HI = bits_f32(0x42b17217u);  // 0x1.62e42ep+6
    const float EXP_LO = bits_f32(0xc2d00000u);  // -0x1.a00000p+6 = -104
    const bool nan = x != x;
    float xc = nan ? 0.0f : fminf(fmaxf(x, EXP_LO), EXP_HI);
    float kf = rintf(__fmul_rn(xc, LOG2E));  // half to even
    float a = __fmul_rn(kf, LN2_HI);
    float r = __fsub_rn(xc, a);
    float b = __fmul_rn(kf, LN2_LO);
    r = __fsub_rn(r, b);
    float p = bits_f32(0x39500d01u);                     // C7 0x1.a01a02p-13
    p = __fadd_rn(__fmul_rn(p, r), bits_f32(0x3ab60b61u));  // C6 0x1.6c16c2p-10
    p = __fadd_rn(__fmul_rn(p, r), bits_f32(0x3c088889u));  // C5 0x1.111112p-7
    p = __fadd_rn(__fmul_rn(p, r), bits_f32(0x3d2aaaabu));  // C4 0x1.555556p-5
    p = __fadd_rn(__fmul_rn(p, r), bits_f32(0x3e2aaaabu));  // C3 0x1.555556p-3
    p = __fadd_rn(__fmul_rn(p, r), bits_f32(0x3f000000u));  // C2 1/2
    p = __fadd_rn(__fmul_rn(p, r), bits_f32(0x3f800000u));  // C1 1
    p = __fadd_rn(__fmul_rn(p, r), bits_f32(0x3f800000u));  // C0 1
    int k = (int)kf;
    int k1 = k >> 1;  // arithmetic shift: floor(k / 2)
    int k2 = k - k1;
    float y = __fmul_rn(__fmul_rn(p, bits_f32((u32)(k1 + 127) << 23)),
                        bits_f32((u32)(k2 + 127) << 23));
    if (nan) return x;
    if (x > EXP_HI) return __int_as_float(0x7f800000);
    if (x < EXP_LO) return 0.0f;
    return y;
}

__device__ __forceinline__ float p_silu(float x) {
    float e = p_exp(-x);  // -x flips the sign bit
    float d = __fadd_rn(1.0f, e);
    return __fdiv_rn(x, d);
}

// GELU in its tanh form, as the logistic it equals, two-sided (docs/numerics.md, "GELU, GEGLU")
__device__ __forceinline__ float p_gelu(float x) {
    const float A = bits_f32(0x3d372713u);  // 0.044715
    const float S = bits_f32(0x3f4c422au);  // sqrt(2 / pi)
    float c = __fadd_rn(__fmul_rn(A, __fmul_rn(x, x)), 1.0f);
    float u = __fmul_rn(S, __fmul_rn(x, c));
    float v = __fmul_rn(u, -2.0f);
    bool right = v > 0.0f;  // x < 0: the exp of -v, at most 1 (NaN: the left side)
    float e = p_exp(right ? -v : v);
    float num = right ? __fmul_rn(x, e) : x;
    return __fdiv_rn(num, __fadd_rn(e, 1.0f));
}

// ---- TREE --------------------------------------------------------------------------------

// TREE(v_0 .. v_{n-1}) built one leaf at a time: ``st`` holds the finished subtrees, level L
// in st[L] when bit L of ``count`` (the leaves pushed so far) is set, exactly as the binary
// counter of a left-to-right walk over the adjacent-pairs tree. Every level index is a
// compile-time constant, so ``st`` stays in registers. fl(a + b) is commutative, so which
// operand comes first does not matter; which pairs are added does, and that is the tree's.
template <int MAXL>
__device__ __forceinline__ void tree_push(float (&st)[MAXL], int count, float v, int level = 0) {
    float carry = v;
    bool open = true;
#pragma unroll
    for (int L = 0; L < MAXL; ++L) {
        if (open && L >= level) {
            if ((count >> L) & 1) {
                carry = __fadd_rn(st[L], carry);
            } else {
                st[L] = carry;
                open = false;
            }
        }
    }
}

// Pad a tree of ``count`` leaves with +0.0 leaves up to ``width`` (a power of two) and return
// its value. A run of 2^j padding leaves starting at a multiple of 2^j is a subtree whose sum
// is +0.0, pushed whole at level j; the adds with real subtrees above it still happen.
template <int MAXL>
__device__ __forceinline__ float tree_finish(float (&st)[MAXL], int count, int width) {
    while (count < width) {
        int j = __ffs(count) - 1;  // the largest aligned zero subtree that starts at count
        if (count == 0) j = 31 - __clz(width);
        tree_push<MAXL>(st, count >> j << j, 0.0f, j);
        count += 1 << j;
    }
    const int top = 31 - __clz(width);
    float r = 0.0f;
#pragma unroll
    for (int L = 0; L < MAXL; ++L) {
        if (L == top) r = st[L];  // a constant index per level: st stays in registers
    }
    return r;
}

__host__ __device__ __forceinline__ int next_pow2(int n) {
    int w = 1;
    while (w < n) w <<= 1;
    return w;
}

// Sum of a warp's values in TREE order over its first ``width`` lanes (width a power of two
// <= 32): the xor butterfly with offsets 1, 2, 4, ... adds exactly the adjacent pairs of each
// level. Every lane gets the result (lanes >= width: garbage).
__device__ __forceinline__ float warp_tree(float v, int width) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        if (off < width) v = __fadd_rn(v, __shfl_xor_sync(FULL_MASK, v, off));
    }
    return v;
}

// ---- NaN-aware max -------------------------------------------------------------------------

// max that propagates NaN (fmaxf drops it)
__device__ __forceinline__ float max_nan(float a, float b) {
    if (a != a) return a;
    if (b != b) return b;
    return fmaxf(a, b);
}

// ---- Q8 activation quantization --------------------------------------------------------------

// x's quant in a block of scale d (docs/numerics.md, "Activation quantization"): 0 where d is
// 0 or x / d is not finite, else x / d rounded half away from zero, clamped to +-127
__device__ __forceinline__ int quant_value(float x, float d) {
    int qi = 0;
    if (d != 0.0f) {
        float v = __fdiv_rn(x, d);  // correctly rounded, not x * (1/d)
        if (isfinite(v)) {
            float r = roundf(v);  // half away from zero; exact
            r = fminf(fmaxf(r, -127.0f), 127.0f);
            qi = (int)r;
        }
    }
    return qi;
}

// One warp quantizes one 32-element block: lane i holds x_i (docs/numerics.md, "Activation
// quantization"). Writes q[i] from every lane and d, s from lane 0.
__device__ __forceinline__ void quantize_block(float x, i8* q, float* d_out, float* s_out) {
    const int lane = threadIdx.x & 31;
    float amax = fabsf(x);  // |-0| = +0
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = max_nan(amax, __shfl_xor_sync(FULL_MASK, amax, off));
    float d = __fdiv_rn(amax, 127.0f);
    const int qi = quant_value(x, d);
    q[lane] = (i8)qi;
    int sum = qi;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off);
    if (lane == 0) {
        *d_out = d;
        *s_out = __fmul_rn(d, (float)sum);
    }
}
