"""The jax backend: registration through its entry point, options, buffers and the device-side
slots of plugin API 2 (zero, increment, copy_from, asynchronous download), both jit modes, the
fused ops and quantized activations, and whole decoder models (as written and fused) compared
node by node with the cpu oracle.

The op-by-op conformance suite runs from parity's own tests:
``python -m pytest tests/test_backend_ops.py --backend jax`` (the device's default jit mode);
``test_the_other_jit_mode_conforms`` below runs one case per op (per weight type for the
matrix products) in the other mode, and ``test_fused_op_conforms`` more cases of the fused ops
and of quantized activations in both.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from importlib.metadata import entry_points

import numpy as np
import pytest

pytest.importorskip("jax")

from parity_jax import program, quant
from parity_jax.backend import JaxBackend

from parity import quant as oracle_quant
from parity.arch.decoder import build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu.backend import CpuBackend
from parity.conformance.case import Case
from parity.conformance.harness import judge
from parity.conformance.suite import activations, op_suite
from parity.core.backend import Device, Executable
from parity.core.builder import GraphBuilder
from parity.core.compare import diff_arrays
from parity.core.config import load_config
from parity.core.dtypes import DType, host_empty, host_zeros
from parity.core.fusion import fuse
from parity.core.ir import FUSED, MATMULS, Op
from parity.core.plugins import load_backends
from parity.core.runtime import Runtime
from parity.core.scheduler import schedule
from parity.core.selection import make_backends
from parity.core.tiers import backend_manifest
from parity.core.weights import WeightData
from parity.errors import BackendError, ConfigError
from parity.quant.synthetic import random_weight

DEVICE = Device("jax")
PROMPT = np.array([5, 300, 42, 511, 0, 9], np.int32)
N_CTX = 64
STEP = GraphParams(n_tokens=1, n_ctx=N_CTX, output="argmax")  # one decode step, greedy


def oracle() -> CpuBackend:
    """The conformance kit's oracle: the cpu backend's readable definition."""
    return CpuBackend(Device("cpu"), kernels="definition")


class FusingJax(JaxBackend):
    """The jax backend running every fusion of parity.core.fusion (its own rewrite is the
    identity): the fused ops and shared quantizations inside real models."""

    def rewrite(self, graph):
        return fuse(graph, accept=self.supports_op)


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


@pytest.mark.parametrize("fused", [False, True], ids=["as-written", "fused"])
def test_every_decoder_node_is_placed_on_jax_under_exact_numerics(fused):
    spec, weights = synthetic_model(tiny_spec("qwen2", n_layer=1), seed=1)
    graph = build_decoder(spec, GraphParams(n_tokens=2, n_ctx=N_CTX))
    backend = JaxBackend(DEVICE, numerics="exact")
    if fused:
        graph = fuse(graph, accept=backend.supports_op)
        assert set(FUSED) | {Op.QUANTIZE} <= {n.op for n in graph}
    assert backend.rewrite(graph) is graph  # the jax backend's own rewrite is the identity
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


def _read(backend: JaxBackend, buf, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    out = host_empty(dtype, shape)
    backend.download(buf, out)
    backend.synchronize()
    return out


def test_upload_refills_the_same_buffer():
    backend = JaxBackend(DEVICE)
    buf = backend.alloc(DType.F32, (2, 3))
    assert not _read(backend, buf, DType.F32, (2, 3)).any()  # zero-filled
    host = np.array([[1e-45, -0.0, 2], [3, 4, 5]], np.float32)  # a subnormal survives the trip
    backend.upload(buf, host)
    host[:] = 7  # the host array is the caller's to reuse
    got = _read(backend, buf, DType.F32, (2, 3))
    assert got.tobytes() == np.array([[1e-45, -0.0, 2], [3, 4, 5]], np.float32).tobytes()
    with pytest.raises(BackendError, match="use an array in the buffer's host layout"):
        backend.upload(buf, np.zeros((2, 3), np.int32))
    with pytest.raises(BackendError, match="use an array in the buffer's host layout"):
        backend.download(buf, np.zeros((3, 2), np.float32))


def test_download_lands_at_synchronize_with_the_value_it_was_called_on():
    backend = JaxBackend(DEVICE)
    buf = backend.alloc(DType.I32, (4,))
    backend.upload(buf, np.arange(4, dtype=np.int32))
    out = np.full(4, -1, np.int32)
    backend.download(buf, out)  # queued
    backend.upload(buf, np.full(4, 9, np.int32))  # later work does not change what it reads
    backend.synchronize()
    assert out.tolist() == [0, 1, 2, 3]
    assert _read(backend, buf, DType.I32, (4,)).tolist() == [9, 9, 9, 9]


def _q8a_host(x: np.ndarray) -> np.ndarray:
    """The host layout (Q8A_BLOCK records) of the oracle's quantization of ``x``."""
    q8 = oracle_quant.quantize_activations(x)
    host = host_empty(DType.Q8A, x.shape)
    host["q"], host["d"], host["s"] = q8.q.reshape(host["q"].shape), q8.d, q8.s
    return host


