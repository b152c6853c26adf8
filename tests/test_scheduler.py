"""Scheduling over several backends: placement, fallback, strict mode, splits and copies, the
explain plan, and the runtime that executes plans (inputs, weights, states, capture)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from parity.arch.decoder import build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu.backend import CpuBackend
from parity.core.backend import CaptureResult, Device, Executable
from parity.core.ir import Op
from parity.core.runtime import Runtime
from parity.core.scheduler import schedule
from parity.errors import BackendError, GraphError, InputError, SchedulingError


class PartialBackend(CpuBackend):
    """Runs the cpu kernels, but claims only some ops: a stand-in for a young GPU backend."""

    name = "partial"
    claimed = frozenset({Op.GET_ROWS, Op.MATMUL, Op.ADD, Op.MUL, Op.RMS_NORM, Op.KV_WRITE})

    def __init__(self, device=None, **kw):
        super().__init__(device or Device("partial"), **kw)
        self.loaded, self.uploads, self.downloads = [], 0, 0

    def supports_op(self, node, srcs):
        return node.op in self.claimed

    def load_weight(self, weight):
        self.loaded.append(weight.name)

    def upload(self, buffer, host):
        self.uploads += 1
        super().upload(buffer, host)

    def download(self, buffer, out):
        self.downloads += 1
        super().download(buffer, out)


@pytest.fixture(scope="module")
def model():
    return synthetic_model(tiny_spec("qwen2"))


def cpu():
    return CpuBackend(Device("cpu"))


def prefill(spec, n=5, n_out=5):
    return build_decoder(spec, GraphParams(n_tokens=n, n_ctx=32, n_out=n_out))


TOKENS = np.array([3, 1, 4, 1, 5], np.int32)


def test_single_backend_is_one_split(model):
    spec, _ = model
    plan = schedule(prefill(spec), [cpu()])
    assert len(plan.splits) == 1 and not plan.fallbacks
    assert {(c.node, c.src) for c in plan.copies} == {(0, "host"), (1, "host")}  # the inputs
    assert plan.splits[0].outputs == plan.graph.outputs


def test_fallback_placement_splits_and_reasons(model):
    spec, _ = model
    g = prefill(spec)
    plan = schedule(g, [PartialBackend(), cpu()])
    for i, node in enumerate(g):
        if node.op.is_leaf and node.op is not Op.STATE:
            assert plan.placements[i] is None
        elif node.op in (Op.STATE, Op.KV_WRITE):
            # partial could write the cache, but its reader ATTENTION runs on cpu: the cache
            # stays with its reader instead of crossing backends every step
            assert plan.backend_of(i) == "cpu"
        else:
            want = "partial" if node.op in PartialBackend.claimed else "cpu"
            assert plan.backend_of(i) == want, node.op
    kv = next(i for i, n in enumerate(g) if n.op is Op.KV_WRITE)
    assert "with its readers" in plan.placements[kv].reason
    rope = next(i for i, n in enumerate(g) if n.op is Op.ROPE)
    assert plan.placements[rope].fallback
    assert "partial has no kernel for ROPE" in plan.placements[rope].reason
    # splits alternate and every cross-backend edge is one copy into the reading split
    backends = [s.backend for s in plan.splits]
    assert all(a != b for a, b in itertools.pairwise(backends))
    for c in plan.copies:
        assert c.dst == plan.splits[c.split].backend and c.node in plan.splits[c.split].inputs
    text = plan.explain(verbose=True)
    assert "fallback" in text and "ROPE" in text and f"{len(plan.splits)} split(s)" in text
    assert json.loads(plan.to_json())["fallbacks"] == len(plan.fallbacks)


def test_strict_mode_makes_fallback_an_error(model):
    spec, _ = model
    with pytest.raises(SchedulingError, match=r"strict mode: \d+ node\(s\) cannot run on partial"):
        schedule(prefill(spec), [PartialBackend(), cpu()], strict=True)
    schedule(prefill(spec), [cpu()], strict=True)  # nothing to fall back from


def test_no_backend_supports_a_node(model):
    spec, _ = model
    with pytest.raises(SchedulingError, match="no backend can run"):
        schedule(prefill(spec), [PartialBackend()])


def test_mixed_plan_is_bit_identical_to_cpu(model):
    spec, weights = model
    g = prefill(spec)
    ref = Runtime([cpu()], weights).run(g, graph_inputs(TOKENS, 0))
    partial = PartialBackend()
    mixed = Runtime([partial, cpu()], weights)
    got = mixed.run(g, graph_inputs(TOKENS, 0))
    (out,) = g.outputs
    assert got[out].tobytes() == ref[out].tobytes()
    assert partial.uploads > 0 and partial.downloads > 0  # values really crossed backends


def test_weights_register_once_across_graphs(model):
    spec, weights = model
    partial = PartialBackend()
    rt = Runtime([partial, cpu()], weights)
    rt.run(prefill(spec, n=3, n_out=1), graph_inputs(TOKENS[:3], 0))
    decode = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=32))
    for pos in range(3, 5):
        rt.run(decode, graph_inputs(TOKENS[pos : pos + 1], pos))
    assert len(partial.loaded) == len(set(partial.loaded)) > 0


def test_input_validation(model):
    spec, weights = model
    g = prefill(spec)
    rt = Runtime([cpu()], weights)
    good = graph_inputs(TOKENS, 0)
    with pytest.raises(BackendError, match="missing graph input"):
        rt.run(g, {"tokens": good["tokens"]})
    with pytest.raises(BackendError, match="unknown graph input"):
        rt.run(g, {**good, "temperature": np.float32(1)})
    with pytest.raises(BackendError, match=r"input 'tokens' must be int32\[5\]"):
        rt.run(g, {**good, "tokens": TOKENS[:4]})
    with pytest.raises(BackendError, match="must be int32"):
        rt.run(g, {**good, "positions": np.zeros(5, np.float32)})


def test_missing_weight_is_reported(model):
    spec, weights = model
    partial_weights = {k: v for k, v in weights.items() if k != "output_norm.weight"}
    with pytest.raises(BackendError, match=r"weight 'output_norm\.weight'"):
        Runtime([cpu()], partial_weights).run(prefill(spec), graph_inputs(TOKENS, 0))


def test_readback_into_caller_buffer_and_reset(model):
    spec, weights = model
    g = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=32))
    rt = Runtime([cpu()], weights)
    (out,) = g.outputs
    buf = np.empty(g.nodes[out].shape, np.float32)
    first = rt.run(g, graph_inputs(TOKENS[:1], 0), out={out: buf})
    assert first[out] is buf
    snapshot = buf.copy()
    rt.run(g, graph_inputs(TOKENS[1:2], 1), out={out: buf})
    rt.reset()
    again = rt.run(g, graph_inputs(TOKENS[:1], 0))
    assert again[out].tobytes() == snapshot.tobytes()


class Replay(Executable):
    """A captured executable: the eager one's very buffers (as capture must give them)."""

    def __init__(self, eager, broken=False):
        super().__init__(eager.split, eager.inputs, eager.outputs)
        self.eager, self.broken = eager, broken


