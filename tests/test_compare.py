"""Oracle comparison: ULP distance, per-node reports, and finding the first divergent node."""

from __future__ import annotations

import json

import numpy as np
import pytest
from faulty_backends import SloppyBackend

from parity.arch.decoder import build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu import ops
from parity.backends.cpu.backend import CpuBackend
from parity.conformance.compare_steps import compare_runtimes
from parity.core.backend import Device
from parity.core.compare import diff_arrays, ulp_distance
from parity.core.ir import Op
from parity.core.runtime import Runtime


def f32(*values):
    return np.array(values, dtype=np.float32)


def test_ulp_distance():
    one = f32(1.0)
    nxt = np.nextafter(one, f32(2.0))
    assert ulp_distance(one, nxt)[0] == 1
    assert ulp_distance(f32(0.0), f32(-0.0))[0] == 0
    tiny = f32(1e-45)  # the smallest subnormal: one step from zero on either side
    assert ulp_distance(tiny, -tiny)[0] == 2
    assert ulp_distance(f32(np.nan), f32(np.nan))[0] == 0
    assert ulp_distance(f32(np.nan), f32(1.0))[0] == np.inf
    # an infinity is a special value: against anything but itself it is infinitely far
    assert ulp_distance(f32(np.inf), f32(np.finfo(np.float32).max))[0] == np.inf
    assert ulp_distance(f32(np.inf, -np.inf), f32(np.inf, -np.inf)).tolist() == [0, 0]
    assert ulp_distance(f32(np.inf), f32(-np.inf))[0] == np.inf


def test_diff_arrays():
    a = f32(1.0, 2.0, 3.0)
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(3.0))
    d = diff_arrays(7, "ADD", a, b)
    assert (d.n_diff, d.max_ulp, d.identical) == (1, 1.0, False) and 0 < d.nmse < 1e-14
    ids = diff_arrays(0, "ARGMAX", np.array([1, 2]), np.array([1, 3]))
    assert ids.n_diff == 1 and ids.max_ulp == np.inf  # a wrong id is no small error
    # signed zeros are part of the contract: a differing sign is a difference, at 0 ULP
    zeros = diff_arrays(0, "ADD", f32(0.0, np.nan), f32(-0.0, np.nan))
    assert (zeros.n_diff, zeros.max_ulp, zeros.identical) == (1, 0.0, False)
    with pytest.raises(ValueError, match="shapes differ"):
        diff_arrays(0, "ADD", a, a[:2])


@pytest.fixture(scope="module")
def model():
    return synthetic_model(tiny_spec("llama"), seed=3)


def test_identical_backends_compare_bit_identical(model):
    spec, weights = model
    g = build_decoder(spec, GraphParams(n_tokens=4, n_ctx=16, n_out=4))
    inputs = graph_inputs(np.array([5, 6, 7, 8]), 0)
    cpu = CpuBackend(Device("cpu"))
    report = compare_runtimes(g, inputs, Runtime([cpu], weights), Runtime([cpu], weights))
    assert report.bit_identical and report.first_divergent is None
    assert len(report.nodes) == sum(not n.op.is_leaf for n in g)
    assert "100.0% bit-identical" in report.summary()


def test_first_divergent_node_is_the_faulty_op(model):
    spec, weights = model
    g = build_decoder(spec, GraphParams(n_tokens=4, n_ctx=16, n_out=4))
    inputs = graph_inputs(np.array([5, 6, 7, 8]), 0)
    report = compare_runtimes(
        g,
        inputs,
        Runtime([CpuBackend(Device("cpu"))], weights),
        Runtime([SloppyBackend(Device("cpu"))], weights),
    )
    first = report.first_divergent
    assert first is not None and first.op == "SWIGLU"
    first_swiglu = next(i for i, n in enumerate(g) if n.op is Op.SWIGLU)
    assert first.node == first_swiglu
    before = [d for d in report.nodes if d.node < first.node]
    assert before and all(d.identical for d in before)
    assert "first divergent node: %" in report.summary() and "SWIGLU" in report.summary()
    data = json.loads(report.to_json())
    assert data["first_divergent"]["node"] == first_swiglu and not data["bit_identical"]


def test_sloppy_silu_really_differs_from_the_contract():
    x = np.linspace(-20, 20, 4001, dtype=np.float32).reshape(1, -1)
    exact = ops.silu(x)
    sloppy = x / (np.float32(1) + np.exp(-x))
    assert exact.tobytes() != sloppy.astype(np.float32).tobytes()