def test_q8a_buffers_hold_quantized_activations():
    backend = JaxBackend(DEVICE)
    shape = (3, 64)
    buf = backend.alloc(DType.Q8A, shape)
    assert _read(backend, buf, DType.Q8A, shape).tobytes() == host_zeros(DType.Q8A, shape).tobytes()
    host = _q8a_host(activations(np.random.default_rng(0), shape))
    backend.upload(buf, host)
    assert _read(backend, buf, DType.Q8A, shape).tobytes() == host.tobytes()
    other = backend.alloc(DType.Q8A, shape)
    assert backend.copy_from(other, buf, backend)
    backend.zero(buf, DType.Q8A, shape)
    assert not _read(backend, buf, DType.Q8A, shape)["q"].any()
    assert _read(backend, other, DType.Q8A, shape).tobytes() == host.tobytes()  # a copy
    with pytest.raises(BackendError, match="host layout"):
        backend.upload(buf, np.zeros(shape, np.float32))


def test_zero_increment_and_copy_from_stay_on_the_device(monkeypatch):
    backend = JaxBackend(DEVICE)
    state, pos, src = (backend.alloc(DType.F32, (4, 8)), backend.alloc(DType.I32, (1,)),
                       backend.alloc(DType.I32, (1,)))  # fmt: skip
    backend.upload(state, np.ones((4, 8), np.float32))
    backend.upload(pos, np.array([5], np.int32))
    backend.upload(src, np.array([42], np.int32))
    dst = backend.alloc(DType.I32, (1,))

    def no_host(*args):
        raise AssertionError("went through the host")

    with monkeypatch.context() as m:
        for name in ("upload", "download", "synchronize"):
            m.setattr(backend, name, no_host)
        backend.zero(state, DType.F32, (4, 8))
        backend.increment(pos, DType.I32, (1,), 1)
        backend.increment(pos, DType.I32, (1,), 2)
        assert backend.copy_from(dst, src, backend)
    assert dst.value is not src.value  # a new array: the caches an executable writes are donated
    assert not _read(backend, state, DType.F32, (4, 8)).any()
    assert _read(backend, pos, DType.I32, (1,)).tolist() == [8]
    assert _read(backend, dst, DType.I32, (1,)).tolist() == [42]
    cpu = CpuBackend(Device("cpu"))  # another backend's buffer goes through the host
    assert not backend.copy_from(dst, cpu.alloc(DType.I32, (1,)), cpu)
    with pytest.raises(BackendError, match="same type and shape"):
        backend.copy_from(dst, state, backend)


def _bound(backend: JaxBackend, graph, weights) -> tuple:
    """``graph`` as one split on ``backend``, weights registered and every input buffer bound:
    what a runtime does before a first step."""
    (split,) = schedule(graph, [backend], strict=True).splits
    backend.register_weights(
        [weights[graph.nodes[i].arg] for i in split.inputs if graph.nodes[i].op is Op.WEIGHT],
        splits=[split],
    )
    bound = {i: backend.alloc(graph.nodes[i].dtype, graph.nodes[i].shape) for i in split.inputs
             if graph.nodes[i].op is not Op.WEIGHT}  # fmt: skip
    return split, bound, backend.prepare(split, bound)


