"""The GPU runtime's host-side pieces, which run without a GPU: driver discovery's answers, the
pinned pool's growth, fallback and switch, and the kernels' sources compiling with NVRTC (when
the CUDA Python bindings are installed: NVRTC needs no GPU)."""

from __future__ import annotations

import re
import tempfile
import warnings

import numpy as np
import pytest

from parity.backends.cuda import discovery
from parity.backends.gpu.pinned import HEADROOM, PinnedPool, PinnedWarning, pinning_wanted


def test_probe_without_a_driver_says_so_in_one_line():
    probe = discovery.probe_driver(("libcuda-that-does-not-exist.so",))
    assert probe.gpus == ()
    assert probe.reason == "no NVIDIA driver: libcuda could not be loaded"


def test_missing_packages_names_what_to_install():
    reason = discovery.missing_packages()
    assert reason == "" or "pip install 'parity[cuda]'" in reason or "CPU-only" in reason
    assert "\n" not in reason


class _Allocator:
    """Stands in for torch's pinned allocation: numpy bytes, counted."""

    def __init__(self, fail: bool = False) -> None:
        self.sizes: list[int] = []
        self.fail = fail

    def __call__(self, nbytes: int) -> np.ndarray:
        if self.fail:
            raise RuntimeError("cudaHostAlloc failed: out of memory")
        self.sizes.append(nbytes)
        return np.zeros(nbytes, np.uint8)


def test_pinned_pool_grows_with_headroom_and_carves_aligned_arrays():
    alloc = _Allocator()
    pool = PinnedPool(alloc)
    a = pool.empty(np.float32, (10, 3))
    b = pool.empty(np.int32, (1,))
    assert alloc.sizes == [120 + HEADROOM]  # one block served both
    assert a.shape == (10, 3) and a.dtype == np.float32 and b.shape == (1,)
    assert (b.ctypes.data - a.ctypes.data) % 64 == 0  # offsets aligned within a block
    a[...] = 1.0
    b[...] = 7
    assert a.sum() == 30 and b[0] == 7  # no overlap
    big = pool.empty(np.uint8, (HEADROOM + 1,))
    assert alloc.sizes[-1] == HEADROOM + 1 + HEADROOM and big.size == HEADROOM + 1
    assert a.sum() == 30  # the earlier block is still alive and intact
    assert pool.reserved == sum(alloc.sizes)


