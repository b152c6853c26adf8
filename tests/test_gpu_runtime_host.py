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


# -- the kernels compile (NVRTC needs no GPU) -------------------------------------------------

KERNELS = [
    ("rows.cu", "rms_norm_f32"),
    ("rows.cu", "quantize_q8"),
    ("rows.cu", "rope_f32<1>"),
    ("rows.cu", "argmax_f32"),
    *(("rows.cu", f"get_rows<{t}>") for t in (0, 1, 30, 2, 3, 6, 8, 12, 14)),
    *(("matmul.cu", f"gemv_q<{t}, 1, 0>") for t in (2, 3, 6, 8, 12, 14)),
    ("matmul.cu", "gemv_q<3, 4, 4>"),
    ("matmul.cu", "gemv_f<1, 1, 2>"),
    ("matmul.cu", "gemm_q<14, 10, 1>"),
    ("matmul.cu", "gemm_q<12, 6, 4>"),
    ("attention.cu", "attention_rows<64>"),
    ("attention.cu", "attention_split_sums<64>"),
]


@pytest.fixture(scope="module")
def compiler():
    pytest.importorskip("cuda.bindings.nvrtc", reason="the CUDA Python bindings (NVRTC)")
    from parity.backends.cuda.nvrtc import Compiler

    return Compiler("sm_90", cache_dir=tempfile.mkdtemp(), notice=False)


def test_kernels_compile_for_sm90(compiler):
    from parity.backends.cuda.library import Library

    library = Library(None, compiler)
    library.ensure(KERNELS)
    for source, name in KERNELS:
        assert (source, name) in library._functions


def test_no_contraction_in_the_generated_code(compiler):
    """--fmad=false: no float multiply-add in the PTX of the kernels (rule 2)."""
    from cuda.bindings import nvrtc

    from parity.backends.cuda.library import sources

    cu, cuh = sources()
    for source in cu:
        _, program = nvrtc.nvrtcCreateProgram(
            cu[source].encode(), source.encode(), len(cuh),
            [v.encode() for v in cuh.values()], [k.encode() for k in cuh],
        )  # fmt: skip
        names = [n for s, n in KERNELS if s == source]
        for n in names:
            nvrtc.nvrtcAddNameExpression(program, n.encode())
        options = [o.encode() for o in compiler.options if not o.startswith("--gpu-arch")]
        options.append(b"--gpu-architecture=compute_90")
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)[:1]
        assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS
        _, size = nvrtc.nvrtcGetPTXSize(program)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(program, ptx)
        nvrtc.nvrtcDestroyProgram(program)
        text = ptx.decode()
        assert not re.search(r"\bfma\.\w*f32", text), source
        assert re.search(r"\b(mul|add)\.rn\.f32", text), source
