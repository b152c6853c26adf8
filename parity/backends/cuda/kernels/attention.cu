// ATTENTION (docs/numerics.md, "ATTENTION"): per (token, head), scores over positions 0..p,
// their exact max, the project's exp, and per 256-slot chunk the TREEs of the weights and of
// the weighted values, folded left to right over the chunks.
//
// A chunk is computed by one block of 256 threads, thread j owning slot j: its score (the TREE
// over D products, then one multiply by the scale) and its weight e_j. Warp w's 32 K rows stream
// through its own shared tile, 32 columns at a time, read coalesced (one warp instruction loads
// four rows' 128-byte segments) while the previous slab is summed: a thread reading its own row
// straight from global memory would touch 32 cache lines per instruction. The weights' TREE is the
// block tree over the 256 slots; each value dimension i's TREE is split into 256/D aligned
// runs of D slots (thread (part, i) builds run ``part`` sequentially, reading v coalesced
// across i), then the runs are added as a tree. Padding slots are +0.0 literally and their
// cache rows are never read.
//
// attention_rows: one block per (token, head) walks every chunk twice (the max first, then the
//   sums with that max), recomputing the scores bit for bit; no scratch. For prefill.
// attention_rows_gqa: the same, one block for the query heads of a KV head.
// attention_tiles: the same, one block for the query heads of a KV head and a tile of tokens,
//   each chunk's K and V read once for all of them (see below).
// attention_chunks (+ attention_sums): flash decoding, for few tokens. One block per (token,
//   head, chunk). Where a token sees at most ``chunks_one_launch`` chunks (known only when the
//   step runs: a captured step serves every position), each block finds the max over every
//   visible chunk itself (the blocks of a head agree on it bit for bit: max is exact), writes
//   its chunk's sums, and the last block of the head to finish (an atomic ticket) folds them in
//   chunk order; attention_sums, launched after it for caches that can hold more chunks, then
//   has nothing to do. Where it sees more (scoring every chunk in every block would read K once
//   a chunk), each block writes its chunk's 256 scores and their max to scratch, and
//   attention_sums takes the max of the chunk maxes, the weights from the stored scores, the
//   chunk's sums, and folds the same way: K and V are each read once. Same operations, same
//   bits as attention_rows.
//
// A sliding window (``window`` W > 0) makes a token at p see positions lo .. p, lo =
// max(0, p - W + 1): every kernel walks the chunks lo / 256 .. p / 256 only (still aligned at
// position 0), a slot outside lo .. p is padding (+0.0, its score dropped from the max), and
// the fold starts at chunk lo / 256. Rows before lo may be loaded (they are valid memory) but
// their scores and values are dropped, like those of rows past p.
#include "common.cuh"

#define CHUNK 256

struct AttnArgs {
    const float* q;
    const float* k;
    const float* v;
    const int* positions;
    float* out;
    i8* oq;  // when given, out is also quantized (the o-projection's Q8A x)
    float* od;
    float* os;
    float* part;  // flash decoding: per (token, head, chunk) D + 1 floats (N_c then D_c);
                  // attention_fast split over blocks: each block's running sums (FAST_PART)
    float* pmax;  // flash decoding, many chunks: per (token, head, chunk) its scores' max
    float* scores;  // ... and its 256 scores; attention_tiles: the kept scores (or null)
    int* tickets;  // flash decoding: per (token, head) a counter, zero between launches;
                   // attention_fast: per (head, FAST_TB tokens)
    int n_head, n_head_kv, n_ctx;
    int chunks_one_launch;  // flash decoding: attention_chunks alone up to this many chunks;
                            // attention_tiles: the chunks a block's share of scores holds
    int window;  // 0: every position 0 .. p
    int n_tokens;  // T (attention_tiles: its last tile may hold fewer)
    int tile_tokens;  // attention_tiles: the tokens of a block
    float scale;
};

// the first position a token at p sees
__device__ __forceinline__ int window_lo(const AttnArgs& a, int p) {
    return a.window > 0 ? max(0, p - a.window + 1) : 0;
}

// whether slot pos holds a position the token sees
__device__ __forceinline__ bool seen(int pos, int lo, int p) { return pos >= lo && pos <= p; }

#define KTILE 36  // floats per row of a warp's K tile: 16-byte aligned, and bank-conflict free
#define TILE_FLOATS (CHUNK / 32 * 32 * KTILE)  // the 8 warps' tiles

// This warp's K rows [row0, row0 + 32), slabs [s0, s0 + G), in registers: coalesced 16-byte
// loads, lane l holding columns 4(l % 8) .. +3 of rows 4j + l / 8 (j < 8). Rows past p read
// row p (valid; the caller drops their scores); a warp whose rows are all past p loads nothing.
// L2: at L2 (__ldcg), not through L1 (loads before PDL's wait: a row the kernel before still
// writes must not stay in L1 for a later load to find).
template <int G, bool L2 = false>
__device__ __forceinline__ void load_k(float4 (&kb)[G][8], const float* kbase, int width, int p,
                                       int row0, int s0) {
    const int lane = threadIdx.x & 31;
    if (row0 > p) return;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int f = j * 32 + lane, r = f >> 3, c4 = f & 7;
            const float4* at = reinterpret_cast<const float4*>(
                kbase + (i64)min(row0 + r, p) * width + (s0 + g) * 32 + c4 * 4);
            kb[g][j] = L2 ? __ldcg(at) : *at;
        }
    }
}

#define VPRE_OF(D) ((D) < 64 ? (D) : 64)  // V rows of its run a flash-decoding thread loads first

// Thread (part, i)'s V values of chunk c's run up front, rows first .. first + VPRE - 1 at
// dimension i (rows past p read row p: valid, dropped by chunk_sums); none where the run is
// wholly past p. L2: as load_k's.
template <int D, bool L2 = false>
__device__ __forceinline__ void load_run_v(float (&vals)[VPRE_OF(D)], const float* vbase,
                                           int width, int first, int i, int p) {
    if (first > p) return;
#pragma unroll
    for (int j = 0; j < VPRE_OF(D); ++j) {
        const float* at = vbase + (i64)min(first + j, p) * width + i;
        vals[j] = L2 ? __ldcg(at) : *at;
    }
}

// slab g of kb into the warp's tile (32 rows of 32 columns), so that each lane reads its own row
template <int G>
__device__ __forceinline__ void stage_k(float* tile, const float4 (&kb)[G][8], int g) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int f = j * 32 + lane, r = f >> 3, c4 = f & 7;
        *reinterpret_cast<float4*>(tile + r * KTILE + c4 * 4) = kb[g][j];
    }
}

// this lane's products q_d * k_d for the tile's 32 columns d0 .. d0 + 31, pushed onto its TREE
__device__ __forceinline__ void push_slab(float (&st)[10], const float* tile, const float* sq,
                                          int d0) {
    const float* mine = tile + (threadIdx.x & 31) * KTILE;
#pragma unroll
    for (int c = 0; c < 32; c += 4) {
        const float4 kv = *reinterpret_cast<const float4*>(mine + c);
        const float* q = sq + d0 + c;
        tree_push<10>(st, d0 + c, __fmul_rn(q[0], kv.x));
        tree_push<10>(st, d0 + c + 1, __fmul_rn(q[1], kv.y));
        tree_push<10>(st, d0 + c + 2, __fmul_rn(q[2], kv.z));
        tree_push<10>(st, d0 + c + 3, __fmul_rn(q[3], kv.w));
    }
}

// The products of slabs [s0, s0 + G) of this lane's row (held in kb), pushed onto its TREE.
// ROWP: the warp's row rp (0 .. 31; -1: none) is ``fresh`` instead, lane l holding column l of
// each slab (attention_chunks' EARLY: row p loaded again after the wait, kb before it).
template <int G, bool ROWP = false>
__device__ __forceinline__ void score_slabs(float (&st)[10], const float4 (&kb)[G][8],
                                            const float* sq, int s0, float* tile, int rp = -1,
                                            const float (&fresh)[G] = {}) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        stage_k<G>(tile, kb, g);
        if (ROWP && rp >= 0) {
            __syncwarp();  // (the staged row's writers are other lanes)
            tile[rp * KTILE + (threadIdx.x & 31)] = fresh[g];
        }
        __syncwarp();
        push_slab(st, tile, sq, (s0 + g) * 32);
        __syncwarp();
    }
}

// Scores of slots row_of(k) + lane, k = 0 .. n-1, for one warp: emit(k, score) with score =
// fl(TREE_d(fl(q_d * k_d)) * scale), rows past p dropped by the caller. The next slab's loads
// are issued before the current slab is summed.
template <int D, typename RowOf, typename Emit>
__device__ __forceinline__ void warp_scores(const float* sq, const float* kbase, int width, int p,
                                            float scale, int n, RowOf row_of, Emit emit,
                                            float* tile) {
    constexpr int SLABS = D / 32;
    float4 kb[1][8];
    if (n > 0) load_k<1>(kb, kbase, width, p, row_of(0), 0);
    for (int k = 0; k < n; ++k) {
        float st[10];
#pragma unroll
        for (int slab = 0; slab < SLABS; ++slab) {
            stage_k<1>(tile, kb, 0);
            __syncwarp();
            if (slab + 1 < SLABS) load_k<1>(kb, kbase, width, p, row_of(k), slab + 1);
            else if (k + 1 < n) load_k<1>(kb, kbase, width, p, row_of(k + 1), 0);
            push_slab(st, tile, sq, slab * 32);
            __syncwarp();
        }
        emit(k, __fmul_rn(tree_finish<10>(st, D, D), scale));
    }
}

// The max of the chunk maxes pm[c0 .. nc - 1] (exact in any order; a NaN propagates), in every
// lane of the calling warp: lane l loads chunks c0 + l, c0 + l + 32, ..., then the warp's
// butterfly. One L2 round trip for up to 32 chunks, where a chain of max_nan over them took one a
// chunk (its NaN test put each load behind the max before it: 15 at depth 4,000).
__device__ __forceinline__ float max_of_maxes(const float* pm, int c0, int nc) {
    float m = -__int_as_float(0x7f800000);
    for (int k = c0 + (int)(threadIdx.x & 31); k < nc; k += 32) m = max_nan(m, pm[k]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max_nan(m, __shfl_xor_sync(FULL_MASK, m, off));
    return m;
}

__device__ __forceinline__ float block_max(float v, float* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = max_nan(v, __shfl_xor_sync(FULL_MASK, v, off));
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    float m = smem[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = max_nan(m, smem[w]);
    __syncthreads();
    return m;
}

// ---- the query heads of a KV head together --------------------------------------------------
//
// H query heads' maxes, TREEs and scores at once, one array element a head (H = 1: block_max's
// and the 256-slot TREE's operations, for one head). ``red``: H x 8 floats of shared memory.
template <int H>
__device__ __forceinline__ void heads_max(float (&v)[H], float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int h = 0; h < H; ++h) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            v[h] = max_nan(v[h], __shfl_xor_sync(FULL_MASK, v[h], off));
        if (lane == 0) red[h * 8 + warp] = v[h];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < H; ++h) {
        float m = red[h * 8];
        for (int w = 1; w < 8; ++w) m = max_nan(m, red[h * 8 + w]);
        v[h] = m;
    }
    __syncthreads();
}

