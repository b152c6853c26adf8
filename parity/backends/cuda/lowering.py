"""A split as kernel launches: which kernel computes each node, with which grid and arguments,
and which nodes one launch computes together.

Launch-level fusions (same operations, same bits as the nodes one by one):

- RMS_NORM[_MUL] then QUANTIZE of it: the norm kernel also writes the Q8A value;
- q, k and v products of one x: one launch; with their ROPEs and KV_WRITEs when those read
  the products directly (matmul.cu's rope_kv_rows: a block computes both rows of a pair);
- ROPE then a KV_WRITE of its rows otherwise: the rope kernel also writes the cache rows; q's
  and k's ROPEs, their KV_WRITEs and v's KV_WRITE at the same positions are one launch;
- ATTENTION then QUANTIZE of it: the attention kernel also writes the Q8A value;
- a norm read only by an ADD (Gemma 3's norms after attention and FFN): the norm kernel also
  writes the sum, and the norm of that sum after it (with its QUANTIZE) is the same launch's;
  two norms of one width and eps (Gemma 3's q and k head norms): one launch;
- SWIGLU or GEGLU then QUANTIZE of it: the GLU kernel also writes the Q8A value;
- with NORM_AFTER_PRODUCT, a decode product then the norm of its output (and what the norm
  kernel would do with it: its QUANTIZE, the ADD and the norm of the sum): the product's last
  block computes the norm;
- with QKV_HEAD_NORMS, Gemma 3's q and k head norms before their ROPEs: the q/k/v launch's
  last block of each head norms it, then rotates it;
- with GLU_IN_PRODUCT, a decode step's gate and up products, the GEGLU (or SWIGLU) of them and
  its QUANTIZE: one gated GEMV (the products' values written too);
- with NORM_IN_PRODUCT, a decode step's residual product, the norm of its output and that
  norm's QUANTIZE: the product leaves its blocks' subtrees of the squares (gemv_q_sq), and
  every product that reads the QUANTIZE makes the norm and its Q8A itself, in each block
  (matmul.cu's *_normed kernels: norm.cuh's NormIn; block 0 of the first of them writes the
  two values).

Every node's value is still written to its own buffer (the runtime may read any of them back),
so a fusion only saves a launch and a pass over memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from parity.backends.cuda.kernel_args import (
    AttnArg,
    GemvSegsArg,
    MmaMoreArg,
    NormInArg,
    NormJobArg,
    NormRowsArg,
    Q8Arg,
    RopeArg,
    RopeSegsArg,
)
from parity.backends.gpu.driver import Launch, pack, pointer
from parity.backends.gpu.runtime import Q8Value
from parity.core.dtypes import DType
from parity.core.ir import Graph, Node, Op
from parity.errors import BackendError

GEMV_TOKENS = (1, 2, 4, 8)  # token counts of the GEMV instantiations; more tokens: GEMM
GEMV_WARPS = 4
ARGMAX_SLICE = 256 * 16  # elements of a row one argmax block takes (rows.cu)
GEMV_MAX_ROUNDS = 128  # rounds of 32 sub-blocks a warp's TREE holds (matmul.cu's GEMV_MAXL)
GEMM_TILE = {False: (32, 64), True: (32, 32)}  # (rows, tokens) per block; gated: fewer tokens
MMA_TILE = 32  # rows of a gemm_mma block (matmul.cu's MmaGeom BN)
# ... and its tokens (BT; 8 BT threads): 32, or 64 for a stage's weights unpacked once for
# twice the tokens (a third of Qwen's gate/up GEMM's instructions unpack them at 32:
# docs/perf.md), one block of 16 warps a multiprocessor instead of two of 8. On the H200
# (ninth session, one round, with other switches): Qwen's Q6_K and Q4_K down products 12 and
# 6 % faster at 64, the gated and SmolLM2's Q4_1 products 3-16 % slower: 32
MMA_TOKENS = 32
# ... and 64 for a prefill's ungated products (o, down, q/k/v one at a time) whose reduction
# is at least this deep (0: none): on the H100 (eleventh session) Qwen's down products, K of
# 4,864, ran 5-12 % faster at 64, Gemma 3's of K 2,048 and less 6 % slower (docs/perf.md; their
# rows differ too, 896 against 640, so depth and grid are not told apart yet). Fifteenth
# session, H100, at 4,096 (Qwen's down products only): `gemm_mma<Q6_K>` 1,450 -> 1,270 us and
# `<Q4_K>` 1,269 -> 1,200 of an exact 512-token prefill, busy 10,594 -> 10,393 us, pp512
# 44,548 -> 46,711 tok/s in one table: 4,096
MMA_DEEP_K = 4096
# ... and the blocks a multiprocessor should hold (its __launch_bounds__' minimum): 2, 128
# registers; 3 caps them at 80 (12-56 bytes spilled) for 24 warps a multiprocessor instead of
# 16 (Qwen's gate/up GEMM: 3.9 of a 12 ms 512-token prefill, far from the tensor cores' speed,
# latency-bound). Until a GPU times 3: 2. (MMA_TOKENS=64 takes one block a multiprocessor
# whatever this says)
MMA_MIN_BLOCKS = 2
# a prefill product read by a QUANTIZE (SWIGLU's, before down) quantizes its output in its
# epilogue, a Q8 block of each of its tokens a block (matmul.cu's gemm_mma), where a
# quantize_q8 launch read it back (bit-exact on the H200 and H100). Tenth session, H100, one
# round: the gated SWIGLU GEMM 14-15 % slower with it (Qwen 3,653 -> 4,179 us a prefill,
# SmolLM2 1,208 -> 1,391) for the 355 and 171 us of quantize_q8 it saves: off. (MMA_GLU's
# launches quantize whatever this says: timed so)
MMA_QUANTIZE = False
# ... and a prefill's gate and up products with their GEGLU (Gemma 3's; SWIGLU comes fused from
# the graph's rewrite) and its QUANTIZE: one gated gemm_mma launch (the products' values
# written too), where two products, a glu_f32 and a quantize_q8 launch were (bit-exact on the
# H200 and H100; tenth session, H100: Gemma 3's 512-token prefill 6.98 -> 6.79 ms: on)
MMA_GLU = True
# a prefill's products of one x by weights of one width (q, k and v) as one gemm_mma_multi
# launch, so that k's and v's few row tiles run beside q's (bit-exact on the H200, the three
# products 21-37 % less time with 64-token tiles; tenth session, H100, alone: the 512-token
# prefill 6.75 -> 6.39 / 11.45 -> 11.10 / 6.98 -> 6.74 ms on the three twins: on)
MMA_MULTI = True
MMA_WSTRIDE = 80  # words of a row of its unpacked quants
MMA_BLOCK_PAIRS = 10  # (d, s) pairs a token's row of activation blocks takes (MmaGeom::DS)
ATTENTION_DIMS = (64, 128, 256)
EPI_BIAS, EPI_RESIDUAL, EPI_SWIGLU, EPI_GEGLU = 1, 2, 4, 8
EPI_RES_EARLY = 16  # ... and a GEMV's residual loaded before PDL's wait (EARLY_LOADS)
EPI_ONE_FENCE = 32  # ... and gemv_q_q8's tickets taken with one fence a block (ONE_FENCE)
# gate/up's tickets (gemv_q_q8: the last block of each 32-row group quantizes the group) taken
# with one acq_rel fence a block, by thread 0 after the block's barrier, where every thread ran
# a sequentially consistent one (Nsight Compute, seventeenth session: memory-barrier stalls
# 1.62 cycles an instruction of its ~10). H100, eighteenth session: conformance's fusion and
# SWIGLU cases 72/72 bit-exact, SmolLM2's and Qwen's 16 decode steps and 32 greedy tokens
# identical to cpu; replayed decode step at depth 100, two rounds, ms: SmolLM2 0.627 / 0.626 ->
# 0.622 / 0.618, Qwen 0.755 / 0.753 -> 0.745 / 0.747 (gate/up 2-3 % less time): on
ONE_FENCE = True
# a one-token product with its QUANTIZE (gate/up and their SWIGLU, or GLU_IN_PRODUCT's GEGLU)
# of rows of one round each, a block a 32-row group (matmul.cu's gemv_q_q8_group): the block
# quantizes its own rows from shared memory, where gemv_q_q8's last block of each group fences,
# takes a ticket and reloads the group at L2 first (gate/up took 5.3 us a launch, SmolLM2, PDL
# off: twice down's time for as many bytes). Bit-exact (emulator; H100 at 2 rows a warp: the
# kit 274/274 and its FFN and SWIGLU cases with GLU_IN_PRODUCT too, the twins' decode steps
# after prompts of 1 and 600 tokens). H100, nineteenth session, replayed decode step at depth 100,
# two rounds, ms: SmolLM2 0.624 / 0.618 -> 0.594 / 0.594 at 2 rows a warp (0.627 / 0.629 at
# 4), Qwen 0.748 / 0.744 -> 0.702 / 0.710 (0.713 / 0.715 at 4); Gemma 3 with GLU_IN_PRODUCT
# 0.626 / 0.623 -> 0.632 / 0.632 (docs/perf.md): on
GROUP_Q8 = True
# ... rows a warp: 1 (blocks of 32 warps) where the launch's groups fit one such block a
# multiprocessor, else 2 (16 warps), a block a wave either way: 0 picks so, 1, 2 or 4 force it.
# H100, twentieth session, replayed decode step at depth 100, ms, two rounds: SmolLM2 (48
# groups) 0.598 / 0.600 at 2 -> 0.588 / 0.585 at 1; Qwen (152 groups: two blocks of 32 warps
# on 20 multiprocessors) 0.700 / 0.697 at 2, 0.703 / 0.702 at 1 (docs/perf.md)
GROUP_Q8_RPW = 0
# ... a group a cluster of GROUP_Q8_SPLIT blocks of 32 / GROUP_Q8_SPLIT rows each (sm_90,
# matmul.cu's gemv_q_q8_split: the cluster's last block quantizes the group after the cluster's
# barrier), so the groups spread over more multiprocessors, and more evenly: Qwen's 152 groups
# a block each leave 20 of 132 multiprocessors two (Nsight Compute, twenty-third session: each
# multiprocessor busy for about half the launch). 0: 4 where the groups outnumber the
# multiprocessors, else 1 (a block a group); 1, 2, 4 or 8 force it. H100, twenty-fourth
# session, replayed decode step at depth 100, ms, two rounds: Qwen 0.704 / 0.704 -> 0.692 /
# 0.696 at 2, 0.689 / 0.690 at 4 (bench_gpu: decode 1,473.8 -> 1,508.2 tok/s at depth 0,
# 1,144.8 -> 1,167.6 at 4,096); SmolLM2 (48 groups) 0.584 / 0.586 -> 0.586 / 0.590 at 2,
# 0.601 / 0.603 at 4 (docs/perf.md). The kit's cases bit-exact at 2 and 4 on the GPU; 1 until
# the twins' decode steps have been compared with 0 there
GROUP_Q8_SPLIT = 1
GROUP_Q8_SHARED = 48 << 10  # ... its copies of the group's rows in static shared memory
FLOAT_WEIGHTS = (DType.F32, DType.F16, DType.BF16)
NORM_THREADS = 1024  # norm.cuh's
# ... and a decode step's norms' where rms_norm_f32 takes them (rows NORM_SLOTS does not: wider
# than 1,024 or not of 32s; a row or two a launch: 4 us each on the H200): any power of two
# from 32 to NORM_THREADS, each thread then taking a longer run of the squares' TREE (the same
# tree). Until a GPU times fewer: NORM_THREADS
NORM_DECODE_THREADS = NORM_THREADS
# ... and a prefill's (rms_norm_f32 a row a block; the ninth session's H200 A/B: 15 us a launch
# of 512 rows at 1,024 threads, and about 18-30 us a row a warp, below), the same choices. Tenth
# session, H100, alone: the 512-token prefill 6.75 -> 6.28 / 11.45 -> 11.08 / 6.98 -> 6.13 ms
# at 256 (128: 6.48 / 11.25 / 6.24): 256
NORM_PREFILL_THREADS = 256
# a decode step's norms of rows up to NORM_THREADS wide, a multiple of 32, a slot a thread
# (rows.cu's rms_norm_slots: a block of the row's width, one barrier a norm where
# rms_norm_f32 takes four at 1,024 threads, a warp a Q8 block; under EARLY_LOADS the weights
# and the ADD's residual loaded before PDL's wait). Bit-exact (emulator; H100: conformance,
# the twins' decode steps and 64 greedy tokens). H100, eighteenth session, replayed decode
# step, ms: depth 100 SmolLM2 0.748-0.752 -> 0.621-0.626, Qwen 0.839-0.851 -> 0.751, Gemma 3
# 0.787-0.792 -> 0.625-0.626; depth 4,000 0.974 -> 0.861, 1.056 -> 0.967, 0.914 -> 0.747; the
# norms' own time a SmolLM2 step (PDL off) 261 -> 165 us (docs/perf.md): on
NORM_SLOTS = True
NORM_EARLY_W, NORM_EARLY_RES = 1, 2  # rows.cu's rms_norm_slots<EARLY>
# a launch's norms of more rows than GEMV_TOKENS' last (a prefill's, or the head norms of a
# step of a few tokens) a row a warp (rows.cu's rms_norm_warps: runs of next_pow2(width) / 32
# slots a lane in registers, the same tree) for rows up to this wide (at most
# NORM_WARP_RUN_MAX * 32), where rms_norm_f32 gives a row 1,024 threads and three barriers.
# On the H200: 5.5 us a launch of Gemma 3's heads of 256, and slower than rms_norm_f32 at
# 576-896 wide (wrong there until 8aacc5a; bit-exact on the H100 since, 16-1,152 wide). Tenth
# session, H100: Gemma 3's 512-token prefill 6.98 -> 6.35 ms at 256 (its heads), the others
# unchanged (no rows that narrow): 256, the models' own widths stay with rms_norm_f32. 0: off
NORM_WARP_WIDTH_MAX = 256
NORM_WARP_RUN_MAX = 64  # slots a lane (norm.cuh's norm_job_warp holds its run in registers)
NORM_WARP_ROWS = 2  # ... rows (warps) a block: 256 blocks for 512 rows (a lane's run of 32
# takes 128 registers)
# (A decode step's norm a row a warp was tried and dropped, eleventh session: 12 us a row
# against rms_norm_f32's 4.5, one warp's serial chain of 32 slots a lane: docs/perf.md.)
# a decode product's output normed by its last block (matmul.cu's gemv_q_norm), not by a launch
# of its own: bit-exact (emulator and H200), and slower: the decode step +43-52 % on the H200
# (the last block's tail, about 17 us), so off (docs/perf.md); with the tail's row in
# registers (norm_row_regs), still +25 % / +25 % / +20 % on an H100 (sixteenth session)
NORM_AFTER_PRODUCT = False
# Gemma 3's q and k head norms and their ROPEs done by the q/k/v launch, each head's last block
# norming the head (matmul.cu's HEAD_NORM): bit-exact, 36 launches fewer a step and 1-2 %
# slower on the H200, so off
QKV_HEAD_NORMS = False
# ... and its gate and up products with their GEGLU and its QUANTIZE: one gated GEMV launch
# (bit-exact, 18 launches fewer a step, no faster on the H200: off)
GLU_IN_PRODUCT = False
# a decode step's norm between a residual product (o, down) and the products that read it
# (q/k/v, gate/up) made by those products, each block norming and quantizing x from the
# residual product's output and its blocks' subtrees of the squares: the norm takes no launch
# (SmolLM2 and Qwen 7 -> 5 a layer, attention's second aside). Bit-exact (emulator, H100), and
# slower on an H100: the step 0.755-0.763 -> 0.832-0.841 ms (SmolLM2), 0.832-0.838 -> 1.079
# (Qwen); each block's norm adds about 4 us to its product where rms_norm_f32 took about 4.2
# (docs/perf.md, sixteenth session), so off
NORM_IN_PRODUCT = False
NORM_IN_RUN = 8  # norm.cuh's: subtrees of the squares a thread of the 128
NORM_IN_SHARED_MAX = 32 << 10  # ... x's Q8A in a block's dynamic shared memory (below 48 KiB
# with the GEMV's own, so no opt-in)
NORM_IN_ROWS = 16  # ... for readers of at most this many rows a column of x (not the head,
# whose every block would norm x again)
HEAD_NORM = 4  # matmul.cu's: added to a q/k/v launch's ROPE mode
ROPE_EARLY = 8  # ... and its rotations' positions, cos and sin loaded before PDL's wait
# Under PDL, a kernel's loads of values that were written two launches back or more, issued
# before its wait, while the kernel before it still runs. A kernel starts only once every block
# of the one before has passed its own wait, so the one two back has finished then (common.cuh's
# pdl_begin); such loads go at L2 (__ldcg), and _written_before_last decides: the positions (a
# step's input, in any launch but its split's first) in flash decoding and in the q/k/v launch's
# rotations with their cos and sin (weights); a decode GEMV's residual (o's and down's: the
# residual stream; not a norm that NORM_IN_PRODUCT leaves to a later launch's block 0); for a
# step of one token, attention_chunks' K rows and V values but row p's (the step's KV_WRITE,
# the launch before: row p again after the wait; heads of 64 only: those of 128 and 256 would
# spill 12 and 32 bytes at 255 registers); attention_sums' V values (the KV_WRITE two launches
# back). The same values, so the same bits (the emulator's late writes check the
# reload; on an H100, conformance 274/274 and the twins' decode steps after prompts of 1 and
# 600 tokens bit-identical to cpu). H100, seventeenth session, replayed decode step, ms:
# depth 100 SmolLM2 0.756 -> 0.752, Qwen 0.842 -> 0.837, Gemma 3 0.819 -> 0.802; depth 4,000
# 1.069-1.076 -> 0.980, 1.099-1.111 -> 1.056-1.060, 0.944-0.956 -> 0.917-0.919; depth 16,000
# Qwen 2.052 -> 1.996, Gemma 3 1.035 -> 1.016 (docs/perf.md): on
EARLY_LOADS = True
GEMV_NORM_WIDTH_MAX = 32 * GEMV_WARPS * 256  # ... of rows up to this wide (norm.cuh's NORM_MAXL)
SPLIT_TOKENS = 4  # flash decoding for at most this many tokens
GQA_HEADS_MAX = 8  # prefill attention takes up to this many query heads of a KV head a block
GQA_WIDTH_MAX = 1024  # ... whose q and sums (heads x head_dim floats, twice) fit shared memory
# prefill attention a block a KV head and a tile of tokens (attention_tiles), where the
# heads of a KV head fit its rows: 512-token prefill 18-20 % faster on the SmolLM2 and Qwen
# twins, 2.5 % on Gemma 3's (H200, docs/perf.md); False: attention_rows_gqa / attention_rows
PREFILL_TILES = True
# a one-token product of many short rows (the output head) by gemv_q_wide: a few blocks a
# multiprocessor, each warp taking every G-th row with its weights asked for rows ahead, where
# gemv_q gives a row a warp: the head 140 -> 78 us (Gemma 3), 85 -> 47 (Qwen), 29 -> 18
# (SmolLM2), the decode step 1-7 % faster on the H200 (docs/perf.md)
WIDE_GEMV = True
WIDE_BLOCKS_PER_SM = 5  # ... blocks of GEMV_WARPS warps a multiprocessor (Q8_0's: 92 registers)
WIDE_AHEAD = 3  # ... rows whose weights a warp has asked for before the one it computes
# ... each row's loads held in as few registers as its bytes take, not a whole round's 32
# sub-blocks (Q8_0 rows of 640: 2 loads a lane, not 3), leaving room for more rows ahead
WIDE_FIT_ROW = False
WIDE_MIN_ROWS = 8  # ... where each warp gets at least this many rows
# ... and the ARGMAX that reads it (greedy decoding) in the same launch: its blocks' keys
# folded by the last block (an atomic ticket), the logits still written; one launch fewer a
# step, and no faster: H100, twentieth session, replayed decode step at depth 100, ms, SmolLM2
# 0.598 / 0.600 -> 0.599 / 0.604, Qwen 0.700 / 0.697 -> 0.701 / 0.695, Gemma 3 0.624 / 0.621
# -> 0.620 / 0.619 (the head's launch takes the ARGMAX's time: docs/perf.md): off
ARGMAX_IN_HEAD = False
TILE_ROWS = 32  # ... query rows (heads x tokens) a block at most, heads of 64 (half: wider)
TILE_TOKENS = 32  # ... and tokens (attention.cu's TILE_TOKENS)
TILE_BLOCKS = 256  # ... and as few tokens a block as give this many blocks (about 2 an H200 SM)
# ... its first pass's scores kept in scratch of at most this many bytes, where a block's chunks
# fit its share, for the second pass to read back instead of making them again (the same
# floats): all of a 512-token prompt's from position 0 at 32 MiB (Qwen: 7 MiB a chunk), none
# of a 4,096-token one's. 0: made twice. Prefill attention of 512 tokens 11-27 % faster, the
# prefill 2.4-8.9 % (H100, docs/perf.md)
TILE_SCORES_BYTES = 32 << 20
# ... in one launch where a token sees at most this many chunks (each block scores every one for
# the max: K read once a chunk); more: the scores through scratch (attention.cu). Heads of 256
# always take the two launches: the one-launch kernel spills at 256, and the two were faster on
# the Gemma 3 twin even at depth 100 (docs/perf.md)
CHUNKS_ONE_LAUNCH = {64: 2, 128: 2, 256: 0}
# ... over the chunks below a graph's reach (GraphParams.reach: a session's decode steps below
# its SHALLOW_REACH, generation/session.py), not n_ctx's: at n_ctx 4,352 below 512 positions, 2
# chunks and one launch (heads of 64) where 17 took two, the second with nothing to do (6.8 % of
# SmolLM2's step, 4.8 % of Qwen's at depth 100, H100, twenty-first session, docs/perf.md). The
# runtime refuses a position at or past the reach on the host; the kernels trap on one all the
# same. Off: every graph's launches sized to n_ctx (for A/B)
DECODE_REACH = True
# ... and where it is 0 (every token's scores through scratch), attention_chunks without the
# one-launch path (no V values held: 128 registers at heads of 256, not 255) and its K slabs a
# slab at a time, each next slab's loads issued before the current one is scored, where the
# four rounds of two slabs of a head of 256 wait for their loads one after another (its
# post-wait loads: EARLY_LOADS does not reach heads of 256). The same bits (emulator). Gemma
# 3's attention_chunks took 6.24 us a launch, PDL off, H100 (twentieth session, docs/perf.md).
# Timed (twenty-first session, H100): 6.29 -> 6.58 us a launch, PDL off; the replayed step 1.0 %
# slower at depth 100 (0.3-0.6 % beside QUARTER_SUMS), at 4,000 0.3-0.9 % slower alone and
# 2.7-3.3 % faster beside QUARTER_SUMS: off
CHUNKS_SLABS_AHEAD = False
# ... and attention_sums' work there (heads of 256) a block a quarter of a chunk (attention.cu's
# attention_quarters): each block the subtrees of its 64 slots, the last block of a head adding
# each chunk's four in tree order before the fold, where attention_sums' block makes each
# dimension's TREE over 256 rows in one thread's chain and loads all 256 rows of V (a query
# head a block: 4 blocks a layer for Gemma 3 below 256 positions). The same bits (emulator).
# Gemma 3's attention_sums took 7.54 us a launch, PDL off, H100 (twentieth session); the
# quarters 5.19, and Gemma 3's replayed step 0.622 -> 0.586 ms at depth 100, 0.745 -> 0.658 at
# 4,000 (twenty-first session, H100, docs/perf.md): on
QUARTER_SUMS = True
# ... and the blocks a multiprocessor should hold of each flash-decoding kernel (its
# __launch_bounds__' second argument; 0: none): none leaves attention_chunks 188 registers at
# heads of 64, one block a multiprocessor, where a deep cache gives hundreds of blocks (Qwen at
# depth 16,384: 896 a layer); 2 caps them at 128 (76 bytes spilled). Until a GPU times them: 0
CHUNKS_MIN_BLOCKS = 0
SUMS_MIN_BLOCKS = 0
# ... and the chunks whose partial results attention_chunks' fold loads together (its one
# launch: at most CHUNKS_ONE_LAUNCH chunks); 8 issues a batch's loads at once, slower at depths
# 4,000 and 16,000 when attention_sums' fold took it too (eighth session, H100): 1. Since the
# twenty-first session attention_sums loads the max of the chunks' maxes a warp's lanes at once
# (max_of_maxes) and folds through shared memory, every thread loading (fold_staged): 6-8 % off
# SmolLM2's and Qwen's step at depth 4,000 (H100, docs/perf.md).
FOLD_BATCH = 1
# ... and a deep token's chunks (seen from this many on, and more than CHUNKS_ONE_LAUNCH) by a
# block a KV head for its query heads, K and V read once for them, not once a head: Qwen at
# depth 16,384 gives 128 blocks a layer, not 896 (H = 2 .. GQA_HEADS_MAX heads whose q and
# sums fit, HEADS_WIDTH_MAX floats). 0: a block a head. Until a GPU times it: 0
HEADS_TOGETHER_CHUNKS = {64: 0, 128: 0, 256: 0}
# ... and by the query heads a KV head (heads of 64 and 128; heads of 256 lost everywhere, eighth
# session): a KV head's block does the work of its H heads, so the depth from which reading K
# and V once pays grows with H. Where an entry is, it takes the place of the width's. H100, the
# replayed decode step at depth 4,000 (16 chunks), ms, two rounds: Qwen (7 heads a KV head)
# 0.866 / 0.864 a block a head, 1.285 / 1.275 together from 16 chunks, 0.859 / 0.861 with the
# KV-head path compiled in from 64 and not taken (twenty-third session, docs/perf.md); SmolLM2
# (3) was 3 % faster together from 3 chunks at 4,000 (eighth session). Until a GPU times it
# by H: none
HEADS_TOGETHER_BY_HEADS: dict[int, int] = {}
# a prefill's attention under numerics = "fast" (heads of 64; of 256 below) as flash attention
# on the tensor cores (attention.cu's attention_fast: TF32 products of split operands, an online
# softmax), where the exact kernels make every score and weight on the float pipes. On an H100
# (docs/perf.md, eleventh session; prompts go in chunks of 512 tokens) it wins 3-6 % for Qwen
# at 512 and 1,024 tokens and 22-24 % at 4,096, 4-7 % for SmolLM2 at 4,096, and loses 2-3 % of
# SmolLM2's 512 and 1,024 (a block of 64 tokens a multiprocessor there, latency bound): on
FAST_ATTENTION = True
# ... and its groups of four warps a block (G), each walking every other tile of the cache;
# and its blocks a (head, 64 tokens) (S), each walking every S-th of the groups' tiles, the
# last to finish merging the S. One block a (head, 64 tokens) makes 72 blocks for SmolLM2 at
# 512 tokens, 112 for Qwen: fewer than an H100's multiprocessors, the longest walking 16 tiles
# while the shortest walk 2. On an H100: G = 2 beat 1 with S = 1 (twelfth session: SmolLM2
# pp512 / pp4096 +7 / +27 %, Qwen +4 / +13 %); G = 1, S = 4 (two blocks a multiprocessor)
# beat G = 2, S = 1 (fourteenth: the kernel 1,541 -> 897 us of SmolLM2's 512-token prefill,
# 1,232 -> 913 of Qwen's; G = 2 with S = 2 or 4 slower than this; pp512 with G = 1 and S = 2,
# 3 or 6 within 7 % of S = 4, SmolLM2's pp4096 8-10 % faster at 3 or 6: docs/perf.md). The
# blocks' sums take scratch of 4.5 times the attention's output (8 MiB for Qwen's 512 tokens)
FAST_ATTENTION_GROUPS = 1
FAST_ATTENTION_SPLIT = 4
# ... and for heads of 256 (Gemma 3), whose q and output rows do not fit a warp's registers:
# four warps on 16 tokens, a quarter of the columns each, their partial scores summed through
# shared memory in the quarters' order; one group a block, tiles of 16 slots. On an H100
# (fifteenth session) it took Gemma 3's 512-token fast prefill from the exact
# attention_tiles<256> (2,048-2,060 us of 4,534-4,573 busy) to 1,049-1,058 us (3,600 busy):
# pp512 1.39x -> 1.72x llama.cpp, pp4096 1.18x -> 1.50x; S = 4 beat S = 2 and 8 (1,345, 1,295)
FAST_ATTENTION_WIDE = True
# a prefill's products of quantized weights under numerics = "fast" on the tensor cores: x's
# Q8A values and dequantize(W) into scratch (W: every call, no copy kept; float16 rows scaled
# by powers of two with FAST_GEMM_HALF, float32 for TF32 without), cuBLAS's GEMM through torch
# (GpuRuntime.matmul), then the bias or residual, a GLU and its Q8A in the launch after it
# (float16: unscale_f32, glu_unscale_f32; TF32: added by the GEMM, glu_f32): the exact GEMM's
# integer sums and per-block float epilogue go. Rows of x with extreme scales (flagged) get
# their tiles again from gemm_mma, exactly. Fast conformance on an H100: 0 FAIL (both forms;
# tier 1e-5); Qwen's 512-token prefill 35 % faster (docs/perf.md, twelfth session): on
FAST_GEMM = True
FAST_GEMM_ELEMENTS = 1 << 25  # ... for weights of up to this many (its scratch: 64 MiB of
# float16, 128 MiB of TF32's float32; a head of every position's logits, 151,936 x 896 for Qwen,
# keeps the integer GEMM)
FAST_GEMM_MIN_ELEMENTS = 1 << 20  # ... and at least this many (H100, twelfth session, TF32: on
# every product, Qwen's 512-token prefill +36 %, Gemma 3's +3 %, SmolLM2's -14 %: its products
# of 576 x 1,536 are too small for the GEMM to pay for the dequantizing; thirteenth, float16:
# Gemma 3's gate, up and down, 2,048 x 640, +8 to +10 % in two calls; Qwen's 4,864 x 896 were
# on already)
# ... with float16 operands instead of TF32 (rows.cu's q8_to_f16, dequant_subs_half: each row
# times a power of two that keeps it in float16's range, undone exactly on the float32 sums by
# unscale_f32 or glu_unscale_f32): half the bytes, twice the tensor rate, the same 11 bits of
# mantissa as TF32's inputs (rounded to nearest, where TF32 truncates). H100, thirteenth
# session: fast conformance on every product 0 FAIL, worst NMSE 3.2e-7; Qwen's 512-token
# prefill even with TF32 (its GEMMs 1,431 -> 776 us, but the weights' dequantizing, then a
# block a row, slower than dequant_rows: 1,324 against 1,030 us), Gemma 3's +8 to +10 % once
# its FFN takes the path (FAST_GEMM_MIN_ELEMENTS); fourteenth, the weights dequantized a
# sub-block a thread: Qwen's prefill 6.80 -> 6.25 ms, Gemma 3's 5.15 -> 4.98: on
FAST_GEMM_HALF = True
# ... gate's and up's sums unscaled, their GLU and its QUANTIZE four columns a thread (rows.cu's
# glu_unscale_f32x4: 16-byte loads and stores, a Q8 block over 8 lanes) rather than one. H100,
# fourteenth session: the kernel 600 -> 388 us of Qwen's 512-token prefill (6.02 -> 5.81 ms),
# 210 -> 154 of Gemma 3's (5.04 -> 5.02 ms); fast conformance of the GLU cases with every
# product on float16 0 FAIL, the same bits as one column in the emulator: on
GLU_UNSCALE_X4 = True
HEADS_WIDTH_MAX = 1024  # ... (attention.cu's shared memory: 36 KiB of tiles, 4 KiB of q)
NO_ROPE = RopeSegsArg()  # a q/k/v launch without ROPEs


def flash_kernel(
    name: str, d: int, min_blocks: int, heads: int = 1, early: bool = False, ahead: bool = False
) -> str:
    """attention_chunks' or attention_sums' name for heads of ``d``, ``min_blocks``,
    FOLD_BATCH, ``heads`` query heads a KV head (HEADS_TOGETHER_CHUNKS), ``early`` loads
    (EARLY_LOADS) and, for attention_chunks, its K slabs loaded a slab ``ahead``
    (CHUNKS_SLABS_AHEAD)."""
    if early and ahead:  # (the template's static_assert: AHEAD's slabs load after the wait)
        raise ValueError("attention_chunks takes its K slabs early or a slab ahead, not both")
    chunks = heads_together_chunks(d, heads)
    together = chunks > 0 and 2 <= heads <= GQA_HEADS_MAX and heads * d <= HEADS_WIDTH_MAX
    if not together and not early and not ahead:
        if min_blocks == 0 and FOLD_BATCH == 1:
            return f"{name}<{d}>"
        return f"{name}<{d}, {min_blocks}, {FOLD_BATCH}>"
    h, hc = (heads, chunks) if together else (1, 0)
    tail = ", 1" if early else ", 0, 1" if ahead else ""
    return f"{name}<{d}, {min_blocks}, {FOLD_BATCH}, {h}, {hc}{tail}>"


def heads_together_chunks(d: int, heads: int) -> int:
    """The chunks a token sees from which flash decoding takes a block a KV head for its
    ``heads`` query heads of ``d`` (0: never): HEADS_TOGETHER_BY_HEADS's, else the width's."""
    if d <= 128 and heads in HEADS_TOGETHER_BY_HEADS:
        return HEADS_TOGETHER_BY_HEADS[heads]
    return HEADS_TOGETHER_CHUNKS[d]


def grid1(n: int, per: int = 256, cap: int = 65535) -> tuple[int, int, int]:
    return (max(1, min(cap, -(-n // per))), 1, 1)


def sub_block(dtype: DType) -> int:
    """Elements of one of a quantized type's sub-blocks (a TREE leaf of its products)."""
    return 16 if dtype is DType.Q6_K else 32