@pytest.mark.parametrize("jit", ["graph", "op"])
def test_kv_states_update_in_place_and_outputs_are_stable(jit):
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=1), seed=2)
    backend = JaxBackend(DEVICE, jit=jit)
    step = build_decoder(spec, STEP)
    split, bound, exe = _bound(backend, step, weights)
    assert isinstance(exe, Executable) and exe.inputs == bound
    assert set(exe.outputs) == set(split.outputs)
    outputs = dict(exe.outputs)
    inputs = step.leaves(Op.INPUT)
    cache = bound[step.leaves(Op.STATE)["cache.k.0"]]
    for i in split.outputs:
        node = step.nodes[i]
        if node.op is Op.KV_WRITE:  # a KV_WRITE's output buffer is its state's
            assert exe.outputs[i] is bound[node.src[0]]
    for pos in range(3):
        for name, value in graph_inputs(PROMPT[pos : pos + 1], pos).items():
            backend.upload(bound[inputs[name]], value)
        assert backend.execute(exe) is None
        rows = _read(backend, cache, DType.F32, cache.value.shape)
        assert rows[: pos + 1].any() and not rows[pos + 1 :].any()  # row pos written, in place
        (out,) = step.outputs
        token = _read(backend, exe.outputs[out], DType.I32, (1,))
        assert 0 <= token[0] < spec.n_vocab
    assert bound[step.leaves(Op.STATE)["cache.k.0"]] is cache
    assert all(exe.outputs[i] is b for i, b in outputs.items())  # the same output buffers


def test_prepare_refuses_a_split_without_its_buffers():
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=1), seed=2)
    backend = JaxBackend(DEVICE)
    step = build_decoder(spec, STEP)
    split, bound, _ = _bound(backend, step, weights)
    del bound[step.leaves(Op.INPUT)["tokens"]]
    with pytest.raises(BackendError, match="needs buffers for the split's inputs"):
        backend.prepare(split, bound)


def test_compiled_programs_are_shared_by_structure():
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=2), seed=2)
    step = build_decoder(spec, STEP)
    _, _, exe = _bound(JaxBackend(DEVICE, jit="op"), step, weights)
    assert len({id(c.fn) for c in exe.calls}) < len(exe.calls) / 2  # the layers share programs
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=1), seed=2)
    step = build_decoder(spec, STEP)
    _, _, first = _bound(JaxBackend(DEVICE), step, weights)
    _, _, second = _bound(JaxBackend(DEVICE), step, weights)
    assert second.calls[0].fn is first.calls[0].fn  # another plan of the step: no new compile


# -- ops and whole models against the oracle ----------------------------------------------------


def _one_case_per_op_and_matmul_type():
    """Both jit modes share every kernel; op mode adds program boundaries around each node.
    The matrix products (fused or not) once per weight type."""
    seen, cases = set(), []
    for spec in op_suite():
        if spec.op == "FUSION":  # patterns for a rewrite; jax runs graphs as written
            continue
        key = (spec.op, spec.type if Op[spec.op] in MATMULS else None)
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