// each head's TREE over the 256 slots (chunk_tree, H at once)
template <int H>
__device__ __forceinline__ void heads_tree(float (&v)[H], float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int h = 0; h < H; ++h) {
        const float w = warp_tree(v[h], 32);
        if (lane == 0) red[h * 8 + warp] = w;
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < H; ++h) {
        const float* r = red + h * 8;
        v[h] = __fadd_rn(__fadd_rn(__fadd_rn(r[0], r[1]), __fadd_rn(r[2], r[3])),
                         __fadd_rn(__fadd_rn(r[4], r[5]), __fadd_rn(r[6], r[7])));
    }
    __syncthreads();
}

// this thread's slot's scores in the chunk at row0 (its warp's first row), for the H heads
// (kb: the first slab's loads, load_k<1>(kb, ..., row0, 0), issued by the caller)
template <int D, int H>
__device__ __forceinline__ void heads_scores(float (&s)[H], float4 (&kb)[1][8], const float* sq,
                                             const float* kbase, int width, int p, int row0,
                                             float scale, float* tile) {
    constexpr int SLABS = D / 32;
    float st[H][10];
#pragma unroll(SLABS <= 2 ? SLABS : 1)  // (wide heads: a loop, or compiling takes minutes)
    for (int slab = 0; slab < SLABS; ++slab) {
        stage_k<1>(tile, kb, 0);
        __syncwarp();
        if (slab + 1 < SLABS) load_k<1>(kb, kbase, width, p, row0, slab + 1);
#pragma unroll
        for (int h = 0; h < H; ++h) push_slab(st[h], tile, sq + h * D, slab * 32);
        __syncwarp();
    }
#pragma unroll
    for (int h = 0; h < H; ++h) s[h] = __fmul_rn(tree_finish<10>(st[h], D, D), scale);
}

// The max of the scores of chunks [c0, c1) that hold positions lo .. p (-inf if none: -inf
// never wins over a real score, and a NaN still does); keep(c, s) sees this thread's score in
// each.
template <int D, typename Keep>
__device__ float chunks_max(const AttnArgs& a, const float* sq, const float* kbase, int lo, int p,
                            int c0, int c1, float* tile, float* smem, Keep keep) {
    c0 = max(c0, lo / CHUNK);
    const int cend = min(c1, p / CHUNK + 1);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float m = -__int_as_float(0x7f800000);
    auto row_of = [&](int k) { return (c0 + k) * CHUNK + warp * 32; };
    warp_scores<D>(sq, kbase, a.n_head_kv * D, p, a.scale, max(0, cend - c0), row_of,
                   [&](int k, float s) {
                       if (seen(row_of(k) + lane, lo, p)) m = max_nan(m, s);
                       keep(c0 + k, s);
                   }, tile + warp * 32 * KTILE);  // fmt: skip
    return block_max(m, smem);
}

// this thread's score in chunk c
template <int D>
__device__ __forceinline__ float chunk_score(const AttnArgs& a, const float* sq,
                                             const float* kbase, int p, int c, float* tile) {
    const int warp = threadIdx.x >> 5;
    float s = 0.0f;
    warp_scores<D>(sq, kbase, a.n_head_kv * D, p, a.scale, 1,
                   [&](int) { return c * CHUNK + warp * 32; }, [&](int, float v) { s = v; },
                   tile + warp * 32 * KTILE);  // fmt: skip
    return s;
}

// chunk c's D_c and N_c for H query heads of one KV head (H = 1: one head), with the maxes m,
// from this thread's slot's scores s: D_c of head h into s[h], N_c of head h at dimension i into
// sn[h D + i]. se: H x 256 floats (the weights, then the runs), red: H x 8. Thread (part, i)
// sums the values of its run's rows at dimension i for every head: the first VPRE from ``vpre``
// (loaded by the caller, early), the rest loaded here 32 at a time; with VPRE > 0 (flash
// decoding, a block a chunk: registers to spare) each batch is loaded ahead of the one before's
// sums. ROWP: the run's row jp (row p, when it is among the first VPRE) takes vp, not vpre[jp]
// (attention_chunks' EARLY: row p loaded again after the wait).
template <int D, int VPRE = 0, int H = 1, bool ROWP = false>
__device__ void chunk_sums(const AttnArgs& a, const float* vbase, int lo, int p, int c,
                           float (&s)[H], const float (&m)[H], float* se, float* sn, float* red,
                           const float (&vpre)[VPRE > 0 ? VPRE : 1], int jp = -1,
                           float vp = 0.0f) {
    constexpr int PARTS = CHUNK / D;
    const int width = a.n_head_kv * D;
    const bool slot_seen = seen(c * CHUNK + threadIdx.x, lo, p);
#pragma unroll
    for (int h = 0; h < H; ++h) {
        float e = 0.0f;  // padding: +0.0 literally
        if (slot_seen) e = p_exp(__fsub_rn(s[h], m[h]));
        se[h * CHUNK + threadIdx.x] = s[h] = e;
    }
    heads_tree<H>(s, red);  // D_c (its barrier also publishes se)
    const int i = threadIdx.x % D, part = threadIdx.x / D;
    float st[H][10];
    const int first = c * CHUNK + part * D;
    auto push = [&](int j, float v) {  // row first + j's value, into every head's run
        const bool in = seen(first + j, lo, p);
#pragma unroll
        for (int h = 0; h < H; ++h) {
            const float e = se[h * CHUNK + part * D + j];
            tree_push<10>(st[h], j, in ? __fmul_rn(e, v) : 0.0f);
        }
    };
    // the run's values in batches of 32 loads issued together (one memory latency per batch,
    // not one per row); rows past p read row p, a valid one, and are dropped, as are rows
    // before lo
#pragma unroll
    for (int j = 0; j < VPRE; ++j) push(j, ROWP && j == jp ? vp : vpre[j]);
    // the rest. Ahead: batch b + 1's loads are issued before batch b is summed, and a barrier
    // keeps them there (left alone, ptxas moves each load next to its use: one memory latency
    // per row, 77 us a launch for heads of 256). Not ahead (attention_rows, whose registers the
    // second buffer would take: 98 -> 136 at heads of 64, spills at 256): one batch at a time.
    // A batch wholly past p holds padding leaves only, as do all after it: neither loaded nor
    // pushed, tree_finish pads the run from the first of them with +0.0 subtrees (the same
    // bits; at depth 100 a head of 256 sums 128 rows, not 256). ``live`` is uniform across a
    // warp (a warp's threads share their run), and the barrier is kept for every thread.
    constexpr int BATCHES = (D - VPRE) / 32;
    constexpr bool AHEAD = VPRE > 0;
    float vals[AHEAD ? 2 : 1][32];
    auto load_batch = [&](float(&v)[32], int j0) {
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = vbase[(i64)min(first + j0 + j, p) * width + i];
    };
    auto live = [&](int j0) { return first + j0 <= p; };
    if (AHEAD && BATCHES > 0 && live(VPRE)) load_batch(vals[0], VPRE);
    int pushed = VPRE;  // leaves of the run pushed so far
#pragma unroll
    for (int b = 0; b < BATCHES; ++b) {
        const int j0 = VPRE + b * 32;
        float(&now)[32] = vals[AHEAD ? b & 1 : 0];
        if (!AHEAD && live(j0)) load_batch(now, j0);
        else if (AHEAD && b + 1 < BATCHES && live(j0 + 32)) load_batch(vals[(b + 1) & 1], j0 + 32);
        if (AHEAD) __syncthreads();
        if (!live(j0)) continue;
#pragma unroll
        for (int j = 0; j < 32; ++j) push(j0 + j, now[j]);
        pushed = j0 + 32;
    }
    float run[H];
#pragma unroll
    for (int h = 0; h < H; ++h) run[h] = tree_finish<10>(st[h], pushed, D);
    __syncthreads();
#pragma unroll
    for (int h = 0; h < H; ++h) se[h * CHUNK + threadIdx.x] = run[h];  // runs by (part, i)
    __syncthreads();
    for (int o = threadIdx.x; o < H * D; o += CHUNK) {  // N_c of (head o / D, dimension o % D)
        const float* r = se + (o / D) * CHUNK + o % D;
        float n;
        if (PARTS == 1) n = r[0];
        else if (PARTS == 2) n = __fadd_rn(r[0], r[D]);
        else n = __fadd_rn(__fadd_rn(r[0], r[D]), __fadd_rn(r[2 * D], r[3 * D]));
        sn[o] = n;
    }
    __syncthreads();
}

// out[t, col] = num / den, and its Q8 block when wanted, where ``on``: uniform across a warp,
// whose 32 columns make one Q8 block (D is a multiple of 32)
template <int D>
__device__ __forceinline__ void store_out(const AttnArgs& a, int t, int col, bool on, float num,
                                          float den) {
    const int width = a.n_head * D;
    const float o = __fdiv_rn(num, den);
    if (on) a.out[(i64)t * width + col] = o;
    if (a.oq != nullptr && on) {
        const int nb = width / 32, b = col / 32;
        quantize_block(o, a.oq + (i64)t * width + b * 32, a.od + (i64)t * nb + b,
                       a.os + (i64)t * nb + b);
    }
}

template <int D>
__device__ __forceinline__ void load_q(const AttnArgs& a, int t, int h, float* sq) {
    if (threadIdx.x < D) sq[threadIdx.x] = a.q[(i64)t * a.n_head * D + h * D + threadIdx.x];
    __syncthreads();
}

__device__ const float NO_VALUES[1] = {0.0f};  // chunk_sums without preloaded values

#define KEEP_CHUNKS 4  // attention_rows keeps the scores of this many chunks from its max pass