def round_bytes(dtype: DType) -> int:
    """Bytes of one GEMV round of a row: 32 sub-blocks (matmul.cu's Round::BYTES)."""
    return dtype.nbytes(32 * sub_block(dtype))


def lane_loads(nbytes: int) -> int:
    """The 16-byte loads a lane of a warp makes to copy ``nbytes`` from the aligned address at
    or below their first byte (matmul.cu's Stage: at most (nbytes + 30) // 16 loads)."""
    return -(-((nbytes + 30) // 16) // 32)


def group_q8_loads(dtype: DType, t: int, k: int, gated: bool) -> tuple[int, int] | None:
    """With GROUP_Q8, a gemv_q_q8_group launch's (PER, COPY) for a product of ``t`` tokens over
    K = ``k``: a lane's 16-byte loads of a row, the words of a row's copy in shared memory;
    None where it does not apply (more tokens, rows of more than one round, copies of 32 rows
    past GROUP_Q8_SHARED): gemv_q_q8."""
    if not GROUP_Q8 or t != 1 or next_pow2(k // sub_block(dtype)) > 32:
        return None
    nbytes = dtype.nbytes(k)
    copy = (nbytes + 30) // 16  # (Stage's loads from the aligned address at or below the row)
    if 32 * (2 if gated else 1) * copy * 16 + 32 * 4 > GROUP_Q8_SHARED:
        return None
    return lane_loads(nbytes), copy


def group_q8_rpw(blocks: int, multiprocessors: int, split: int = 1) -> int:
    """gemv_q_q8_group's rows a warp for a launch of ``blocks`` blocks of 32 / ``split`` rows
    (GROUP_Q8_RPW; at most those rows)."""
    if GROUP_Q8_RPW:
        return min(GROUP_Q8_RPW, 32 // split)
    return 1 if blocks <= multiprocessors else 2


def group_q8_split(clusters: bool, groups: int, multiprocessors: int) -> int:
    """Blocks a 32-row group of a launch of ``groups`` groups (GROUP_Q8_SPLIT), 1 where the
    GPU has no clusters."""
    if GROUP_Q8_SPLIT not in (0, 1, 2, 4, 8):  # (8: the largest cluster every sm_90 part takes)
        raise BackendError(f"GROUP_Q8_SPLIT = {GROUP_Q8_SPLIT}: blocks a group of 32 rows must "
                           "be 1, 2, 4 or 8, or 0 (chosen by the launch)")  # fmt: skip
    if not clusters:
        return 1
    if GROUP_Q8_SPLIT == 0:
        return 4 if groups > multiprocessors else 1
    return GROUP_Q8_SPLIT


def gemv_warps_per_row(dtype: DType, k: int) -> int:
    """Warps computing one output row of a quantized GEMV (matmul.cu's WPR): one per round of 32
    sub-blocks of the row's TREE, up to GEMV_WARPS, so long rows spread over a block."""
    rounds = max(1, next_pow2(k // sub_block(dtype)) // 32)
    if rounds > GEMV_MAX_ROUNDS * GEMV_WARPS:
        raise BackendError(
            f"a {dtype.name} product over K = {k} is wider than the cuda GEMV's TREE holds "
            f"({GEMV_MAX_ROUNDS * GEMV_WARPS * 32} sub-blocks)"
        )
    return min(GEMV_WARPS, rounds)


def tile_tokens(t: int, heads: int, n_head_kv: int, d: int = 64) -> int:
    """attention_tiles' tokens a block for ``t`` tokens and ``heads`` query heads a KV head of
    ``d``: as many as ``tile_rows(d)`` rows take, but few enough for TILE_BLOCKS blocks where
    ``t`` allows."""
    return max(1, min(tile_rows(d) // heads, TILE_TOKENS, t * n_head_kv // TILE_BLOCKS))


def fast_attention_tokens(d: int) -> int:
    """attention_fast's tokens a block for heads of ``d`` (attention.cu's FAST_TB): four warps
    of 16 tokens with heads of 64, four warps on a quarter of the same 16 tokens' columns each
    with heads of 256."""
    return 16 * 4 // (d // 64)


def fast_attention_shared(d: int, groups: int) -> int:
    """attention_fast's dynamic shared memory (attention.cu's FAST_SHARED): each group's tile
    of cache slots (32 with heads of 64, 16 with heads of 256), K and V split in hi and lo,
    rows of ``d`` + 4 words; with heads of 256 the four warps' partial scores."""
    if groups not in (1, 2):
        raise ValueError(f"FAST_ATTENTION_GROUPS is {groups!r}; attention_fast takes 1 or 2")
    slots = 32 if d == 64 else 16
    partial = 0 if d == 64 else 4 * slots // 2 * 32
    return (groups * 4 * slots * (d + 4) + partial) * 4


def tiles_shared(rows: int, d: int) -> int:
    """attention_tiles' dynamic shared memory for ``rows`` query rows of heads of ``d``: q and
    the sums (``d`` floats a row each), the weights and the partial TREEs (256 each, twice for
    heads of 256), max and den."""
    return 4 * rows * (2 * d + (3 if d == 256 else 2) * 256 + 2)


def tile_rows(d: int) -> int:
    """attention_tiles' query rows a block at most for heads of ``d``: at most about 81 KiB of
    shared memory, so two blocks fit an SM's (heads of 128 take 250 registers a thread, so
    their blocks go one an SM all the same)."""
    return TILE_ROWS if d == 64 else TILE_ROWS // 2


def tile_scores_chunks(rows: int, span: int) -> int:
    """The chunks of scores each of attention_tiles' ``rows`` query rows (all its blocks') may
    keep in TILE_SCORES_BYTES (at most the ``span`` a block's tokens can see); 0: none."""
    return min(span, TILE_SCORES_BYTES // (rows * 256 * 4))


def gemm_mma_shared(dtype: DType, gated: bool, k: int, tokens: int = 32) -> int | None:
    """Bytes of dynamic shared memory of matmul.cu's gemm_mma for a product over K in blocks
    of ``tokens`` (its MmaShared, then the TREE counters of levels LOG .. log2(W)), or None
    where it does not apply: rows shorter than a stage's subtree (W < SUBS) go to gemm_q."""
    sub = sub_block(dtype)
    subs, log = 256 // sub, (3 if sub == 32 else 4)
    width = next_pow2(k // sub)
    if width < subs:
        return None
    nmat = 2 if gated else 1
    raw = (dtype.nbytes(256) + 30) // 16 * 16  # a stage of a row, copied from an aligned start
    weights = nmat * MMA_TILE * (raw + MMA_WSTRIDE * 4 + (subs + 2) * 8)  # raw, wq, wam
    activations = tokens * (MMA_WSTRIDE * 4 + MMA_BLOCK_PAIRS * 8)  # xq, xds
    levels = width.bit_length() - 1 - log + 1  # LOG .. log2(W)
    return weights + activations + levels * nmat * 4 * (8 * tokens) * 4  # 4 outputs a thread


def takes_mma(dtype: DType, gated: bool, k: int) -> bool:
    """Whether a prefill's product of weights of ``dtype`` over K = ``k`` takes gemm_mma."""
    return dtype.is_quantized and gemm_mma_shared(dtype, gated, k, MMA_TOKENS) is not None


def mma_variant(tokens: int | None = None) -> str:
    """gemm_mma's (and gemm_mma_multi's) template arguments after the types and epilogue:
    MINB and BT (``tokens``, by default MMA_TOKENS) where they are not the defaults."""
    tokens = MMA_TOKENS if tokens is None else tokens
    if tokens != 32:  # (16 warps: one block a multiprocessor, its registers' bound)
        return f", 1, {tokens}"
    return f", {MMA_MIN_BLOCKS}" if MMA_MIN_BLOCKS != 2 else ""


def normed_shared(t: int, k: int) -> int:
    """The dynamic shared memory of a *_normed GEMV: x's Q8A for ``t`` tokens of ``k``
    (matmul.cu's normed_q8: the quants, then each 32-block's d and s)."""
    return -(-(t * k + 8 * t * (k // 32)) // 16) * 16


def tree_levels(width: int) -> int:
    """MAXL for a TREE of ``width`` leaves (a power of two): its levels plus one."""
    return width.bit_length()


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@attrs.frozen
class Segments:
    """A multi-product launch's segments (GemvSegs) and its blocks."""

    arg: GemvSegsArg
    blocks: int


@attrs.define
class NormInProducts:
    """A decode norm left to the products that read its QUANTIZE (NORM_IN_PRODUCT), and the
    residual product's subtrees of the squares it is made from."""

    norm: int
    weight: int | None
    quantize: int
    parts: Any  # (T, np) floats, gemv_q_sq's
    level: int  # log2 of the slots a subtree holds
    np: int
    written: bool = False  # a product's block 0 wrote the norm's and the QUANTIZE's values
    launched: bool = False  # ... or rms_norm_f32 did, for a reader that cannot make it


class _Done(set):
    """Lowering.done: the nodes computed so far, and the order they came in (``order``)."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[int] = []

    def add(self, i: int) -> None:
        if i not in self:
            self.order.append(i)
            super().add(i)

    def update(self, *items) -> None:
        for group in items:
            for i in group:
                self.add(i)


@attrs.define
class Lowered:
    """A split's launches, and the extra device buffers they write (scratch)."""

    launches: list[tuple[Callable[..., None], tuple[Any, ...]]]
    scratch: list[Any]
    kernels: set[tuple[str, str]]
    pending: list[tuple[tuple[str, str], Launch]]  # launches whose kernel ``bind`` sets

    def bind(self, function: Callable[[str, str, int], int]) -> None:
        """Give every launch its kernel's handle (compiled or loaded by then), allowed the
        launch's dynamic shared memory."""
        for key, launch in self.pending:
            launch.fn = function(*key, launch.shared)
        self.pending = []


class Lowering:
    """Builds launches for one split: ``launch`` enqueues a ``Launch`` on the stream,
    ``copy(dst, src)`` is a device copy, ``scratch(dtype, shape)`` a buffer of the executable's
    own. The kernels the launches need are compiled together afterwards (``Lowered.bind``)."""

    def __init__(
        self,
        graph: Graph,
        values: Mapping[int, Any],
        weights: Mapping[str, Any],
        launch: Callable[[Launch], None],
        copy: Callable[[Any, Any], None],
        scratch: Callable[[DType, tuple[int, ...]], Any],
        pdl: bool = False,
        views: frozenset[int] = frozenset(),
        multiprocessors: int = 132,
        fast: bool = False,
        matmul: Callable[..., None] | None = None,
        half_gemm: bool = False,
        clusters: bool = False,
    ) -> None:
        self.graph = graph
        self.values = values
        self.weights = weights
        self.enqueue = launch
        self.copy = copy
        self.new_scratch = scratch
        self.pdl = pdl  # every launch with programmatic dependent launch
        self.views = views  # RESHAPEs and SLICE_ROWS whose value is a view: nothing to copy
        self.multiprocessors = multiprocessors  # the GPU's (grids sized to the machine)
        self.fast = fast  # numerics = "fast": the fast kernels where a switch turns them on
        self.matmul = matmul  # out = a b^T (+ add) on the tensor cores (FAST_GEMM); None: none
        self.half_gemm = half_gemm  # ... which takes float16 a and b too (FAST_GEMM_HALF)
        self.clusters = clusters  # thread block clusters (sm_90)
        self._fast_x = -1  # the Q8A x whose floats the FAST_GEMM scratch holds last
        self._weight_tops: dict[int, Any] = {}  # FAST_GEMM_HALF: each weight's rows' bounds
        self.out: Lowered = Lowered([], [], set(), [])
        self.done = _Done()
        # EARLY_LOADS: for each node done, the launches made by the end of the node's lowering
        # that did it (its value's writer is one of them, or none)
        self._written: dict[int, int] = {}
        self._shared: dict[str, tuple[int, Any]] = {}  # name: (elements, buffer)
        # NORM_IN_PRODUCT: the subtrees a residual product left for the norm of its output
        # (norm: (parts, level, np)), then the norms left to their products, by QUANTIZE
        self._norm_parts: dict[int, tuple[Any, int, int]] = {}
        self._norm_in: dict[int, NormInProducts] = {}

    # -- helpers --------------------------------------------------------------------------

    def _launch(self, source: str, name: str, grid, block, args, shared: int = 0) -> None:
        launch = Launch(name, 0, grid, block, shared, pack(args), self.pdl)  # kernel: ``bind``
        self.out.kernels.add((source, name))
        self.out.pending.append(((source, name), launch))
        self.out.launches.append((self.enqueue, (launch,)))

    def _value(self, i: int) -> Any:
        return self.values[i]

    def _weight(self, node: Node) -> Any:
        return self.weights[node.arg]

    def _src(self, node: Node, k: int) -> Node:
        return self.graph.nodes[node.src[k]]

    def _ptr(self, i: int) -> ctypes.c_void_p:
        src = self.graph.nodes[i]
        if src.op is Op.WEIGHT:
            return pointer(self.weights[src.arg])
        return pointer(self.values[i])

    def _shared_scratch(self, name: str, dtype: DType, n: int) -> Any:
        """Scratch that every launch of the split asking for ``name`` shares (at least ``n``
        elements, zeroed once): the layers' flash-decoding launches run one after another on
        the stream, each after the one before has finished (under PDL too: they wait before
        touching the scratch), and leave the tickets at zero."""
        have = self._shared.get(name)
        if have is None or have[0] < n:
            buffer = self.new_scratch(dtype, (n,))
            self.out.scratch.append(buffer)
            have = self._shared[name] = (n, buffer)
        return have[1]

    # -- the nodes ----------------------------------------------------------------------------

    def lower(self, nodes: tuple[int, ...], readers: Mapping[int, list[int]]) -> Lowered:
        inside = set(nodes)
        self.inside, self.readers, self.order = inside, readers, nodes
        for i in nodes:
            if i not in self.done:
                self._lower_node(i)
        return self.out

    def _lower_node(self, i: int) -> None:
        node = self.graph.nodes[i]
        follow = [u for u in self.readers.get(i, []) if u in self.inside and u not in self.done]
        first = len(self.done.order)
        getattr(self, f"_{node.op.name.lower()}")(i, node, follow)
        self.done.add(i)
        for j in self.done.order[first:]:
            self._written[j] = len(self.out.launches)

    def _written_before_last(self, i: int) -> bool:
        """Whether node ``i``'s value was written two launches back or earlier: the next launch
        may load it before PDL's wait (EARLY_LOADS). A weight, never written; a step's input
        (ids, positions) where a launch of this split came first: the input was uploaded or
        copied before the split's first kernel, or advanced by advance_i32, which lets the
        next kernel start before it writes, so only the kernel after that one may load early.
        A value from outside the split: no (the split before may end with the kernel that
        wrote it). A norm left to its products (NORM_IN_PRODUCT) is done before the launch
        that writes it: never."""
        op = self.graph.nodes[i].op
        if i not in self.inside:
            return op is Op.WEIGHT or (op is Op.INPUT and bool(self.out.launches))
        if any(i in (n.norm, n.quantize) for n in self._norm_in.values()):
            return False
        return self._written.get(i, 1 << 30) < len(self.out.launches)

    def _pull(self, i: int) -> bool:
        """Make node ``i``'s value exist before the next launch, launching it now if it is a
        matrix product of the split whose sources are ready (v's, for the rope launch that
        writes it into the cache). False if it cannot be."""
        if self._ready(i):
            return True
        node = self.graph.nodes[i]
        if node.op is not Op.MATMUL or not all(self._ready(s) for s in node.src):
            return False
        self._lower_node(i)
        return True

    def _fused_reader(self, follow: list[int], op: Op) -> int | None:
        """The first reader of ``op`` among a node's later readers in the split, if any."""
        for u in follow:
            if self.graph.nodes[u].op is op:
                return u
        return None

    def _q8_parts(self, i: int | None) -> tuple[Any, Any, Any]:
        if i is None:
            return (None, None, None)
        pending = self._norm_in.get(i)
        if pending is not None and not pending.launched:  # a reader that cannot make it: the
            pending.launched = True  # norm's own launch, before it (the same values again
            self._launch_norm([(pending.norm, pending.weight, i)])  # where a product wrote them)
        v: Q8Value = self.values[i]
        return (v.q, v.d, v.s)

    def _normed_x(self, i: int) -> NormInArg | None:
        """With NORM_IN_PRODUCT, the NormIn of a decode product whose Q8A x ``i`` is a norm's
        QUANTIZE left to its readers (the first one's block 0 writes both values); None when
        x is made otherwise."""
        pending = self._norm_in.get(i)
        if pending is None or pending.launched:
            return None
        nodes = self.graph.nodes
        norm = nodes[pending.norm]
        arg = NormInArg()
        arg.x, arg.parts = self._ptr(norm.src[0]).value, pending.parts.data_ptr()
        arg.w = None if pending.weight is None else self._ptr(pending.weight).value
        arg.eps, arg.np, arg.level = float(norm.arg), pending.np, pending.level
        if not pending.written:
            pending.written = True
            arg.y = self._ptr(pending.norm).value
            v: Q8Value = self.values[i]
            arg.q, arg.qd, arg.qs = v.q.data_ptr(), v.d.data_ptr(), v.s.data_ptr()
        return arg

    def _norm_parts_for(self, i: int, t: int, n: int, rows: int) -> Any:
        """With NORM_IN_PRODUCT, for decode residual product ``i`` (``rows`` rows a GEMV block):
        scratch for its blocks' subtrees of the squares, when the norm of its output is one
        that its readers can make (``_norm_in``); else None."""
        if not NORM_IN_PRODUCT:
            return None
        nodes = self.graph.nodes
        norm = self._norm_of(i)
        if (norm is None or next_pow2(n) // rows > NORM_IN_RUN * 32 * GEMV_WARPS or n % 32
                or normed_shared(t, n) > NORM_IN_SHARED_MAX):  # fmt: skip
            return None
        readers = self.readers.get(norm, [])
        if len(readers) != 1 or nodes[readers[0]].op is not Op.QUANTIZE:
            return None
        users = self.readers.get(readers[0], [])
        for u in users:  # products of the split, of quantized weights, none the output head's
            node = nodes[u]
            if u not in self.inside or node.op not in (Op.MATMUL, Op.MATMUL_ADD, Op.MATMUL_SWIGLU):
                return None
            w = nodes[node.src[1]]
            wide = self._wide_blocks(w.dtype, t, node.shape[1], w.shape[1], 0)
            if w.dtype in FLOAT_WEIGHTS or wide or node.shape[1] > NORM_IN_ROWS * n:
                return None
        if not users:
            return None
        blocks = -(-n // rows)
        parts = self.new_scratch(DType.F32, (t * blocks,))
        self.out.scratch.append(parts)
        self._norm_parts[norm] = (parts, rows.bit_length() - 1, blocks)
        return parts

    def _get_rows(self, i, node, follow):
        table, ids = self._src(node, 0), node.src[1]
        t, k = node.shape
        row_bytes = table.dtype.nbytes(k)
        self._launch(
            "rows.cu", f"get_rows<{table.dtype.value}>", grid1(t * k), (256, 1, 1),
            [self._ptr(i), self._ptr(node.src[0]), self._ptr(ids), t, k,
             ctypes.c_longlong(row_bytes)],
        )  # fmt: skip

    def _slice_rows(self, i, node, follow):
        if i not in self.views:
            x = self.values[node.src[0]]
            start, count = node.arg.start, node.arg.count
            self.out.launches.append((self.copy, (self.values[i], x[start : start + count])))

    def _reshape(self, i, node, follow):
        if i not in self.views:
            self.out.launches.append((self.copy, (self.values[i], self.values[node.src[0]])))

    def _binary(self, i, node, op: int):
        b = self.graph.nodes[node.src[1]]
        n = node.shape[0] * node.shape[1]
        row = int(len(b.shape) == 1)
        self._launch(
            "rows.cu", f"binary_f32<{op}>", grid1(n), (256, 1, 1),
            [self._ptr(i), self._ptr(node.src[0]), self._ptr(node.src[1]), ctypes.c_longlong(n),
             node.shape[1], row],
        )  # fmt: skip

    def _add(self, i, node, follow):
        self._binary(i, node, 0)

    def _mul(self, i, node, follow):
        self._binary(i, node, 1)

    def _silu(self, i, node, follow):
        self._unary(i, node, "silu_f32")

    def _gelu(self, i, node, follow):
        self._unary(i, node, "gelu_f32")

    def _unary(self, i, node, kernel: str):
        n = node.shape[0] * node.shape[1]
        self._launch("rows.cu", kernel, grid1(n), (256, 1, 1),
                     [self._ptr(i), self._ptr(node.src[0]), ctypes.c_longlong(n)])  # fmt: skip

    def _swiglu(self, i, node, follow):
        self._glu(i, node, follow, 0)

    def _geglu(self, i, node, follow):
        self._glu(i, node, follow, 1)

    def _glu(self, i, node, follow, act: int):
        n = node.shape[0] * node.shape[1]
        qn = self._fused_reader(follow, Op.QUANTIZE)
        q, qd, qs = self._q8_parts(qn)
        self._launch("rows.cu", f"glu_f32<{act}>", grid1(n), (256, 1, 1),
                     [self._ptr(i), pointer(q), pointer(qd), pointer(qs),
                      self._ptr(node.src[0]), self._ptr(node.src[1]),
                      ctypes.c_longlong(n)])  # fmt: skip
        if qn is not None:
            self.done.add(qn)

    def _scale(self, i, node, follow):
        n = node.shape[0] * node.shape[1]
        self._launch("rows.cu", "scale_f32", grid1(n), (256, 1, 1),
                     [self._ptr(i), self._ptr(node.src[0]), ctypes.c_longlong(n),
                      float(node.arg)])  # fmt: skip

    def _norm(self, i, node, follow, w):
        qn = self._fused_reader(follow, Op.QUANTIZE)
        source = self._norm_parts.get(i)
        if source is not None and qn is not None:  # NORM_IN_PRODUCT: its readers make it
            self._norm_in[qn] = NormInProducts(i, w, qn, *source)
            self.done.add(qn)
            return
        jobs = [(i, w, qn)]
        other = None if qn is not None else self._norm_sibling(i, node)
        if other is not None:
            jobs.append((other, self._norm_weight(other), None))
            self.done.add(other)
        self._launch_norm(jobs)

    def _launch_norm(self, jobs: list[tuple[int, int | None, int | None]]) -> None:
        """One rms_norm_f32 (or rms_norm_slots, rms_norm_warps) launch of one or two norms
        (node, weight, QUANTIZE or None) of one width (``_norm_job``). No job reads what another
        block of the launch writes: ``written``."""
        a = NormRowsArg()
        a.width = self.graph.nodes[jobs[0][0]].shape[1]
        written = {i for i, _, _ in jobs}
        quantized = False
        reads: list[tuple[int, int]] = []
        for slot, (i, w, qn) in zip("ab", jobs, strict=False):
            quantized |= self._norm_job(getattr(a, slot), i, w, qn, written, reads)
        rows = a.a.rows + a.b.rows
        decode = rows <= GEMV_TOKENS[-1]
        if decode and NORM_SLOTS and a.width % 32 == 0 and 32 <= a.width <= NORM_THREADS:
            early = 0
            for mode in (NORM_EARLY_W, NORM_EARLY_RES) if EARLY_LOADS and self.pdl else ():
                some = [i for m, i in reads if m == mode]
                if some and all(self._written_before_last(i) for i in some):
                    early |= mode
            self._launch("rows.cu", f"rms_norm_slots<{early}>", (rows, 1, 1), (a.width, 1, 1),
                         [a])  # fmt: skip
            return
        if not decode and a.width <= min(NORM_WARP_WIDTH_MAX, 32 * NORM_WARP_RUN_MAX):
            run = max(1, next_pow2(a.width) // 32)
            self._launch("rows.cu", f"rms_norm_warps<{run}>", (-(-rows // NORM_WARP_ROWS), 1, 1),
                         (32 * NORM_WARP_ROWS, 1, 1), [a])  # fmt: skip
            return
        threads = NORM_DECODE_THREADS if decode else NORM_PREFILL_THREADS
        threads = max(threads, next_pow2(a.width) // 256)  # (norm.cuh: 256 squares a thread)
        self._launch("rows.cu", "rms_norm_f32", (rows, 1, 1), (threads, 1, 1), [a],
                     a.width * 4 if quantized else 0)  # fmt: skip

    def _norm_job(self, job: NormJobArg, i: int, w: int | None, qn: int | None,
                  written: set[int],
                  reads: list[tuple[int, int]] | None = None) -> bool:  # fmt: skip
        """Fill ``job`` (norm.cuh's NormJob) for norm ``i`` with weight ``w`` and its QUANTIZE
        ``qn``; a norm read only by an ADD also writes its sum, and the norm of the sum that
        follows (with its QUANTIZE) is the same job's. Marks what it computes done; True when
        it quantizes (the kernel's row of shared memory). ``reads`` gets the weights' and the
        residual's nodes, each with its NORM_EARLY_* bit (rms_norm_slots may load them early)."""
        reads = [] if reads is None else reads
        nodes = self.graph.nodes
        node = nodes[i]
        job.y, job.x = self._ptr(i).value, self._ptr(node.src[0]).value
        job.w = None if w is None else self._ptr(w).value
        if w is not None:
            reads.append((NORM_EARLY_W, w))
        job.eps, job.rows = float(node.arg), node.shape[0]
        quantized = qn is not None
        if qn is not None:
            job.q, job.qd, job.qs = (p.data_ptr() for p in self._q8_parts(qn))
            self.done.add(qn)
        add = self._norm_add(i, written) if qn is None else None
        if add is None:
            return quantized
        res = next(s for s in nodes[add].src if s != i)
        job.sum, job.res = self._ptr(add).value, self._ptr(res).value
        reads.append((NORM_EARLY_RES, res))
        self.done.add(add)
        written.add(add)
        then = self._norm_of(add)
        if then is not None:
            job.y2, job.eps2 = self._ptr(then).value, float(nodes[then].arg)
            w2 = self._norm_weight(then)
            job.w2 = None if w2 is None else self._ptr(w2).value
            if w2 is not None:
                reads.append((NORM_EARLY_W, w2))
            q2 = self._fused_reader(
                [u for u in self.readers.get(then, []) if u in self.inside], Op.QUANTIZE
            )
            if q2 is not None:
                job.q2, job.qd2, job.qs2 = (p.data_ptr() for p in self._q8_parts(q2))
                self.done.add(q2)
                quantized = True
            self.done.add(then)
            written.add(then)
        return quantized

    def _norm_after(self, i: int) -> tuple[NormJobArg, bool] | None:
        """With NORM_AFTER_PRODUCT, the job of the norm that reads product ``i``'s output (a
        decode GEMV's), for the product's last block to do (matmul.cu's gemv_q_norm), and
        whether it quantizes; None when there is none or the block cannot hold its tree."""
        norm = self._norm_of(i) if NORM_AFTER_PRODUCT else None
        if norm is None or next_pow2(self.graph.nodes[i].shape[1]) > GEMV_NORM_WIDTH_MAX:
            return None
        follow = [u for u in self.readers.get(norm, []) if u in self.inside and u not in self.done]
        job = NormJobArg()
        quantized = self._norm_job(job, norm, self._norm_weight(norm),
                                   self._fused_reader(follow, Op.QUANTIZE), {norm})  # fmt: skip
        self.done.add(norm)
        return job, quantized

    def _norm_of(self, i: int) -> int | None:
        """A norm of the split still to launch whose x is ``i`` (a sum the norm kernel writes),
        of its width: the same blocks compute it."""
        for u in self.readers.get(i, []):
            node = self.graph.nodes[u]
            if (u in self.inside and u not in self.done
                    and node.op in (Op.RMS_NORM, Op.RMS_NORM_MUL) and node.src[0] == i
                    and node.shape == self.graph.nodes[i].shape
                    and all(self._ready(s) for s in node.src[1:])):  # fmt: skip
                return u
        return None

    def _norm_weight(self, i: int) -> int | None:
        node = self.graph.nodes[i]
        return node.src[1] if node.op is Op.RMS_NORM_MUL else None

    def _norm_add(self, i: int, written: set[int]) -> int | None:
        """The ADD that is the norm's one reader in the split, of two values of one shape, the
        other one ready and not ``written`` by the same launch (ADD(norm(x), norm(y)) of two
        jobs: the other job's rows are another block's): the norm kernel writes its sum too."""
        inside = [u for u in self.readers.get(i, []) if u in self.inside]
        if len(inside) != 1 or inside[0] in self.done:
            return None
        add = self.graph.nodes[inside[0]]
        if add.op is not Op.ADD:
            return None
        a, b = add.src
        if a == b or self.graph.nodes[a].shape != self.graph.nodes[b].shape:
            return None
        other = b if a == i else a
        return inside[0] if other not in written and self._ready(other) else None

    def _norm_sibling(self, i: int, node: Node) -> int | None:
        """A later norm of the split of this one's width and eps, its x and weight ready and no
        QUANTIZE among its readers (Gemma 3's k head norm, after q's): launched with this one."""
        for j in self.order[self.order.index(i) + 1 :]:
            other = self.graph.nodes[j]
            if (j in self.done or other.op not in (Op.RMS_NORM, Op.RMS_NORM_MUL)
                    or other.shape[1] != node.shape[1] or other.arg != node.arg
                    or not all(self._ready(s) for s in other.src)):  # fmt: skip
                continue
            if not any(self.graph.nodes[u].op is Op.QUANTIZE for u in self.readers.get(j, [])):
                return j
        return None

    def _rms_norm(self, i, node, follow):
        self._norm(i, node, follow, None)

    def _rms_norm_mul(self, i, node, follow):
        self._norm(i, node, follow, node.src[1])

    def _quantize(self, i, node, follow):
        t, k = node.shape
        q, d, s = self._q8_parts(i)
        blocks = t * k // 32
        self._launch("rows.cu", "quantize_q8", grid1(blocks, 8), (256, 1, 1),
                     [pointer(q), pointer(d), pointer(s), self._ptr(node.src[0]),
                      ctypes.c_longlong(blocks)])  # fmt: skip

    def _rope(self, i, node, follow):
        """This ROPE, the step's other ROPE of the same positions and tables (k after q), the
        KV_WRITE of each, and the one more KV_WRITE at those positions (v): one launch."""
        arg = node.arg
        t = node.shape[0]
        jobs = [(i, node, self._rope_kv(i, node, follow))]
        other = self._rope_sibling(i, node)
        if other is not None:
            o = self.graph.nodes[other]
            later = [u for u in self.readers.get(other, []) if u in self.inside]
            jobs.append((other, o, self._rope_kv(other, o, later)))
        v = self._other_kv_write(node.src[1], {kv for *_, kv in jobs})
        a = RopeArg()
        a.positions, a.cos_t, a.sin_t = (self._ptr(s).value for s in node.src[1:])
        for slot, (r, rn, kv) in enumerate(jobs):
            setattr(a, f"y{slot}", self._ptr(r).value)
            setattr(a, f"x{slot}", self._ptr(rn.src[0]).value)
            if kv is not None:
                setattr(a, f"cache{slot}", self._ptr(self.graph.nodes[kv].src[0]).value)
                self.done.add(kv)
            setattr(a, f"heads{slot}", rn.arg.n_head)
            self.done.add(r)
        if v is not None:
            kv_node = self.graph.nodes[v]
            a.v, a.v_cache = self._ptr(kv_node.src[1]).value, self._ptr(kv_node.src[0]).value
            a.v_width = self.graph.nodes[kv_node.src[1]].shape[1]
            self.done.add(v)
        a.n_tokens, a.head_dim, a.n_rot = t, arg.head_dim, arg.n_rot
        per_head = arg.n_rot // 2 + (arg.head_dim - arg.n_rot)
        work = t * per_head * (a.heads0 + a.heads1) + t * a.v_width
        self._launch("rows.cu", f"rope_f32<{int(arg.mode == 'neox')}>", grid1(work),
                     (256, 1, 1), [a])  # fmt: skip

    def _rope_kv(self, i: int, node: Node, follow: list[int]) -> int | None:
        """The KV_WRITE of this ROPE's rows at the positions it rotated by, if the split has
        one still to launch."""
        kv = self._fused_reader(follow, Op.KV_WRITE)
        if kv is not None and self.graph.nodes[kv].src[1:] == (i, node.src[1]):
            return kv if self._may_write_now(kv) else None
        return None

    def _rope_sibling(self, i: int, node: Node) -> int | None:
        """Another ROPE of the split still to launch with this one's positions, tables and
        mode, whose x is computed or is a product that can launch first."""
        for u in self.readers.get(node.src[1], []):
            other = self.graph.nodes[u]
            if (u != i and u in self.inside and u not in self.done and other.op is Op.ROPE
                    and other.src[1:] == node.src[1:]
                    and attrs.evolve(other.arg, n_head=node.arg.n_head) == node.arg
                    and self._pull(other.src[0])):  # fmt: skip
                return u
        return None

    def _other_kv_write(self, positions: int, taken: set[int | None]) -> int | None:
        """A KV_WRITE of the split still to launch at ``positions`` whose cache is ready and
        whose rows are, or are a product that can launch first (v's, beside the ROPEs' own)."""
        for u in self.readers.get(positions, []):
            kv = self.graph.nodes[u]
            if (u in self.inside and u not in self.done and u not in taken
                    and kv.op is Op.KV_WRITE and kv.src[2] == positions
                    and self._ready(kv.src[0]) and self._may_write_now(u)
                    and self._pull(kv.src[1])):  # fmt: skip
                return u
        return None

    def _may_write_now(self, kv: int) -> bool:
        """Whether KV_WRITE ``kv`` may run before its turn: nothing still to launch reads the
        cache as it was before the write."""
        cache = self.graph.nodes[kv].src[0]
        return all(r == kv or r in self.done for r in self.readers.get(cache, []))

    def _ready(self, i: int) -> bool:
        """Whether node ``i``'s value exists before the next launch: computed by an earlier
        launch of this split, not computed by this split at all, or a view of such a value."""
        if i in self.done or i not in self.inside:
            return True
        return i in self.views and self._ready(self.graph.nodes[i].src[0])

    def _kv_write(self, i, node, follow):
        cache, rows, pos = node.src
        t, width = self.graph.nodes[rows].shape
        self._launch("rows.cu", "kv_write_f32", grid1(t * width), (256, 1, 1),
                     [self._ptr(cache), self._ptr(rows), self._ptr(pos), t, width])  # fmt: skip

    def _argmax(self, i, node, follow):
        rows, width = self._src(node, 0).shape
        slices = -(-width // ARGMAX_SLICE)
        keys = self.new_scratch(DType.I32, (rows * slices * 2,))  # unsigned 64-bit keys
        tickets = self.new_scratch(DType.I32, (rows,))  # zero: scratch is zeroed
        self.out.scratch += [keys, tickets]
        self._launch("rows.cu", "argmax_f32", (slices, rows, 1), (256, 1, 1),
                     [self._ptr(i), self._ptr(node.src[0]), width, pointer(keys),
                      pointer(tickets)])  # fmt: skip

    def _attention(self, i, node, follow):
        arg = node.arg
        d = arg.head_dim
        t = node.shape[0]
        n_ctx = self._src(node, 1).shape[0]
        qn = self._fused_reader(follow, Op.QUANTIZE)
        oq, od, os_ = self._q8_parts(qn)
        a = AttnArg()
        a.q, a.k, a.v, a.positions = (self._ptr(s).value for s in node.src)
        a.out = self._ptr(i).value
        a.oq, a.od, a.os = (pointer(p).value for p in (oq, od, os_))
        a.n_head, a.n_head_kv, a.n_ctx, a.scale = arg.n_head, arg.n_head_kv, n_ctx, arg.scale
        a.window = arg.window
        reach = arg.reach if DECODE_REACH else 0  # (every position below it: its chunks do)
        chunks = -(-(reach or n_ctx) // 256)
        seen = chunks if not arg.window else min(chunks, -(-(arg.window - 1) // 256) + 1)
        flash = d == 64 or (d == 256 and FAST_ATTENTION_WIDE)  # (attention_fast's heads)
        if self.fast and FAST_ATTENTION and t > SPLIT_TOKENS and flash:
            a.oq = a.od = a.os = None  # (its QUANTIZE: a launch of its own)
            a.n_tokens = t
            groups = FAST_ATTENTION_GROUPS if d == 64 else 1  # (heads of 256: one group)
            split, blocks = FAST_ATTENTION_SPLIT, -(-t // fast_attention_tokens(d))
            if split > 1:  # each block's sums (36 floats a thread), a ticket a (head, block)
                part = self._shared_scratch("fast_part", DType.F32,
                                            arg.n_head * blocks * split * 36 * 128)  # fmt: skip
                tickets = self._shared_scratch("fast_tickets", DType.I32, arg.n_head * blocks)
                a.part, a.tickets = part.data_ptr(), tickets.data_ptr()
            self._launch("attention.cu", f"attention_fast<{d}, {groups}>",
                         (arg.n_head * split, blocks, 1), (128 * groups, 1, 1), [a],
                         fast_attention_shared(d, groups))  # fmt: skip
            return
        if t <= SPLIT_TOKENS:  # flash decoding: a block a (head, token, chunk)
            th = t * arg.n_head
            quarters = (QUARTER_SUMS and d == 256 and CHUNKS_ONE_LAUNCH[d] == 0
                        and HEADS_TOGETHER_CHUNKS[d] == 0)  # fmt: skip
            parts = th * chunks * (4 if quarters else 1) * (d + 1)  # (quarters: a block's)
            part = self._shared_scratch("part", DType.F32, parts)
            tickets = self._shared_scratch("tickets", DType.I32, th)  # zero between launches
            a.part, a.tickets = part.data_ptr(), tickets.data_ptr()
            grid = (arg.n_head, t, chunks)
            a.chunks_one_launch = CHUNKS_ONE_LAUNCH[d]
            more = seen > a.chunks_one_launch  # a token may see more: scores through scratch
            if more:
                scores = self._shared_scratch("scores", DType.F32, th * chunks * 256)
                pmax = self._shared_scratch("pmax", DType.F32, th * chunks)
                a.scores, a.pmax = scores.data_ptr(), pmax.data_ptr()
            heads = arg.n_head // arg.n_head_kv
            early = self._early_positions(node.src[3])  # (attention_sums: the cache too)
            early_k = early and t == 1 and d == 64 and self._writes_row_p(node)
            ahead = CHUNKS_SLABS_AHEAD and a.chunks_one_launch == 0 and not early_k
            self._launch("attention.cu",
                         flash_kernel("attention_chunks", d, CHUNKS_MIN_BLOCKS, heads, early_k,
                                      ahead),
                         grid, (256, 1, 1), [a])  # fmt: skip
            if more and quarters:  # a block a quarter of a chunk
                name = f"attention_quarters<{d}{', 1' if early else ''}>"
                self._launch("attention.cu", name, (arg.n_head, t, 4 * chunks), (256, 1, 1), [a])
            elif more:
                self._launch("attention.cu",
                             flash_kernel("attention_sums", d, SUMS_MIN_BLOCKS, heads, early),
                             grid, (256, 1, 1), [a])  # fmt: skip
        elif PREFILL_TILES and arg.n_head // arg.n_head_kv <= tile_rows(d):
            heads = arg.n_head // arg.n_head_kv
            a.n_tokens = t
            a.tile_tokens = tile = tile_tokens(t, heads, arg.n_head_kv, d)
            grid = (arg.n_head_kv, -(-t // tile), 1)
            rows = grid[0] * grid[1] * heads * tile  # (every block's)
            # a block's tokens in a window may span one chunk more than one token sees
            span = min(chunks, seen + 1) if arg.window else seen
            a.chunks_one_launch = kept = tile_scores_chunks(rows, span)
            if kept:
                scores = self._shared_scratch("tile_scores", DType.F32, rows * kept * 256)
                a.scores = scores.data_ptr()
            name = f"attention_tiles<{d}, true>" if kept else f"attention_tiles<{d}>"
            self._launch("attention.cu", name, grid, (256, 1, 1), [a],
                         tiles_shared(heads * tile, d))  # fmt: skip
        elif (2 <= arg.n_head // arg.n_head_kv <= GQA_HEADS_MAX
              and arg.n_head // arg.n_head_kv * d <= GQA_WIDTH_MAX):  # fmt: skip
            heads = arg.n_head // arg.n_head_kv  # the query heads of a KV head, in one block
            self._launch("attention.cu", f"attention_rows_gqa<{d}, {heads}>",
                         (arg.n_head_kv, t, 1), (256, 1, 1), [a])  # fmt: skip
        else:
            self._launch("attention.cu", f"attention_rows<{d}>", (arg.n_head, t, 1),
                         (256, 1, 1), [a])  # fmt: skip
        if qn is not None:
            self.done.add(qn)

    def _early_positions(self, positions: int) -> bool:
        """Whether the next launch may load ``positions`` before PDL's wait (EARLY_LOADS): a
        step's input, which no kernel of the step writes (_written_before_last)."""
        return EARLY_LOADS and self.pdl and self._written_before_last(positions)

    def _writes_row_p(self, attention: Node) -> bool:
        """Whether the step's only writes of ``attention``'s caches are KV_WRITEs of a cache
        leaf at its own positions (the IR lets one KV_WRITE read a cache, and only a STATE):
        for one token, row p alone (attention_chunks' EARLY)."""
        nodes = self.graph.nodes
        return all(nodes[nodes[c].src[0]].op is Op.STATE and nodes[c].src[2] == attention.src[3]
                   for c in attention.src[1:3])  # fmt: skip

    # -- matrix products ------------------------------------------------------------------------

    def _product(
        self,
        out: Any,
        x_id: int,
        weights: tuple[int, ...],
        bias: int | None,
        res: int | None,
        shape: tuple[int, int],
        q8: int | None = None,
        node: int | None = None,
        glu: tuple[int, int, int] | None = None,
    ) -> bool:
        """``out`` = x W^T (with the bias, the residual, or SWIGLU of two products). With
        ``q8`` (a QUANTIZE of the product) its value is written too where the kernel can: True
        when it did. ``node``: the product's, whose norm a decode GEMV may do too
        (``_norm_after``). ``glu``: (epilogue, gate node, up node) of two products and the
        GLU that reads them (``_glu_of``), the products' values written too."""
        x = self.graph.nodes[x_id]
        w = self.graph.nodes[weights[0]]
        t, n = shape
        k = w.shape[1]
        epi = (EPI_BIAS if bias is not None else 0) | (EPI_RESIDUAL if res is not None else 0)
        w2 = weights[1] if len(weights) == 2 else None
        if w2 is not None:
            epi = EPI_SWIGLU if glu is None else glu[0]
        row_bytes = w.dtype.nbytes(k)
        common = [self._ptr(weights[0]),
                  ctypes.c_void_p(None) if w2 is None else self._ptr(w2),
                  ctypes.c_void_p(None) if bias is None else self._ptr(bias),
                  ctypes.c_void_p(None) if res is None else self._ptr(res),
                  t, n, k, ctypes.c_longlong(row_bytes)]  # fmt: skip
        if w.dtype in FLOAT_WEIGHTS:
            step = GEMV_TOKENS[-1]
            for start in range(0, t, step):  # float weights: GEMV, 8 tokens at a time
                count = min(step, t - start)
                tmax = next(c for c in GEMV_TOKENS if c >= count)
                args = list(common)
                if res is not None:
                    args[3] = pointer(self.values[res][start : start + count])
                args[4] = count
                rows = slice(start, start + count)
                y, xs = pointer(out[rows]), pointer(self.values[x_id][rows])
                name = f"gemv_f<{w.dtype.value}, {tmax}, {epi}>"
                block = (32 * GEMV_WARPS, 1, 1)
                self._launch("matmul.cu", name, grid1(n, GEMV_WARPS), block, [y, xs, *args])
            return False
        if t <= GEMV_TOKENS[-1] and self._normed_x_pending(x_id):
            return self._normed_product(out, x_id, common, w.dtype, t, n, k, epi, q8, glu)
        if x.dtype is DType.F32:  # x not quantized yet (a graph run as written): into scratch
            xv = self.new_scratch(DType.Q8A, x.shape)
            self.out.scratch.append(xv)
            blocks = t * k // 32
            self._launch("rows.cu", "quantize_q8", grid1(blocks, 8), (256, 1, 1),
                         [pointer(xv.q), pointer(xv.d), pointer(xv.s), self._ptr(x_id),
                          ctypes.c_longlong(blocks)])  # fmt: skip
            q, d, s = xv.q, xv.d, xv.s
        else:
            q, d, s = self._q8_parts(x_id)
        xq = Q8Arg(q.data_ptr(), d.data_ptr(), s.data_ptr())
        if t <= GEMV_TOKENS[-1]:
            tmax = next(c for c in GEMV_TOKENS if c >= t)
            block = (32 * GEMV_WARPS, 1, 1)
            wpr = gemv_warps_per_row(w.dtype, k)
            grid = (-(-n // (GEMV_WARPS // wpr)), 1, 1)
            early = (EARLY_LOADS and self.pdl and res is not None
                     and self._written_before_last(res))  # fmt: skip
            flags = epi | (EPI_RES_EARLY if early else 0)
            kind = f"{w.dtype.value}, {tmax}, {flags}, {wpr}"
            group = None if q8 is None else group_q8_loads(w.dtype, t, k, w2 is not None)
            if group is not None and n % 32 == 0:  # a block a group of 32 rows: no tickets
                per, copy = group
                split = group_q8_split(self.clusters, n // 32, self.multiprocessors)
                blocks = n // 32 * split
                rpw = group_q8_rpw(blocks, self.multiprocessors, split)
                kind = f"{w.dtype.value}, {epi}, {rpw}, {per}, {copy}"
                name = f"gemv_q_q8_group<{kind}>"
                if split > 1:
                    name = f"gemv_q_q8_split<{kind}, {split}>"
                self._launch("matmul.cu", name, (blocks, 1, 1), (32 * 32 // (rpw * split), 1, 1),
                             [pointer(out), xq, *common, *self._q8_out(q8, glu)])  # fmt: skip
                return True
            if q8 is not None and n % 32 == 0:
                fence = EPI_ONE_FENCE if ONE_FENCE else 0
                kind = f"{w.dtype.value}, {tmax}, {flags | fence}, {wpr}"
                self._launch("matmul.cu", f"gemv_q_q8<{kind}>", grid, block,
                             [pointer(out), xq, *common, *self._q8_out(q8, glu, n)])  # fmt: skip
                return True
            rows = GEMV_WARPS // wpr
            parts = None if res is None or node is None else self._norm_parts_for(node, t, n, rows)
            if parts is not None:  # NORM_IN_PRODUCT: the subtrees of its output's squares too
                self._launch("matmul.cu", f"gemv_q_sq<{kind}>", grid, block,
                             [pointer(out), xq, *common, pointer(parts)])  # fmt: skip
                return False
            after = None if node is None else self._norm_after(node)
            if after is not None:
                job, quantized = after
                ticket = self._shared_scratch("norm_ticket", DType.I32, 1)  # zero between
                self._launch("matmul.cu", f"gemv_q_norm<{kind}>", grid, block,
                             [pointer(out), xq, *common, job, pointer(ticket)],
                             n * 4 if quantized else 0)  # fmt: skip
                return False
            wide = self._wide_blocks(w.dtype, t, n, k, epi)
            if wide:
                # a lane's loads of a row: as many as a whole round of 32 sub-blocks takes
                # (matmul.cu's Round::PER_LANE), or with WIDE_FIT_ROW the row's own
                per = lane_loads(row_bytes if WIDE_FIT_ROW else round_bytes(w.dtype))
                argmax = self._argmax_of(node)
                tail = [pointer(None)] * 3
                if argmax is not None:  # the token, and scratch: the blocks' keys, a ticket
                    keys = self.new_scratch(DType.I32, (2 * wide,))  # unsigned 64-bit keys
                    ticket = self.new_scratch(DType.I32, (1,))  # zero: scratch is zeroed
                    self.out.scratch += [keys, ticket]
                    tail = [self._ptr(argmax), pointer(keys), pointer(ticket)]
                    self.done.add(argmax)
                fused = int(argmax is not None)
                name = f"gemv_q_wide<{w.dtype.value}, {epi}, {WIDE_AHEAD}, {per}, {fused}>"
                self._launch("matmul.cu", name, (wide, 1, 1), block,
                             [pointer(out), xq, *common, *tail])  # fmt: skip
                return False
            self._launch("matmul.cu", f"gemv_q<{kind}>", grid, block,
                         [pointer(out), xq, *common])  # fmt: skip
            return False
        gated = bool(epi & (EPI_SWIGLU | EPI_GEGLU))
        tokens = 64 if not gated and 0 < MMA_DEEP_K <= k else MMA_TOKENS
        shared = gemm_mma_shared(w.dtype, gated, k, tokens)
        if shared is not None:  # the tensor-core GEMM
            mma = f"{w.dtype.value}, {epi}{mma_variant(tokens)}"
            more = MmaMoreArg()
            fused = (MMA_QUANTIZE or glu is not None) and q8 is not None and n % 32 == 0
            if self._tensor_cores(w, t):  # float16 or TF32, then gemm_mma: flagged tiles only
                flagged, fused = self._float_product(out, x_id, q, d, weights, bias, res, shape,
                                                     q8, epi, glu)  # fmt: skip
                more.flagged = flagged.data_ptr()
            if fused:
                more.q, more.d, more.s = (p.data_ptr() for p in self._q8_parts(q8))
            if glu is not None:
                more.gate, more.up = (self._ptr(j).value for j in glu[1:])
            self._launch("matmul.cu", f"gemm_mma<{mma}>",
                         (-(-n // MMA_TILE), -(-t // tokens), 1), (8 * tokens, 1, 1),
                         [pointer(out), xq, *common, more], shared)  # fmt: skip
            return fused
        sub = sub_block(w.dtype)
        maxl = max(6, tree_levels(next_pow2(k // sub)))
        maxl = next(m for m in (6, 8, 10, 12) if m >= maxl)
        bn, bt = GEMM_TILE[gated]
        self._launch("matmul.cu", f"gemm_q<{w.dtype.value}, {maxl}, {epi}>",
                     (-(-n // bn), -(-t // bt), 1), (256, 1, 1),
                     [pointer(out), xq, *common])  # fmt: skip
        return False

    def _q8_out(self, q8: int, glu: tuple[int, int, int] | None, n: int = 0) -> list[Any]:
        """gemv_q_q8's arguments after the product's: the QUANTIZE's value, with ``n`` rows a
        ticket a group of 32 (scratch, zero; gemv_q_q8_group takes none), and the gate and up
        products' values or nulls."""
        oq, od, os_ = self._q8_parts(q8)
        args = [pointer(oq), pointer(od), pointer(os_)]
        if n:
            tickets = self.new_scratch(DType.I32, (n // 32,))
            self.out.scratch.append(tickets)
            args.append(pointer(tickets))
        raw = [pointer(None)] * 2 if glu is None else [self._ptr(j) for j in glu[1:]]
        return [*args, *raw]

    def _normed_x_pending(self, i: int) -> bool:
        pending = self._norm_in.get(i)
        return pending is not None and not pending.launched

    def _normed_product(self, out: Any, x_id: int, common: list[Any], dtype: DType, t: int,
                        n: int, k: int, epi: int, q8: int | None,
                        glu: tuple[int, int, int] | None) -> bool:  # fmt: skip
        """A decode product of the norm it makes first (NORM_IN_PRODUCT): gemv_q_q8_normed when
        it quantizes its output too (True), else gemv_q_normed."""
        arg = self._normed_x(x_id)
        tmax = next(c for c in GEMV_TOKENS if c >= t)
        wpr = gemv_warps_per_row(dtype, k)
        grid, block = (-(-n // (GEMV_WARPS // wpr)), 1, 1), (32 * GEMV_WARPS, 1, 1)
        kind = f"{dtype.value}, {tmax}, {epi}, {wpr}"
        if q8 is not None and n % 32 == 0:
            self._launch("matmul.cu", f"gemv_q_q8_normed<{kind}>", grid, block,
                         [pointer(out), arg, *common, *self._q8_out(q8, glu, n)],
                         normed_shared(t, k))  # fmt: skip
            return True
        self._launch("matmul.cu", f"gemv_q_normed<{kind}>", grid, block,
                     [pointer(out), arg, *common], normed_shared(t, k))  # fmt: skip
        return False

    def _tensor_cores(self, w: Node, t: int) -> bool:
        """Does a product of ``t`` tokens by weight ``w`` take FAST_GEMM's path?"""
        return (FAST_GEMM and self.fast and self.matmul is not None and t > GEMV_TOKENS[-1]
                and w.dtype.is_quantized
                and FAST_GEMM_MIN_ELEMENTS <= w.shape[0] * w.shape[1] <= FAST_GEMM_ELEMENTS
                and w.shape[0] <= 65535 and w.shape[1] % 32 == 0)  # fmt: skip

    def _float_product(
        self, out, x_id, q, d, weights, bias, res, shape, q8, epi, glu
    ) -> tuple[Any, bool]:
        """``_product``'s products on the tensor cores (FAST_GEMM): with FAST_GEMM_HALF and a
        runtime whose GEMM takes float16 operands, ``_half_product``; else on TF32: x's Q8A
        values (q, d) as floats with its rows' flags (once for the products of one x in a row:
        q, k and v; gate and up), each weight dequantized into scratch and multiplied in by
        the runtime's ``matmul``, the bias or residual added by it. Two weights: the gate and
        up products (into the graph's values where ``glu`` names them), then glu_f32 for the
        GLU and, where asked and rows are whole Q8 blocks, its QUANTIZE. Returns the flags,
        for gemm_mma to recompute the flagged rows' tiles exactly after it, and whether the
        QUANTIZE was done."""
        if FAST_GEMM_HALF and self.half_gemm:
            return self._half_product(out, x_id, q, d, weights, bias, res, shape, q8, epi, glu)
        t, n = shape
        k = self.graph.nodes[weights[0]].shape[1]
        xf = self._shared_scratch("fast_x", DType.F32, t * k)[: t * k].view(t, k)
        flags = self._shared_scratch("fast_flags", DType.I32, t)
        if self._fast_x != x_id:
            self._launch("rows.cu", "q8_to_f32", grid1(t * k), (256, 1, 1),
                         [pointer(xf), pointer(flags), pointer(q), pointer(d), t, k])  # fmt: skip
            self._fast_x = x_id
        wf = self._shared_scratch("fast_w", DType.F32, n * k)[: n * k].view(n, k)

        def product(y: Any, weight: int, add: Any = None) -> None:
            w = self.graph.nodes[weight]
            self._launch("rows.cu", f"dequant_rows<{w.dtype.value}>", (-(-k // 2048), n, 1),
                         (256, 1, 1), [pointer(wf), self._ptr(weight), k,
                                       ctypes.c_longlong(w.dtype.nbytes(k))])  # fmt: skip
            self.out.launches.append((self.matmul, (y, xf, wf, add)))

        if len(weights) == 1:
            add = None
            if bias is not None:  # (a float32 weight: its bytes as floats)
                b = self.graph.nodes[bias]
                add = self.weights[b.arg].view(xf.dtype) if b.op is Op.WEIGHT else self.values[bias]
            product(out, weights[0], self.values[res] if add is None and res is not None else add)
            if bias is not None and res is not None:  # (addmm adds one: the residual after)
                self._launch("rows.cu", "binary_f32<0>", grid1(t * n), (256, 1, 1),
                             [pointer(out), pointer(out), self._ptr(res),
                              ctypes.c_longlong(t * n), n, 0])  # fmt: skip
            return flags, False
        if glu is not None:  # the graph keeps the gate's and up's values: the products' outputs
            g, u = self.values[glu[1]], self.values[glu[2]]
        else:
            g, u = (self._shared_scratch(name, DType.F32, t * n)[: t * n].view(t, n)
                    for name in ("fast_gate", "fast_up"))  # fmt: skip
        product(g, weights[0])
        product(u, weights[1])
        quantize = q8 is not None and n % 32 == 0
        oq, od, os_ = self._q8_parts(q8 if quantize else None)
        self._launch("rows.cu", f"glu_f32<{int(epi == EPI_GEGLU)}>", grid1(t * n), (256, 1, 1),
                     [pointer(out), pointer(oq), pointer(od), pointer(os_), pointer(g),
                      pointer(u), ctypes.c_longlong(t * n)])  # fmt: skip
        return flags, quantize

    def _half_product(
        self, out, x_id, q, d, weights, bias, res, shape, q8, epi, glu
    ) -> tuple[Any, bool]:
        """``_float_product`` with float16 operands (FAST_GEMM_HALF): x's rows and each
        weight's as float16 times a power of two a row (from a bound a row: x's found every
        launch, a weight's by its first and kept in scratch of its own), the runtime's GEMM
        summing in float32, then unscale_f32 (the bias or residual added after the shifts are
        undone) or, for gate and up, glu_unscale_f32 (the GLU and its QUANTIZE)."""
        t, n = shape
        k = self.graph.nodes[weights[0]].shape[1]
        xh = self._shared_scratch("fast_xh", DType.F16, t * k)[: t * k].view(t, k)
        xtops = self._shared_scratch("fast_xtops", DType.F32, t)
        flags = self._shared_scratch("fast_flags", DType.I32, t)
        if self._fast_x != x_id:
            self._launch("rows.cu", "q8_to_f16", (t, 1, 1), (256, 1, 1),
                         [pointer(xh), pointer(xtops), pointer(flags), pointer(q), pointer(d),
                          k])  # fmt: skip
            self._fast_x = x_id
        wh = self._shared_scratch("fast_wh", DType.F16, n * k)[: n * k].view(n, k)
        grid = (-(-n // 256), t, 1)

        def product(y: Any, weight: int) -> Any:
            w = self.graph.nodes[weight]
            tops = self._weight_tops.get(weight)
            if tops is None:  # the weight's rows' bounds, found by its first launch and kept
                tops = self._weight_tops[weight] = self.new_scratch(DType.F32, (n,))
                self.out.scratch.append(tops)
            subs = n * (k // sub_block(w.dtype))  # (a thread each)
            self._launch("rows.cu", f"dequant_subs_half<{w.dtype.value}>", (-(-subs // 128), 1, 1),
                         (128, 1, 1), [pointer(wh), pointer(tops), self._ptr(weight), k,
                                       ctypes.c_longlong(w.dtype.nbytes(k)), subs])  # fmt: skip
            self.out.launches.append((self.matmul, (y, xh, wh)))
            return tops

        if len(weights) == 1:
            wtops = product(out, weights[0])
            extra = [pointer(None) if j is None else self._ptr(j) for j in (bias, res)]
            self._launch("rows.cu", "unscale_f32", grid, (256, 1, 1),
                         [pointer(out), pointer(xtops), pointer(wtops), *extra, n])  # fmt: skip
            return flags, False
        keep = glu is not None  # the graph keeps the gate's and up's values
        if keep:
            g, u = self.values[glu[1]], self.values[glu[2]]
        else:
            g, u = (self._shared_scratch(name, DType.F32, t * n)[: t * n].view(t, n)
                    for name in ("fast_gate", "fast_up"))  # fmt: skip
        gtops = product(g, weights[0])
        utops = product(u, weights[1])
        quantize = q8 is not None and n % 32 == 0
        oq, od, os_ = self._q8_parts(q8 if quantize else None)
        x4 = "x4" if GLU_UNSCALE_X4 and n % 32 == 0 else ""
        grid = (-(-n // (1024 if x4 else 256)), t, 1)
        self._launch("rows.cu", f"glu_unscale_f32{x4}<{int(epi == EPI_GEGLU)}>", grid,
                     (256, 1, 1), [pointer(out), pointer(oq), pointer(od), pointer(os_),
                                   pointer(g), pointer(u), pointer(xtops), pointer(gtops),
                                   pointer(utops), n, int(keep)])  # fmt: skip
        return flags, quantize

    def _argmax_of(self, i: int | None) -> int | None:
        """With ARGMAX_IN_HEAD, the ARGMAX that reads product ``i``'s one row (greedy
        decoding's), for gemv_q_wide to do too; None when there is none."""
        if not ARGMAX_IN_HEAD or i is None:
            return None
        follow = [u for u in self.readers.get(i, []) if u in self.inside and u not in self.done]
        return self._fused_reader(follow, Op.ARGMAX)

    def _wide_blocks(self, dtype: DType, t: int, n: int, k: int, epi: int) -> int:
        """With WIDE_GEMV, the blocks of a gemv_q_wide launch for a one-token product of ``n``
        rows of one round each (the output head), where each of its warps gets at least
        WIDE_MIN_ROWS rows; else 0 (gemv_q)."""
        sub = sub_block(dtype)
        if not WIDE_GEMV or t != 1 or epi & (EPI_SWIGLU | EPI_GEGLU) or next_pow2(k // sub) > 32:
            return 0
        blocks = self.multiprocessors * WIDE_BLOCKS_PER_SM
        return blocks if n >= blocks * GEMV_WARPS * WIDE_MIN_ROWS else 0

    def _matmul(self, i, node, follow):
        glu = self._glu_of(i, node)
        if glu is not None:  # the gate and up products and their GLU (Gemma 3's GEGLU)
            g, gate, up, qn = glu
            nodes = self.graph.nodes
            epi = EPI_GEGLU if nodes[g].op is Op.GEGLU else EPI_SWIGLU
            weights = (nodes[gate].src[1], nodes[up].src[1])
            if not self._product(self.values[g], node.src[0], weights, None, None, node.shape,
                                 qn, glu=(epi, gate, up)):  # fmt: skip
                raise BackendError(  # (_glu_of takes what gemv_q_q8 and gemm_mma compute)
                    f"the fused gate/up/{nodes[g].op.name} launch did not quantize its output"
                )
            self.done.update((gate, up, g, qn))
            return
        bias = node.src[2] if len(node.src) == 3 else None
        group = [i, *self._siblings(i, node)]
        if len(group) > 1:
            self._products(group)
            return
        self._product(self.values[i], node.src[0], (node.src[1],), bias, None, node.shape,
                      node=i)  # fmt: skip

    def _glu_of(self, i: int, node: Node) -> tuple[int, int, int, int] | None:
        """With GLU_IN_PRODUCT, for a decode product ``i`` (with MMA_GLU, a prefill's): the
        GEGLU or SWIGLU that reads it as its gate or up, the other product of the same Q8A x
        with a weight of the same quantized type and shape (no biases), and the QUANTIZE of
        the GLU: (GLU, gate, up, QUANTIZE) for one gemv_q_q8 (or gemm_mma) launch,
        whose epilogue is the GLU; else None."""
        nodes = self.graph.nodes
        x = node.src[0]
        t, n = node.shape
        if t <= GEMV_TOKENS[-1]:
            fits = GLU_IN_PRODUCT
        else:
            w = nodes[node.src[1]]
            fits = MMA_GLU and takes_mma(w.dtype, True, w.shape[1])
        if not fits or len(node.src) != 2 or n % 32 or nodes[x].dtype is not DType.Q8A:
            return None
        glus = [u for u in self.readers.get(i, []) if u in self.inside and u not in self.done
                and nodes[u].op in (Op.GEGLU, Op.SWIGLU)]  # fmt: skip
        if len(glus) != 1:
            return None
        gate, up = nodes[glus[0]].src
        other = up if i == gate else gate
        if gate == up or other in self.done or other not in self.inside:
            return None
        o = nodes[other]
        if o.op is not Op.MATMUL or len(o.src) != 2 or o.src[0] != x:
            return None
        wg, wu = nodes[nodes[gate].src[1]], nodes[nodes[up].src[1]]
        if (wg.dtype, wg.shape) != (wu.dtype, wu.shape) or wg.dtype in FLOAT_WEIGHTS:
            return None
        follow = [u for u in self.readers.get(glus[0], []) if u in self.inside]
        qn = self._fused_reader([u for u in follow if u not in self.done], Op.QUANTIZE)
        return None if qn is None else (glus[0], gate, up, qn)

    def _siblings(self, i: int, node: Node) -> list[int]:
        """Other products of the split that read this product's Q8A x with weights of its
        width, and its bias or none (q, k and v): at most two, launched with it (a prefill's
        with MMA_MULTI, where each takes gemm_mma)."""
        nodes = self.graph.nodes
        x = node.src[0]
        prefill = node.shape[0] > GEMV_TOKENS[-1]
        if nodes[x].dtype is not DType.Q8A or (prefill and not MMA_MULTI):
            return []
        if self._tensor_cores(nodes[node.src[1]], node.shape[0]):
            return []  # (one GEMM a weight: FAST_GEMM)

        def mma(u: int) -> bool:
            w = nodes[nodes[u].src[1]]
            return takes_mma(w.dtype, False, w.shape[1])

        if prefill and not mma(i):
            return []
        k = nodes[node.src[1]].shape[1]
        found = []
        for u in self.readers.get(x, []):
            other = nodes[u]
            if (u == i or u not in self.inside or u in self.done or other.op is not Op.MATMUL
                    or other.src[0] != x or len(other.src) != len(node.src)):  # fmt: skip
                continue
            if nodes[other.src[1]].shape[1] == k and len(found) < 2 and (not prefill or mma(u)):
                found.append(u)
        return found

    def _products(self, group: list[int]) -> None:
        """Products of one Q8A x by weights of one width in one launch: segments 0 and 1 of
        one weight type, segment 2 of that or another (q and k Q5_0, v Q8_0)."""
        nodes = self.graph.nodes
        types = [nodes[nodes[i].src[1]].dtype for i in group]
        if len(set(types)) == 3:  # three types: the third launches on its own
            group = group[:2]
            types = types[:2]
        common = max(set(types), key=types.count)  # two of one type and one other: A, A, B
        same = [i for i, t in zip(group, types, strict=True) if t == common]
        other = [i for i, t in zip(group, types, strict=True) if t != common]
        third = other[0] if other else (same[2] if len(same) == 3 else None)
        first_two = same[:2] if len(same) > 1 else [*same, None]
        slots = [*first_two, third]
        first = nodes[group[0]]
        t, k = first.shape[0], nodes[first.src[1]].shape[1]
        normed = t <= GEMV_TOKENS[-1] and self._normed_x_pending(first.src[0])
        if normed:  # NORM_IN_PRODUCT: x is the norm this launch makes
            xq, shared = self._normed_x(first.src[0]), normed_shared(t, k)
        else:
            q, d, s = self._q8_parts(first.src[0])
            xq, shared = Q8Arg(q.data_ptr(), d.data_ptr(), s.data_ptr()), 0
        epi = EPI_BIAS if len(first.src) == 3 else 0
        qt2 = common if slots[2] is None else nodes[nodes[slots[2]].src[1]].dtype
        self.done.update(group)
        if t > GEMV_TOKENS[-1]:  # a prefill's (MMA_MULTI): gemm_mma's tiles of 32 rows
            segs = self._segments(slots, k, MMA_TILE)
            types = {common, qt2}
            shared = max(gemm_mma_shared(dtype, False, k, MMA_TOKENS) or 0 for dtype in types)
            kind = f"{common.value}, {qt2.value}, {epi}{mma_variant()}"
            self._launch("matmul.cu", f"gemm_mma_multi<{kind}>",
                         (segs.blocks, -(-t // MMA_TOKENS), 1), (8 * MMA_TOKENS, 1, 1),
                         [segs.arg, xq, t, k], shared)  # fmt: skip
            return
        wpr = min(gemv_warps_per_row(nodes[nodes[i].src[1]].dtype, k) for i in group)
        segs = self._segments(slots, k, GEMV_WARPS // wpr)
        tmax = next(c for c in GEMV_TOKENS if c >= t)
        mode, rope = self._qkv_rope(slots, GEMV_WARPS // wpr)
        kind = f"{common.value}, {qt2.value}, {tmax}, {epi}, {wpr}, {mode}"
        name = "gemv_q_multi_normed" if normed else "gemv_q_multi"
        self._launch("matmul.cu", f"{name}<{kind}>", (segs.blocks, 1, 1),
                     (32 * GEMV_WARPS, 1, 1), [segs.arg, xq, t, k, rope], shared)  # fmt: skip

    def _segments(self, slots: list[int | None], k: int, rows: int) -> Segments:
        """The GemvSegs of products ``slots`` over K = ``k``, ``rows`` rows a block."""
        nodes = self.graph.nodes
        arg = GemvSegsArg()
        for name, i in zip(("s0", "s1", "s2"), slots, strict=True):
            if i is None:
                continue  # N = 0, no blocks
            node = nodes[i]
            seg = getattr(arg, name)
            seg.y = self._ptr(i).value
            seg.w = self._ptr(node.src[1]).value
            seg.bias = self._ptr(node.src[2]).value if len(node.src) == 3 else None
            seg.row_bytes = nodes[node.src[1]].dtype.nbytes(k)
            seg.N = node.shape[1]
            seg.blocks = -(-seg.N // rows)
        return Segments(arg, arg.s0.blocks + arg.s1.blocks + arg.s2.blocks)

    def _qkv_rope(self, slots: list[int | None], rows: int) -> tuple[int, RopeSegsArg]:
        """The ROPEs and KV_WRITEs a q/k/v launch can do too (matmul.cu's RopeSegs), and its
        ROPE mode (0: none, 1: adjacent pairs, 2: neox): segments 0 and 1 each read only by
        a ROPE of the same positions and tables, segment 2 only by a KV_WRITE or nothing, the
        rotated rows' KV_WRITEs at those positions, and blocks of whole pairs."""
        nodes = self.graph.nodes

        def only_reader(i: int) -> int | None:
            inside = [u for u in self.readers.get(i, []) if u in self.inside]
            return inside[0] if len(inside) == 1 else None

        heads = [None if i is None else self._head_norm(i) for i in slots[:2]]
        normed = QKV_HEAD_NORMS and None not in heads
        if normed:  # the ROPEs read the head norms: HEAD_NORM
            ropes = [only_reader(chain[2]) for chain in heads]
        else:
            ropes = [None if i is None else only_reader(i) for i in slots[:2]]
        if (rows % 2 and not normed) or None in ropes:
            return 0, NO_ROPE
        r0, r1 = (nodes[r] for r in ropes)  # (a ROPE reads a product only as its rows)
        if (r0.op, r1.op) != (Op.ROPE, Op.ROPE) or r0.src[1:] != r1.src[1:]:
            return 0, NO_ROPE
        arg = r0.arg
        if attrs.evolve(r1.arg, n_head=arg.n_head) != arg or arg.n_rot % 2:
            return 0, NO_ROPE
        if normed and (
            arg.head_dim % rows or any(nodes[chain[1]].shape[1] != arg.head_dim for chain in heads)
        ):
            return 0, NO_ROPE  # (a block's rows must lie in one head: its ticket's)
        positions = r0.src[1]

        def kv_of(i: int) -> int | None:  # the KV_WRITE of i's rows at the ropes' positions
            kv = only_reader(i)
            if kv is None or nodes[kv].op is not Op.KV_WRITE or nodes[kv].src[1:] != (i, positions):
                return None
            return kv if self._ready(nodes[kv].src[0]) and self._may_write_now(kv) else None

        kvs = [kv_of(r) for r in ropes]
        if slots[2] is not None:
            kvs.append(kv_of(slots[2]))
            if kvs[2] is None:
                return 0, NO_ROPE  # v read by something else: its own launch would be needed
        a = RopeSegsArg()
        for j, r in enumerate(ropes):
            a.out[j] = self._ptr(r).value
        for j, kv in enumerate(kvs):
            if kv is not None:
                a.cache[j] = self._ptr(nodes[kv].src[0]).value
        a.positions, a.cos_t, a.sin_t = (self._ptr(s).value for s in r0.src[1:])
        a.head_dim, a.n_rot = arg.head_dim, arg.n_rot
        mode = 2 if arg.mode == "neox" else 1
        weights = all(nodes[w].op is Op.WEIGHT for w in r0.src[2:])  # (cos and sin)
        if not normed and weights and self._early_positions(positions):
            mode |= ROPE_EARLY
        if normed:
            counts = [nodes[i].shape[1] // arg.head_dim for i in slots[:2]]
            a.heads0 = counts[0]
            a.tickets = self._shared_scratch("head_tickets", DType.I32, sum(counts)).data_ptr()
            for j, (_, norm, _) in enumerate(heads):
                a.normed[j] = self._ptr(norm).value
                w = self._norm_weight(norm)
                a.norm_w[j] = None if w is None else self._ptr(w).value
                a.eps[j] = float(nodes[norm].arg)
                self.done.update(heads[j])
            mode |= HEAD_NORM
        self.done.update(ropes)
        self.done.update(kv for kv in kvs if kv is not None)
        return mode, a

    def _head_norm(self, i: int) -> tuple[int, int, int] | None:
        """Product ``i``'s head norm, Gemma 3's q or k norm: its only reader a RESHAPE to
        (tokens x heads, head_dim) that is a view, normed (RMS_NORM[_MUL], its weight ready),
        reshaped back by a view, each the only reader of the one before: (the RESHAPE, the norm,
        the RESHAPE back), whose reader may be a ROPE."""
        nodes = self.graph.nodes

        def only(j: int, op: tuple[Op, ...]) -> int | None:
            inside = [u for u in self.readers.get(j, []) if u in self.inside]
            if len(inside) != 1 or inside[0] in self.done or nodes[inside[0]].op not in op:
                return None
            return inside[0] if nodes[inside[0]].src[0] == j else None

        to_heads = only(i, (Op.RESHAPE,))
        norm = None if to_heads is None else only(to_heads, (Op.RMS_NORM, Op.RMS_NORM_MUL))
        back = None if norm is None else only(norm, (Op.RESHAPE,))
        if back is None or not {to_heads, back} <= self.views:
            return None
        if nodes[back].shape != nodes[i].shape or not all(
            self._ready(s) for s in nodes[norm].src[1:]
        ):
            return None
        return to_heads, norm, back

    def _matmul_add(self, i, node, follow):
        bias = node.src[2] if len(node.src) == 4 else None
        self._product(self.values[i], node.src[0], (node.src[1],), bias, node.src[-1],
                      node.shape, node=i)  # fmt: skip

    def _matmul_swiglu(self, i, node, follow):
        x, gate, up = node.src
        if (self.graph.nodes[gate].dtype, self.graph.nodes[gate].shape) == (
            self.graph.nodes[up].dtype, self.graph.nodes[up].shape,
        ):  # fmt: skip
            qn = self._fused_reader(follow, Op.QUANTIZE)
            if self._product(self.values[i], x, (gate, up), None, None, node.shape, qn):
                self.done.add(qn)  # the down projection's x, quantized by the same launch
            return
        # gate and up of different types: the two products, then SWIGLU (the same roundings)
        g, u = (self.new_scratch(DType.F32, node.shape) for _ in "gu")
        self.out.scratch += [g, u]
        self._product(g, x, (gate,), None, None, node.shape)
        self._product(u, x, (up,), None, None, node.shape)
        n = node.shape[0] * node.shape[1]
        self._launch("rows.cu", "glu_f32<0>", grid1(n), (256, 1, 1),
                     [self._ptr(i), pointer(None), pointer(None), pointer(None), pointer(g),
                      pointer(u), ctypes.c_longlong(n)])  # fmt: skip
