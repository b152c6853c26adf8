// CUDA C on the CPU, for testing the cuda backend's kernels on machines without a GPU.
//
// The kernel sources are compiled by the host C++ compiler with this header included first.
// Each CUDA thread of a block is a fiber (ucontext) on one OS thread; the blocks of a grid run
// one after another. A block's fibers run in turn until each reaches a barrier: __syncthreads
// waits for the block, __syncwarp and the warp intrinsics (shuffles, votes) for the warp, so
// every warp-synchronous exchange the kernels rely on happens as on the device. A barrier that
// some thread never reaches (a divergent __syncthreads) is reported, not hung on. Since fibers
// never preempt each other, atomics are plain read-modify-writes and fences are no-ops.
//
// __shared__ variables become function statics, shared by a block's fibers; blocks run one at
// a time, so each block sees them as its own (their contents carry over between blocks, like
// uninitialised shared memory). Float arithmetic is the host's binary32 with contraction off
// (-ffp-contract=off): the same correctly rounded operations as the device's --fmad=false.
#pragma once

#define PARITY_EMULATOR 1

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__ static  // (a library compiles the kernels it names, and what they call)
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __cluster_dims__(...)  // (a grid's blocks run in order: common.cuh's cluster barrier)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

namespace emu {

constexpr int MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 256 << 10;
constexpr size_t MAX_DYNAMIC_SMEM = 227 << 10;  // an sm_90 block's, static included
constexpr size_t GUARD = 256;  // poisoned bytes after the dynamic shared memory, checked

// a barrier of ``size`` threads: generation ``gen`` passes when all have arrived
struct Barrier {
    int size = 0, arrived = 0;
    unsigned long long gen = 0;
};

struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    int lane = 0, warp = 0;
    const Barrier* wait = nullptr;  // the barrier it waits at (null: running)
    unsigned long long gen = 0;  // ... to pass this generation of
    bool done = false;
};

struct Warp {
    Barrier bar;
    unsigned long long slot[32];
    int words[32][8];  // a matrix fragment's registers, by lane (mma)
};

// A test's stand-in for a write the kernel before makes while this one, launched under PDL,
// already runs: each block starts with ``poison`` at ``dst`` and finds ``truth`` there once its
// threads are past pdl_begin (emu_late_write; one launch's, then dropped). A load the kernel
// issues before its wait that it does not make again after sees the poison.
struct Late {
    void* dst;
    const void* poison;
    const void* truth;
    size_t n;
};

struct State {
    dim3 grid, block, block_idx;
    int nthreads = 0;
    Barrier bar;  // the block's
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<std::unique_ptr<char[]>> stacks;  // (not zero-filled: untouched pages stay free)
    std::vector<unsigned char> dynamic_smem;
    size_t dynamic_smem_size = 0;
    ucontext_t sched;
    Fiber* cur = nullptr;
    bool reverse = false;  // resume a block's threads from the last to the first
    bool trapped = false;
    void (*body)(const void*) = nullptr;
    const void* arg = nullptr;
    std::vector<Late> late;  // the next launch's late writes
    char error[256] = {0};
};

inline State& state() {
    static State s;
    return s;
}

inline void fail(const char* what) {
    State& s = state();
    if (!s.error[0]) std::snprintf(s.error, sizeof s.error, "%s", what);
}

// arrive at barrier b; the last to arrive lets the others pass and goes on, the others park
// until the scheduler resumes them
inline void arrive(Barrier& b) {
    State& s = state();
    const unsigned long long gen = b.gen;
    if (++b.arrived == b.size) {
        b.arrived = 0;
        ++b.gen;
        return;
    }
    Fiber* f = s.cur;
    f->wait = &b;
    f->gen = gen;
    swapcontext(&f->ctx, &s.sched);
}

inline void sync_block() { arrive(state().bar); }

inline void sync_warp() { arrive(state().warps[state().cur->warp].bar); }

// every lane of the warp publishes v, then reads lane src's
template <typename T>
inline T exchange(T v, int src) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits in 8 bytes");
    State& s = state();
    Warp& w = s.warps[s.cur->warp];
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    sync_warp();  // the slots' previous readers are done
    w.slot[s.cur->lane] = bits;
    sync_warp();
    T r;
    const unsigned long long got = w.slot[src < w.bar.size ? src : s.cur->lane];
    std::memcpy(&r, &got, sizeof(T));
    return r;
}