// grid (n_head, T)
template <int D>
__global__ void __launch_bounds__(CHUNK) attention_rows(AttnArgs a) {
    pdl_begin();
    __shared__ __align__(16) float tile[TILE_FLOATS];
    __shared__ float sq[D], se[CHUNK], sn[D], smem[32], kept[KEEP_CHUNKS * CHUNK];
    const int h = blockIdx.x, t = blockIdx.y;
    const int g = h / (a.n_head / a.n_head_kv);
    const int p = a.positions[t];
    const float* kbase = a.k + g * D;
    const float* vbase = a.v + g * D;
    load_q<D>(a, t, h, sq);
    const int lo = window_lo(a, p), c0 = lo / CHUNK, nc = p / CHUNK + 1;
    const float m = chunks_max<D>(a, sq, kbase, lo, p, c0, nc, tile, smem, [&](int c, float s) {
        if (c - c0 < KEEP_CHUNKS) kept[(c - c0) * CHUNK + threadIdx.x] = s;  // read back here
    });
    float num = 0.0f, den = 0.0f;
    for (int c = c0; c < nc; ++c) {
        float s[1] = {c - c0 < KEEP_CHUNKS ? kept[(c - c0) * CHUNK + threadIdx.x]
                                           : chunk_score<D>(a, sq, kbase, p, c, tile)};
        chunk_sums<D>(a, vbase, lo, p, c, s, {m}, se, sn, smem, NO_VALUES);
        const float dc = s[0];
        const float nci = threadIdx.x < D ? sn[threadIdx.x] : 0.0f;
        den = c == c0 ? dc : __fadd_rn(den, dc);
        num = c == c0 ? nci : __fadd_rn(num, nci);
        __syncthreads();
    }
    store_out<D>(a, t, h * D + threadIdx.x, threadIdx.x < D, num, den);
}

// ---- flash decoding -------------------------------------------------------------------------

// Whether a token that sees chunks c0 .. nc - 1 takes the deep path with the query heads of a
// KV head in one block (from HC chunks on; both launches agree), and that block's KV head g and
// chunk c: the launch's first n_head_kv x chunks blocks (x fastest, then z; the rest exit).
template <int HC>
__device__ __forceinline__ bool heads_together(const AttnArgs& a, int c0, int nc) {
    return nc - c0 > a.chunks_one_launch && nc - c0 >= HC;
}

__device__ __forceinline__ void kv_block(const AttnArgs& a, int& g, int& c) {
    const int l = blockIdx.x + gridDim.x * blockIdx.z;
    g = l % a.n_head_kv;
    c = l / a.n_head_kv;
}

#define STAGE_FLOATS 1040  // fold_staged's shared memory: 16 chunks' partials at heads of 64