class CapturingBackend(CpuBackend):
    name = "capturing"

    def __init__(self, broken_replay=False):
        super().__init__(Device("capturing"))
        self.captures = 0
        self.broken_replay = broken_replay

    def supports_op(self, node, srcs):
        return True

    def capture(self, exe):
        self.captures += 1
        return CaptureResult(executable=Replay(exe, self.broken_replay))

    def execute(self, exe):
        if not isinstance(exe, Replay):
            return super().execute(exe)
        super().execute(exe.eager)
        for buf in exe.outputs.values():
            if exe.broken and buf.dtype == np.float32:
                buf += np.float32(1)


def test_capture_after_third_run_and_verify(model):
    spec, weights = model
    g = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=32))
    backend = CapturingBackend()
    rt = Runtime([backend], weights, verify_capture=True)
    outs = [rt.run(g, graph_inputs(TOKENS[p : p + 1], p))[g.outputs[0]] for p in range(4)]
    assert backend.captures == 1 and rt.capture_status(g) == [""]
    ref_rt = Runtime([cpu()], weights)
    ref = [ref_rt.run(g, graph_inputs(TOKENS[p : p + 1], p))[g.outputs[0]] for p in range(4)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(outs, ref, strict=True))
    # a one-shot graph never pays for capture
    one_shot = prefill(spec)
    rt.run(one_shot, graph_inputs(TOKENS, 0))
    assert backend.captures == 1 and rt.capture_status(one_shot) == ["not run often enough yet"]


