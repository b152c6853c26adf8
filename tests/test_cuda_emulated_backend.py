"""The cuda backend without a GPU: its lowering, launches and CUDA C kernels run on the CPU in
the emulator (``tests/cuda_emulator``), judged bit for bit against the cpu oracle by the
conformance kit, case by case, and through whole tiny models (prefill on the int8 tensor-core
GEMM, whose mma the emulator computes from the PTX fragments, then decode).

The GPU runs the same code (tests/test_cuda_backend.py, `parity conformance cuda`); here a CI
machine without one catches a wrong fusion, index or barrier."""

from __future__ import annotations

from collections import Counter

import pytest
from cuda_emulator import compiler

from parity.conformance.suite import op_suite

pytestmark = [
    pytest.mark.skipif(compiler() is None, reason="no C++ compiler for the CUDA C emulator"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
torch = pytest.importorskip("torch")  # the backend's buffers (HostRuntime: CPU tensors)

# Cases that take the emulator over 5 s on a 2-core VM (each thread a fiber costs about a
# microsecond a barrier); smaller cases take the same kernels and launch paths, and `parity
# conformance cuda` runs them all on a GPU.
SLOW = {
    "matmul-Q4_K-896x4864-t7",
    "matmul-Q6_K-896x4864-t7",
    "matmul_add-Q6_K-896x4864-t7",
    "attention-9x3x64-p0-t300",
    "attention-14x2x64-p0-t300",
    "attention-window100-4x1x256-p0-t300",
    "attention-plain-window0-9x3x64-p100-t100",
    "attention-9x3x64-p8600-t1",
    "attention-14x2x64-p8600-t1",
    "fusion-ffn-Q4_1-576x1024-t7",
    "fusion-ffn-Q5_0-896x1024-t7",
}


def _backend():
    from cuda_emulator.backend import EmulatedCudaBackend

    from parity.core.backend import Device

    return EmulatedCudaBackend(Device("cuda", 0))


CASES = {spec.id: spec for spec in op_suite()}


@pytest.mark.parametrize("case", [c for c in CASES if c not in SLOW])
def test_conformance_case_is_bit_exact_in_the_emulator(case) -> None:
    from parity.conformance.harness import judge

    result = judge(_backend, CASES[case].build())
    assert result.verdict == "exact", result.explain()


WIDE = {"head_dim": 256, "n_head": 4, "n_head_kv": 1}  # Gemma 3 270M's heads


@pytest.mark.parametrize("arch, tiles, heads", [
    ("llama", False, {}), ("llama", True, {}), ("qwen2", True, {}), ("gemma3", False, {}),
    ("gemma3", True, WIDE),
])  # fmt: skip
def test_a_tiny_model_prefill_and_decode_are_bit_exact_in_the_emulator(
    arch, tiles, heads, monkeypatch
):
    """A 40-token prefill (the int8 tensor-core GEMM; prefill attention a block a KV head's
    query heads, or with ``tiles`` a block a tile of tokens) and two decode steps (GEMV, flash
    decoding): every node of every step bit-identical to the cpu oracle's, and the greedy
    tokens the same. ``heads``: the spec's head shape, if not the tiny one's."""
    from cuda_emulator.backend import EmulatedDriver

    from parity.arch.synthetic import synthetic_model, tiny_spec
    from parity.backends.cpu.backend import CpuBackend
    from parity.backends.cuda import lowering
    from parity.conformance.compare_steps import compare_steps
    from parity.core.backend import Device

    launched: Counter[str] = Counter()
    launch = EmulatedDriver.launch

    def counted(self, made, stream):
        launched[self.library.kernel(made.fn)[1].split("<")[0]] += 1
        launch(self, made, stream)

    monkeypatch.setattr(EmulatedDriver, "launch", counted)
    monkeypatch.setattr(lowering, "PREFILL_TILES", tiles)
    spec, weights = synthetic_model(tiny_spec(arch, n_ctx_train=1024, **heads), seed=5)
    prompt = [(7 * i) % 500 + 1 for i in range(40)]
    report = compare_steps(arch, spec, weights, prompt, 3, lambda: CpuBackend(Device("cpu")),
                           _backend)  # fmt: skip
    assert report.violation is None and report.first_divergent is None
    assert report.identical_share == 1.0 and report.tokens_agree == 3
    prefill = "attention_tiles" if tiles else "attention_rows_gqa"
    for kernel in ("gemm_mma", prefill, "gemv_q_multi", "attention_chunks"):
        assert launched[kernel] > 0, launched