// publish_and_fold's fold through shared memory: the partials (N_c, then D_c) of FB chunks of
// the H heads at a time loaded by every thread at once (at L2: other blocks wrote them), then
// thread o (head o / D, dimension o % D) adds them in chunk order, as the fold from registers.
template <int D, int H>
__device__ __forceinline__ void fold_staged(const AttnArgs& a, int t, int h0, int c0, int nc,
                                            float* stage) {
    // (H (D + 1) <= 1032 under lowering.py's GQA_HEADS_MAX and HEADS_WIDTH_MAX: FB >= 1)
    constexpr int ROW = H * (D + 1), FB = STAGE_FLOATS / ROW;
    constexpr int OUT = (H * D + CHUNK - 1) / CHUNK, LOADS = (FB * ROW + CHUNK - 1) / CHUNK;
    static_assert(ROW <= STAGE_FLOATS, "a chunk's partials in the stage");
    const i64 th = (i64)t * a.n_head + h0;
    float num[OUT], den[OUT];
    for (int k0 = c0; k0 < nc; k0 += FB) {
        const int nb = min(FB, nc - k0);
        if (k0 > c0) __syncthreads();  // (the batch before is added)
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int v = threadIdx.x + u * CHUNK;
            if (v < nb * ROW) {
                const int j = v / ROW, r = v % ROW;  // chunk k0 + j, head r / (D + 1)
                stage[v] = __ldcg(a.part + ((th + r / (D + 1)) * gridDim.z + k0 + j) * (D + 1) +
                                  r % (D + 1));
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < OUT; ++u) {
            const int o = threadIdx.x + u * CHUNK;
            if (o >= H * D) break;  // (whole warps: H D is a multiple of 32)
            const float* sh = stage + (o / D) * (D + 1);
            for (int j = 0; j < nb; ++j) {
                const float dk = sh[j * ROW + D], nk = sh[j * ROW + o % D];
                den[u] = k0 + j == c0 ? dk : __fadd_rn(den[u], dk);
                num[u] = k0 + j == c0 ? nk : __fadd_rn(num[u], nk);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < OUT; ++u) {
        const int o = threadIdx.x + u * CHUNK;
        if (o < H * D) store_out<D>(a, t, h0 * D + o, true, num[u], den[u]);
    }
}

// Chunk c's sums of the H heads h0 .. h0 + H - 1 (D_c = dc[h], N_c in sn[h D ..]) into their
// scratch; the last of the blocks sharing head h0's ticket (an atomic) folds the chunks c0 ..
// nc - 1 of each head in order and writes the outputs. grid (n_head, T, chunks). FOLD: the
// chunks whose partials are loaded together. A token that sees one chunk (a cache shallower
// than 256 positions) has one block: it writes num / den = N_c / D_c at once (the fold of one
// chunk is that chunk's sums), without the scratch, the fences and the ticket. STAGE (shared
// memory of STAGE_FLOATS, or null): the last block's threads all load the partials of as many
// chunks as it holds at once, one L2 round trip a batch, before the H D of them add them up in
// chunk order (FOLD's loads are a thread's: four chunks a round trip as compiled).
template <int D, int FOLD, int H = 1>
__device__ __forceinline__ void publish_and_fold(const AttnArgs& a, int t, int h0, int c, int c0,
                                                 int nc, const float (&dc)[H], const float* sn,
                                                 int* last, float* stage = nullptr) {
    static_assert(FOLD >= 1, "chunks a fold batch");
    if (nc - c0 == 1) {  // the heads' only chunk: the fold is its own sums, no other block's
#pragma unroll
        for (int h = 0; h < H; ++h) {  // (head by head: dc[o / D] would put dc in memory;
            for (int i = threadIdx.x; i < D; i += CHUNK)  // whole warps: D is a multiple of 32)
                store_out<D>(a, t, (h0 + h) * D + i, true, sn[h * D + i], dc[h]);
        }
        return;
    }
    const i64 th = (i64)t * a.n_head + h0;
    auto part = [&](int h) { return a.part + (th + h) * gridDim.z * (D + 1); };
    for (int o = threadIdx.x; o < H * D; o += CHUNK) part(o / D)[(i64)c * (D + 1) + o % D] = sn[o];
    if (threadIdx.x == 0) {
#pragma unroll
        for (int h = 0; h < H; ++h) part(h)[(i64)c * (D + 1) + D] = dc[h];
    }
    if (!last_block(&a.tickets[th], nc - c0, *last)) return;
    if (stage != nullptr) {
        fold_staged<D, H>(a, t, h0, c0, nc, stage);
        if (threadIdx.x == 0) a.tickets[th] = 0;  // ready for the next launch (or replay)
        return;
    }
    // the chunks' sums at L2 (other blocks wrote them), FOLD chunks' loads issued together
    // before they are added in chunk order: one L2 latency a batch, not a chunk (64 chunks at
    // depth 16,384). Thread o takes head o / D at dimension o % D (whole warps: H D is a
    // multiple of 32).
    for (int o = threadIdx.x; o < H * D; o += CHUNK) {
        const float* ph = part(o / D);
        const int i = o % D;
        float num = 0.0f, den = 0.0f;
        for (int k0 = c0; k0 < nc; k0 += FOLD) {
            float nb[FOLD], db[FOLD];
#pragma unroll
            for (int j = 0; j < FOLD; ++j) {
                const float* pk = ph + (i64)min(k0 + j, nc - 1) * (D + 1);
                nb[j] = __ldcg(pk + i);
                db[j] = __ldcg(pk + D);
            }
#pragma unroll
            for (int j = 0; j < FOLD; ++j) {
                const int k = k0 + j;
                if (k >= nc) break;
                den = k == c0 ? db[j] : __fadd_rn(den, db[j]);
                num = k == c0 ? nb[j] : __fadd_rn(num, nb[j]);
            }
        }
        store_out<D>(a, t, h0 * D + o, true, num, den);
    }
    if (threadIdx.x == 0) a.tickets[th] = 0;  // ready for the next launch (or replay)
}

// A deep token's first launch with the H query heads of KV head g in one block: chunk c's
// scores of each head and their maxes into scratch, its K rows loaded once for the H heads
// (sq: H x D floats, red: H x 8 of shared memory)
template <int D, int H>
__device__ __forceinline__ void heads_chunk_scores(const AttnArgs& a, int t, int g, int c, int lo,
                                                   int p, float* tiles, float* sq, float* red) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int width = a.n_head_kv * D, row0 = c * CHUNK + warp * 32;
    const float* kbase = a.k + g * D;
    float4 kb[1][8];
    load_k<1>(kb, kbase, width, p, row0, 0);  // (issued before q is waited for)
    const float* qrow = a.q + (i64)t * a.n_head * D + g * H * D;  // the H heads, adjacent
    for (int o = threadIdx.x; o < H * D; o += CHUNK) sq[o] = qrow[o];
    __syncthreads();
    float s[H], m[H];
    heads_scores<D, H>(s, kb, sq, kbase, width, p, row0, a.scale, tiles + warp * 32 * KTILE);
    const i64 tc = ((i64)t * a.n_head + g * H) * gridDim.z + c;  // head g H's chunk c
    const bool in = seen(row0 + lane, lo, p);
#pragma unroll
    for (int h = 0; h < H; ++h) {
        a.scores[(tc + h * gridDim.z) * CHUNK + threadIdx.x] = s[h];  // (unseen: dropped later)
        m[h] = in ? s[h] : -__int_as_float(0x7f800000);
    }
    heads_max<H>(m, red);
    if (threadIdx.x == 0) {
#pragma unroll
        for (int h = 0; h < H; ++h) a.pmax[tc + h * gridDim.z] = m[h];
    }
}

// grid (n_head, T, chunks of n_ctx). Every load that needs no result is issued first, together:
// this warp's K rows of chunk c, this thread's V values of its run (one launch only), q. The
// other visible chunks' scores (for the max) stream through the tile after that.
// (MINB: the blocks a multiprocessor should hold, __launch_bounds__'s second argument; 0,
// none, lets the one-launch path keep its V rows in registers, 188 at heads of 64, so one
// block a multiprocessor; 2 caps them at 128, for deep caches' many blocks. FOLD:
// publish_and_fold's. H > 1: the chunks of a token that sees at least HC of them, and more than
// chunks_one_launch, by a block a KV head for its H query heads (heads_together); the other
// tokens' by a block a head. EARLY, for a step of one token whose positions no kernel of the
// step writes (the lowering's EARLY_LOADS): the position, then those K rows and V values, at
// L2, before PDL's wait, while the kernel before (the step's KV_WRITE of row p) still runs; the
// cache's other rows were written by earlier steps, and row p is loaded again after the wait.
// AHEAD, where chunks_one_launch is 0 (every token's scores go through scratch: heads of 256):
// no one-launch path, so no V values held, and the K slabs a slab at a time, each next slab's
// loads issued before this one is scored, where the rounds of G slabs wait for their loads one
// after another; the same products pushed in the same order: the same bits.)
template <int D, int MINB = 0, int FOLD = 1, int H = 1, int HC = 0, int EARLY = 0, int AHEAD = 0>
__global__ void __launch_bounds__(CHUNK, MINB) attention_chunks(AttnArgs a) {
    if (!EARLY) pdl_begin();
    static_assert(!(AHEAD && EARLY), "AHEAD's slabs load after the wait");
    constexpr int SLABS = D / 32;
    constexpr int G = AHEAD || SLABS < 2 ? 1 : 2;  // K slabs held at once (AHEAD: and the next)
    constexpr int VPRE = VPRE_OF(D);
    __shared__ __align__(16) float tiles[TILE_FLOATS];
    __shared__ float sq[H * D], se[CHUNK], sn[D], smem[H * 8 > 32 ? H * 8 : 32];
    __shared__ int last;
    const int t = blockIdx.y;
    const int p = EARLY ? __ldcg(a.positions + t) : a.positions[t];
    const int lo = window_lo(a, p), c0 = lo / CHUNK, nc = p / CHUNK + 1;
    if (nc > (int)gridDim.z) __trap();  // a position past the chunks launched (GraphParams.reach)
    if (H > 1 && heads_together<HC>(a, c0, nc)) {
        if (EARLY) pdl_begin();
        int g, c;
        kv_block(a, g, c);
        if (c >= c0 && c < nc) heads_chunk_scores<D, H>(a, t, g, c, lo, p, tiles, sq, smem);
        return;
    }
    const int h = blockIdx.x, c = blockIdx.z;
    const int g = h / (a.n_head / a.n_head_kv);
    const bool live = c >= c0 && c < nc;  // (else outside the window or past the position)
    if (!EARLY && !live) return;           // no ticket
    const bool alone = !AHEAD && nc - c0 <= a.chunks_one_launch;  // (else: attention_sums)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int width = a.n_head_kv * D;
    const float* kbase = a.k + g * D;
    const float* vbase = a.v + g * D;
    float* tile = tiles + warp * 32 * KTILE;
    const int row0 = c * CHUNK + warp * 32;
    float4 kb[G][8];
    if (!EARLY) load_k<G>(kb, kbase, width, p, row0, 0);
    const int first = c * CHUNK + (threadIdx.x / D) * D, i = threadIdx.x % D;
    float vals[VPRE];
    // (EARLY: row p, which the kernel before wrote, loaded again after the wait: its place
    // among the warp's K rows, its K columns of the first slabs, its value of the run)
    const int rp = p >= row0 && p < row0 + 32 ? p - row0 : -1;
    float kp[G], vp = 0.0f;
    if (EARLY) {  // (every block waits, one without work too: common.cuh's second rule)
        if (live) load_k<G, true>(kb, kbase, width, p, row0, 0);
        if (live && alone) load_run_v<D, true>(vals, vbase, width, first, i, p);
        pdl_begin();
        if (!live) return;  // no ticket
        if (rp >= 0) {
#pragma unroll
            for (int slab = 0; slab < G; ++slab)
                kp[slab] = __ldcg(kbase + (i64)p * width + slab * 32 + lane);
        }
        if (alone && first <= p && p < first + VPRE) vp = __ldcg(vbase + (i64)p * width + i);
    } else if (alone) {
        load_run_v<D>(vals, vbase, width, first, i, p);
    }
    load_q<D>(a, t, h, sq);
    float st[10];
    if constexpr (AHEAD > 0) {
        float4 kn[1][8];
#pragma unroll
        for (int slab = 0; slab < SLABS; ++slab) {  // (unrolled: kb and kn take turns)
            const bool next = slab + 1 < SLABS;
            if (slab & 1) {
                if (next) load_k<1>(kb, kbase, width, p, row0, slab + 1);
                score_slabs<1>(st, kn, sq, slab, tile);
            } else {
                if (next) load_k<1>(kn, kbase, width, p, row0, slab + 1);
                score_slabs<1>(st, kb, sq, slab, tile);
            }
        }
    } else {
#pragma unroll
        for (int s0 = 0; s0 < SLABS; s0 += G) {
            if (s0 > 0) load_k<G>(kb, kbase, width, p, row0, s0);
            score_slabs<G, EARLY != 0>(st, kb, sq, s0, tile, s0 == 0 ? rp : -1, kp);
        }
    }
    const float s = __fmul_rn(tree_finish<10>(st, D, D), a.scale);  // this slot's score
    if (!alone) {  // the score and the chunk's max, for attention_sums
        const i64 tc = ((i64)t * a.n_head + h) * gridDim.z + c;
        a.scores[tc * CHUNK + threadIdx.x] = s;  // (slots not seen: dropped there)
        const float m = block_max(seen(row0 + lane, lo, p) ? s : -__int_as_float(0x7f800000),
                                  smem);
        if (threadIdx.x == 0) a.pmax[tc] = m;
        return;
    }
    float m = seen(row0 + lane, lo, p) ? s : -__int_as_float(0x7f800000);
    if (nc - c0 > 1) {  // the other visible chunks, for the max only
        auto row_of = [&](int k) {  // chunk k of c0 .. nc - 1 without c
            return (c0 + k < c ? c0 + k : c0 + k + 1) * CHUNK + warp * 32;
        };
        warp_scores<D>(sq, kbase, width, p, a.scale, nc - c0 - 1, row_of,
                       [&](int k, float v) {
                           if (seen(row_of(k) + lane, lo, p)) m = max_nan(m, v);
                       }, tile);  // fmt: skip
    }
    float e[1] = {s};
    chunk_sums<D, VPRE, 1, EARLY != 0>(a, vbase, lo, p, c, e, {block_max(m, smem)}, se, sn, smem,
                                       vals, p - first, vp);
    publish_and_fold<D, FOLD>(a, t, h, c, c0, nc, e, sn, &last);
}

// ---- flash decoding over more chunks: the scores through scratch ---------------------------------

// Chunk c's weights for the H heads h0 .. h0 + H - 1 of KV head g (H = 1: head h0) from their
// stored scores and the max of their chunks' maxes, its sums, and the fold by the heads' last
// block. This thread's V values (load_run_v's) are loaded by the caller, first. se: H x 256
// floats, sn: H x D, red: H x 8.
template <int D, int FOLD, int H>
__device__ __forceinline__ void sums_from_scores(const AttnArgs& a, int t, int h0, int g, int c,
                                                 int lo, int p, int c0, int nc,
                                                 const float (&vals)[VPRE_OF(D)], float* se,
                                                 float* sn, float* red, int* last,
                                                 float* stage) {
    constexpr int VPRE = VPRE_OF(D);
    const float* vbase = a.v + g * D;
    const i64 th = (i64)t * a.n_head + h0;
    float s[H], m[H];
#pragma unroll
    for (int h = 0; h < H; ++h) {
        s[h] = a.scores[((th + h) * gridDim.z + c) * CHUNK + threadIdx.x];
        m[h] = max_of_maxes(a.pmax + (th + h) * gridDim.z, c0, nc);  // (each warp its own)
    }
    chunk_sums<D, VPRE, H>(a, vbase, lo, p, c, s, m, se, sn, red, vals);
    publish_and_fold<D, FOLD, H>(a, t, h0, c, c0, nc, s, sn, last, stage);
}

// grid (n_head, T, chunks of n_ctx), after attention_chunks: where a token sees more than
// chunks_one_launch chunks, chunk c's sums from its stored scores (sums_from_scores), by a block
// a head, or with H > 1 for a token heads_together<HC> takes, by a block a KV head for its H
// query heads (V read once for them). EARLY (the lowering's EARLY_LOADS, where the step's
// KV_WRITE ran at least two launches before, as attention_chunks sits between them): the
// position and this thread's V values at L2 before PDL's wait, while attention_chunks still
// runs: this kernel started only once every block of attention_chunks had passed its wait, so
// the KV_WRITE has finished, and no kernel after it writes the cache.
template <int D, int MINB = 0, int FOLD = 1, int H = 1, int HC = 0, int EARLY = 0>
__global__ void __launch_bounds__(CHUNK, MINB) attention_sums(AttnArgs a) {
    if (!EARLY) pdl_begin();
    __shared__ float se[H * CHUNK], sn[H * D], smem[H * 8 > 32 ? H * 8 : 32];
    __shared__ float stage[STAGE_FLOATS];  // (the fold's)
    __shared__ int last;
    const int t = blockIdx.y;
    const int p = EARLY ? __ldcg(a.positions + t) : a.positions[t];
    const int lo = window_lo(a, p), c0 = lo / CHUNK, nc = p / CHUNK + 1;
    if (nc > (int)gridDim.z) __trap();  // (as attention_chunks)
    const bool deep = nc - c0 > a.chunks_one_launch;  // (else attention_chunks did)
    const bool together = H > 1 && deep && heads_together<HC>(a, c0, nc);
    int g, c, h0;
    if (together) {
        kv_block(a, g, c);
        h0 = g * H;
    } else {
        h0 = blockIdx.x;
        c = blockIdx.z;
        g = h0 / (a.n_head / a.n_head_kv);
    }
    const bool live = deep && c >= c0 && c < nc;
    const int width = a.n_head_kv * D, first = c * CHUNK + (threadIdx.x / D) * D;
    float vals[VPRE_OF(D)];
    if (EARLY) {  // (every block waits, one without work too: when no token is deep, none
                  // has work, and o's wait must still cover attention_chunks)
        if (live) load_run_v<D, true>(vals, a.v + g * D, width, first, threadIdx.x % D, p);
        pdl_begin();
    }
    if (!live) return;
    if (!EARLY) load_run_v<D>(vals, a.v + g * D, width, first, threadIdx.x % D, p);
    if (together)
        sums_from_scores<D, FOLD, H>(a, t, h0, g, c, lo, p, c0, nc, vals, se, sn, smem, &last,
                                     stage);
    else
        sums_from_scores<D, FOLD, 1>(a, t, h0, g, c, lo, p, c0, nc, vals, se, sn, smem, &last,
                                     stage);
}

// ---- flash decoding's sums a quarter of a chunk a block (heads of 256) --------------------------

// grid (n_head, T, 4 x chunks of n_ctx), 256 threads, after attention_chunks, where every
// token's scores go through scratch (chunks_one_launch 0: heads of 256), in attention_sums'
// place (the lowering's QUARTER_SUMS): a block a (head, token, quarter of a chunk), 64 slots,
// thread i dimension i. attention_sums' block makes a chunk's weights' TREE and each
// dimension's TREE over the chunk's 256 rows in one thread's chain, and loads all 256 rows of
// V; here each block makes the subtrees of its quarter (its 64 weights: warps 0 and 1, the block
// tree's first pair; dimension i over its 64 rows), and the last block of the (token, head)
// (an atomic ticket) adds each chunk's four in tree order, ((Q0 + Q1) + (Q2 + Q3)), the two top
// levels of the 256-slot TREEs, then folds the chunks left to right and writes the outputs:
// the same adds, the same bits. A quarter holding no slot of lo .. p has no block's work (its
// subtrees are +0.0, as a TREE of padding is) and takes no ticket, nor does a token that sees
// at most chunks_one_launch chunks (attention_sums' rule; the lowering gives it 0). EARLY: the position and
// this thread's V values at L2 before PDL's wait, as attention_sums' (the cache's KV_WRITE ran
// two launches back); the scores and maxes, attention_chunks' (the launch before), after it.
template <int D, int EARLY = 0>
__global__ void __launch_bounds__(CHUNK) attention_quarters(AttnArgs a) {
    static_assert(D == CHUNK, "a thread a dimension, a quarter 64 of the chunk's 256 slots");
    constexpr int QR = CHUNK / 4;  // the rows (slots) of a quarter
    if (!EARLY) pdl_begin();
    __shared__ float se[QR], red[2];
    __shared__ int last;
    const int t = blockIdx.y, h = blockIdx.x, gq = blockIdx.z;  // gq: quarter of the cache
    const int chunks = gridDim.z / 4, c = gq / 4;
    const int p = EARLY ? __ldcg(a.positions + t) : a.positions[t];
    const int lo = window_lo(a, p), c0 = lo / CHUNK, nc = p / CHUNK + 1;
    if (nc > chunks) __trap();  // (as attention_chunks)
    const int qa = lo / QR, qb = p / QR;  // the quarters holding a slot of lo .. p
    const bool deep = nc - c0 > a.chunks_one_launch;  // (else attention_chunks did: none, as
                                                       // the lowering launches it, at 0)
    const bool live = deep && gq >= qa && gq <= qb;
    const int g = h / (a.n_head / a.n_head_kv), i = threadIdx.x, first = gq * QR;
    const int width = a.n_head_kv * D;
    const float* vbase = a.v + g * D;
    float vals[QR];  // rows first .. first + 63 at dimension i (past p: row p, dropped)
    if (EARLY) {  // (every block waits, one without work too)
        if (live) {
#pragma unroll
            for (int j = 0; j < QR; ++j) vals[j] = __ldcg(vbase + (i64)min(first + j, p) * width + i);
        }
        pdl_begin();
    }
    if (!live) return;  // no ticket
    if (!EARLY) {
#pragma unroll
        for (int j = 0; j < QR; ++j) vals[j] = vbase[(i64)min(first + j, p) * width + i];
    }
    const i64 th = (i64)t * a.n_head + h;
    // the quarter's weights and their subtree (threads 0 .. 63: warps 0 and 1)
    if (i < QR) {
        const float m = max_of_maxes(a.pmax + th * chunks, c0, nc);  // (warps 0 and 1 each)
        const float sc = a.scores[(th * chunks + c) * CHUNK + (gq % 4) * QR + i];
        float e = 0.0f;  // padding: +0.0 literally
        if (seen(first + i, lo, p)) e = p_exp(__fsub_rn(sc, m));
        se[i] = e;
        const float w = warp_tree(e, 32);
        if ((i & 31) == 0) red[i >> 5] = w;
    }
    __syncthreads();
    float st[10];
#pragma unroll
    for (int j = 0; j < QR; ++j)
        tree_push<10>(st, j, seen(first + j, lo, p) ? __fmul_rn(se[j], vals[j]) : 0.0f);
    float* part = a.part + (th * gridDim.z + gq) * (D + 1);
    part[i] = tree_finish<10>(st, QR, QR);
    if (i == 0) part[D] = __fadd_rn(red[0], red[1]);
    if (!last_block<true>(&a.tickets[th], qb - qa + 1, last)) return;
    // the chunks' sums from their quarters' subtrees (at L2: other blocks wrote them), in order
    const float* ph = a.part + th * gridDim.z * (D + 1);
    float num = 0.0f, den = 0.0f;
    for (int k = c0; k < nc; ++k) {
        float nq[4], dq[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int q = k * 4 + r;
            const bool on = q >= qa && q <= qb;  // (else +0.0: a subtree of padding)
            nq[r] = on ? __ldcg(ph + (i64)q * (D + 1) + i) : 0.0f;
            dq[r] = on ? __ldcg(ph + (i64)q * (D + 1) + D) : 0.0f;
        }
        const float nk = __fadd_rn(__fadd_rn(nq[0], nq[1]), __fadd_rn(nq[2], nq[3]));
        const float dk = __fadd_rn(__fadd_rn(dq[0], dq[1]), __fadd_rn(dq[2], dq[3]));
        num = k == c0 ? nk : __fadd_rn(num, nk);
        den = k == c0 ? dk : __fadd_rn(den, dk);
    }
    store_out<D>(a, t, h * D + i, true, num, den);
    if (i == 0) a.tickets[th] = 0;  // ready for the next launch (or replay)
}

// ---- prefill, the query heads of a KV head together ---------------------------------------------

// The H query heads h = g H .. g H + H - 1 that read KV head g, for one token: every K and V row
// is loaded once for the H heads (prefill reads each row for every head and every later token,
// and H is 3 to 7 here). Per head, the operations of attention_rows in its order: thread j owns
// slot j of a chunk, the max pass first, then per chunk the scores again, the weights' TREE and
// the values' runs. Shared memory: ``pool`` holds the warps' K tiles while scores are made, then
// the weights (H x 256), then the runs (H x 256).
// grid (n_head_kv, T); H = n_head / n_head_kv
template <int D, int H>
__global__ void __launch_bounds__(CHUNK) attention_rows_gqa(AttnArgs a) {
    pdl_begin();
    constexpr int PARTS = CHUNK / D;
    static_assert(H * CHUNK <= TILE_FLOATS, "the pool holds H x 256 weights");
    __shared__ __align__(16) float pool[TILE_FLOATS];
    __shared__ float sq[H * D], acc[H * D], red[H * 8], den[H];
    const int g = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int p = a.positions[t];
    const int lo = window_lo(a, p), c0 = lo / CHUNK, nc = p / CHUNK + 1;
    const int width = a.n_head_kv * D;
    const float* kbase = a.k + g * D;
    const float* vbase = a.v + g * D;
    float* tile = pool + warp * 32 * KTILE;
    const float* qrow = a.q + (i64)t * a.n_head * D + g * H * D;  // the H heads, adjacent
    for (int o = tid; o < H * D; o += CHUNK) sq[o] = qrow[o];
    __syncthreads();
    float m[H];
#pragma unroll
    for (int h = 0; h < H; ++h) m[h] = -__int_as_float(0x7f800000);
    for (int c = c0; c < nc; ++c) {
        float s[H];
        float4 kb[1][8];
        load_k<1>(kb, kbase, width, p, c * CHUNK + warp * 32, 0);
        heads_scores<D, H>(s, kb, sq, kbase, width, p, c * CHUNK + warp * 32, a.scale, tile);
        if (seen(c * CHUNK + tid, lo, p)) {
#pragma unroll
            for (int h = 0; h < H; ++h) m[h] = max_nan(m[h], s[h]);
        }
    }
    heads_max<H>(m, red);
    const int i = tid % D, part = tid / D;
    for (int c = c0; c < nc; ++c) {
        const int pos = c * CHUNK + tid;
        float e[H];
        float4 kb[1][8];
        load_k<1>(kb, kbase, width, p, c * CHUNK + warp * 32, 0);
        heads_scores<D, H>(e, kb, sq, kbase, width, p, c * CHUNK + warp * 32, a.scale, tile);
#pragma unroll
        for (int h = 0; h < H; ++h) e[h] = seen(pos, lo, p) ? p_exp(__fsub_rn(e[h], m[h])) : 0.0f;
        __syncthreads();  // every warp is done with its tile: the pool takes the weights
#pragma unroll
        for (int h = 0; h < H; ++h) pool[h * CHUNK + tid] = e[h];
        heads_tree<H>(e, red);  // D_c per head (its barrier also publishes the weights)
        // the runs: thread (part, i) over rows first .. first + D - 1 of its part, every head
        const int first = c * CHUNK + part * D;
        float st[H][10];
#pragma unroll(D <= 64 ? D / 32 : 1)
        for (int j0 = 0; j0 < D; j0 += 32) {
            float vals[32];
#pragma unroll
            for (int j = 0; j < 32; ++j) vals[j] = vbase[(i64)min(first + j0 + j, p) * width + i];
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const bool in = seen(first + j0 + j, lo, p);
#pragma unroll
                for (int h = 0; h < H; ++h) {
                    const float w = pool[h * CHUNK + part * D + j0 + j];
                    tree_push<10>(st[h], j0 + j, in ? __fmul_rn(w, vals[j]) : 0.0f);
                }
            }
        }
        __syncthreads();  // the weights are read: the pool takes the runs
#pragma unroll
        for (int h = 0; h < H; ++h) pool[h * CHUNK + tid] = tree_finish<10>(st[h], D, D);
        __syncthreads();
        for (int o = tid; o < H * D; o += CHUNK) {  // N_c of (head o / D, dimension o % D)
            const float* r = pool + (o / D) * CHUNK + o % D;
            float nci;
            if (PARTS == 1) nci = r[0];
            else if (PARTS == 2) nci = __fadd_rn(r[0], r[D]);
            else nci = __fadd_rn(__fadd_rn(r[0], r[D]), __fadd_rn(r[2 * D], r[3 * D]));
            acc[o] = c == c0 ? nci : __fadd_rn(acc[o], nci);
        }
        if (tid == 0) {
#pragma unroll
            for (int h = 0; h < H; ++h) den[h] = c == c0 ? e[h] : __fadd_rn(den[h], e[h]);
        }
        __syncthreads();  // before the next chunk's tiles overwrite the runs
    }
    // out[t, (g H + h) D + i] = num / den, and its Q8 blocks when wanted (whole warps: H D is a
    // multiple of 32)
    const int out_width = a.n_head * D;
    for (int o0 = warp * 32; o0 < H * D; o0 += CHUNK) {
        const int o = o0 + lane;
        const float v = __fdiv_rn(acc[o], den[o / D]);
        const int col = g * H * D + o;
        a.out[(i64)t * out_width + col] = v;
        if (a.oq != nullptr) {
            const int nb = out_width / 32, b = col / 32;
            quantize_block(v, a.oq + (i64)t * out_width + b * 32, a.od + (i64)t * nb + b,
                           a.os + (i64)t * nb + b);
        }
    }
}