def test_pinned_pool_warns_once_then_uses_pageable_memory():
    pool = PinnedPool(_Allocator(fail=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = pool.empty(np.float32, (4,))
        b = pool.empty(np.float32, (4,))
    assert [w.category for w in caught] == [PinnedWarning]
    assert "pageable" in str(caught[0].message)
    assert not pool.pinned and a.shape == b.shape == (4,)


def test_pinned_pool_refuses_to_grow_during_a_capture():
    pool = PinnedPool(_Allocator(), capturing=lambda: True)
    with pytest.raises(RuntimeError, match="during a CUDA graph capture"):
        pool.empty(np.float32, (4,))


def test_pinning_switch():
    assert pinning_wanted({}) is True
    assert pinning_wanted({"PARITY_PINNED": "0"}) is False
    assert pinning_wanted({"PARITY_PINNED": "off"}) is False
    assert pinning_wanted({"PARITY_PINNED": "1"}) is True
    pool = PinnedPool(_Allocator(), pinned=False)
    assert pool.empty(np.float32, (2,)).shape == (2,) and pool.reserved == 0


def test_pdl_switch_and_the_launch_config_cuda_h_lays_out():
    import ctypes

    from parity.backends.gpu.driver import Launch, _LaunchConfig, pdl_wanted

    assert pdl_wanted({}) is True
    assert pdl_wanted({"PARITY_PDL": "0"}) is False
    assert pdl_wanted({"PARITY_PDL": "off"}) is False
    assert Launch("k", 0, (1, 1, 1), (32, 1, 1), 0, ()).config is None  # a plain launch
    config = Launch("k", 0, (3, 2, 1), (128, 1, 1), 64, (), pdl=True).config
    assert (config.gx, config.gy, config.gz, config.bx, config.shared) == (3, 2, 1, 128, 64)
    attribute = bytes(config.attrs.contents)  # programmatic stream serialization, allowed
    assert (attribute[:4], attribute[8:12], config.n_attrs) == (b"\x06\0\0\0", b"\x01\0\0\0", 1)
    # CUlaunchConfig on a 64-bit host: seven uints, the stream at 32, attrs at 40, 56 in all
    assert (_LaunchConfig.stream.offset, _LaunchConfig.attrs.offset) == (32, 40)
    assert ctypes.sizeof(_LaunchConfig) == 56


@pytest.mark.parametrize(("tokens", "decode"), [(1, True), (16, True), (17, False), (512, False)])
def test_decode_sized_splits_take_pdl(tokens, decode):
    from parity.arch.decoder import build_decoder
    from parity.arch.params import GraphParams
    from parity.arch.synthetic import synthetic_model, tiny_spec
    from parity.backends.gpu.backend import GpuBackend
    from parity.core.backend import Split

    spec, _ = synthetic_model(tiny_spec("llama"))
    graph = build_decoder(spec, GraphParams(n_tokens=tokens, n_ctx=1024, n_out=1))
    nodes = tuple(i for i, n in enumerate(graph.nodes) if not n.op.is_leaf)
    assert GpuBackend.decode_sized(Split(0, "cuda", graph, nodes, (), ())) is decode


# -- the kernels compile (NVRTC needs no GPU) -------------------------------------------------

KERNELS = [
    ("rows.cu", "rms_norm_f32"),
    *(("rows.cu", f"rms_norm_slots<{e}>") for e in (0, 1, 3)),  # (NORM_SLOTS)
    ("rows.cu", "quantize_q8"),
    ("rows.cu", "rope_f32<1>"),
    ("rows.cu", "argmax_f32"),
    *(("rows.cu", f"get_rows<{t}>") for t in (0, 1, 30, 2, 3, 6, 8, 12, 14)),
    *(("matmul.cu", f"gemv_q<{t}, 1, 0, 1>") for t in (2, 3, 6, 8, 12, 14)),
    *(("matmul.cu", f"gemv_q<{t}, 1, 2, 4>") for t in (12, 14)),
    ("matmul.cu", "gemv_q<3, 4, 4, 2>"),
    ("matmul.cu", "gemv_q<8, 8, 4, 4>"),
    ("matmul.cu", "gemv_q_multi<6, 8, 1, 1, 1, 2>"),
    ("matmul.cu", "gemv_q_multi<3, 3, 1, 0, 1, 1>"),
    ("matmul.cu", "gemv_q_multi<3, 3, 8, 0, 2, 0>"),
    ("matmul.cu", "gemv_q_q8<12, 1, 4, 1>"),
    ("matmul.cu", "gemv_q_q8<3, 1, 36, 1>"),  # (... ONE_FENCE)
    ("matmul.cu", "gemv_q_q8_group<3, 4, 1, 1, 24>"),  # (... GROUP_Q8: SmolLM2, Qwen, Gemma 3)
    ("matmul.cu", "gemv_q_q8_group<6, 4, 2, 2, 40>"),
    ("matmul.cu", "gemv_q_q8_group<6, 8, 1, 1, 29>"),
    ("matmul.cu", "gemv_q_q8_group<3, 4, 2, 1, 24>"),  # (... GROUP_Q8_RPW = 2, 1)
    ("matmul.cu", "gemv_q_q8_group<6, 4, 1, 2, 40>"),
    ("matmul.cu", "gemv_q_q8_split<6, 4, 2, 2, 40, 2>"),  # (... GROUP_Q8_SPLIT = 2, 4)
    ("matmul.cu", "gemv_q_q8_split<3, 4, 1, 1, 24, 4>"),
    ("matmul.cu", "gemv_q_norm<3, 1, 2, 1>"),
    ("matmul.cu", "gemv_q_norm<12, 8, 0, 4>"),
    ("matmul.cu", "gemv_q_q8<8, 1, 8, 1>"),
    ("matmul.cu", "gemv_q_multi<8, 8, 1, 0, 1, 6>"),
    ("matmul.cu", "gemv_q_multi<8, 8, 4, 0, 1, 5>"),
    ("matmul.cu", "gemv_q_multi<12, 14, 1, 1, 1, 10>"),  # (... EARLY_LOADS: ROPE_EARLY)
    ("matmul.cu", "gemv_q<3, 1, 18, 1>"),  # (... EPI_RES_EARLY)
    ("matmul.cu", "gemv_f<1, 1, 2>"),
    ("matmul.cu", "gemm_q<14, 10, 1>"),
    ("matmul.cu", "gemm_q<12, 6, 4>"),
    *(("matmul.cu", f"gemm_mma<{t}, {e}>") for t in (2, 3, 6, 8, 12, 14) for e in (0, 1, 2, 4)),
    ("matmul.cu", "gemm_mma<6, 4, 3>"),  # (the switches' instantiations: MMA_MIN_BLOCKS ...)
    ("matmul.cu", "gemm_mma<6, 4, 1, 64>"),  # (... MMA_TOKENS)
    ("matmul.cu", "gemm_mma<14, 2, 1, 64>"),
    ("matmul.cu", "gemm_mma_multi<6, 8, 1>"),  # (... MMA_MULTI)
    ("matmul.cu", "gemm_mma_multi<3, 3, 0, 1, 64>"),
    ("matmul.cu", "gemv_q_wide<8, 0, 3>"),
    ("matmul.cu", "gemv_q_wide<8, 0, 6, 2>"),  # (... WIDE_FIT_ROW, FOLD_BATCH, MIN_BLOCKS)
    ("matmul.cu", "gemv_q_wide<8, 0, 3, 3, 1>"),  # (... ARGMAX_IN_HEAD)
    ("rows.cu", "advance_i32"),
    *(("rows.cu", f"rms_norm_warps<{r}>") for r in (1, 2, 4, 8, 16, 32, 64)),  # (NORM_WARP_...)
    ("rows.cu", "gelu_f32"),
    ("rows.cu", "glu_f32<1>"),
    ("rows.cu", "glu_f32<0>"),
    ("rows.cu", "scale_f32"),
    ("attention.cu", "attention_rows<64>"),
    ("attention.cu", "attention_chunks<64>"),
    ("attention.cu", "attention_sums<64>"),
    ("attention.cu", "attention_sums<256>"),
    ("attention.cu", "attention_chunks<64, 2, 8>"),
    ("attention.cu", "attention_sums<64, 2, 8>"),
    ("attention.cu", "attention_chunks<64, 0, 8, 7, 3>"),  # (... HEADS_TOGETHER_CHUNKS)
    ("attention.cu", "attention_sums<64, 0, 8, 7, 3>"),
    ("attention.cu", "attention_chunks<256, 0, 8, 4, 8>"),
    ("attention.cu", "attention_sums<256, 0, 8, 4, 8>"),
    ("attention.cu", "attention_chunks<64, 0, 1, 1, 0, 1>"),  # (... EARLY_LOADS)
    ("attention.cu", "attention_sums<64, 0, 1, 1, 0, 1>"),
    ("attention.cu", "attention_sums<256, 0, 1, 1, 0, 1>"),
    ("attention.cu", "attention_sums<128, 0, 1, 1, 0, 1>"),
    ("attention.cu", "attention_chunks<256, 0, 1, 1, 0, 0, 1>"),  # (... CHUNKS_SLABS_AHEAD)
    ("attention.cu", "attention_quarters<256, 1>"),  # (... QUARTER_SUMS)
    ("attention.cu", "attention_quarters<256>"),
    ("attention.cu", "attention_rows_gqa<64, 7>"),
    ("attention.cu", "attention_rows_gqa<256, 4>"),
    *(("attention.cu", f"attention_tiles<{d}>") for d in (64, 128, 256)),
    *(("attention.cu", f"attention_tiles<{d}, true>") for d in (64, 128, 256)),  # kept scores
    *(
        ("attention.cu", f"attention_fast<{form}>")  # (numerics = "fast": prefill attention)
        for form in ("64, 1", "64, 2", "256, 1")
    ),
]


@pytest.fixture(scope="module")
def compiler():
    pytest.importorskip("cuda.bindings.nvrtc", reason="the CUDA Python bindings (NVRTC)")
    from parity.backends.cuda.nvrtc import Compiler

    return Compiler("sm_90", cache_dir=tempfile.mkdtemp(), notice=False)


@pytest.mark.long
def test_kernels_compile_for_sm90_without_contraction(compiler, monkeypatch):
    """Every instantiation compiles for sm_90 (NVRTC needs no GPU), and with --fmad=false the
    PTX of the programs the cubins come from has no float multiply-add (rule 2): one compile
    each, read twice."""
    from cuda.bindings import nvrtc

    from parity.backends.cuda.library import Library

    ptx: list[str] = []
    cubin_size = nvrtc.nvrtcGetCUBINSize

    def with_ptx(program):  # (Compiler._compile asks for the cubin's size once it compiled)
        _, size = nvrtc.nvrtcGetPTXSize(program)
        text = bytearray(size)  # (NVRTC writes into it)
        nvrtc.nvrtcGetPTX(program, text)
        ptx.append(text.decode())
        return cubin_size(program)

    monkeypatch.setattr(nvrtc, "nvrtcGetCUBINSize", with_ptx)
    library = Library(None, compiler)
    library.ensure(KERNELS)
    for source, name in KERNELS:
        assert (source, name) in library._functions
    assert len(ptx) == len(dict.fromkeys(KERNELS))  # (a program an instantiation, none cached)
    assert not [text for text in ptx if re.search(r"\bfma\.\w*f32", text)]
    assert sum(bool(re.search(r"\b(mul|add)\.rn\.f32", text)) for text in ptx) > len(ptx) // 2
    # (GROUP_Q8_SPLIT's kernels launch as clusters, whose barrier they take)
    clustered = [t for t in ptx if ".reqnctapercluster" in t]
    assert len(clustered) == sum(n.startswith("gemv_q_q8_split<") for _, n in KERNELS)
    assert all("barrier.cluster.wait.acquire" in t for t in clustered)


def test_compiling_leaves_the_interpreters_shared_bytes_alone(compiler):
    """NVRTC writes its log and cubin into buffers it is given: an empty log is one byte, and
    a buffer made as b" " * 1 is Python's one shared b" ", which the log's NUL once turned
    into b"\\0" for the rest of the process (every SPM space then decoded as NUL)."""
    from parity.backends.cuda.library import Library
    from parity.backends.cuda.nvrtc import Compiler

    fresh = Compiler("sm_90", cache_dir=tempfile.mkdtemp(), notice=False)  # (compiles, no cache)
    Library(None, fresh).ensure([("rows.cu", "scale_f32")])  # no warnings: an empty log
    assert bytes([32])[0] == 32 and b" "[0] == 32


# -- lowering, with stand-in device buffers -----------------------------------------------------


def test_the_wide_heads_loads_a_lane_cover_a_round_as_matmul_cu_counts_them():
    """gemv_q_wide's PER by default is Round<QT>::PER_LANE (VECS = (BYTES + 15) / 16 + 1 loads
    over 32 lanes), so the lowering names the instantiation the GPU timed; and any row's copy,
    from an aligned start up to 15 bytes below it, fits the loads it is given."""
    from parity.backends.cuda.lowering import lane_loads, round_bytes
    from parity.core.dtypes import DType

    for dtype in (t for t in DType if t.is_quantized and t is not DType.Q8A):
        b = round_bytes(dtype)
        assert lane_loads(b) == ((b + 15) // 16 + 1 + 31) // 32, dtype
        for nbytes in range(1, b + 1):
            assert all(
                (offset + nbytes + 15) // 16 <= 32 * lane_loads(nbytes) for offset in range(16)
            )


class _FakeTensor:
    """Stands in for a device tensor: an address, and slices that keep one."""

    _next = 1 << 20

    def __init__(self) -> None:
        _FakeTensor._next += 256
        self.address = _FakeTensor._next

    def data_ptr(self) -> int:
        return self.address

    def __getitem__(self, key) -> _FakeTensor:
        return _FakeTensor()

    dtype = "float32"

    def view(self, *shape) -> _FakeTensor:  # (a reshape, or bytes as floats: the same address)
        return self


def _fake_value(dtype, shape):
    from parity.backends.gpu.runtime import Q8Value
    from parity.core.dtypes import DType

    if dtype is DType.Q8A:
        return Q8Value(_FakeTensor(), _FakeTensor(), _FakeTensor())
    return _FakeTensor()


def _twin_spec(name):
    """A real model's spec with weights of the real types and sizes that take no memory."""
    from parity.arch.decoder import rope_weights
    from parity.arch.synthetic import REAL_SPECS, twin_layout
    from parity.core.weights import WeightData

    spec = REAL_SPECS[name]
    layout = {**twin_layout(name), **{w.name: (w.dtype, w.shape) for w in rope_weights(spec)}}
    nothing = np.zeros(1, np.uint8)
    return spec.with_weights(
        WeightData(n, t, shape, np.lib.stride_tricks.as_strided(nothing, (t.nbytes(
            int(np.prod(shape))),), (0,)))
        for n, (t, shape) in layout.items()
    )  # fmt: skip


def _lower(spec, params, views=lambda graph: frozenset(), **options):
    """A decoder graph fused as the GPU backends fuse it, through cuda's Lowering, its values
    fake addresses."""
    from parity.arch.decoder import build_decoder
    from parity.backends.cuda.lowering import Lowering
    from parity.core.fusion import PASSES, fuse
    from parity.core.ir import Op

    graph = fuse(build_decoder(spec, params), accept=lambda n, s: True, passes=PASSES, share_min=1)
    values = {i: _fake_value(n.dtype, n.shape) for i, n in enumerate(graph.nodes)
              if n.op is not Op.WEIGHT}  # fmt: skip
    for i, n in enumerate(graph.nodes):
        if n.op is Op.KV_WRITE:
            values[i] = values[n.src[0]]
    weights = {n.arg: _FakeTensor() for n in graph.nodes if n.op is Op.WEIGHT}
    nodes = tuple(i for i, n in enumerate(graph.nodes) if not n.op.is_leaf)
    readers: dict[int, list[int]] = {}
    for i in nodes:
        for s in graph.nodes[i].src:
            readers.setdefault(s, []).append(i)
    lowering = Lowering(graph, values, weights, lambda _: None, _copy, _fake_value,
                        views=views(graph), **options)  # fmt: skip
    return spec, graph, lowering, lowering.lower(nodes, readers), nodes


def _float_gemm(out, a, b, add=None) -> None:
    """The runtime's float GEMM (FAST_GEMM), counted by identity."""


@pytest.mark.parametrize("name, per_layer", [("smollm2-135m", 0), ("qwen2.5-coder-0.5b", 3)])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("half, half_gemm", [(False, True), (True, True), (True, False)])
def test_fast_products_take_the_tensor_cores_by_the_weight_size(
    name, per_layer, fast, half, half_gemm, monkeypatch
):
    """FAST_GEMM under numerics = "fast", a 300-token prefill of a real model: the products of
    FAST_GEMM_MIN_ELEMENTS or more (Qwen's gate, up and down) on the float GEMM (TF32 or,
    with FAST_GEMM_HALF and a runtime whose GEMM takes them (``half_gemm``: torch 2.8 on),
    float16 operands), each after its weight's dequantizing and followed by gemm_mma for the
    flagged tiles; the smaller ones (Qwen's q/k/v and o, all of SmolLM2's) and every product
    under exact on gemm_mma alone."""
    from parity.arch.params import GraphParams
    from parity.backends.cuda import lowering as lowering_module

    monkeypatch.setattr(lowering_module, "FAST_GEMM_HALF", half)
    params = GraphParams(n_tokens=300, n_ctx=2048, output="logits")
    spec, _, lowering, lowered, nodes = _lower(_twin_spec(name), params, fast=fast,
                                               matmul=_float_gemm, half_gemm=half_gemm)  # fmt: skip
    half = half and half_gemm  # (else TF32's form)
    assert lowering.done == set(nodes)
    gemms = sum(fn is _float_gemm for fn, _ in lowered.launches)
    names = [launch.name for _, (launch, *_) in lowered.launches if hasattr(launch, "name")]
    expected = per_layer * spec.n_layer if fast else 0
    assert gemms == expected
    assert sum(n.startswith(("dequant_rows", "dequant_subs")) for n in names) == expected
    x_floats = "q8_to_f16" if half else "q8_to_f32"  # (gate/up's x, then down's)
    assert names.count(x_floats) == (2 * spec.n_layer if expected else 0)
    if expected:
        assert sum(n.startswith("dequant_subs_half") for n in names) == (expected if half else 0)
    assert sum(n.startswith("gemm_mma") for n in names) == 4 * spec.n_layer  # (as exact)


def _copy(dst, src) -> None:
    """The lowering's copy (a RESHAPE or SLICE_ROWS that is not a view), counted by identity."""


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("tokens, n_ctx", [(1, 512), (1, 2048), (7, 2048), (300, 2048)])
def test_lowering_covers_every_node_of_the_real_models(name, tokens, n_ctx):
    from parity.arch.params import GraphParams
    from parity.backends.cuda.lowering import CHUNKS_ONE_LAUNCH, MMA_MULTI, MMA_QUANTIZE
    from parity.core.ir import Op

    params = GraphParams(n_tokens=tokens, n_ctx=n_ctx, output="argmax" if tokens == 1 else "logits")
    spec, graph, lowering, lowered, nodes = _lower(_twin_spec(name), params)
    assert lowering.done == set(nodes)  # every node computed, alone or by a fused launch
    names = [launch.name for _, (launch, *_) in lowered.launches if hasattr(launch, "name")]
    producers = (Op.RMS_NORM, Op.RMS_NORM_MUL, Op.ATTENTION)
    if tokens <= 8 or MMA_QUANTIZE:  # gate/up's GEMV or GEMM quantizes its output for down
        producers += (Op.MATMUL_SWIGLU,)
    alone = [i for i in nodes if graph.nodes[i].op is Op.QUANTIZE
             and graph.nodes[graph.nodes[i].src[0]].op not in producers]  # fmt: skip
    assert names.count("quantize_q8") == len(alone)  # the others: their producer's launch
    assert "kv_write_f32" not in names  # k and v rows: the layer's q/k/v or rope launch
    ropes = sum(n.startswith("rope_f32") for n in names)
    # the q/k/v launches' template arguments, ROPE last
    multi = [n[n.index("<") + 1 : -1].split(", ") for n in names if n.startswith("gemv_q_multi")]
    if tokens <= 8:  # q, k, v, their ROPEs and KV_WRITEs: one launch
        mode = "2" if name.startswith("qwen") else "1"  # neox pairs, adjacent pairs
        assert [args[-1] for args in multi] == [mode] * spec.n_layer
        assert ropes == 0
    else:
        assert ropes == spec.n_layer  # q's and k's: one launch
    if tokens == 1:  # norm, q/k/v with their ROPEs and cache writes, attention, o, norm,
        # gate/up, down: 7 a layer; 8 where the cache holds more chunks than one attention
        # launch takes (the scores through scratch: attention_sums)
        sums = n_ctx // 256 > CHUNKS_ONE_LAUNCH[spec.head_dim]
        assert names.count(f"attention_sums<{spec.head_dim}>") == sums * spec.n_layer
        assert len(lowered.launches) == (7 + sums) * spec.n_layer + 4, names[:12]
        # one set of flash-decoding scratch for all the layers
        shared = {"part", "tickets"} | ({"scores", "pmax"} if sums else set())
        assert set(lowering._shared) == shared
        assert sum(any(b is buf for _, b in lowering._shared.values())
                   for buf in lowered.scratch) == len(shared)  # fmt: skip
    if tokens > 8:  # a prefill's products on the tensor cores: q, k, v (one launch with
        # MMA_MULTI), o, gate/up, down
        per_layer = 4 if MMA_MULTI else 6
        assert sum(n.startswith("gemm_mma") for n in names) == per_layer * spec.n_layer
        assert not any(n.startswith("gemm_q") for n in names)
    allowed = []
    lowered.bind(lambda source, kernel, shared: allowed.append(shared) or 1)
    assert not lowered.pending
    assert all(launch.fn == 1 for _, (launch, *_) in lowered.launches if hasattr(launch, "fn"))
    assert len(allowed) == len(names)


@pytest.mark.parametrize(
    "name, heads, d, tile",
    [("smollm2-135m", 3, 64, 3), ("qwen2.5-coder-0.5b", 7, 64, 2), ("gemma3", 4, 256, 1)],
)
def test_prefill_tiles_launch_a_block_a_kv_head_and_tile_of_tokens(
    name, heads, d, tile, monkeypatch
):
    """With PREFILL_TILES, a prefill's attention is one attention_tiles launch a layer: a block
    a KV head and ``tile`` tokens (as few as still give TILE_BLOCKS blocks), its shared memory
    sized for the rows; the most rows' shared memory fits two blocks an H200 SM."""
    from parity.arch.params import GraphParams
    from parity.backends.cuda import lowering
    from parity.backends.cuda.lowering import TILE_BLOCKS, tile_rows, tile_tokens, tiles_shared

    monkeypatch.setattr(lowering, "PREFILL_TILES", True)
    params = GraphParams(n_tokens=300, n_ctx=2048, output="logits")
    if name == "gemma3":  # Gemma 3 270M's heads: four of 256 on one KV head
        from parity.arch.synthetic import synthetic_model, tiny_spec

        model, _ = synthetic_model(tiny_spec(name, n_ctx_train=2048, head_dim=256, n_head=4,
                                             n_head_kv=1), seed=1)  # fmt: skip
    else:
        model = _twin_spec(name)
    spec, _, _, lowered, _ = _lower(model, params)
    tiles = [launch for _, (launch, *_) in lowered.launches
             if getattr(launch, "name", "").startswith(f"attention_tiles<{d}")]  # fmt: skip
    assert len(tiles) == spec.n_layer
    assert tile_tokens(300, heads, spec.n_head_kv, d) == tile
    assert spec.n_head_kv * -(-300 // tile) >= TILE_BLOCKS > spec.n_head_kv * -(-300 // (tile + 1))
    for launch in tiles:
        assert launch.grid == (spec.n_head_kv, -(-300 // tile), 1)
        assert launch.shared == tiles_shared(heads * tile, d)
        (a,) = launch.args
        assert (a.n_tokens, a.tile_tokens) == (300, tile)
        # the scores kept (TILE_SCORES_BYTES): as many chunks a row as 32 MiB hold, up to the
        # 2,048-slot cache's 8 (fewer in a window); at least the two of 300 tokens from 0
        rows = spec.n_head_kv * -(-300 // tile) * heads * tile
        assert 2 <= a.chunks_one_launch <= min(8, lowering.TILE_SCORES_BYTES // (rows * 1024))
        assert launch.name == f"attention_tiles<{d}, true>" and a.scores
    for width in (64, 128, 256):  # the most rows: two blocks' shared memory fit an SM
        assert 2 * (tiles_shared(tile_rows(width), width) + 256) <= 228 << 10
    assert tile_tokens(4096, 7, 2) == 4 and tile_tokens(4096, 1, 2) == 32  # rows, tokens cap
    assert tile_tokens(20, 3, 3) == 1  # few tokens: a token a block


def test_gemm_mma_shared_memory_and_its_limits():
    from parity.backends.cuda.lowering import gemm_mma_shared
    from parity.core.dtypes import DType

    assert gemm_mma_shared(DType.Q4_0, False, 128) is None  # 4 blocks: shorter than a stage
    assert gemm_mma_shared(DType.Q6_K, False, 128) is None  # 8 sub-blocks of 16 < 16
    # Q5_0 over 896: a 192-byte stage copy, TREE counters of levels 3..5 for 4 outputs
    one = 32 * (192 + 80 * 4 + 10 * 8) + 32 * (80 * 4 + 10 * 8)
    assert gemm_mma_shared(DType.Q5_0, False, 896) == one + 3 * 4 * 256 * 4
    two = gemm_mma_shared(DType.Q5_0, True, 896)  # gate and up: twice the weights and counters
    assert two == one + 32 * (192 + 80 * 4 + 10 * 8) + 3 * 8 * 256 * 4
    for dtype in (DType.Q4_K, DType.Q6_K, DType.Q8_0):  # the widest real rows fit an H200's SM
        assert gemm_mma_shared(dtype, True, 4864) < 227 << 10
        assert gemm_mma_shared(dtype, True, 4864, tokens=64) < 227 << 10  # (one block an SM)
    # 64 tokens a block (MMA_TOKENS): twice the activations, twice the threads' counters
    wide = gemm_mma_shared(DType.Q5_0, False, 896, tokens=64)
    assert wide == one + 32 * (80 * 4 + 10 * 8) + 3 * 4 * 256 * 4 * 2


def test_reshapes_and_slices_of_computed_values_are_views_not_copies():
    """A RESHAPE or SLICE_ROWS of a value the split computes is a view of its buffer (no copy,
    no launch); of an input (another split's value, a state), a buffer of its own."""
    pytest.importorskip("torch")
    from parity.backends.gpu.backend import GpuBackend
    from parity.backends.gpu.host import HostRuntime
    from parity.core.backend import Split
    from parity.core.builder import GraphBuilder
    from parity.core.dtypes import DType
    from parity.core.ir import Op, SliceArg

    b = GraphBuilder()
    x = b.input("x", DType.F32, (4, 64))
    a = b.op(Op.ADD, x, x)
    r = b.op(Op.RESHAPE, a, arg=(8, 32))
    rr = b.op(Op.RESHAPE, r, arg=(2, 128))  # a view of a view
    s = b.op(Op.SLICE_ROWS, a, arg=SliceArg(1, 2))
    rx = b.op(Op.RESHAPE, x, arg=(8, 32))  # of an input: copied
    graph = b.build(rr, s, rx)
    nodes = tuple(i for i, n in enumerate(graph.nodes) if not n.op.is_leaf)
    (inp,) = (i for i, n in enumerate(graph.nodes) if n.op is Op.INPUT)
    backend = object.__new__(GpuBackend)  # (the allocation needs only a runtime)
    backend.rt = HostRuntime()
    split = Split(0, "gpu", graph, nodes, (inp,), ())
    values, views = backend.split_values(split, {inp: backend.alloc(DType.F32, (4, 64))})
    by_op = {}
    for i in nodes:
        by_op.setdefault(graph.nodes[i].op, []).append(i)
    add = by_op[Op.ADD][0]
    reshapes = by_op[Op.RESHAPE]
    (slice_,) = by_op[Op.SLICE_ROWS]
    base = values[add].data_ptr()
    assert views == {reshapes[0], reshapes[1], slice_}
    assert values[reshapes[0]].data_ptr() == values[reshapes[1]].data_ptr() == base
    assert values[slice_].data_ptr() == base + 64 * 4
    assert tuple(values[reshapes[1]].shape) == (2, 128)
    assert reshapes[2] not in views  # of the input
    assert values[reshapes[2]].data_ptr() != values[inp].data_ptr()
    values[add].fill_(3.0)
    assert float(values[slice_][0, 0]) == float(values[reshapes[1]][1, 127]) == 3.0


def test_gemma3_head_norms_reshape_through_views_not_copies():
    """Gemma 3's per-head q and k norms RESHAPE the products' rows and back: with those values
    as views (GpuBackend.split_values) cuda's lowering copies nothing; without, four a layer."""
    from parity.arch.params import GraphParams
    from parity.arch.synthetic import synthetic_model, tiny_spec
    from parity.core.ir import Op

    params = GraphParams(n_tokens=1, n_ctx=1024, output="argmax")

    def reshapes(graph):
        return frozenset(i for i, n in enumerate(graph.nodes) if n.op is Op.RESHAPE)

    spec, _ = synthetic_model(tiny_spec("gemma3", n_ctx_train=2048), seed=1)
    for views, copies_per_layer in ((lambda graph: frozenset(), 4), (reshapes, 0)):
        _, _, lowering, lowered, nodes = _lower(spec, params, views)
        assert lowering.done == set(nodes)
        copies = sum(fn is _copy for fn, _ in lowered.launches)
        assert copies == copies_per_layer * spec.n_layer


def test_gemma3_decode_step_launches():
    """A Gemma 3 layer's decode step in 10 launches (11 where attention sums chunks through
    scratch): q/k/v; the q and k head norms together; their ROPEs and cache writes; attention;
    o; the norm after attention with the residual ADD and the norm of the sum before the FFN
    with its quantization; gate/up; GEGLU with its quantization; down; the norm after it with
    the ADD and the next layer's first norm. (It was 16 with each of those norms, ADDs and
    quantizations launched alone.)"""
    from parity.arch.params import GraphParams
    from parity.arch.synthetic import synthetic_model, tiny_spec
    from parity.core.ir import Op

    params = GraphParams(n_tokens=1, n_ctx=1024, output="argmax")
    spec, _ = synthetic_model(tiny_spec("gemma3", n_ctx_train=2048), seed=1)
    _, _, lowering, lowered, nodes = _lower(
        spec, params, lambda graph: frozenset(
            i for i, n in enumerate(graph.nodes) if n.op is Op.RESHAPE)
    )  # fmt: skip
    assert lowering.done == set(nodes)
    names = [launch.name for _, (launch, *_) in lowered.launches]
    sums = names.count("attention_sums<64>")
    # the step's own: embedding rows, their scale, the first layer's first norm, the head
    # (the output norm is the last layer's) and argmax
    assert len(names) == 10 * spec.n_layer + sums + 5, names
    assert names.count("rms_norm_slots<0>") == 3 * spec.n_layer + 1  # (a slot a thread)
    assert names.count("glu_f32<1>") == spec.n_layer
    assert not {"quantize_q8", "binary_f32<0>"} & set(names)


@pytest.mark.parametrize("name, per_layer", [("smollm2-135m", 5), ("qwen2.5-coder-0.5b", 5),
                                             ("gemma3", 8)])  # fmt: skip
@pytest.mark.parametrize("tokens", [1, 7])
def test_norm_after_product_takes_the_norms_launches(name, per_layer, tokens, monkeypatch):
    """With NORM_AFTER_PRODUCT, a decode step's norms after the o and down products (and for
    Gemma 3 the ADD and the norm of the sum that follow each) are those products' last
    blocks' work (gemv_q_norm): two launches fewer a layer (SmolLM2 and Qwen 7 -> 5, Gemma 3
    10 -> 8, attention's second launch aside), the output norm the last layer's when it reads
    that layer's output, and one ticket for them all. Only the first layer's first norm (after
    the embedding) and Gemma 3's head norms keep rms_norm_f32."""
    from parity.arch.params import GraphParams
    from parity.backends.cuda import lowering as lowering_mod
    from parity.core.ir import Op

    monkeypatch.setattr(lowering_mod, "NORM_AFTER_PRODUCT", True)
    params = GraphParams(n_tokens=tokens, n_ctx=1024, output="argmax" if tokens == 1 else "logits")
    if name == "gemma3":
        from parity.arch.synthetic import synthetic_model, tiny_spec

        model, _ = synthetic_model(tiny_spec("gemma3", n_ctx_train=2048), seed=1)
        views = lambda graph: frozenset(  # noqa: E731
            i for i, n in enumerate(graph.nodes) if n.op is Op.RESHAPE
        )
    else:
        model, views = _twin_spec(name), lambda graph: frozenset()  # fmt: skip
    spec, _, lowering, lowered, nodes = _lower(model, params, views)
    assert lowering.done == set(nodes)
    names = [launch.name for _, (launch, *_) in lowered.launches if hasattr(launch, "name")]
    sums = sum(n.startswith("attention_sums") for n in names)
    # the step's own: embedding rows (and Gemma's scale), the first norm, the head, and argmax;
    # or with logits of several tokens, the output norm of the last token's row (a slice of
    # the last layer's output, so no product's) where argmax was
    own = 5 if name == "gemma3" else 4
    assert len(names) == per_layer * spec.n_layer + sums + own, names[:16]
    sliced = tokens > 1  # (Gemma 3's last down still norms: its norm after the FFN, the ADD)
    alone = sliced and name != "gemma3"
    assert sum(n.startswith("gemv_q_norm") for n in names) == 2 * spec.n_layer - alone
    head_norms = spec.n_layer if name == "gemma3" else 0  # (of 7 tokens' 28 rows: a row a warp)
    assert sum(n.startswith(("rms_norm_f32", "rms_norm_slots", "rms_norm_warps"))
               for n in names) == head_norms + 1 + sliced  # fmt: skip
    assert "norm_ticket" in lowering._shared
    norms = [launch for _, (launch, *_) in lowered.launches
             if getattr(launch, "name", "").startswith("gemv_q_norm")]  # fmt: skip
    for launch in norms:  # a job that quantizes gets its row of shared memory
        job = launch.args[-2]
        assert launch.shared == (spec.n_embd * 4 if job.q or job.q2 else 0)
    assert norms[0].shared  # (the first: the norm before the FFN, quantized for gate/up)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_norm_in_product_leaves_the_norms_to_their_products(name, tokens, monkeypatch):
    """With NORM_IN_PRODUCT, a decode layer's two norms take no launch: the o and down products
    leave their blocks' subtrees of the squares (gemv_q_sq), and q/k/v and gate/up make the
    norm and its Q8A themselves (gemv_q_multi_normed, gemv_q_q8_normed): 7 -> 5 launches a
    layer, attention's second aside. rms_norm_f32 runs for the first layer's first norm (its x
    is the embedding's rows) and the output norm (read by the head, which keeps gemv_q_wide's
    grid, or by a slice of the last layer's output); the launch that makes a norm writes the
    norm's and the QUANTIZE's values too."""
    from parity.arch.params import GraphParams
    from parity.backends.cuda import lowering as lowering_mod

    monkeypatch.setattr(lowering_mod, "NORM_IN_PRODUCT", True)
    params = GraphParams(n_tokens=tokens, n_ctx=1024, output="argmax" if tokens == 1 else "logits")
    spec, _, lowering, lowered, nodes = _lower(_twin_spec(name), params)
    assert lowering.done == set(nodes)
    launches = [launch for _, (launch, *_) in lowered.launches if hasattr(launch, "name")]
    names = [launch.name for launch in launches]
    sums = sum(n.startswith("attention_sums") for n in names)
    assert len(names) == 5 * spec.n_layer + sums + 5 - (tokens > 1), names[:16]
    count = lambda prefix: sum(n.startswith(prefix) for n in names)  # noqa: E731
    assert count(("rms_norm_f32", "rms_norm_slots")) == 2
    assert count("gemv_q_sq<") == 2 * spec.n_layer - 1  # (the last down's norm: the head's)
    assert count("gemv_q_multi_normed<") == spec.n_layer - 1
    assert count("gemv_q_q8_normed<") == spec.n_layer
    # the subtrees' slots: the producer's rows a block (o: 4; down, over K = 1,536 or 4,864:
    # 2 or 1)
    levels = {"gemv_q_q8_normed": 2, "gemv_q_multi_normed": 1 if name == "smollm2-135m" else 0}
    for launch in launches:
        kernel = launch.name.split("<")[0]
        if kernel in levels:
            arg = launch.args[1]  # NormIn: its only reader, so it writes the two values
            assert arg.y and arg.q and arg.qd and arg.qs and arg.parts and arg.w
            assert (arg.level, arg.np) == (levels[kernel], spec.n_embd >> levels[kernel])
            assert launch.shared == lowering_mod.normed_shared(tokens, spec.n_embd)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("pdl, norm_in", [(True, False), (True, True), (False, False)])
def test_early_loads_where_the_kernel_before_cannot_be_writing(
    name, tokens, pdl, norm_in, monkeypatch
):
    """EARLY_LOADS, under PDL only: every q/k/v launch's rotations load the positions (a step's
    input) early (not Gemma 3's, whose launch norms the heads first); every attention_chunks
    its K and V rows for one token only (three: the KV_WRITE before it wrote three rows), and
    for heads of 64 only; every attention_sums (the KV_WRITE is two launches back); every o and
    down product its residual (SmolLM2's and Qwen's, written two launches back or more; with
    NORM_IN_PRODUCT as gemv_q_sq; Gemma 3's residual adds are its norms'). The same launches
    otherwise. (Gemma 3: the tiny spec, the real one's layer kinds.)"""
    from parity.arch.params import GraphParams
    from parity.arch.synthetic import synthetic_model, tiny_spec
    from parity.backends.cuda import lowering as lowering_mod
    from parity.core.ir import Op

    gemma = name == "gemma3"
    spec = synthetic_model(tiny_spec(name, n_ctx_train=2048), seed=1)[0] if gemma else (
        _twin_spec(name))  # fmt: skip
    views = lambda graph: frozenset(  # noqa: E731
        i for i, n in enumerate(graph.nodes) if n.op is Op.RESHAPE
    )
    params = GraphParams(n_tokens=tokens, n_ctx=1024, output="argmax" if tokens == 1 else "logits")
    monkeypatch.setattr(lowering_mod, "NORM_IN_PRODUCT", norm_in)

    def names(early: bool) -> list[str]:
        monkeypatch.setattr(lowering_mod, "EARLY_LOADS", early)
        lowered = _lower(spec, params, views, pdl=pdl)[3]
        return [launch.name for _, (launch, *_) in lowered.launches if hasattr(launch, "name")]

    before, after = names(False), names(True)
    assert [n.split("<")[0] for n in after] == [n.split("<")[0] for n in before]
    pairs = list(zip(before, after, strict=True))
    if not pdl:
        assert before == after
        return
    d = spec.head_dim
    chunks = [b for a, b in pairs if a.startswith("attention_chunks<")]
    sums = [b for a, b in pairs if a.startswith("attention_sums<")]
    # (a cache of 1,024 positions: four chunks, so sums after each chunks launch but those of
    # Gemma 3's local layers, whose window sees two)
    assert len(chunks) == spec.n_layer and 1 <= len(sums) <= len(chunks)
    early = ", 0, 1, 1, 0, 1>"
    assert all(b.endswith(early) == (tokens == 1 and d == 64) for b in chunks), chunks
    assert all(b.endswith(early) for b in sums), sums
    multi = [(a, b) for a, b in pairs if a.startswith("gemv_q_multi")]
    mode = lambda n: int(n.rsplit(", ", 1)[1][:-1])  # noqa: E731
    assert multi and all(mode(b) == mode(a) | (0 if gemma else 8) for a, b in multi)
    residual = [(a, b) for a, b in pairs
                if a.startswith(("gemv_q<", "gemv_q_sq<")) and a.split(", ")[2] == "2"]  # fmt: skip
    assert all(b.split(", ")[2] == "18" for _, b in residual), residual
    assert len(residual) == (0 if gemma else 2 * spec.n_layer)
    if norm_in and not gemma:  # (the last down's norm is the head's: a plain gemv_q)
        assert sum(b.startswith("gemv_q_sq<") for _, b in residual) == 2 * spec.n_layer - 1
    # the decode norms' weights (every norm here has one), and Gemma 3's chained norms' residuals
    norms = [b for a, b in pairs if a.startswith("rms_norm_slots<")]
    assert norms, after
    modes = {int(b.split("<")[1][:-1]) for b in norms}
    assert all(m & lowering_mod.NORM_EARLY_W for m in modes), norms
    assert any(m & lowering_mod.NORM_EARLY_RES for m in modes) == gemma, norms
    changed = ("attention_chunks<", "attention_sums<", "gemv_q_multi", "gemv_q<", "gemv_q_sq<",
               "rms_norm_slots<")  # fmt: skip
    others = [(a, b) for a, b in pairs if a != b and not a.startswith(changed)]
    assert not others, others


@pytest.mark.parametrize("tokens", [1, 7])
def test_gemma3_decode_step_with_every_decode_switch_takes_five_launches_a_layer(
    tokens, monkeypatch
):
    """With NORM_AFTER_PRODUCT, QKV_HEAD_NORMS and GLU_IN_PRODUCT a Gemma 3 layer's decode step
    is 5 launches (6 with attention's second), as SmolLM2's and Qwen's: q/k/v with the head
    norms, ROPEs and cache writes; attention; o with the norm after it, the ADD and the norm
    before the FFN; gate, up, GEGLU and its quantization; down with the norm after it, the ADD
    and the next layer's first norm. One norm launch runs alone, after the embedding (and for
    logits of several tokens, the output norm of the last one's row); no ROPE or GLU launch."""
    from parity.arch.params import GraphParams
    from parity.arch.synthetic import synthetic_model, tiny_spec
    from parity.backends.cuda import lowering as lowering_mod
    from parity.core.ir import Op

    for switch in ("NORM_AFTER_PRODUCT", "QKV_HEAD_NORMS", "GLU_IN_PRODUCT"):
        monkeypatch.setattr(lowering_mod, switch, True)
    output = "argmax" if tokens == 1 else "logits"
    params = GraphParams(n_tokens=tokens, n_ctx=1024, output=output)
    spec, _ = synthetic_model(tiny_spec("gemma3", n_ctx_train=2048, head_dim=256, n_head=4,
                                        n_head_kv=1), seed=1)  # fmt: skip
    _, _, lowering, lowered, nodes = _lower(
        spec, params, lambda graph: frozenset(
            i for i, n in enumerate(graph.nodes) if n.op is Op.RESHAPE)
    )  # fmt: skip
    assert lowering.done == set(nodes)
    names = [launch.name for _, (launch, *_) in lowered.launches if hasattr(launch, "name")]
    # (heads of 256, flash decoding: always a second launch, QUARTER_SUMS's)
    sums = sum(n.startswith(("attention_sums<256", "attention_quarters<256")) for n in names)
    assert sums == (spec.n_layer if tokens == 1 else 0)  # (7 tokens: prefill's attention)
    assert len(names) == 5 * spec.n_layer + sums + 5, names[:14]
    assert sum(n.endswith(", 6>") and n.startswith("gemv_q_multi") for n in names) == spec.n_layer
    geglu = [n for n in names if n.startswith("gemv_q_q8<") and int(n.split(", ")[2]) & 8]
    geglu += [n for n in names if n.startswith("gemv_q_q8_group<") and n.split(", ")[1] == "8"]
    assert len(geglu) == spec.n_layer, names  # (EPI_GEGLU among its flags; one token: GROUP_Q8)
    assert sum(n.startswith(("rms_norm_f32", "rms_norm_slots")) for n in names) == 1 + (tokens > 1)
    assert not any(n.startswith(("rope_f32", "glu_f32")) for n in names)
    multi = [launch for _, (launch, *_) in lowered.launches
             if getattr(launch, "name", "").startswith("gemv_q_multi")]  # fmt: skip
    rope = multi[0].args[-1]  # the heads' tickets, shared by the layers' launches
    assert rope.heads0 == 4 and rope.tickets and "head_tickets" in lowering._shared


@pytest.mark.parametrize(
    "case", ["add of two norms", "norm after a fused add", "add of a chained norm"]
)
def test_a_two_norm_launch_never_reads_what_its_other_job_writes(case):
    """Two norms in one norm launch (rms_norm_slots here) run in different blocks: neither may
    take the other's rows (or the sums and chained norms it writes) as its residual.
    ADD(norm(x), norm(y)); a = r + norm(x), b = a + norm(y); a = r + norm(x), t = norm(a)
    (chained in the same job), b = t + norm(y): those last ADDs launch on their own."""
    from parity.backends.cuda.kernel_args import NormRowsArg
    from parity.backends.cuda.lowering import Lowering
    from parity.core.dtypes import DType
    from parity.core.ir import Graph, Node, Op

    f32, shape = DType.F32, (4, 64)
    nodes = [Node(Op.INPUT, f32, shape, (), n) for n in ("x", "y", "r")]
    if case == "add of two norms":
        nodes += [
            Node(Op.RMS_NORM, f32, shape, (0,), 1e-6),
            Node(Op.RMS_NORM, f32, shape, (1,), 1e-6),
            Node(Op.ADD, f32, shape, (3, 4)),
        ]
    elif case == "norm after a fused add":
        nodes += [
            Node(Op.RMS_NORM, f32, shape, (0,), 1e-6),
            Node(Op.ADD, f32, shape, (2, 3)),
            Node(Op.RMS_NORM, f32, shape, (1,), 1e-6),
            Node(Op.ADD, f32, shape, (4, 5)),
        ]
    else:
        nodes += [
            Node(Op.RMS_NORM, f32, shape, (0,), 1e-6),
            Node(Op.ADD, f32, shape, (2, 3)),
            Node(Op.RMS_NORM, f32, shape, (1,), 1e-6),
            Node(Op.RMS_NORM, f32, shape, (4,), 1e-6),
            Node(Op.ADD, f32, shape, (6, 5)),
        ]
    graph = Graph(tuple(nodes), (len(nodes) - 1,))  # fmt: skip
    values = {i: _fake_value(n.dtype, n.shape) for i, n in enumerate(graph.nodes)}
    order = tuple(i for i, n in enumerate(graph.nodes) if not n.op.is_leaf)
    readers: dict[int, list[int]] = {}
    for i in order:
        for s in graph.nodes[i].src:
            readers.setdefault(s, []).append(i)
    lowering = Lowering(graph, values, {}, lambda _: None, _copy, _fake_value)
    lowered = lowering.lower(order, readers)
    assert lowering.done == set(order)
    names = [launch.name for _, (launch, *_) in lowered.launches]
    assert names.count("rms_norm_slots<0>") == 1  # the two norms together (4 rows of 64)
    assert names.count("binary_f32<0>") == 1  # the ADD that would read the other job's rows
    (norms,) = (launch.args[0] for _, (launch, *_) in lowered.launches
                if launch.name == "rms_norm_slots<0>")  # fmt: skip
    assert isinstance(norms, NormRowsArg)
    jobs = [job for job in (norms.a, norms.b) if job.rows]
    assert len(jobs) == 2
    writes = {p for job in jobs for p in (job.y, job.sum, job.y2) if p}
    reads = {p for job in jobs for p in (job.x, job.res) if p}
    assert not writes & reads


class _Queue:
    """A GPU runtime's stream as GpuBackend's marks see it: downloads land at once (the
    interleaving of a Q8A value's three parts is what waits), events are records."""

    def __init__(self) -> None:
        self.waited: list[dict] = []

    def event(self) -> dict:
        return {}

    def record(self, event: dict) -> None:
        event["recorded"] = True

    def wait(self, event: dict) -> None:
        self.waited.append(event)

    def destroy(self, event: dict) -> None:
        event["destroyed"] = True

    def synchronize(self) -> None:
        return None

    def download(self, src: np.ndarray, out: np.ndarray) -> None:
        out[...] = src


@pytest.mark.parametrize("order", ["first-then-second", "second-then-first"])
def test_a_mark_lands_the_q8a_downloads_queued_before_it_and_no_later_ones(order):
    """Two steps' Q8A downloads with a mark after each (GpuBackend.new_mark, place_mark): a
    wait on the first mark interleaves the first value's parts into its host array and leaves
    the second's for its own mark; a wait on the second lands both, and the first is then a
    wait with nothing left to land."""
    from parity.backends.gpu.backend import GpuBackend
    from parity.backends.gpu.runtime import Q8Value
    from parity.core.dtypes import DType, host_zeros

    backend = GpuBackend.__new__(GpuBackend)
    backend.rt = _Queue()
    backend.init_memory()
    rng = np.random.default_rng(0)

    def value() -> Q8Value:
        return Q8Value(rng.integers(-127, 128, (2, 64)).astype(np.int8),
                       rng.random((2, 2), np.float32), rng.random((2, 2), np.float32))  # fmt: skip

    values = [value(), value()]
    outs = [host_zeros(DType.Q8A, (2, 64)) for _ in values]
    marks = []
    for v, out in zip(values, outs, strict=True):
        backend.download(v, out)
        marks.append(backend.new_mark())
        backend.place_mark(marks[-1])

    def landed(i: int) -> bool:
        return bool((outs[i]["d"] == values[i].d).all() and (outs[i]["q"] != 0).any())

    first, second = marks if order == "first-then-second" else marks[::-1]
    backend.wait_mark(first)
    assert (landed(0), landed(1)) == ((True, False) if first is marks[0] else (True, True))
    backend.wait_mark(second)
    assert landed(0) and landed(1) and backend._pending == []
    assert outs[1]["q"].reshape(2, 64).tolist() == values[1].q.tolist()
    assert [id(e) for e in backend.rt.waited] == [id(first.event), id(second.event)]
    backend.drop_mark(marks[0])
    assert marks[0].event == {"recorded": True, "destroyed": True}
