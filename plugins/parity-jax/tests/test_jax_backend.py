"""The jax backend: registration through its entry point, options, buffers, both jit modes, and
whole decoder models compared node by node with the cpu oracle.

The op-by-op conformance suite runs from parity's own tests:
``python -m pytest tests/test_backend_ops.py --backend jax`` (jit = "graph");
``test_op_mode_conforms`` below runs one case per op (per weight type for MATMUL) under
jit = "op".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import numpy as np
import pytest

pytest.importorskip("jax")

from parity_jax import program, quant
from parity_jax.backend import JaxBackend

from parity.arch.decoder import build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu.backend import CpuBackend
from parity.conformance.compare_steps import compare_runtimes
from parity.conformance.harness import judge
from parity.conformance.suite import op_suite
from parity.core.backend import Device
from parity.core.config import load_config, make_backends
from parity.core.dtypes import DType
from parity.core.ir import Op
from parity.core.plugins import load_backends
from parity.core.runtime import Runtime
from parity.core.scheduler import schedule
from parity.core.tiers import backend_manifest
from parity.errors import BackendError, ConfigError

DEVICE = Device("jax")
PROMPT = np.array([5, 300, 42, 511, 0, 9], np.int32)
N_CTX = 64
STEP = GraphParams(n_tokens=1, n_ctx=N_CTX, output="argmax")  # one decode step, greedy


# -- registration and discovery ------------------------------------------------------------


def test_registers_through_the_parity_entry_point():
    (ep,) = [ep for ep in entry_points(group="parity") if ep.name == "jax"]
    assert ep.value == "parity_jax"
    registry = load_backends(env={"PARITY_PLUGINS": "jax"})
    assert registry.backends["jax"] is JaxBackend and registry.owners["jax"] == "jax"
    assert "jax" not in registry.broken


def test_registration_and_discovery_import_no_jax():
    code = textwrap.dedent("""
        import sys
        from parity.core.plugins import load_backends
        cls = load_backends(env={"PARITY_PLUGINS": "jax"}).get("jax")
        assert cls.available().ok
        (device,) = cls.devices()
        cls.score(device)
        assert "jax" not in sys.modules, "registering or discovering the backend imported jax"
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unavailable_without_jax_says_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    ok = JaxBackend.available()
    assert not ok.ok and "pip install" in ok.reason and "jax[cuda12]" in ok.reason


def test_scores_below_the_cpu_oracle_without_a_gpu_plugin(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert JaxBackend.score(DEVICE) < CpuBackend.score(Device("cpu"))


# -- the manifest ---------------------------------------------------------------------------


def test_manifest_declares_every_op_exact():
    manifest = backend_manifest(JaxBackend)
    assert set(manifest.tiers) == {op.name for op in Op if not op.is_leaf}
    assert manifest.all_exact


def test_every_decoder_node_is_placed_on_jax_under_exact_numerics():
    spec, weights = synthetic_model(tiny_spec("qwen2", n_layer=1), seed=1)
    graph = build_decoder(spec, GraphParams(n_tokens=2, n_ctx=N_CTX))
    backend = JaxBackend(DEVICE, numerics="exact")
    for node in graph:
        if not node.op.is_leaf:
            srcs = [graph.nodes[s] for s in node.src]
            assert backend.supports_op(node, srcs)
            assert backend.op_numerics(node, srcs) == "exact"
    plan = Runtime([backend, CpuBackend(Device("cpu"))], weights).plan(graph)
    assert len(plan.splits) == 1 and not plan.fallbacks


# -- options ----------------------------------------------------------------------------------


def test_jit_option_from_the_config_file(tmp_path):
    path = tmp_path / "parity.toml"
    path.write_text('backend = "jax"\n[backends.jax]\njit = "op"\n')
    backends = make_backends(load_config(path=path), load_backends(env={"PARITY_PLUGINS": "jax"}))
    assert [b.name for b in backends] == ["jax", "cpu"] and backends[0].jit == "op"


def test_jit_defaults_by_device_and_the_argument_wins():
    import jax

    assert JaxBackend(DEVICE).jit == ("op" if jax.devices()[0].platform == "cpu" else "graph")
    assert JaxBackend(DEVICE, jit="graph", options={"jit": "op"}).jit == "graph"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"options": {"jit": "whole"}}, r"\[backends.jax\] jit = 'whole': use one of graph, op"),
        ({"jit": "node"}, r"jit='node' \(argument\): use one of graph, op"),
        ({"options": {"jit": "op", "threads": 2}}, r"unknown option\(s\) threads"),
    ],
)
def test_bad_options_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        JaxBackend(DEVICE, **kwargs)


def test_a_device_jax_does_not_have_is_refused():
    with pytest.raises(BackendError, match="jax has no device 7"):
        JaxBackend(Device("jax", 7))


# -- buffers ----------------------------------------------------------------------------------


def test_upload_refills_the_same_buffer():
    backend = JaxBackend(DEVICE)
    buf = backend.alloc(DType.F32, (2, 3))
    out = np.full((2, 3), np.nan, np.float32)
    backend.download(buf, out)
    assert not out.any()  # zero-filled
    host = np.array([[1e-45, -0.0, 2], [3, 4, 5]], np.float32)  # a subnormal survives the trip
    backend.upload(buf, host)
    host[:] = 7  # the host array is the caller's to reuse
    backend.download(buf, out)
    assert out.tobytes() == np.array([[1e-45, -0.0, 2], [3, 4, 5]], np.float32).tobytes()
    with pytest.raises(BackendError, match="allocate a buffer of the host array's type"):
        backend.upload(buf, np.zeros((2, 3), np.int32))