// ---- prefill: a block a KV head and a tile of tokens -----------------------------------------
//
// attention_tiles<D>: grid (n_head_kv, ceil(T / TQ)), TQ = ``tile_tokens``; the block takes the
// H query heads of KV head g for TQ tokens, R = H TQ query rows (r = tq H + h), so each
// chunk's K and V rows are read once for all of them, not once a token. Thread j holds 64
// columns of slot j's K row in registers at a time (a slab) and makes the rows' TREEs over
// them, q broadcast from shared memory; a row's score is its slabs' TREEs added as the TREE's
// upper levels (heads of 128: S0 + S1; of 256: (S0 + S1) + (S2 + S3)), the partial sums kept
// by row in shared memory (P, Q). For the sums, thread (part, i) takes its run of D slots at
// dimension i 64 rows at a time, each batch's values in registers, and makes the rows' TREEs
// over them, added the same way. Every score, weight, TREE and fold is the one attention_rows
// makes, and so are the bits. The scores are made twice (the max pass, then the sums), as in
// attention_rows, unless KEEP and ``scores`` (lowering.py's TILE_SCORES_BYTES): a block whose
// chunks fit its share of that scratch keeps pass 1's scores there (global memory, mostly L2
// at these sizes) and pass 2 reads them back, the same floats. Dynamic shared memory:
// lowering.py's tiles_shared(R, D) bytes (at most about 81 KiB). Heads of 64 and 256 fit 128 registers, two blocks an SM (8 and 48 bytes spilled;
// with KEEP 40 and 52); heads of 128 take 250 (ptxas, sm_90), one block an SM.
#define TILE_TOKENS 32  // TQ at most