inline void entry() {
    State& s = state();
    s.body(s.arg);
    s.cur->done = true;
    swapcontext(&s.cur->ctx, &s.sched);
}

// __trap: the block stops here (its other threads are not resumed) and the launch fails
inline void trap() {
    State& s = state();
    fail("__trap");
    s.trapped = true;
    swapcontext(&s.cur->ctx, &s.sched);
}

inline bool runnable(const Fiber& f) {
    return !f.done && (f.wait == nullptr || f.wait->gen > f.gen);
}

// Runs body(arg) as every thread of every block. Returns 0, or -1 with state().error set.
inline int run_grid(void (*body)(const void*), const void* arg, dim3 grid, dim3 block,
                    size_t dynamic_smem) {
    State& s = state();
    s.error[0] = 0;
    s.trapped = false;
    const long n = (long)block.x * block.y * block.z;
    // the driver's limits (sm_90): a launch past them fails there, so it fails here
    if (n < 1 || n > MAX_THREADS || block.z > 64) {
        fail("block size out of range (1 .. 1024 threads, z <= 64)");
        return -1;
    }
    if (grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535) {
        fail("grid size out of range (x 1 .. 2^31 - 1, y and z 1 .. 65535)");
        return -1;
    }
    if (dynamic_smem > MAX_DYNAMIC_SMEM) {
        fail("more dynamic shared memory than an sm_90 block has (227 KiB)");
        return -1;
    }
    s.grid = grid;
    s.block = block;
    s.nthreads = (int)n;
    s.body = body;
    s.arg = arg;
    s.fibers.assign(n, Fiber{});
    s.warps.assign((n + 31) / 32, Warp{});
    for (size_t w = 0; w < s.warps.size(); ++w)
        s.warps[w].bar.size = (int)std::min<long>(32, n - 32 * (long)w);
    while ((long)s.stacks.size() < n) s.stacks.emplace_back(new char[STACK_BYTES]);
    s.dynamic_smem.assign(dynamic_smem + GUARD, 0xff);  // NaN-ish garbage, as on the device
    s.dynamic_smem_size = dynamic_smem;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                s.block_idx = dim3{bx, by, bz};
                for (const Late& l : s.late) std::memcpy(l.dst, l.poison, l.n);
                s.bar = Barrier{(int)n, 0, 0};
                for (auto& w : s.warps) w.bar.arrived = 0, w.bar.gen = 0;
                for (long i = 0; i < n; ++i) {
                    Fiber& f = s.fibers[i];
                    f = Fiber{};
                    f.tid = dim3{(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                                 (unsigned)(i / (block.x * block.y))};
                    f.lane = (int)(i % 32);
                    f.warp = (int)(i / 32);
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = s.stacks[i].get();
                    f.ctx.uc_stack.ss_size = STACK_BYTES;
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, entry, 0);
                }
                long left = n;
                while (left > 0) {
                    bool moved = false;
                    for (long k = 0; k < n; ++k) {
                        Fiber& f = s.fibers[s.reverse ? n - 1 - k : k];
                        if (!runnable(f)) continue;
                        f.wait = nullptr;
                        s.cur = &f;
                        swapcontext(&s.sched, &f.ctx);
                        if (s.trapped) return -1;
                        moved = true;
                        if (f.done) --left;
                    }
                    if (!moved) {
                        char what[200];
                        std::snprintf(what, sizeof what,
                                      "block (%u, %u, %u): %ld threads wait at a barrier the "
                                      "others never reach (divergent __syncthreads or warp sync)",
                                      bx, by, bz, left);
                        fail(what);
                        return -1;
                    }
                }
                for (size_t b = 0; b < GUARD; ++b) {
                    if (s.dynamic_smem[dynamic_smem + b] != 0xff) {
                        fail("a write past the launch's dynamic shared memory");
                        return -1;
                    }
                }
                if (s.error[0]) return -1;
            }
    return 0;
}