def test_capture_verification_rejects_a_bad_replay(model):
    spec, weights = model
    g = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=32))
    rt = Runtime([CapturingBackend(broken_replay=True)], weights, verify_capture=True)
    for p in range(4):
        rt.run(g, graph_inputs(TOKENS[p : p + 1], p))
    (reason,) = rt.capture_status(g)
    assert "captured replay differs from eager" in reason


def test_backend_without_capture_says_why(model):
    spec, weights = model
    g = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=32))
    rt = Runtime([cpu()], weights)
    for p in range(3):
        rt.run(g, graph_inputs(TOKENS[p : p + 1], p))
    assert rt.capture_status(g) == ["cpu does not capture graphs"]
    off = Runtime([cpu()], weights, capture=False)
    off.run(g, graph_inputs(TOKENS[:1], 0))
    assert off.capture_status(g) == ["capture is off"]


class GraphLikeBackend(CpuBackend):
    """Models a CUDA graph: a captured executable replays on the memory it saw at capture time,
    so it checks at every replay that the runtime still feeds it through those very buffers."""

    name = "graphlike"

    def __init__(self, broken_replay=False):
        super().__init__(Device("graphlike"))
        self.broken_replay = broken_replay
        self.released = 0
        self.replays = 0

    def supports_op(self, node, srcs):
        return True

    def capture(self, exe):
        replay = Replay(exe, self.broken_replay)
        replay.addresses = _addresses(exe)  # what a CUDA graph bakes in
        return CaptureResult(executable=replay)

    def execute(self, exe):
        if not isinstance(exe, Replay):
            return super().execute(exe)
        assert _addresses(exe) == exe.addresses, "a buffer moved after capture"
        self.replays += 1
        super().execute(exe.eager)
        for buf in exe.outputs.values():
            if exe.broken and buf.dtype == np.float32:
                buf += np.float32(1)

    def release(self, exe):
        self.released += 1


def _addresses(exe):
    return {i: b.ctypes.data for i, b in (*exe.inputs.items(), *exe.outputs.items())}


def decode_steps(runtime, spec, n=6):
    g = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=32))
    tokens = np.arange(n, dtype=np.int32) * 7 % spec.n_vocab
    return g, [runtime.run(g, graph_inputs(tokens[p : p + 1], p))[g.outputs[0]].copy()
               for p in range(n)]  # fmt: skip


@pytest.mark.parametrize("verify", [False, True])
def test_captured_replay_sees_stable_buffers(model, verify):
    spec, weights = model
    _, want = decode_steps(Runtime([cpu()], weights), spec)
    rt = Runtime([GraphLikeBackend()], weights, verify_capture=verify)
    g, got = decode_steps(rt, spec)
    assert rt.capture_status(g) == [""] and rt.backends[0].replays >= 3
    assert [a.tobytes() for a in got] == [b.tobytes() for b in want]


def test_bad_replay_is_caught_and_the_step_stays_correct(model):
    spec, weights = model
    _, want = decode_steps(Runtime([cpu()], weights), spec)
    backend = GraphLikeBackend(broken_replay=True)
    rt = Runtime([backend], weights, verify_capture=True)
    g, got = decode_steps(rt, spec)
    assert "captured replay differs from eager" in rt.capture_status(g)[0]
    assert backend.released == 1
    assert [a.tobytes() for a in got] == [b.tobytes() for b in want]