class _Case:
    """A small graph with seeded leaf values, built into a conformance ``Case``."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.b = GraphBuilder()
        self.inputs: dict[str, np.ndarray] = {}
        self.weights: dict[str, WeightData] = {}

    def x(self, name: str, shape: tuple[int, int], quantized: bool = False):
        value = activations(self.rng, shape)
        if quantized:  # a Q8A input: the oracle's quantization of the values
            self.inputs[name] = _q8a_host(value)
            return self.b.input(name, DType.Q8A, shape)
        self.inputs[name] = value
        return self.b.input(name, DType.F32, shape)

    def w(self, name: str, dtype: DType, shape: tuple[int, ...]):
        data = random_weight(dtype, shape, self.rng, edge=True)
        self.weights[name] = WeightData(name, dtype, shape, data)
        return self.b.weight(name, dtype, shape)

    def case(self, id: str, *outputs) -> Case:
        return Case(id, self.b.build(*outputs), self.inputs, self.weights)


def _fused_cases() -> dict[str, Callable[[], Case]]:
    """QUANTIZE, MATMUL of quantized activations and every fused op, on float and quantized
    weights, with and without bias, for one token and several."""
    cases = {}

    def add(id, make):
        cases[id] = make

    for t in (1, 5):
        add(f"quantize-512-t{t}", lambda t=t: _quantize(t))
        for dtype in (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q8_0, DType.Q4_K, DType.Q6_K):
            add(f"matmul-q8a-{dtype.name}-48x512-t{t}", lambda d=dtype, t=t: _matmul_q8a(d, t))
        add(f"rms_norm_mul-576-t{t}", lambda t=t: _rms_norm_mul(t))
        for dtype, bias, q8a in ((DType.F32, True, False), (DType.F16, False, False),
                                 (DType.Q4_K, True, False), (DType.Q8_0, False, True)):  # fmt: skip
            tag = f"{dtype.name}{'-bias' if bias else ''}{'-q8a' if q8a else ''}"
            add(
                f"matmul_add-{tag}-t{t}",
                lambda d=dtype, b=bias, q=q8a, t=t: _matmul_add(d, b, q, t),
            )
        for dtype, q8a in ((DType.BF16, False), (DType.Q4_K, False), (DType.Q6_K, True)):
            tag = f"{dtype.name}{'-q8a' if q8a else ''}"
            add(f"matmul_swiglu-{tag}-t{t}", lambda d=dtype, q=q8a, t=t: _matmul_swiglu(d, q, t))
    add("shared-quantize-Q4_1-t3", _shared_quantization)
    return cases


def _quantize(t: int) -> Case:
    g = _Case(10 + t)
    return g.case(f"quantize-t{t}", g.b.op(Op.QUANTIZE, g.x("x", (t, 512))))


def _matmul_q8a(dtype: DType, t: int) -> Case:
    g = _Case(20 + t)
    return g.case("m", g.b.op(Op.MATMUL, g.x("x", (t, 512), quantized=True),
                              g.w("w", dtype, (48, 512))))  # fmt: skip


def _rms_norm_mul(t: int) -> Case:
    g = _Case(30 + t)
    x, w = g.x("x", (t, 576)), g.w("w", DType.F32, (576,))
    return g.case("n", g.b.op(Op.RMS_NORM_MUL, x, w, arg=float(np.float32(1e-5))))


def _matmul_add(dtype: DType, bias: bool, q8a: bool, t: int) -> Case:
    g = _Case(40 + t)
    k = 256
    srcs = [g.x("x", (t, k), quantized=q8a), g.w("w", dtype, (64, k))]
    if bias:
        srcs.append(g.w("bias", DType.F32, (64,)))
    return g.case("ma", g.b.op(Op.MATMUL_ADD, *srcs, g.x("r", (t, 64))))


def _matmul_swiglu(dtype: DType, q8a: bool, t: int) -> Case:
    g = _Case(50 + t)
    k = 256
    x = g.x("x", (t, k), quantized=q8a)
    return g.case("ms", g.b.op(Op.MATMUL_SWIGLU, x, g.w("gate", dtype, (96, k)),
                               g.w("up", dtype, (96, k))))  # fmt: skip


def _shared_quantization() -> Case:
    """One QUANTIZE read by a MATMUL, a MATMUL_ADD and a MATMUL_SWIGLU, as the fusion pass puts
    it into a layer; every node is judged, the Q8A value too."""
    g = _Case(60)
    k, dtype = 256, DType.Q4_1
    xq = g.b.op(Op.QUANTIZE, g.x("x", (3, k)))
    y = g.b.op(Op.MATMUL, xq, g.w("w", dtype, (32, k)))
    r = g.b.op(Op.MATMUL_ADD, xq, g.w("wo", dtype, (32, k)), y)
    f = g.b.op(Op.MATMUL_SWIGLU, xq, g.w("gate", dtype, (32, k)), g.w("up", dtype, (32, k)))
    return g.case("shared", g.b.op(Op.ADD, r, f), xq)


FUSED_CASES = _fused_cases()


@pytest.mark.parametrize("jit", ["graph", "op"])
@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_op_conforms(case, jit):
    """The fused ops and quantized activations, every node bit-exact, in both jit modes."""
    result = judge(lambda: JaxBackend(DEVICE, jit=jit), FUSED_CASES[case]())
    assert result.verdict == "exact", result.explain()


@pytest.mark.parametrize("jit", ["graph", "op"])
def test_non_finite_blocks_give_the_oracles_bits(jit):
    """A NaN or an infinity zeroes its block's quants and makes d and s NaN or inf (through a
    runtime: a Q8A output downloaded into its host records), and a MATMUL row reading one is
    NaN. XLA:CPU's vectorized max reduction drops a NaN at these sizes unless tested apart."""
    x = activations(np.random.default_rng(3), (7, 896))
    x[1, 40], x[2, 100], x[3, 7] = np.nan, np.inf, -np.inf
    b = GraphBuilder()
    xi = b.input("x", DType.F32, x.shape)
    quantized = b.op(Op.QUANTIZE, xi)
    y = b.op(Op.MATMUL, xi, b.weight("w", DType.Q4_0, (16, 896)))
    graph = b.build(quantized, y)
    w = random_weight(DType.Q4_0, (16, 896), np.random.default_rng(4))
    weights = {"w": WeightData("w", DType.Q4_0, (16, 896), w)}
    want, got = (Runtime([be], weights).run(graph, {"x": x})
                 for be in (oracle(), JaxBackend(DEVICE, jit=jit)))  # fmt: skip
    for i in graph.outputs:
        assert diff_arrays(i, "", want[i], got[i]).identical
        assert want[i].tobytes() == got[i].tobytes()
    blocks = got[graph.outputs[0]]
    assert (
        np.isnan(blocks["d"][1, 1]) and np.isinf(blocks["d"][2, 3]) and not blocks["q"][1, 1].any()
    )
    assert (
        np.isnan(got[graph.outputs[1]][1:4]).all() and not np.isnan(got[graph.outputs[1]][0]).any()
    )


