"""The cuda backend's attention kernels (attention.cu), run on the CPU through the emulator in
``tests/cuda_emulator``, bit for bit against the oracle (``ops.attention``) and its activation
quantization: every launch path the lowering takes (flash decoding in one launch and through
scratch, prefill a block per head, a block per KV head's query heads), with windows, chunk
boundaries, heads of 64 and 256, and rows past each token's position holding NaN and inf.

The GPU runs the same sources (tests/test_cuda_backend.py, conformance); this catches a
kernel's logic and barrier errors on machines without one."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_emulator import EmulatorError, compile_kernels, compiler

from parity.backends.cpu import ops
from parity.backends.cuda.kernel_args import AttnArg
from parity.backends.cuda.lowering import tile_tokens, tiles_shared
from parity.quant.activation import quantize_activations

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler for the emulator")

F32 = np.float32
CHUNK = 256

KERNELS = [
    "attention_rows<64>",
    "attention_rows<256>",
    "attention_rows_gqa<64, 2>",
    "attention_rows_gqa<64, 3>",
    "attention_rows_gqa<64, 7>",
    "attention_rows_gqa<256, 4>",
    "attention_tiles<64>",
    "attention_tiles<128>",
    "attention_tiles<256>",
    "attention_chunks<64>",
    "attention_sums<64>",
    "attention_chunks<256>",
    "attention_sums<256>",
    # a deep token's chunks by a block a KV head (HEADS_TOGETHER_CHUNKS): <d, MINB, FOLD, H, HC>
    "attention_chunks<64, 0, 8, 3, 3>",
    "attention_sums<64, 0, 8, 3, 3>",
    "attention_chunks<64, 0, 1, 7, 5>",
    "attention_sums<64, 0, 1, 7, 5>",
    "attention_chunks<256, 0, 8, 2, 1>",
    "attention_sums<256, 0, 8, 2, 1>",
    # loads before PDL's wait (EARLY_LOADS): <d, MINB, FOLD, H, HC, EARLY>
    "attention_chunks<64, 0, 1, 1, 0, 1>",
    "attention_sums<64, 0, 1, 1, 0, 1>",
    "attention_sums<256, 0, 1, 1, 0, 1>",
    # heads of 256: K a slab ahead (CHUNKS_SLABS_AHEAD), the sums a block a quarter of a chunk
    # (QUARTER_SUMS), with loads before PDL's wait too
    "attention_chunks<256, 0, 1, 1, 0, 0, 1>",
    "attention_quarters<256>",
    "attention_quarters<256, 1>",
]


@pytest.fixture(scope="module", params=["forward", "reverse"])
def lib(request):
    """The kernels, a block's threads resumed first to last between barriers, or last to first:
    a missing barrier between a write and a read shows in one order or the other."""
    lib = compile_kernels("attention.cu", KERNELS)
    lib.reverse = request.param == "reverse"
    return lib


def ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def run(lib, kind, q, k, v, pos, *, nh, nkv, d, scale, window=0, one_launch=2, quantize=False,
        tile=0, shared=None, together=None, early=False, late=(), ahead=False,
        quarters=False):  # fmt: skip
    """The lowering's launches for ``kind`` (rows, gqa, tiles, chunks), on host arrays: out and,
    with ``quantize``, its Q8 activations (q, d, s). ``tile``: attention_tiles' tokens a block
    (0: the lowering's choice); ``shared``: its dynamic shared memory (None: the lowering's).
    ``together``: flash decoding's (FOLD, HC) with the query heads of a KV head in one block
    from HC chunks on (None: a block a head). ``early``: flash decoding's loads before PDL's
    wait, as EARLY_LOADS picks them (attention_chunks' for heads of 64, attention_sums');
    ``late``: (dst, poison, truth) arrays, late writes (the emulator's) of the first launch.
    Heads of 256 with ``one_launch`` 0: ``ahead``, attention_chunks' K a slab ahead;
    ``quarters``, attention_quarters in attention_sums' place."""
    t, n_ctx = q.shape[0], k.shape[0]
    out = np.full_like(q, np.nan)
    a = AttnArg()
    a.q, a.k, a.v, a.positions, a.out = ptr(q), ptr(k), ptr(v), ptr(pos), ptr(out)
    a.n_head, a.n_head_kv, a.n_ctx, a.scale, a.window = nh, nkv, n_ctx, scale, window
    keep = [out]
    if quantize:
        oq = np.zeros(out.shape, np.int8)
        od = np.zeros((t, out.shape[1] // 32), F32)
        os_ = np.zeros_like(od)
        a.oq, a.od, a.os = ptr(oq), ptr(od), ptr(os_)
        keep += [oq, od, os_]
    if kind == "chunks":
        chunks = -(-n_ctx // CHUNK)
        th = t * nh
        part = np.full(th * chunks * (4 if quarters else 1) * (d + 1), np.nan, F32)
        tickets = np.zeros(th, np.int32)
        scores = np.full(th * chunks * CHUNK, np.nan, F32)
        pmax = np.full(th * chunks, np.nan, F32)
        a.part, a.tickets, a.scores, a.pmax = ptr(part), ptr(tickets), ptr(scores), ptr(pmax)
        a.chunks_one_launch = one_launch
        args = f"{d}" if together is None else f"{d}, 0, {together[0]}, {nh // nkv}, {together[1]}"
        early_args = f"{d}, 0, 1, 1, 0, 1" if early else args
        for dst, poison, truth in late:
            lib.late_write(dst.ctypes.data, poison.ctypes.data, truth.ctypes.data, dst.nbytes)
        first = "256, 0, 1, 1, 0, 0, 1" if ahead else early_args if d == 64 else args
        lib.launch(f"attention_chunks<{first}>", (nh, t, chunks), (CHUNK,), [a])
        if quarters:
            lib.launch(f"attention_quarters<{d}{', 1' if early else ''}>", (nh, t, 4 * chunks),
                       (CHUNK,), [a])  # fmt: skip
        else:
            lib.launch(f"attention_sums<{early_args}>", (nh, t, chunks), (CHUNK,), [a])
        assert not tickets.any(), "the tickets are zero again between launches"
    elif kind == "tiles":
        tq = tile or tile_tokens(t, nh // nkv, nkv, d)
        a.n_tokens, a.tile_tokens = t, tq
        if shared is None:
            shared = tiles_shared(nh // nkv * tq, d)
        lib.launch(f"attention_tiles<{d}>", (nkv, -(-t // tq)), (CHUNK,), [a], shared)
    elif kind == "gqa":
        lib.launch(f"attention_rows_gqa<{d}, {nh // nkv}>", (nkv, t), (CHUNK,), [a])
    else:
        lib.launch(f"attention_rows<{d}>", (nh, t), (CHUNK,), [a])
    return keep


def inputs(seed, t, n_ctx, nh, nkv, d, pos, q_scale=1.0, window=0, poison_unseen=False):
    """q, k, v; the cache rows past the last position hold NaN keys and inf values, and with
    ``poison_unseen`` so do all those no token sees (NaN and -inf: below the windows, between
    the positions), which a block may load but must drop."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((t, nh * d)) * q_scale).astype(F32)
    k = rng.standard_normal((n_ctx, nkv * d)).astype(F32)
    v = rng.standard_normal((n_ctx, nkv * d)).astype(F32)
    top = int(pos.max())
    k[top + 1 :], v[top + 1 :] = np.nan, np.inf  # rows no token may read
    if poison_unseen:
        seen = np.zeros(n_ctx, bool)
        for p in pos:
            seen[max(0, p - window + 1) if window else 0 : p + 1] = True
        k[~seen], v[~seen] = np.nan, -np.inf
    v[3] = -0.0
    if top >= 300:
        k[300, :d] = 1e30  # one huge score: the rest of its head's weights underflow
    return q, k, v


def check(lib, kind, *, seed, nh, nkv, d, pos, n_ctx, window=0, one_launch=2, q_scale=1.0, tile=0,
          poison_unseen=False, together=None, ahead=False, quarters=False):  # fmt: skip
    pos = np.asarray(pos, np.int32)
    q, k, v = inputs(seed, len(pos), n_ctx, nh, nkv, d, pos, q_scale, window, poison_unseen)
    scale = float(F32(1 / np.sqrt(d)))
    want = ops.attention(q, k, v, pos, n_head=nh, n_head_kv=nkv, head_dim=d, scale=scale,
                         window=window)  # fmt: skip
    out, oq, od, os_ = run(lib, kind, q, k, v, pos, nh=nh, nkv=nkv, d=d, scale=scale,
                           window=window, one_launch=one_launch, quantize=True,
                           tile=tile, together=together, ahead=ahead,
                           quarters=quarters)  # fmt: skip
    assert out.tobytes() == want.tobytes(), np.argwhere(out.view(np.int32) != want.view(np.int32))
    wq = quantize_activations(want)
    assert oq.tobytes() == wq.q.tobytes()
    assert od.tobytes() == wq.d.astype(F32).tobytes()
    assert os_.tobytes() == wq.s.astype(F32).tobytes()


PREFILL_POSITIONS = [0, 1, 255, 256, 257, 300, 511, 512, 700]


@pytest.mark.parametrize("kind", ["rows", "gqa", "tiles"])
@pytest.mark.parametrize("window", [0, 200])
def test_prefill_heads_of_64(lib, kind, window) -> None:
    nh, nkv = (6, 2) if kind == "gqa" else (9, 3) if kind == "tiles" else (3, 1)
    # (tiles: every token in one block)
    check(lib, kind, seed=1, nh=nh, nkv=nkv, d=64, pos=PREFILL_POSITIONS, n_ctx=720,
          window=window, q_scale=4.0, tile=10)  # fmt: skip


@pytest.mark.parametrize("kind", ["gqa", "tiles"])
def test_prefill_qwen_heads(lib, kind) -> None:
    """Seven query heads a KV head (Qwen2.5's 14 / 2)."""
    check(lib, kind, seed=2, nh=14, nkv=2, d=64, pos=[5, 256, 600], n_ctx=640, tile=4)


@pytest.mark.parametrize("window", [0, 40])
def test_prefill_tiles_of_consecutive_tokens(lib, window) -> None:
    """A prompt's tokens, several tiles of them (the last one partial) across a chunk
    boundary, one query head a KV head (32 tokens a tile) and three (10)."""
    pos = list(range(230, 300))
    check(lib, "tiles", seed=7, nh=2, nkv=2, d=64, pos=pos, n_ctx=320, window=window, tile=32)
    check(lib, "tiles", seed=8, nh=3, nkv=1, d=64, pos=pos[:23], n_ctx=320, window=window,
          tile=10)  # fmt: skip


@pytest.mark.parametrize("kind", ["rows", "gqa", "tiles"])
def test_prefill_heads_of_256_with_a_window(lib, kind) -> None:
    """Gemma 3's heads: 4 query heads, one KV head of 256, a sliding window of 512 (tiles: four
    tokens a block, its 16 rows the most for heads of 256)."""
    check(lib, kind, seed=3, nh=4, nkv=1, d=256, pos=[0, 255, 511, 512, 900], n_ctx=960,
          window=512, tile=4)  # fmt: skip


@pytest.mark.parametrize("d, window", [(128, 0), (256, 0), (256, 100)])
def test_prefill_tiles_of_wide_heads(lib, d, window) -> None:
    """Heads of 128 and 256: a score is its slabs' TREEs added above them, a run its batches'.
    Several tiles across a chunk boundary, a partial last one, -0.0 values in a row."""
    pos = list(range(240, 275))
    check(lib, "tiles", seed=9, nh=4, nkv=2, d=d, pos=pos, n_ctx=320, window=window, tile=8)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("pos, window", [([0, 700, 5, 699], 100), ([700, 0, 650], 60),
                                         ([3, 520], 2)])  # fmt: skip
def test_prefill_tiles_drop_the_rows_their_tokens_do_not_see(lib, d, pos, window) -> None:
    """A tile's tokens far apart: the block loads the chunks any of them sees, and every row
    none of them sees holds a NaN key and a -inf value, which must never reach a score, a max
    or a sum (0 * -inf is NaN). A token a block, two, and all of them in one."""
    for tile in sorted({1, 2, len(pos)}):
        check(lib, "tiles", seed=10, nh=2, nkv=1, d=d, pos=pos, n_ctx=704, window=window,
              tile=tile, poison_unseen=True)  # fmt: skip


def test_prefill_tiles_trap_on_a_launch_they_cannot_hold(lib) -> None:
    """More tokens a block than its position table holds, or less shared memory than its rows
    take: the kernel traps (the launch fails) instead of writing past them."""
    pos = np.arange(40, dtype=np.int32)
    q, k, v = inputs(11, 40, 64, 1, 1, 64, pos)
    for tile, shared in [(33, None), (4, tiles_shared(4, 64) - 4)]:
        with pytest.raises(EmulatorError, match="__trap"):
            run(lib, "tiles", q, k, v, pos, nh=1, nkv=1, d=64, scale=0.125, tile=tile,
                shared=shared)  # fmt: skip


@pytest.mark.parametrize("one_launch", [2, 0])
@pytest.mark.parametrize("window", [0, 300])
def test_flash_decoding_heads_of_64(lib, one_launch, window) -> None:
    """Up to ``one_launch`` visible chunks the max is found by every block; past it (and
    always with 0) the scores go through scratch and attention_sums folds."""
    check(lib, "chunks", seed=4, nh=3, nkv=1, d=64, pos=[0, 255, 256, 700, 1030], n_ctx=1100,
          window=window, one_launch=one_launch, q_scale=4.0)  # fmt: skip


@pytest.mark.parametrize("ahead, quarters", [(False, False), (True, False), (True, True)])
def test_flash_decoding_heads_of_256(lib, ahead, quarters) -> None:
    check(lib, "chunks", seed=5, nh=2, nkv=1, d=256, pos=[3, 600], n_ctx=768, one_launch=0,
          ahead=ahead, quarters=quarters)  # fmt: skip


@pytest.mark.parametrize("window", [0, 100, 300])
def test_flash_decoding_heads_of_256_a_quarter_a_block(lib, window) -> None:
    """QUARTER_SUMS (with CHUNKS_SLABS_AHEAD): four tokens, at a quarter's first and last
    slots, a chunk's, and past them (the quarters of slots no token sees, padding rows of NaN
    keys and -inf values, take no block's work); windows of 100 and 300 start mid-quarter and
    mid-chunk."""
    check(lib, "chunks", seed=6, nh=4, nkv=1, d=256, pos=[0, 63, 256, 700], n_ctx=1000,
          window=window, one_launch=0, q_scale=4.0, poison_unseen=True, ahead=True,
          quarters=True)  # fmt: skip


@pytest.mark.parametrize("window", [0, 300])
def test_flash_decoding_heads_of_a_kv_head_together(lib, window) -> None:
    """Three heads of two KV heads in one block from 3 chunks on (and past 2): position 256
    sees 2 chunks (a block a head, one launch), 700 and 1030 three and five (a block a KV head,
    each chunk's K and V read once for its heads; 1030 in a window of 300 sees three)."""
    check(lib, "chunks", seed=7, nh=6, nkv=2, d=64, pos=[0, 256, 700, 1030], n_ctx=1100,
          window=window, q_scale=4.0, poison_unseen=True, together=(8, 3))  # fmt: skip


def test_flash_decoding_seven_heads_together_from_five_chunks(lib) -> None:
    """Qwen's 7 heads a KV head, from 5 chunks on: 700 sees 3 (through scratch, a block a
    head), 1300 and 1799 six and eight (a block a KV head), in one launch; the fold a chunk at a
    time."""
    check(lib, "chunks", seed=8, nh=14, nkv=2, d=64, pos=[100, 700, 1300, 1799], n_ctx=1800,
          q_scale=4.0, together=(1, 5))  # fmt: skip


def test_flash_decoding_heads_of_256_together(lib) -> None:
    """Heads of 256, every token through scratch (one_launch 0) and a block a KV head from the
    first chunk: depth 3 sums one batch of V rows, 600 three chunks."""
    check(lib, "chunks", seed=9, nh=4, nkv=2, d=256, pos=[3, 600], n_ctx=768, one_launch=0,
          together=(8, 1))  # fmt: skip


@pytest.mark.parametrize("d, quarters", [(64, False), (256, False), (256, True)])
def test_flash_decoding_loads_before_the_wait_take_row_p_after_it(lib, d, quarters) -> None:
    """EARLY_LOADS, a step of one token: attention_chunks (heads of 64) loads the position, its
    K rows and V values before PDL's wait, while the kernel before still writes row p, and row
    p again after it; attention_sums (two launches after that write) its V values. Row p of K
    and V is a late write here: NaN and inf in every block until it passes its wait, the real
    row after. The outputs are the oracle's, at positions on both sides of the warps' 32 rows,
    the runs' 64 and the chunks' 256, in one launch and through scratch (700). The same late
    write of a V row that attention_sums loads early poisons its output: the stand-in bites.
    ``quarters``: attention_quarters' (QUARTER_SUMS) loads in attention_sums' place, every
    token through scratch, as the lowering launches it."""
    nh, nkv = (3, 1) if d == 64 else (2, 1)
    scale = float(F32(1 / np.sqrt(d)))
    for p in (0, 5, 31, 32, 63, 64, 255, 256, 300, 700):
        pos = np.array([p], np.int32)
        q, k, v = inputs(11 + p, 1, 768, nh, nkv, d, pos, q_scale=4.0)
        want = ops.attention(q, k, v, pos, n_head=nh, n_head_kv=nkv, head_dim=d, scale=scale)
        poison_k, poison_v = np.full_like(k[p], np.nan), np.full_like(v[p], np.inf)
        late = [(k[p], poison_k, k[p].copy()), (v[p], poison_v, v[p].copy())]
        out, *_ = run(lib, "chunks", q, k, v, pos, nh=nh, nkv=nkv, d=d, scale=scale, early=True,
                      late=late, quantize=True, quarters=quarters,
                      one_launch=0 if quarters else 2)  # fmt: skip
        assert out.tobytes() == want.tobytes(), p
    # attention_sums' early loads see a write the kernel before makes (700: its path); a late
    # write of one of its V rows stands in for one (there is none: the lowering's rule)
    pos = np.array([700], np.int32)
    q, k, v = inputs(12, 1, 768, nh, nkv, d, pos)
    row = v[520].copy()  # (among the first 64 of its run: loaded early)
    poison = np.full_like(row, np.inf)  # (alive until the launch has used it)
    original = lib.launch

    def late_for_sums(name, *args, **kwargs):
        if name.startswith(("attention_sums", "attention_quarters")):
            lib.late_write(v[520].ctypes.data, poison.ctypes.data, row.ctypes.data, row.nbytes)
        original(name, *args, **kwargs)

    lib.launch = late_for_sums
    try:
        out, *_ = run(lib, "chunks", q, k, v, pos, nh=nh, nkv=nkv, d=d, scale=scale, early=True,
                      quarters=quarters, one_launch=0 if quarters else 2)  # fmt: skip
    finally:
        del lib.launch
    assert np.isnan(out).any() or np.isinf(out).any()


@pytest.mark.parametrize("d, pos, window, peak", [
    (64, [4500, 700], 0, 4400),  # 18 chunks: the fold's batches of 16, then 2
    (64, [4500, 4100], 4200, 4050),  # 17 and 16 chunks from chunk 1: batches past chunk 0
    (64, [8600], 0, 8500),  # 34 chunks: the max's second pass of lanes, batches 16, 16, 2
    (256, [2200, 1100], 0, 2100),  # 9 chunks of heads of 256: batches of 4, 4 and 1
])  # fmt: skip
def test_flash_decoding_folds_many_chunks_in_batches(lib, d, pos, window, peak) -> None:
    """attention_sums' fold through shared memory (fold_staged) over more chunks than its stage
    holds, in windows that start past chunk 0, and the max of the chunks' maxes (max_of_maxes)
    over more chunks than a warp has lanes, the largest score in a late chunk (row ``peak``'s
    key along the query): the oracle's bits, the threads in both orders."""
    pos = np.asarray(pos, np.int32)
    q, k, v = inputs(13, len(pos), -(-int(pos.max()) // 256) * 256 + 256, 2, 1, d, pos, 4.0)
    k[300] = k[301]  # (not inputs' one huge score: the largest is row peak's)
    k[peak, :d] = np.sign(q[0, :d]) * 3.0  # (query head 0 of token 0 scores it highest)
    scale = float(F32(1 / np.sqrt(d)))
    want = ops.attention(q, k, v, pos, n_head=2, n_head_kv=1, head_dim=d, scale=scale,
                         window=window)  # fmt: skip
    out, *_ = run(lib, "chunks", q, k, v, pos, nh=2, nkv=1, d=d, scale=scale, window=window,
                  one_launch=0)  # fmt: skip
    assert out.tobytes() == want.tobytes(), np.argwhere(out.view(np.int32) != want.view(np.int32))


def test_flash_decoding_a_nan_score_deep_in_the_cache(lib) -> None:
    """A NaN key in a row the token sees, in its eleventh chunk: that chunk's max is NaN, so the
    max of the chunks' maxes is (in every warp, whichever lane loaded it) and every output of
    the head is NaN, as the oracle's; the other head's outputs keep the oracle's bits."""
    pos = np.array([3000], np.int32)
    q, k, v = inputs(14, 1, 3072, 2, 2, 64, pos)
    k[2600, :64] = np.nan  # (KV head 0: query head 0)
    scale = float(F32(0.125))
    want = ops.attention(q, k, v, pos, n_head=2, n_head_kv=2, head_dim=64, scale=scale)
    out, *_ = run(lib, "chunks", q, k, v, pos, nh=2, nkv=2, d=64, scale=scale, one_launch=0)
    assert np.isnan(want[0, :64]).all() and np.isnan(out[0, :64]).all()
    assert out[0, 64:].tobytes() == want[0, 64:].tobytes()


@pytest.mark.parametrize("kernel", ["attention_chunks<64>", "attention_sums<64>",
                                    "attention_quarters<256>"])  # fmt: skip
def test_flash_decoding_traps_on_a_position_past_its_chunks(lib, kernel) -> None:
    """A launch over fewer chunks than a token's position needs (a graph's reach broken) traps
    rather than leaving chunks out: each of flash decoding's kernels on its own."""
    d = 256 if "quarters" in kernel else 64
    pos = np.array([600], np.int32)  # (3 chunks; the launch holds 2)
    q, k, v = inputs(15, 1, 768, 1, 1, d, pos)
    a = AttnArg()
    a.q, a.k, a.v, a.positions = ptr(q), ptr(k), ptr(v), ptr(pos)
    out = np.zeros_like(q)
    scratch = [np.zeros(4 * 2 * (d + 1), F32), np.zeros(1, np.int32), np.zeros(2 * CHUNK, F32),
               np.zeros(2, F32)]  # fmt: skip
    a.out, a.part, a.tickets, a.scores, a.pmax = ptr(out), *(ptr(x) for x in scratch)
    a.n_head, a.n_head_kv, a.n_ctx, a.scale, a.chunks_one_launch = 1, 1, 768, 0.125, 0
    grid = (1, 1, 8 if "quarters" in kernel else 2)
    with pytest.raises(EmulatorError, match="__trap"):
        lib.launch(kernel, grid, (CHUNK,), [a])


def test_all_zero_values_keep_their_sign(lib) -> None:
    """v = -0.0 everywhere: p = 255 gives -0.0, p = 0 and p = 256 give +0.0 (numerics.md)."""
    pos = np.array([0, 255, 256], np.int32)
    q, k, _ = inputs(6, 3, 300, 2, 1, 64, pos)
    v = np.full_like(k, -0.0)
    scale = float(F32(0.125))
    want = ops.attention(q, k, v, pos, n_head=2, n_head_kv=1, head_dim=64, scale=scale)
    for kind in ("rows", "gqa", "chunks", "tiles"):
        (out,) = run(lib, kind, q, k, v, pos, nh=2, nkv=1, d=64, scale=scale, tile=16)
        assert out.tobytes() == want.tobytes(), kind
    q, k, _ = inputs(6, 3, 300, 2, 1, 256, pos)  # heads of 256: the sign through the batches
    v = np.full_like(k, -0.0)
    want256 = ops.attention(q, k, v, pos, n_head=2, n_head_kv=1, head_dim=256, scale=scale)
    (out,) = run(lib, "tiles", q, k, v, pos, nh=2, nkv=1, d=256, scale=scale, tile=3)
    assert out.tobytes() == want256.tobytes()
    assert np.signbit(want256[1]).all() and not np.signbit(want256[[0, 2]]).any()
    assert np.signbit(want[1]).all() and not np.signbit(want[[0, 2]]).any()


def test_a_divergent_barrier_is_reported(lib, tmp_path) -> None:
    """The emulator names a barrier that some threads never reach instead of hanging."""
    src = tmp_path / "bad.cu"
    src.write_text("struct A { int n; };\n__global__ void bad(A a) {\n"
                   "    if (threadIdx.x < a.n) __syncthreads();\n}\n")  # fmt: skip
    bad = compile_kernels(str(src), ["bad"], cache=tmp_path)

    class A(ctypes.Structure):
        _fields_ = [("n", ctypes.c_int)]

    bad.launch("bad", (1,), (64,), [A(64)])  # every thread reaches it
    with pytest.raises(EmulatorError, match="never reach"):
        bad.launch("bad", (2,), (64,), [A(10)])