def _prepared(backend: JaxBackend, graph, weights) -> tuple:
    """``graph`` as one split on ``backend``, weights registered: what a runtime would do."""
    (split,) = schedule(graph, [backend], strict=True).splits
    for i in split.inputs:
        if graph.nodes[i].op is Op.WEIGHT:
            backend.register_weight(weights[graph.nodes[i].arg])
    return split, backend.prepare(split)


@pytest.mark.parametrize("jit", ["graph", "op"])
def test_kv_states_update_in_place_and_outputs_are_stable(jit):
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=1), seed=2)
    backend = JaxBackend(DEVICE, jit=jit)
    step = build_decoder(spec, STEP)
    split, exe = _prepared(backend, step, weights)
    bound = {i: backend.alloc(step.nodes[i].dtype, step.nodes[i].shape) for i in split.inputs
             if step.nodes[i].op is not Op.WEIGHT}  # fmt: skip
    inputs = step.leaves(Op.INPUT)
    cache = bound[step.leaves(Op.STATE)["cache.k.0"]]
    rows = np.empty(cache.value.shape, np.float32)
    outputs = []
    for pos in range(3):
        for name, value in graph_inputs(PROMPT[pos : pos + 1], pos).items():
            backend.upload(bound[inputs[name]], value)
        outputs.append(backend.execute(exe, bound))
        backend.download(cache, rows)
        assert rows[: pos + 1].any() and not rows[pos + 1 :].any()  # row pos written, in place
    assert bound[step.leaves(Op.STATE)["cache.k.0"]] is cache
    assert all(outputs[2][i] is outputs[0][i] for i in outputs[0])  # the same output buffers


def test_compiled_programs_are_shared_by_structure():
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=2), seed=2)
    step = build_decoder(spec, STEP)
    _, exe = _prepared(JaxBackend(DEVICE, jit="op"), step, weights)
    assert len({id(c.fn) for c in exe.calls}) < len(exe.calls) / 2  # the layers share programs
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=1), seed=2)
    step = build_decoder(spec, STEP)
    _, first = _prepared(JaxBackend(DEVICE), step, weights)
    _, second = _prepared(JaxBackend(DEVICE), step, weights)
    assert second.calls[0].fn is first.calls[0].fn  # another plan of the step: no new compile


# -- ops and whole models against the oracle ----------------------------------------------------


def _one_case_per_op_and_matmul_type():
    """Both jit modes share every kernel; op mode adds program boundaries around each node."""
    seen, cases = set(), []
    for spec in op_suite():
        key = (spec.op, spec.type if spec.op == "MATMUL" else None)
        if key not in seen:
            seen.add(key)
            cases.append(spec)
    return cases


@pytest.mark.parametrize("spec", _one_case_per_op_and_matmul_type(), ids=lambda s: s.id)
def test_the_other_jit_mode_conforms(spec):
    """tests/test_backend_ops.py runs the whole suite in the device's default jit mode; here one
    case per op (and matmul type) runs in the other one."""
    import jax

    other = "graph" if jax.devices()[0].platform == "cpu" else "op"
    result = judge(lambda: JaxBackend(DEVICE, jit=other), spec.build())
    assert result.verdict == "exact", result.explain()


@pytest.mark.parametrize("jit", ["graph", "op"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_matches_the_oracle_node_by_node(arch, jit):
    """Prefill, then decode steps, each compared node by node: every node within its declared
    tier, which for this backend is bit-identical."""
    spec, weights = synthetic_model(tiny_spec(arch, n_layer=1), seed=4)
    cpu = Runtime([CpuBackend(Device("cpu"))], weights)
    jax_rt = Runtime([JaxBackend(DEVICE, jit=jit)], weights, strict=True)
    manifest = backend_manifest(JaxBackend)
    prefill = build_decoder(spec, GraphParams(n_tokens=len(PROMPT), n_ctx=N_CTX))
    step = build_decoder(spec, STEP)
    runs = [(prefill, graph_inputs(PROMPT, 0))]
    runs += [(step, graph_inputs(np.array([t]), len(PROMPT) + i)) for i, t in enumerate([3, 77])]
    for graph, inputs in runs:
        report = compare_runtimes(graph, inputs, cpu, jax_rt)
        for diff in report.nodes:
            node = graph.nodes[diff.node]
            tier = manifest.tier_of(node, [graph.nodes[s] for s in node.src])
            assert tier.admits(diff), report.summary()
        assert report.bit_identical, report.summary()


@pytest.fixture
def small_temporaries(monkeypatch):
    """Temporaries bounded to 1024 elements, so matmul and attention take their blocked paths
    (token blocks, weight column blocks); compiled programs are dropped on both sides."""
    monkeypatch.setattr(quant, "TEMP_ELEMENTS", 1 << 10)
    program.compiled.cache_clear()
    yield
    program.compiled.cache_clear()


@pytest.mark.parametrize(
    "case", ["matmul-Q4_1-48x512-t5", "matmul-F32-48x256-t1", "attention-14x2x64-p511-t2"]
)
def test_blocked_paths_give_the_same_bits(small_temporaries, case):
    (spec,) = [s for s in op_suite() if s.id == case]
    result = judge(lambda: JaxBackend(DEVICE, jit="op"), spec.build())
    assert result.verdict == "exact", result.explain()