def _compare(graph, inputs, reference: Runtime, candidate: Runtime, manifest) -> int:
    """Run ``graph`` on both runtimes with every computed node exposed and assert that each node
    the candidate kept is within its declared tier and bit-identical; the nodes compared."""
    computed = tuple(i for i, n in enumerate(graph.nodes) if not n.op.is_leaf)
    want = reference.run(graph, inputs, expose=computed)
    got = candidate.run(graph, inputs, expose=computed)
    ran = candidate.step(graph, computed).rewritten
    here = ran.rewritten()
    assert set(got) <= set(want) and set(graph.outputs) <= set(got)
    for i in got:
        node = ran.nodes[here[i]]
        diff = diff_arrays(i, node.op.name, want[i], got[i])
        tier = manifest.tier_of(node, [ran.nodes[s] for s in node.src])
        assert tier.admits(diff) and diff.identical, diff.describe()
    return len(got)


def _decode_runs(spec) -> list[tuple]:
    prefill = build_decoder(spec, GraphParams(n_tokens=len(PROMPT), n_ctx=N_CTX))
    step = build_decoder(spec, STEP)
    runs = [(prefill, graph_inputs(PROMPT, 0))]
    runs += [(step, graph_inputs(np.array([t]), len(PROMPT) + i)) for i, t in enumerate([3, 77])]
    return runs


