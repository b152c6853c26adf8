"""Every op on every installed backend, judged by the conformance kit against the oracle (the
cpu backend's readable definition).

``--backend NAME`` selects the backend under test; backends that cannot run here (no GPU) skip.
On the cpu backend this checks its compiled numba kernels (its default) against the definition;
its numpy kernels get their own run.
"""

from __future__ import annotations

import pytest

from parity.backends.cpu.backend import CpuBackend
from parity.conformance.harness import judge
from parity.conformance.suite import op_suite
from parity.core.backend import Device
from parity.core.dtypes import WEIGHT_TYPES
from parity.core.ir import Op

SUITE = op_suite()


def test_suite_covers_every_op_and_weight_type():
    ops = {op.name for op in Op if not op.is_leaf} - {"KV_WRITE"}
    assert {s.op for s in SUITE} == ops | {"FUSION"}  # and patterns for a backend's rewrite
    for op in ("MATMUL_ADD", "MATMUL_SWIGLU"):
        assert {s.type for s in SUITE if s.op == op} == {t.name for t in WEIGHT_TYPES}
    quantized = {t.name for t in WEIGHT_TYPES if t.is_quantized}
    assert {s.type for s in SUITE if "q8x" in s.id} == quantized  # products of quantized x
    assert {s.type for s in SUITE if s.op == "FUSION"} == {"Q4_1", "Q5_0", "Q4_K", "Q8_0"}
    cases = [s.build() for s in SUITE if s.op == "ATTENTION"]
    assert all(any(n.op is Op.KV_WRITE for n in c.graph) for c in cases)  # inside attention
    for op in ("MATMUL", "GET_ROWS"):
        assert {s.type for s in SUITE if s.op == op} == {t.name for t in WEIGHT_TYPES}
    assert len({s.id for s in SUITE}) == len(SUITE)


@pytest.mark.parametrize("spec", SUITE, ids=[s.id for s in SUITE])
def test_op_conforms(backend_cls, spec):
    result = judge(lambda: backend_cls(backend_cls.devices()[0]), spec.build())
    if result.verdict == "unsupported":
        pytest.skip(result.explain())
    assert not result.failed, result.explain()


@pytest.mark.parametrize("spec", SUITE, ids=[s.id for s in SUITE])
def test_cpu_numpy_kernels_match_the_definition(spec):
    """The cpu backend's numpy kernels (the definition, the tiled attention, one quantization
    for products that share an x) give the definition's bits, its buffers guarded."""
    result = judge(lambda: CpuBackend(Device("cpu"), kernels="numpy"), spec.build())
    if result.verdict == "unsupported":  # a pattern whose fusion the numpy kernels don't make
        pytest.skip(result.explain())
    assert result.verdict == "exact", result.explain()
    assert result.guarded