// columns [c0, c0 + 64) of K row ``row`` (clamped to row ``last``: a valid row, dropped later)
__device__ __forceinline__ void load_slab(float4 (&kr)[16], const float* kbase, int width,
                                          int row, int last, int c0) {
    const float4* src = reinterpret_cast<const float4*>(kbase + (i64)min(row, last) * width + c0);
#pragma unroll
    for (int d = 0; d < 16; ++d) kr[d] = src[d];
}

// TREE_d(fl(q_d k_d)) over a slab's 64 columns, q from shared memory, k in registers
__device__ __forceinline__ float slab_dot(const float4 (&kr)[16], const float* q) {
    float st[10];
#pragma unroll
    for (int d = 0; d < 16; ++d) {
        const float4 qv = *reinterpret_cast<const float4*>(q + 4 * d);
        tree_push<10>(st, 4 * d, __fmul_rn(qv.x, kr[d].x));
        tree_push<10>(st, 4 * d + 1, __fmul_rn(qv.y, kr[d].y));
        tree_push<10>(st, 4 * d + 2, __fmul_rn(qv.z, kr[d].z));
        tree_push<10>(st, 4 * d + 3, __fmul_rn(qv.w, kr[d].w));
    }
    return tree_finish<10>(st, 64, 64);
}

// the TREE of NS subtrees of 64 leaves, given one at a time (k = 0 .. NS - 1): returns it at
// the last; the earlier ones wait in p and q (this thread's own slots)
template <int NS>
__device__ __forceinline__ float upper_tree(int k, float s, float* p, float* q) {
    if (NS == 1) return s;
    if (NS == 2) {
        if (k == 0) *p = s;
        return k == 0 ? 0.0f : __fadd_rn(*p, s);
    }
    if (k == 0) *p = s;
    else if (k == 1) *p = __fadd_rn(*p, s);
    else if (k == 2) *q = s;
    else return __fadd_rn(*p, __fadd_rn(*q, s));
    return 0.0f;
}

// the TREE of a batch: fl(e_j v_j) for its 64 slots from ``first``, +0.0 where the token does
// not see the slot (CHECK false: it sees them all)
template <bool CHECK>
__device__ __forceinline__ float batch_run(const float* e, const float (&vals)[64], int first,
                                           int lo, int p) {
    float st[10];
#pragma unroll
    for (int j = 0; j < 64; j += 4) {
        const float4 ev = *reinterpret_cast<const float4*>(e + j);
        const float ej[4] = {ev.x, ev.y, ev.z, ev.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const bool in = !CHECK || seen(first + j + k, lo, p);
            tree_push<10>(st, j + k, in ? __fmul_rn(ej[k], vals[j + k]) : 0.0f);
        }
    }
    return tree_finish<10>(st, 64, 64);
}

template <int D, bool KEEP = false>  // KEEP: the scores may be kept (``scores`` given)
__global__ void __launch_bounds__(CHUNK, D == 128 ? 1 : 2) attention_tiles(AttnArgs a) {
    pdl_begin();
    constexpr int NS = D / 64, PARTS = CHUNK / D;
    static_assert(D == 64 || D == 128 || D == 256, "heads of 64, 128 or 256");
    const int H = a.n_head / a.n_head_kv, TQ = a.tile_tokens, R = H * TQ;
    extern __shared__ __align__(16) float tiles[];
    // the launch must give TQ <= TILE_TOKENS tokens and the rows' shared memory (lowering.py's
    // tile_tokens and tiles_shared): a wrong one would write past them
    const u32 need = 4u * R * (2 * D + (NS == 4 ? 3 : 2) * CHUNK + 2);
    if (threadIdx.x == 0 && (TQ < 1 || TQ > TILE_TOKENS || dynamic_smem_bytes() < need)) __trap();
    float* qs = tiles;  // [R][D] the q rows
    float* w = qs + R * D;  // [R][CHUNK] running maxes, then a chunk's weights
    float* ps_ = w + R * CHUNK;  // [R][CHUNK] upper-tree partials; a chunk's runs at the end
    float* qq = ps_ + R * CHUNK;  // [R][CHUNK] more partials (heads of 256)
    float* acc = qq + (NS == 4 ? R * CHUNK : 0);  // [R][D] the folded N_c
    float* mx = acc + R * D;  // [R]
    float* den = mx + R;  // [R]
    __shared__ int ps[TILE_TOKENS], los[TILE_TOKENS];
    const int g = blockIdx.x, t0 = blockIdx.y * TQ, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int width = a.n_head_kv * D, out_width = a.n_head * D;
    const float* kbase = a.k + g * D;
    const float* vbase = a.v + g * D;
    if (tid < TQ) {  // (tokens past the last: their rows copy the last token's, not stored)
        const int t = min(t0 + tid, a.n_tokens - 1);
        ps[tid] = a.positions[t];
        los[tid] = window_lo(a, ps[tid]);
    }
    for (int o = tid; o < R * D; o += CHUNK) {  // q rows: token t0 + o / (H D), heads g H ..
        const int t = min(t0 + o / (H * D), a.n_tokens - 1);
        qs[o] = a.q[(i64)t * out_width + g * H * D + o % (H * D)];
    }
    for (int r = 0; r < R; ++r) w[r * CHUNK + tid] = -__int_as_float(0x7f800000);
    __syncthreads();
    int cmin = los[0] / CHUNK, cmax = 0, last = 0;
    for (int tq = 0; tq < TQ; ++tq) {
        cmin = min(cmin, los[tq] / CHUNK);
        cmax = max(cmax, ps[tq] / CHUNK);
        last = max(last, ps[tq]);
    }
    // the scores kept for pass 2 (KEEP, and this block's chunks no more than the
    // ``chunks_one_launch`` its share holds: R rows of that many chunks); else pass 2 makes
    // them again. (Worked out at each use from the arguments: registers held across the
    // passes spill.)
    auto keep = [&] { return KEEP && cmax - cmin < a.chunks_one_launch; };
    auto kept = [&](int r, int c) {  // row r's score of slot tid of chunk c
        const i64 row = (i64)(blockIdx.y * gridDim.x + blockIdx.x) * R + r;
        return a.scores + (row * a.chunks_one_launch + c - cmin) * CHUNK + threadIdx.x;
    };
    // every row's score of this thread's slot in chunk c, slab by slab: act(r, in, score)
    auto scores = [&](int c, auto act) {
        const int pos = c * CHUNK + tid;
#pragma unroll
        for (int k = 0; k < NS; ++k) {
            float4 kr[16];
            load_slab(kr, kbase, width, pos, last, 64 * k);
            for (int tq = 0; tq < TQ; ++tq) {
                const bool in = seen(pos, los[tq], ps[tq]);
                for (int h = 0; h < H; ++h) {
                    const int r = tq * H + h;
                    const float s = upper_tree<NS>(k, slab_dot(kr, qs + r * D + 64 * k),
                                                   ps_ + r * CHUNK + tid, qq + r * CHUNK + tid);
                    if (k == NS - 1) act(r, in, __fmul_rn(s, a.scale));
                }
            }
        }
    };
    // pass 1: each thread's max of its slots' scores, by row (in w), then each row's
    for (int c = cmin; c <= cmax; ++c) {
        scores(c, [&](int r, bool in, float s) {
            if (in) w[r * CHUNK + tid] = max_nan(w[r * CHUNK + tid], s);
            if (keep()) *kept(r, c) = s;
        });
    }
    __syncthreads();
    for (int r = warp; r < R; r += CHUNK / 32) {  // a warp a row: lane l's 8 slots, then 32 lanes
        const float4 m0 = *reinterpret_cast<const float4*>(w + r * CHUNK + lane * 8);
        const float4 m1 = *reinterpret_cast<const float4*>(w + r * CHUNK + lane * 8 + 4);
        float v = max_nan(max_nan(max_nan(m0.x, m0.y), max_nan(m0.z, m0.w)),
                          max_nan(max_nan(m1.x, m1.y), max_nan(m1.z, m1.w)));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v = max_nan(v, __shfl_xor_sync(FULL_MASK, v, off));
        if (lane == 0) mx[r] = v;
    }
    __syncthreads();
    // pass 2, chunk by chunk: the weights; D_c (a warp a row: lane l's 8 slots, then the warp
    // tree, which is the 256-slot TREE); the runs of thread (part, i); N_c; each folded into
    // the rows whose token sees the chunk
    const int i = tid % D, part = tid / D;
    for (int c = cmin; c <= cmax; ++c) {
        auto weigh = [&](int r, bool in, float s) {
            w[r * CHUNK + tid] = in ? p_exp(__fsub_rn(s, mx[r])) : 0.0f;
        };
        if (keep()) {  // (this thread wrote them: no barrier)
            const int pos = c * CHUNK + tid;
            for (int tq = 0; tq < TQ; ++tq) {
                const bool in = seen(pos, los[tq], ps[tq]);
                for (int h = 0; h < H; ++h) {
                    const int r = tq * H + h;
                    weigh(r, in, *kept(r, c));
                }
            }
        } else {
            scores(c, weigh);
        }
        __syncthreads();
        for (int r = warp; r < R; r += CHUNK / 32) {
            const float4 e0 = *reinterpret_cast<const float4*>(w + r * CHUNK + lane * 8);
            const float4 e1 = *reinterpret_cast<const float4*>(w + r * CHUNK + lane * 8 + 4);
            float v = __fadd_rn(__fadd_rn(__fadd_rn(e0.x, e0.y), __fadd_rn(e0.z, e0.w)),
                                __fadd_rn(__fadd_rn(e1.x, e1.y), __fadd_rn(e1.z, e1.w)));
            v = warp_tree(v, 32);
            const int tq = r / H, c0 = los[tq] / CHUNK;
            if (lane == 0 && c >= c0 && c <= ps[tq] / CHUNK)
                den[r] = c == c0 ? v : __fadd_rn(den[r], v);
        }
        // the runs, a batch of 64 slots at a time; the run of (part, i) ends in ps_
#pragma unroll
        for (int b = 0; b < NS; ++b) {
            const int first = c * CHUNK + part * D + 64 * b;
            float vals[64];
#pragma unroll
            for (int j = 0; j < 64; ++j) vals[j] = vbase[(i64)min(first + j, last) * width + i];
            for (int tq = 0; tq < TQ; ++tq) {
                const int lo = los[tq], p = ps[tq];
                const int r0 = tq * H;
                const float* e = w + part * D + 64 * b;
                auto put = [&](int r, float x) {  // batch b's TREE of row r, added above
                    const float run = upper_tree<NS>(b, x, ps_ + r * CHUNK + tid,
                                                     qq + r * CHUNK + tid);
                    if (b == NS - 1) ps_[r * CHUNK + tid] = run;
                };
                // (a warp's threads share part: each branch is the warp's)
                if (first >= lo && first + 63 <= p) {  // every slot seen: no checks
                    for (int r = r0; r < r0 + H; ++r)
                        put(r, batch_run<false>(e + r * CHUNK, vals, first, lo, p));
                } else if (first > p || first + 63 < lo) {  // none: +0.0 leaves, +0.0
                    for (int r = r0; r < r0 + H; ++r) put(r, 0.0f);  // (-0.0 + +0.0 above)
                } else {
                    for (int r = r0; r < r0 + H; ++r)
                        put(r, batch_run<true>(e + r * CHUNK, vals, first, lo, p));
                }
            }
        }
        __syncthreads();
        for (int o = tid; o < R * D; o += CHUNK) {
            const int r = o / D, tq = r / H, c0 = los[tq] / CHUNK;
            if (c < c0 || c > ps[tq] / CHUNK) continue;
            const float* x = ps_ + r * CHUNK + o % D;
            float n;
            if (PARTS == 1) n = x[0];
            else if (PARTS == 2) n = __fadd_rn(x[0], x[D]);
            else n = __fadd_rn(__fadd_rn(x[0], x[D]), __fadd_rn(x[2 * D], x[3 * D]));
            acc[o] = c == c0 ? n : __fadd_rn(acc[o], n);
        }
        __syncthreads();  // before the next chunk's partials, weights and runs overwrite these
    }
    // out[t, (g H + h) D + i] = num / den, and its Q8 blocks when wanted (whole warps)
    for (int o0 = warp * 32; o0 < R * D; o0 += CHUNK) {
        const int o = o0 + lane, r = o / D, t = t0 + r / H;
        if (t >= a.n_tokens) break;  // (a warp's 32 outputs share a row: all break)
        const float v = __fdiv_rn(acc[o], den[r]);
        const int col = g * H * D + o % (H * D);
        a.out[(i64)t * out_width + col] = v;
        if (a.oq != nullptr) {
            const int nb = out_width / 32, b = col / 32;
            quantize_block(v, a.oq + (i64)t * out_width + b * 32, a.od + (i64)t * nb + b,
                           a.os + (i64)t * nb + b);
        }
    }
}