// a kernel called with its arguments from CUDA's ``void** params`` (one pointer an argument)
template <typename... A>
struct Kernel {
    static inline void (*fn)(A...) = nullptr;
    template <size_t... I>
    static void call(void* const* p, std::index_sequence<I...>) {
        fn(*static_cast<const std::remove_reference_t<A>*>(p[I])...);
    }
    static void body(const void* params) {
        call(static_cast<void* const*>(params), std::index_sequence_for<A...>{});
    }
};

template <typename... A>
inline int launch(void (*fn)(A...), void* const* params, dim3 grid, dim3 block,
                  size_t dynamic_smem) {
    Kernel<A...>::fn = fn;
    const int rc = run_grid(&Kernel<A...>::body, params, grid, block, dynamic_smem);
    for (const Late& l : state().late) std::memcpy(l.dst, l.truth, l.n);  // (a trapped block's)
    state().late.clear();
    return rc;
}

// common.cuh's pdl_begin: with late writes pending, a barrier of the block (every thread of a
// kernel calls pdl_begin, as on the device) across which thread 0 writes their values
inline void pdl_wait() {
    State& s = state();
    if (s.late.empty()) return;
    sync_block();  // every thread's loads before the wait are made
    if (s.cur->tid.x == 0 && s.cur->tid.y == 0 && s.cur->tid.z == 0) {
        for (const Late& l : s.late) std::memcpy(l.dst, l.truth, l.n);
    }
    sync_block();
}

inline void* dynamic_smem() { return state().dynamic_smem.data(); }
inline unsigned dynamic_smem_size() { return (unsigned)state().dynamic_smem_size; }

// every lane's n registers v[0 .. n), by lane
inline void gather(const int* v, int n, int (&out)[32][8]) {
    State& s = state();
    Warp& w = s.warps[s.cur->warp];
    sync_warp();  // the previous gather's readers are done
    for (int i = 0; i < n; ++i) w.words[s.cur->lane][i] = v[i];
    sync_warp();
    std::memcpy(out, w.words, sizeof out);
}

inline int s8(const int (&regs)[32][8], int lane, int reg, int byte) {
    return (signed char)((unsigned)regs[lane][reg] >> (8 * byte));
}

// mma.sync.aligned.m16n8k{32,16}.row.col.s32.s8.s8.s32 with a zero accumulator: the PTX ISA's
// fragments (lane = 4 group + t): A row r, column k at lane 4 (r % 8) + (k % 16) / 4, register
// (r >= 8) + 2 (k >= 16), byte k % 4; B row k, column n at lane 4 n + (k % 16) / 4, register
// (k >= 16), byte k % 4; D row g + 8 (i >= 2), column 2 t + i % 2 in register i.
template <int K>
inline void mma_s8(int (&c)[4], const int* a, const int* b) {
    int A[32][8], B[32][8];
    gather(a, K / 8, A);
    gather(b, K / 16, B);
    const int lane = state().cur->lane, g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >= 2), n = 2 * t + i % 2;
        int acc = 0;
        for (int k = 0; k < K; ++k) {
            const int kk = k % 16, hi = k >= 16;
            acc += s8(A, 4 * (r % 8) + kk / 4, (r >= 8) + 2 * hi, k % 4) *
                   s8(B, 4 * n + kk / 4, hi, k % 4);
        }
        c[i] = acc;
    }
}

inline void mma_s8_k32(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    const int a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
    mma_s8<32>(c, a, b);
}

inline void mma_s8_k16(int (&c)[4], int a0, int a1, int b0) {
    const int a[2] = {a0, a1}, b[1] = {b0};
    mma_s8<16>(c, a, b);
}