def test_reset_keeps_state_buffers_and_zeroes_them(model):
    spec, weights = model
    rt = Runtime([cpu()], weights)
    decode_steps(rt, spec, n=2)
    before = {name: s.buffers["cpu"] for name, s in rt.states.items()}
    assert any(b.any() for b in before.values())
    rt.reset()
    assert all(rt.states[n].buffers["cpu"] is b and not b.any() for n, b in before.items())


def test_state_size_mismatch_is_explained(model):
    spec, weights = model
    rt = Runtime([cpu()], weights)
    small = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=16))
    rt.run(small, graph_inputs(TOKENS[:1], 0))
    big = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=64))
    with pytest.raises(BackendError, match="must share n_ctx; call clear_states"):
        rt.run(big, graph_inputs(TOKENS[:1], 1))
    rt.clear_states()
    rt.run(big, graph_inputs(TOKENS[:1], 0))


def test_expose_only_computed_nodes(model):
    spec, weights = model
    g = prefill(spec)
    rt = Runtime([cpu()], weights)
    weight = next(iter(g.leaves(Op.WEIGHT).values()))
    for bad in (weight, len(g.nodes)):
        with pytest.raises(GraphError, match=f"cannot expose %{bad}"):
            rt.run(g, graph_inputs(TOKENS, 0), expose=[bad])


def test_integer_inputs_must_fit(model):
    spec, weights = model
    g = prefill(spec)
    tokens = TOKENS.astype(np.int64)
    tokens[0] = 2**32 + 3  # would wrap to token 3
    with pytest.raises(InputError, match="outside the int32 range"):
        Runtime([cpu()], weights).run(g, {"tokens": tokens, "positions": np.arange(5)})


def test_plans_are_evicted_and_released(model):
    spec, weights = model
    backend = GraphLikeBackend()
    rt = Runtime([backend], weights, max_plans=2)
    for n in (1, 2, 3):
        g = build_decoder(spec, GraphParams(n_tokens=n, n_ctx=32))
        rt.run(g, graph_inputs(TOKENS[:n], 0))
    assert len(rt._steps) == 2 and backend.released == 1


def test_one_backend_instance_serves_one_model(model):
    spec, weights = model
    _, other = synthetic_model(tiny_spec("qwen2"), seed=99)
    shared = cpu()
    g = prefill(spec)
    Runtime([shared], weights).run(g, graph_inputs(TOKENS, 0))
    Runtime([shared], weights).run(g, graph_inputs(TOKENS, 0))  # same weights: fine
    with pytest.raises(ValueError, match="serves one model"):
        Runtime([shared], other).run(g, graph_inputs(TOKENS, 0))


class FastOnlyMatmul(CpuBackend):
    name = "fastmm"
    numerics_modes = ("exact", "fast")

    def op_numerics(self, node, srcs):
        return "fast" if node.op is Op.MATMUL else "exact"


def test_exact_numerics_refuses_fast_only_ops(model):
    spec, _ = model
    g = prefill(spec)
    exact = schedule(g, [FastOnlyMatmul(Device("fastmm")), cpu()])
    mm = next(i for i, n in enumerate(g) if n.op is Op.MATMUL)
    assert exact.backend_of(mm) == "cpu"
    assert "computes MATMUL only in fast numerics" in exact.placements[mm].reason
    fast = schedule(g, [FastOnlyMatmul(Device("fastmm"), numerics="fast"), cpu()])
    assert fast.backend_of(mm) == "fastmm" and fast.placements[mm].numerics == "fast"
    exact_only = type("ExactOnly", (CpuBackend,), {"name": "x", "numerics_modes": ("exact",)})
    with pytest.raises(ValueError, match="offers numerics exact, not 'fast'"):
        exact_only(Device("x"), numerics="fast")