// ---- prefill in fast numerics: flash attention on the tensor cores -----------------------------
//
// attention_fast<D, G>: ATTENTION under numerics = "fast" (docs/numerics.md's budget: an online
// softmax, any order), for a prefill. Grid (n_head, ceil(T / FAST_TB(D))), G groups of 128
// threads. Each warp takes 16 tokens and a slice of 64 of the head's D columns: warp w of a
// group takes tokens t0 + 16 (w / DW) .. and columns 64 (w % DW) .., DW = D / 64 (heads of 64:
// four warps of 16 tokens, a block 64 tokens; heads of 256: four warps on the same 16 tokens,
// a quarter of the columns each, whose partial scores are summed through shared memory in the
// slices' order, so every warp of the 16 tokens holds the same scores and weights). Group k
// walks tiles k, k + G, .. of the cache (FAST_BN(D) slots a tile) from the lowest window start
// of the block's tokens to their highest position; group 1's running sums are merged into
// group 0's at the end (G = 2, heads of 64 only: half the walk for the longest blocks, when a
// prompt's blocks do not fill the GPU). With S blocks a (head, FAST_TB tokens), grid (n_head
// S, ceil(T / FAST_TB)), the walk is split S G ways: walker s G + k takes tiles s G + k, + S G,
// ..; each block writes its running max, sums and rows to a.part, and the last of the S to
// finish (a ticket in a.tickets, reset for the next launch) merges the S in their order: the
// bits do not depend on which finished first. Scores and the weighted values are m16n8k8 TF32
// products, each operand split in two (hi + lo, three products: about float32's accuracy, as
// the triton backend's "tf32x3"); the running max and sum rescaled with the project's exp; one
// division at the end. A tile's K and V rows are split once into shared memory for the warps,
// and the next tile's loaded into registers while this one's products run; the blocks of the
// latest tokens (the most tiles) go first.
// Slots outside a token's window lo .. p weigh +0.0, and rows no token of the block sees are
// never loaded. The weights go from the scores' accumulator layout (columns 2t, 2t + 1 of each
// 8 slots) to the second product's A operand (columns t, t + 4) with the slots in the order
// 0, 2, 4, 6, 1, 3, 5, 7, and the V rows read in that order: no shuffle. A tile's split words
// go to shared memory 16 bytes a store: one word a store put four lanes on a bank (H100,
// fifteenth session: the kernel 7-19 % faster, 908 -> 838 us of SmolLM2's 512-token prefill,
// 921 -> 854 Qwen's, 1,057 -> 855 Gemma 3's).
#define FAST_BN(D) ((D) == 64 ? 32 : 16)  // cache slots a tile (the next one's in registers)
#define FAST_ROW(D) ((D) + 4)  // words a shared row of K or V: conflict-free fragment reads
#define FAST_TILE(D) (FAST_BN(D) * FAST_ROW(D))  // words of a tile's K or V, hi or lo
#define FAST_TB(D) (16 * 4 / ((D) / 64))  // tokens a block
// a block's partial scores (heads over 64: 4 warps' FAST_BN / 2 floats a lane), words
#define FAST_XS(D) ((D) == 64 ? 0 : 4 * FAST_BN(D) / 2 * 32)
// dynamic shared memory of attention_fast<D, G>, bytes: each group's tile (K and V, hi and lo)
// and the partial scores
#define FAST_SHARED(D, G) (((G) * 4 * FAST_TILE(D) + FAST_XS(D)) * 4)

__device__ __forceinline__ u32 to_tf32(float x) {
#ifdef PARITY_EMULATOR
    return emu::to_tf32(x);
#else
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
#endif
}

// x = hi + lo, both TF32 (lo: what hi leaves, rounded again)
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
}

// d += a b, m16n8k8 TF32 with float32 accumulation
__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#ifdef PARITY_EMULATOR
    emu::mma_tf32_k8(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// d += a b with both split: the small products first, then hi hi
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4],
                                           const u32 (&bh)[2], const u32 (&bl)[2]) {
    mma_tf32(d, al, bh);
    mma_tf32(d, ah, bl);
    mma_tf32(d, ah, bh);
}

// floats of a walk's running max, sums and rows, 128 threads' (36 a thread: m, l, o)
#define FAST_PART (36 * 128)