// cvt.rna.tf32.f32: x kept to 10 bits of mantissa (the low 13 bits zero), rounded to nearest
// with ties away from zero; NaN stays NaN, infinities stay
inline unsigned to_tf32(float x) {
    unsigned b;
    std::memcpy(&b, &x, sizeof b);
    if ((b & 0x7f800000u) == 0x7f800000u) return (b & 0xffffe000u) | ((b & 0x7fffffu) ? 0x400000u : 0u);
    return (b + 0x1000u) & 0xffffe000u;
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, d += a b: A row r, column k at lane
// 4 (r % 8) + k % 4, register (r >= 8) + 2 (k >= 4); B row k, column n at lane 4 n + k % 4,
// register (k >= 4); D row g + 8 (i >= 2), column 2 t + i % 2 in register i. The operands'
// low 13 bits are ignored; the products summed in double, then added to d once (the hardware's
// order and rounding of the sum are not the contract's: fast numerics only).
inline void mma_tf32_k8(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    int A[32][8], B[32][8];
    const int av[4] = {(int)a[0], (int)a[1], (int)a[2], (int)a[3]}, bv[2] = {(int)b[0], (int)b[1]};
    gather(av, 4, A);
    gather(bv, 2, B);
    const int lane = state().cur->lane, g = lane / 4, t = lane % 4;
    auto value = [](int word) {
        const unsigned bits = (unsigned)word & 0xffffe000u;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return (double)f;
    };
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >= 2), n = 2 * t + i % 2;
        double acc = 0.0;
        for (int k = 0; k < 8; ++k)
            acc += value(A[4 * (r % 8) + k % 4][(r >= 8) + 2 * (k >= 4)]) *
                   value(B[4 * n + k % 4][k >= 4]);
        d[i] = (float)((double)d[i] + acc);
    }
}

}  // namespace emu

#define threadIdx (emu::state().cur->tid)
#define blockIdx (emu::state().block_idx)
#define blockDim (emu::state().block)
#define gridDim (emu::state().grid)

inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::sync_warp(); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __trap() { emu::trap(); }

template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    const int lane = emu::state().cur->lane;
    return emu::exchange(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const int lane = emu::state().cur->lane;
    const int src = lane ^ mask;  // (PTX: a lane may read any lane up to its segment's last)
    return emu::exchange(v, src <= (lane | (width - 1)) ? src : lane);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = emu::state().cur->lane;
    const int src = lane + (int)delta;
    return emu::exchange(v, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = emu::state().cur->lane;
    const int src = lane - (int)delta;
    return emu::exchange(v, src >= (lane & ~(width - 1)) ? src : lane);
}
inline unsigned __ballot_sync(unsigned, int pred) {
    unsigned r = 0;
    const int size = emu::state().warps[emu::state().cur->warp].bar.size;
    for (int l = 0; l < 32; ++l) {
        // every lane takes part in each round's exchange
        const int got = emu::exchange(pred ? 1 : 0, l);
        if (l < size && got) r |= 1u << l;
    }
    return r;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
    const int size = emu::state().warps[emu::state().cur->warp].bar.size;
    const unsigned full = size == 32 ? 0xffffffffu : (1u << size) - 1;
    return __ballot_sync(m, pred) == full;
}

template <typename T>
inline T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <typename T>
inline T atomicMax(T* p, T v) {
    const T old = *p;
    *p = std::max(old, v);
    return old;
}
template <typename T>
inline T atomicExch(T* p, T v) {
    const T old = *p;
    *p = v;
    return old;
}

// the cache-hinted loads and stores: plain ones
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
template <typename T>
inline T __ldcg(const T* p) {
    return *p;
}
template <typename T>
inline T __ldcs(const T* p) {
    return *p;
}
template <typename T>
inline void __stcg(T* p, T v) {
    *p = v;
}
template <typename T>
inline void __stcs(T* p, T v) {
    *p = v;
}

template <typename To, typename From>
inline To bit_cast(From v) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}
inline float __uint_as_float(unsigned b) { return bit_cast<float>(b); }
inline float __int_as_float(int b) { return bit_cast<float>(b); }
inline unsigned __float_as_uint(float f) { return bit_cast<unsigned>(f); }
inline int __float_as_int(float f) { return bit_cast<int>(f); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }  // correctly rounded, as IEEE asks
inline unsigned __vsub4(unsigned a, unsigned b) {  // four byte differences, each modulo 256
    unsigned r = 0;
    for (int i = 0; i < 32; i += 8) r |= ((((a >> i) & 0xffu) - ((b >> i) & 0xffu)) & 0xffu) << i;
    return r;
}
inline int __dp4a(int a, int b, int c) {  // four signed byte products, added to c
    for (int i = 0; i < 4; ++i) c += (signed char)(a >> (8 * i)) * (signed char)(b >> (8 * i));
    return c;
}

using std::isfinite;  // fabsf, fmaxf, fminf, rintf, roundf: <cmath>'s global C functions

// CUDA's integer min and max, for the mixed types the kernels pass
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
    return a < b ? a : b;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}