@pytest.mark.parametrize("jit", ["graph", "op"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_matches_the_oracle_node_by_node(arch, jit):
    """Prefill, then decode steps, each compared node by node: every node within its declared
    tier, which for this backend is bit-identical."""
    spec, weights = synthetic_model(tiny_spec(arch, n_layer=1), seed=4)
    cpu = Runtime([oracle()], weights)
    jax_rt = Runtime([JaxBackend(DEVICE, jit=jit)], weights, strict=True)
    manifest = backend_manifest(JaxBackend)
    for graph, inputs in _decode_runs(spec):
        n_computed = sum(not n.op.is_leaf for n in graph)
        assert _compare(graph, inputs, cpu, jax_rt, manifest) == n_computed


@pytest.mark.parametrize("jit", ["graph", "op"])
def test_fused_decoder_matches_the_oracle_node_by_node(jit):
    """The same with every fusion of parity.core.fusion (fused ops, one QUANTIZE per shared x):
    each node that keeps its value after the rewrite is bit-identical to the unfused oracle's."""
    spec, weights = synthetic_model(tiny_spec("qwen2", n_layer=2), seed=5)
    cpu = Runtime([oracle()], weights)
    jax_rt = Runtime([FusingJax(DEVICE, jit=jit)], weights, strict=True)
    manifest = backend_manifest(JaxBackend)
    for graph, inputs in _decode_runs(spec):
        ops = {n.op for n in jax_rt.rewrite(graph)}
        assert set(FUSED) | {Op.QUANTIZE} <= ops, ops
        assert 0 < _compare(graph, inputs, cpu, jax_rt, manifest) < len(graph)


def test_greedy_decode_stays_on_the_device(monkeypatch):
    """Tokens fed from the last step's ARGMAX (copy_from) and positions kept and advanced on
    the device (increment): the same tokens as host-fed decoding on the oracle, with nothing
    uploaded after the first decode step and a reset (zero) starting the sequence over."""
    spec, weights = synthetic_model(tiny_spec("llama", n_layer=1), seed=6)
    prefill = build_decoder(spec, GraphParams(n_tokens=len(PROMPT), n_ctx=N_CTX, output="argmax"))
    decode = build_decoder(spec, STEP)
    cpu = Runtime([oracle()], weights)
    want = [int(cpu.run(prefill, graph_inputs(PROMPT, 0))[prefill.outputs[0]][-1])]
    for i in range(4):
        out = cpu.run(decode, graph_inputs(np.array(want[-1:]), len(PROMPT) + i))
        want.append(int(out[decode.outputs[0]][0]))

    backend = JaxBackend(DEVICE)
    rt = Runtime([backend], weights, strict=True)
    for _ in range(2):  # the second time after a reset: the caches zeroed on the device
        rt.reset()
        first = rt.step(prefill)
        for name, value in graph_inputs(PROMPT, 0).items():
            first.inputs[name][...] = value
        first.run()
        got = [int(first.outputs[prefill.outputs[0]][-1])]
        step = rt.step(decode, pin=True)
        step.feed("tokens", first)
        step.inputs["positions"][...] = len(PROMPT)
        step.keep("positions", advance=1)
        step.run()
        got.append(int(step.outputs[decode.outputs[0]][0]))
        step.feed("tokens", step)  # from now on each step reads the one before
        uploads = []
        with monkeypatch.context() as m:
            m.setattr(backend, "upload", lambda *args, u=uploads: u.append(args))
            for _ in range(3):
                step.run()
                got.append(int(step.outputs[decode.outputs[0]][0]))
        assert got == want and not uploads


@pytest.fixture
def small_temporaries(monkeypatch):
    """Temporaries bounded to 1024 elements, so matmul and attention take their blocked paths
    (token blocks, weight column blocks); compiled programs are dropped on both sides."""
    monkeypatch.setattr(quant, "TEMP_ELEMENTS", 1 << 10)
    program.compiled.cache_clear()
    program.kernel.cache_clear()
    yield
    program.compiled.cache_clear()
    program.kernel.cache_clear()


@pytest.mark.parametrize(
    "case", ["matmul-Q4_1-48x512-t5", "matmul-F32-48x256-t1", "attention-14x2x64-p511-t2"]
)
def test_blocked_paths_give_the_same_bits(small_temporaries, case):
    (spec,) = [s for s in op_suite() if s.id == case]
    result = judge(lambda: JaxBackend(DEVICE, jit="op"), spec.build())
    assert result.verdict == "exact", result.explain()


@pytest.mark.parametrize("case", ["matmul-q8a-Q6_K-48x512-t5", "matmul_swiglu-Q6_K-q8a-t5"])
def test_blocked_paths_of_quantized_activations_give_the_same_bits(small_temporaries, case):
    result = judge(lambda: JaxBackend(DEVICE, jit="op"), FUSED_CASES[case]())
    assert result.verdict == "exact", result.explain()