// a walk's running max m, sums l (this thread's share) and rows o merged with another's, kept
// at ``part`` (stride 128: m, l, then o), both rescaled to the max of the two (a max of -inf:
// no slot seen, weight 0); ``global``: scratch that other blocks wrote
__device__ __forceinline__ void fast_merge(float (&m)[2], float (&l)[2], float (&o)[8][4],
                                           const float* part, bool global) {
    const float NEG = -__int_as_float(0x7f800000);
    const auto at = [&](int k) { return global ? __ldcg(part + 128 * k) : part[128 * k]; };
    float keep[2], take[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float other = at(r), mn = fmaxf(m[r], other);
        keep[r] = m[r] == NEG ? 0.0f : p_exp(m[r] - mn);
        take[r] = other == NEG ? 0.0f : p_exp(other - mn);
        l[r] = l[r] * keep[r] + at(2 + r) * take[r];
        m[r] = mn;
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            o[n][i] = o[n][i] * keep[i >> 1] + at(4 + 4 * n + i) * take[i >> 1];
}

template <int D, int G>
__global__ void __launch_bounds__(128 * G) attention_fast(AttnArgs a) {
    pdl_begin();
    static_assert(D == 64 || D == 256, "heads of 64 or 256");
    static_assert(G == 1 || (G == 2 && D == 64), "one or two groups of four warps (two: 64)");
    // DW warps a token's columns (a slice of 64 each), TB tokens a block; BN cache slots a tile
    constexpr int DW = D / 64, TB = FAST_TB(D), BN = FAST_BN(D), ROW = FAST_ROW(D);
    constexpr int TILE = FAST_TILE(D), KS = 8;  // k-steps of a score's slice, n-tiles of a row's
    extern __shared__ __align__(16) u32 fast_smem[];  // FAST_SHARED(D, G) bytes
    __shared__ int ps[TB], los[TB], last;
    // the latest tokens first: their blocks walk the most tiles, the short ones fill the tail
    const int S = gridDim.x / a.n_head, h = blockIdx.x / S, seg = blockIdx.x % S;
    const int blk = gridDim.y - 1 - blockIdx.y, t0 = blk * TB;
    const int group = threadIdx.x >> 7, tid = threadIdx.x & 127;  // (tid: within the group)
    const int walker = seg * G + group, W = S * G;  // (W walkers a (head, TB tokens))
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int slice = 64 * (warp % DW);  // this warp's first column
    u32* kh = fast_smem + group * 4 * TILE;  // this group's tile, split
    u32* kl = kh + TILE;
    u32* vh = kl + TILE;
    u32* vl = vh + TILE;
    float* xs = reinterpret_cast<float*>(fast_smem + 4 * TILE) + lane;  // (DW > 1: G is 1)
    const int kv = h / (a.n_head / a.n_head_kv);
    const int width = a.n_head_kv * D, qwidth = a.n_head * D;
    const float* kbase = a.k + kv * D;
    const float* vbase = a.v + kv * D;
    if (threadIdx.x < TB) {  // (tokens past the last: the last token's, not stored)
        const int t = min(t0 + (int)threadIdx.x, a.n_tokens - 1);
        ps[threadIdx.x] = a.positions[t];
        los[threadIdx.x] = window_lo(a, ps[threadIdx.x]);
    }
    __syncthreads();
    int first = los[0], end = ps[0];
    for (int i = 1; i < TB; ++i) {
        first = min(first, los[i]);
        end = max(end, ps[i]);
    }
    // this thread's two rows (tokens) of its warp's 16: r (g) and r + 8
    const int r0 = 16 * (warp / DW) + g, r1 = r0 + 8;
    const int p0 = ps[r0], p1 = ps[r1], lo0 = los[r0], lo1 = los[r1];
    const i64 q0 = (i64)min(t0 + r0, a.n_tokens - 1) * qwidth + h * D + slice;
    const i64 q1 = (i64)min(t0 + r1, a.n_tokens - 1) * qwidth + h * D + slice;
    u32 qh[KS][4], ql[KS][4];  // A fragments: (r0, 8s + c), (r1, 8s + c), (r0, +4), (r1, +4)
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        split_tf32(a.q[q0 + 8 * s + c], qh[s][0], ql[s][0]);
        split_tf32(a.q[q1 + 8 * s + c], qh[s][1], ql[s][1]);
        split_tf32(a.q[q0 + 8 * s + c + 4], qh[s][2], ql[s][2]);
        split_tf32(a.q[q1 + 8 * s + c + 4], qh[s][3], ql[s][3]);
    }
    const float NEG = -__int_as_float(0x7f800000);
    float o[KS][4];  // the output rows' accumulators: (r0, 8n + 2c + {0, 1}), (r1, ..)
#pragma unroll
    for (int n = 0; n < KS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {NEG, NEG}, l[2] = {0.0f, 0.0f};  // running max and this thread's share of the sum
    // the tile's K and V rows in registers, four columns a load (FAST_LOADS loads a thread)
    constexpr int FAST_LOADS = BN * D / (4 * 128);
    float4 kx[FAST_LOADS], vx[FAST_LOADS];
    const auto fetch = [&](int j0) {
#pragma unroll
        for (int i = 0; i < FAST_LOADS; ++i) {
            const int e = 4 * (tid + 128 * i), j = j0 + e / D;
            const bool in = j >= first && j <= end;  // a slot some token of the block sees
            const i64 at_j = (i64)j * width + e % D;
            const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            kx[i] = in ? *reinterpret_cast<const float4*>(kbase + at_j) : zero;
            vx[i] = in ? *reinterpret_cast<const float4*>(vbase + at_j) : zero;
        }
    };
    // walker w takes tiles w, w + W, ..: every group makes the same number of rounds (each with
    // the block's barriers), a group past the last tile loads zeros and skips the products
    const int j_first = first / BN * BN;
    const int rounds = ((end - j_first) / BN + W) / W;
    fetch(j_first + walker * BN);
    for (int round = 0; round < rounds; ++round) {
        const int j0 = j_first + (round * W + walker) * BN;
        __syncthreads();  // (the previous tile's readers are done)
#pragma unroll
        for (int i = 0; i < FAST_LOADS; ++i) {
            const int e = 4 * (tid + 128 * i), at = e / D * ROW + e % D;  // (a multiple of 4)
            uint4 hi, lo;  // (four words each, 16-byte stores)
            split_tf32(kx[i].x, hi.x, lo.x), split_tf32(kx[i].y, hi.y, lo.y);
            split_tf32(kx[i].z, hi.z, lo.z), split_tf32(kx[i].w, hi.w, lo.w);
            *reinterpret_cast<uint4*>(kh + at) = hi, *reinterpret_cast<uint4*>(kl + at) = lo;
            split_tf32(vx[i].x, hi.x, lo.x), split_tf32(vx[i].y, hi.y, lo.y);
            split_tf32(vx[i].z, hi.z, lo.z), split_tf32(vx[i].w, hi.w, lo.w);
            *reinterpret_cast<uint4*>(vh + at) = hi, *reinterpret_cast<uint4*>(vl + at) = lo;
        }
        __syncthreads();
        if (j0 + W * BN <= end) fetch(j0 + W * BN);  // the next, in flight meanwhile
        // (this group's rounds are done; the barriers are not. With DW > 1 the skip takes the
        // partial scores' barrier too: G is 1 there, so the whole block skips or none does)
        if (j0 > end) continue;
        // scores of slots j0 + 8 n + 2 c + {0, 1} for rows r0 (sc[n][0..1]) and r1 ([2..3])
        float sc[BN / 8][4];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < KS; ++s) {  // B: K row 8 n + g, columns 8 s + c and + 4
                const int at = (8 * n + g) * ROW + slice + 8 * s + c;
                const u32 bh[2] = {kh[at], kh[at + 4]}, bl[2] = {kl[at], kl[at + 4]};
                mma_3xtf32(sc[n], qh[s], ql[s], bh, bl);
            }
        }
        if constexpr (DW > 1) {  // the slices' partial scores summed in their order, every warp
#pragma unroll
            for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) xs[32 * (4 * (BN / 8 * warp + n) + i)] = sc[n][i];
            __syncthreads();  // (the next round's first barrier keeps the reads before its writes)
            const int w0 = warp / DW * DW;  // the first warp of these tokens
#pragma unroll
            for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float sum = xs[32 * (4 * (BN / 8 * w0 + n) + i)];
#pragma unroll
                    for (int w = 1; w < DW; ++w) sum += xs[32 * (4 * (BN / 8 * (w0 + w) + n) + i)];
                    sc[n][i] = sum;
                }
        }
        // the online softmax, row by row (a row's BN slots lie in the 4 threads of a group)
        float mt[2] = {NEG, NEG};
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int j = j0 + 8 * n + 2 * c + (i & 1), r = i >> 1;
                const bool in = r == 0 ? seen(j, lo0, p0) : seen(j, lo1, p1);
                sc[n][i] = in ? sc[n][i] * a.scale : NEG;
                mt[r] = fmaxf(mt[r], sc[n][i]);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(FULL_MASK, mt[r], 1));
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(FULL_MASK, mt[r], 2));
            const float mn = fmaxf(m[r], mt[r]);
            alpha[r] = mn == NEG ? 1.0f : p_exp(m[r] - mn);  // (exp(-inf) = 0: nothing before)
            m[r] = mn;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = i >> 1;
                sc[n][i] = sc[n][i] == NEG ? 0.0f : p_exp(sc[n][i] - m[r]);
                l[r] += sc[n][i];
            }
        }
#pragma unroll
        for (int n = 0; n < KS; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        // o += w V: k-step n takes slots 8 n .. 8 n + 7 as columns c -> 2 c and c + 4 -> 2 c + 1
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            u32 wh[4], wl[4];
            split_tf32(sc[n][0], wh[0], wl[0]);  // (r0, slot 2 c)
            split_tf32(sc[n][2], wh[1], wl[1]);  // (r1, slot 2 c)
            split_tf32(sc[n][1], wh[2], wl[2]);  // (r0, slot 2 c + 1)
            split_tf32(sc[n][3], wh[3], wl[3]);  // (r1, slot 2 c + 1)
#pragma unroll
            for (int d = 0; d < KS; ++d) {  // B: V rows 8 n + 2 c and + 1, column 8 d + g
                const int at = (8 * n + 2 * c) * ROW + slice + 8 * d + g;
                const u32 bh[2] = {vh[at], vh[at + ROW]};
                const u32 bl[2] = {vl[at], vl[at + ROW]};
                mma_3xtf32(o[d], wh, wl, bh, bl);
            }
        }
    }
    if (G > 1) {  // group 1's running max, sums and rows to group 0, rescaled to the max of both
        __syncthreads();  // (the tiles' readers are done: the merge reuses their memory)
        float* part = reinterpret_cast<float*>(fast_smem) + tid;  // (a word a thread, a row)
        if (group == 1) {
            part[0] = m[0], part[128] = m[1], part[256] = l[0], part[384] = l[1];
#pragma unroll
            for (int n = 0; n < KS; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[128 * (4 + 4 * n + i)] = o[n][i];
        }
        __syncthreads();
        if (group == 0) fast_merge(m, l, o, part, false);
    }
    if (S > 1) {  // the block's sums to scratch; the last of the S blocks merges them in order
        const i64 at = (i64)h * gridDim.y + blk;  // (the ticket's; S partials, FAST_PART each)
        float* parts = a.part + at * S * FAST_PART + tid;
        if (group == 0) {
            float* mine = parts + seg * FAST_PART;
            mine[0] = m[0], mine[128] = m[1], mine[256] = l[0], mine[384] = l[1];
#pragma unroll
            for (int n = 0; n < KS; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) mine[128 * (4 + 4 * n + i)] = o[n][i];
            __threadfence();
        }
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(&a.tickets[at], 1) == S - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        if (group != 0) return;
        m[0] = m[1] = NEG, l[0] = l[1] = 0.0f;
#pragma unroll
        for (int n = 0; n < KS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        for (int s = 0; s < S; ++s) fast_merge(m, l, o, parts + s * FAST_PART, true);
        if (tid == 0) a.tickets[at] = 0;  // (for the next launch)
    }
    if (group != 0) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
    const int ta = t0 + r0, tb = t0 + r1;
#pragma unroll
    for (int n = 0; n < KS; ++n) {
        const int col = h * D + slice + 8 * n + 2 * c;
        if (ta < a.n_tokens) {
            a.out[(i64)ta * qwidth + col] = o[n][0] / l[0];
            a.out[(i64)ta * qwidth + col + 1] = o[n][1] / l[0];
        }
        if (tb < a.n_tokens) {
            a.out[(i64)tb * qwidth + col] = o[n][2] / l[1];
            a.out[(i64)tb * qwidth + col + 1] = o[n][3] / l[1];
        }
    }
}
