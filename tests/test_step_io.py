"""Step I/O a device can keep: host buffers the runtime owns, a decode step that allocates
nothing, greedy decode that moves one 4-byte id per step, inputs checked before any backend
sees them, weights registered at load (derived ones from metadata alone), caches zeroed on
the device, and captures that replay on the buffers bound at prepare."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import parity
from parity import quant
from parity.arch.decoder import DecoderGraphs, build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.backends.cpu import ops
from parity.backends.cpu.backend import CpuBackend
from parity.core import weights as weight_ops
from parity.core.backend import CaptureResult, Device, Executable
from parity.core.dtypes import DType
from parity.core.ir import Op
from parity.core.runtime import Runtime
from parity.errors import BackendError, ContextLengthError, InputError
from parity.generation.session import Session
from parity.gguf.writer import tiny_bpe_tokenizer

N_CTX = 128


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return synthetic_model(tiny_spec(request.param), seed=5)


class Counting(CpuBackend):
    """The cpu backend as a device: host<->device bytes, device copies and kernels counted."""

    name = "counting"

    def __init__(self, **kwargs):
        super().__init__(Device("counting"), **kwargs)
        self.up = self.down = self.copies = self.executes = self.zeroes = 0
        self.loaded: list[str] = []
        self.batches: list[list[str]] = []

    def upload(self, buffer, host):
        self.up += host.nbytes
        super().upload(buffer, host)

    def download(self, buffer, out):
        self.down += out.nbytes
        super().download(buffer, out)

    def copy_from(self, dst, src, source):
        self.copies += 1
        return super().copy_from(dst, src, source)

    def execute(self, executable):
        self.executes += 1
        super().execute(executable)

    def zero(self, buffer, dtype, shape):
        self.zeroes += 1
        super().zero(buffer, dtype, shape)

    def load_weight(self, weight):
        self.loaded.append(weight.name)

    def register_weights(self, weights, *, splits=(), progress=None):
        self.batches.append([w.name for w in weights])
        super().register_weights(weights, splits=splits, progress=progress)

    def moved(self) -> tuple[int, int]:
        """(bytes up, bytes down) since the last call."""
        up, down = self.up, self.down
        self.up = self.down = 0
        return up, down


def session_on(backend, model) -> Session:
    spec, weights = model
    return Session(Runtime([backend], weights), DecoderGraphs(spec), N_CTX, n_batch=16)


# -- 1. step I/O ----------------------------------------------------------------------------


def test_the_runtime_owns_each_steps_host_buffers(model):
    spec, weights = model
    runtime = Runtime([CpuBackend(Device("cpu"))], weights)
    graph = build_decoder(spec, GraphParams(n_tokens=3, n_ctx=N_CTX))
    step = runtime.step(graph)
    assert runtime.step(graph) is step  # prepared once
    assert set(step.inputs) == {"tokens", "positions"}
    assert step.inputs["tokens"].shape == (3,) and step.inputs["tokens"].dtype == np.int32
    (out,) = graph.outputs
    assert set(step.outputs) == {out} and step.outputs[out].shape == (1, spec.n_vocab)
    held = step.outputs[out]
    step.inputs["tokens"][...] = [3, 1, 4]
    step.inputs["positions"][...] = [0, 1, 2]
    step.run()
    want = runtime.run(graph, graph_inputs(np.array([3, 1, 4]), 0))[out]
    assert step.outputs[out] is held and held.tobytes() == want.tobytes()


class Measured(CpuBackend):
    """Marks where its kernels start and ends with a fresh tracemalloc peak, so that what a
    step's own code (runtime, session) allocates can be told from what the kernels use."""

    name = "measured"

    def __init__(self):
        super().__init__(Device("measured"))
        self.marks: list[int] = []

    def execute(self, executable):
        if tracemalloc.is_tracing():
            self.marks.append(tracemalloc.get_traced_memory()[1])
        super().execute(executable)
        if tracemalloc.is_tracing():
            tracemalloc.reset_peak()


ITERATORS = 512  # bytes: the few loop iterators a step keeps alive at once


@pytest.mark.parametrize(
    "greedy, queues", [(True, False), (True, True), (False, False)],
    ids=["greedy", "greedy-ahead", "sampled"],
)  # fmt: skip
def test_a_decode_step_allocates_nothing(model, greedy, queues):
    """64 decode steps through the session and the runtime: nothing they allocate outlives a
    step, and at no moment do they hold more than a few loop iterators (no dict, no list, no
    array a step builds for itself). What the cpu backend's kernels allocate inside a call
    (numba's scratch: a row's terms, attention's laid-out keys) is theirs and not counted.
    ``queues``: as on a GPU, each greedy step is started ahead."""
    backend = Measured()
    backend.queues = queues
    session = session_on(backend, model)
    token = session.prefill([5, 9, 13], greedy=greedy)

    def step(token: int) -> int:
        if greedy:
            return session.step(token, greedy=True)
        session.step(7, greedy=False)  # sampled: the host picks the token
        return 7

    for _ in range(4):  # warm: compiled, fed from the device, position kept there
        token = step(token)
    tracemalloc.start()
    try:
        token = step(token)  # what one step leaves for the next is traced from here on
        before = tracemalloc.take_snapshot()
        worst = 0
        for _ in range(64):
            backend.marks.clear()
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            token = step(token)
            peak = tracemalloc.get_traced_memory()[1]
            worst = max(worst, peak - base, *(m - base for m in backend.marks))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    ours = [tracemalloc.Filter(True, "*/parity/core/*"),
            tracemalloc.Filter(True, "*/parity/generation/*")]  # fmt: skip
    growth = after.filter_traces(ours).compare_to(before.filter_traces(ours), "lineno")
    assert sum(max(s.size_diff, 0) for s in growth) == 0, growth[:3]
    assert worst <= ITERATORS, f"a step held {worst} bytes of its own"


def test_greedy_decode_moves_one_token_id_a_step(model):
    """Greedy decode on a device: the token of step t reaches step t+1 on the device and the
    position advances there, so each step reads back 4 bytes and uploads nothing."""
    backend = Counting()
    session = session_on(backend, model)
    token = session.prefill([5, 9, 13, 2], greedy=True)
    backend.moved()
    token = session.step(token, greedy=True)  # the first step sets its position: 4 bytes up
    assert backend.moved() == (4, 4)
    for _ in range(16):
        copies = backend.copies
        token = session.step(token, greedy=True)
        assert backend.moved() == (0, 4) and backend.copies == copies + 1  # id moved on device
    # and it is the greedy sequence the host-fed steps give
    reference = session_on(CpuBackend(Device("cpu")), model)
    want = [reference.prefill([5, 9, 13, 2], greedy=True)]
    for _ in range(17):
        want.append(reference.step(want[-1], greedy=True))
    assert list(session.tokens[4:]) == want[:-1] and token == want[-1]


def test_sampled_decode_moves_its_token_up_and_its_logits_down(model):
    spec, _ = model
    backend = Counting()
    session = session_on(backend, model)
    session.prefill([5, 9, 13], greedy=False)
    session.step(7, greedy=False)
    backend.moved()
    session.step(8, greedy=False)
    assert backend.moved() == (4, 4 * spec.n_vocab)  # the id up; the position stays on device


@pytest.mark.parametrize("marks", [True, False])
def test_downloads_wait_for_one_wait_a_step(model, marks):
    """A greedy step waits once, for its own work only where the backend has marks (the
    step queued after it still in flight, its download not landed), else for everything."""
    backend = Queued(marks=marks)
    session = session_on(backend, model)
    want = session_on(CpuBackend(Device("cpu")), model)
    got = [session.prefill([3, 4], greedy=True)]
    ref = [want.prefill([3, 4], greedy=True)]
    syncs, waits = backend.syncs, backend.waits
    for _ in range(5):
        got.append(session.step(got[-1], greedy=True))
        ref.append(want.step(ref[-1], greedy=True))
        assert len(backend.pending) == (2 if marks else 1)  # the steps queued ahead
    assert got == ref
    assert (backend.waits, backend.syncs) == ((waits + 5, syncs) if marks else (waits, syncs + 5))


class Queued(Counting):
    """Downloads land only when waited for, as on a CUDA stream; it says it queues, so greedy
    sessions start the next steps before handing a token back; with ``marks`` a step waits
    for the downloads queued before its mark (a CUDA event), else synchronize lands all. An
    upload's host array must stay as it was until its upload is waited for (a stream reads
    it later): checked then."""

    name = "queued"
    queues = True

    def __init__(self, marks=True):
        super().__init__()
        self.pending, self.syncs, self.waits, self.landed = [], 0, 0, 0
        self.sources, self.checked = [], 0  # uploads' host arrays as handed over, and checked
        self.marks = marks

    def upload(self, buffer, host):
        super().upload(buffer, host)
        self.sources.append((host, host.copy()))

    def download(self, buffer, out):
        self.down += out.nbytes
        self.pending.append((buffer.copy(), out))

    def _land(self, n, uploads):
        for value, out in self.pending[:n]:
            out[...] = value
        del self.pending[:n]
        self.landed += n
        fresh = max(0, uploads - self.checked)  # (a mark waited after a later one: none)
        for host, was in self.sources[:fresh]:
            assert host.tobytes() == was.tobytes(), "a host array changed before its upload ran"
        del self.sources[:fresh]
        self.checked = max(self.checked, uploads)

    def synchronize(self):
        self.syncs += 1
        self._land(len(self.pending), self.checked + len(self.sources))

    def new_mark(self):
        return [0, 0] if self.marks else None  # (downloads and uploads queued before it, ever)

    def place_mark(self, mark):
        if mark is not None:
            mark[:] = self.landed + len(self.pending), self.checked + len(self.sources)

    def wait_mark(self, mark):
        if mark is None:
            return self.synchronize()
        self.waits += 1
        self._land(mark[0] - self.landed, mark[1])


def _greedy(session, prompt, n):
    tokens = [session.prefill(prompt, greedy=True)]
    for _ in range(n):
        tokens.append(session.step(tokens[-1], greedy=True))
    return tokens


def test_greedy_decode_on_a_queue_keeps_two_steps_ahead(model):
    """Where the backend queues, the two steps after a greedy token are queued before the
    token is handed back (the first two right after the prefill), each fed by the one before
    it on the device, the two decode steps taking turns; the tokens are the same."""
    backend = Queued()
    session = session_on(backend, model)
    want = _greedy(session_on(CpuBackend(Device("cpu")), model), [5, 9, 13, 2], 12)
    first = session.prefill([5, 9, 13, 2], greedy=True)
    executes = backend.executes
    assert len(session._ahead) == 2  # the first two decode steps are already queued
    a, b = session._ahead
    assert a is not b
    got = [first]
    for i in range(12):
        got.append(session.step(got[-1], greedy=True))
        assert session._ahead == [(a, b)[(i + 1) % 2], (a, b)[i % 2]]  # taking turns
    assert got == want
    assert backend.executes == executes + 12  # each step once: those started ahead are used
    backend.moved()
    session.step(got[-1], greedy=True)
    assert backend.moved() == (0, 4)  # fed and positioned on the device, one id read back


def test_a_step_started_ahead_is_dropped_when_the_caller_goes_another_way(model):
    spec, _ = model
    prompt = [5, 9, 13, 2]
    session = session_on(Queued(), model)
    reference = session_on(CpuBackend(Device("cpu")), model)
    tokens = _greedy(session, prompt, 4)
    assert tokens == _greedy(reference, prompt, 4)
    forced = (tokens[-1] + 1) % spec.n_vocab  # not the token the step ahead was fed
    got = [session.step(forced, greedy=True) for forced in (forced,)]
    got.append(session.step(got[-1], greedy=True))
    want = [reference.step(forced, greedy=True)]
    want.append(reference.step(want[-1], greedy=True))
    assert got == want  # the dropped step's KV row was overwritten, never read
    logits = session.step(got[-1], greedy=False)  # logits after a step was started ahead
    assert logits.tobytes() == reference.step(want[-1], greedy=False).tobytes()
    again = _greedy(session, [7, 7, 1], 3)  # a new prompt, with a step in flight
    assert again == _greedy(reference, [7, 7, 1], 3)
    session.reset()
    assert _greedy(session, prompt, 2) == _greedy(reference, prompt, 2)


def test_no_step_starts_ahead_past_the_context_or_off_a_queue(model):
    spec, weights = model
    backend = Queued()
    session = Session(Runtime([backend], weights), DecoderGraphs(spec), 8, n_batch=4)
    reference = Session(
        Runtime([CpuBackend(Device("cpu"))], weights), DecoderGraphs(spec), 8, n_batch=4
    )
    got, want = _greedy(session, [3, 4, 5], 4), _greedy(reference, [3, 4, 5], 4)
    assert got == want and session.n_tokens == 7
    assert len(session._ahead) == 1  # position 7, the last the context holds
    got.append(session.step(got[-1], greedy=True))
    assert session.n_tokens == 8 and not session._ahead  # no room for another
    with pytest.raises(ContextLengthError):
        session.step(got[-1], greedy=True)
    want.append(reference.step(want[-1], greedy=True))
    assert got == want
    assert not reference._ahead  # the cpu backend computes on the spot: nothing ahead
    off = session_on(Queued(), model)
    off.look_ahead = False
    assert _greedy(off, [3, 4, 5], 4) == _greedy(session_on(Queued(), model), [3, 4, 5], 4)
    assert not off._ahead


# -- 2. inputs checked once -----------------------------------------------------------------


def test_inputs_are_checked_before_any_backend_sees_them(model):
    spec, weights = model
    backend = Counting()
    runtime = Runtime([backend], weights)
    prefill = build_decoder(spec, GraphParams(n_tokens=3, n_ctx=N_CTX))
    runtime.step(prefill)
    backend.moved()
    executes = backend.executes
    bad = {
        "token id past the vocabulary": graph_inputs(np.array([1, spec.n_vocab, 2]), 0),
        "a negative id": graph_inputs(np.array([1, -1, 2]), 0),
        "a position past the context": graph_inputs(np.array([1, 2, 3]), N_CTX - 2),
        "a repeated position": {"tokens": np.array([1, 2, 3]), "positions": np.array([4, 4, 5])},
    }
    for what, inputs in bad.items():
        with pytest.raises(InputError, match=r"input '(tokens|positions)'"):
            runtime.run(prefill, inputs)
        assert backend.moved() == (0, 0) and backend.executes == executes, what
    session = Session(runtime, DecoderGraphs(spec), N_CTX)
    with pytest.raises(InputError, match=r"outside 0\.\.511 \(the 512 rows of token_embd"):
        session.step(spec.n_vocab + 3, greedy=True)
    with pytest.raises(InputError, match=r"0\.\.511"):
        session.prefill([1, 2, spec.n_vocab], greedy=True)


def test_device_fed_inputs_stay_in_range_by_construction(model):
    spec, weights = model
    runtime = Runtime([CpuBackend(Device("cpu"))], weights)
    logits = runtime.step(build_decoder(spec, GraphParams(n_tokens=1, n_ctx=4)))
    decode = runtime.step(build_decoder(spec, GraphParams(n_tokens=1, n_ctx=4, output="argmax")))
    with pytest.raises(BackendError, match="cannot feed input 'tokens'"):
        decode.feed("tokens", logits)  # logits are no token ids
    decode.feed("tokens", decode)  # its own ARGMAX: in the vocabulary
    decode.inputs["positions"][0] = 0
    decode.keep("positions", advance=1)
    for _ in range(4):  # positions 0..3 fill the context
        decode.run()
    with pytest.raises(InputError, match="kept on the device would reach 4"):
        decode.run()


# -- 3. weights at load, derived weights, reset ---------------------------------------------


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    spec, weights = synthetic_model(tiny_spec("qwen2"), seed=2)
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    return write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer())


def test_every_weight_is_registered_at_load_in_one_batch(model_file):
    backend = Counting()
    progress = []
    model = parity.load(model_file, backends=[backend], n_ctx=64)
    assert len(backend.batches) == 1 and len(backend.loaded) == len(set(backend.loaded))
    assert set(backend.loaded) == {w for w, *_ in model.spec.weights}
    loaded = len(backend.loaded)
    gen = model.generate("hello there", max_tokens=6, temperature=0, ignore_eos=True).complete()
    model.generate("hello", max_tokens=3, temperature=0.7, seed=1).complete()
    assert len(gen.tokens) == 6 and len(backend.loaded) == loaded  # nothing in a request
    # the batch hook reports bytes as it goes
    fresh = Counting()
    runtime = Runtime([fresh], model.file.weights)
    graph = model.graphs(GraphParams(n_tokens=1, n_ctx=64))
    runtime.register([graph], progress=lambda name: lambda done, total: progress.append(
        (name, done, total)))  # fmt: skip
    total = sum(w.nbytes for w in model.file.weights.values())
    assert progress[-1] == ("counting", total, total) and len(progress) == len(fresh.loaded)


def test_a_slow_upload_shows_a_progress_line(model_file, capsys, monkeypatch):
    import parity.model as model_module

    monkeypatch.setattr(model_module, "PROGRESS_AFTER_S", 0)
    report = model_module._upload_progress("cuda:0")
    report(50 << 20, 100 << 20)
    report(100 << 20, 100 << 20)
    assert "weights to cuda:0" in capsys.readouterr().err


class Stacking(CpuBackend):
    """Builds gate and up stacked into one weight at load where metadata says it can, and runs
    the fused FFN on it: one product of twice the rows, split back (rows are independent, so
    the bits are the unfused composition's)."""

    name = "stacking"

    def __init__(self):
        super().__init__(Device("stacking"), kernels="numpy")
        self.stacked: dict[tuple[str, str], object] = {}
        self._by_forms: dict[tuple[int, int], object] = {}
        self.ops[Op.MATMUL_SWIGLU] = self._gate_up

    def rewrite(self, graph):
        from parity.core.fusion import fuse

        return fuse(graph, accept=self.supports_op, passes=("gate_up",))

    def register_weights(self, weights, *, splits=(), progress=None):
        super().register_weights(weights, splits=splits, progress=progress)
        for split in splits:
            for node in (split.graph.nodes[i] for i in split.nodes):
                if node.op is not Op.MATMUL_SWIGLU:
                    continue
                gate, up = (self.weights[split.graph.nodes[s].arg] for s in node.src[1:])
                key = (gate.name, up.name)
                if key in self.stacked or not weight_ops.can_concat_rows([gate, up]):
                    continue
                both = weight_ops.concat_rows(f"{gate.name}+{up.name}", [gate, up])
                self.stacked[key] = both
                forms = (
                    id(self.weight(gate.name, "prepared")),
                    id(self.weight(up.name, "prepared")),
                )
                self._by_forms[forms] = quant.prepare_weight(both.dtype, both.raw(), both.shape)

    def _gate_up(self, x, w_gate, w_up, arg=None):
        both = self._by_forms.get((id(w_gate), id(w_up)))
        if both is None:
            return ops.matmul_swiglu(x, w_gate, w_up)
        y = ops.matmul(x, both)  # (T, 2N): gate's rows, then up's
        n = w_gate.shape[0]
        return ops.swiglu(np.ascontiguousarray(y[:, :n]), np.ascontiguousarray(y[:, n:]))


def test_derived_weights_are_built_at_load_from_metadata_alone(monkeypatch):
    """gate and up stacked at load where their types agree; where they do not, the question
    is answered from dtypes and shapes and nothing is built to be thrown away."""
    spec = tiny_spec("llama")
    spec, weights = synthetic_model(spec, seed=4, layer_types={1: {"ffn": DType.Q8_0}})
    weights = dict(weights)
    weights["blk.1.ffn_up.weight"] = synthetic_model(spec, seed=4, types={"ffn": DType.Q4_0})[1][
        "blk.1.ffn_up.weight"
    ]
    spec = spec.with_weights(weights.values())
    built = []
    real = weight_ops.concat_rows
    monkeypatch.setattr(
        weight_ops, "concat_rows", lambda name, ws: built.append(name) or real(name, ws)
    )
    backend = Stacking()
    runtime = Runtime([backend], weights)
    graphs = DecoderGraphs(spec)
    runtime.register([graphs(GraphParams(n_tokens=1, n_ctx=16))])
    assert built == ["blk.0.ffn_gate.weight+blk.0.ffn_up.weight"]  # layer 1: Q8_0 gate, Q4_0 up
    both = backend.stacked["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]
    gate, up = weights["blk.0.ffn_gate.weight"], weights["blk.0.ffn_up.weight"]
    assert both.shape == (2 * gate.shape[0], gate.shape[1])
    assert both.raw().tobytes() == gate.raw().tobytes() + up.raw().tobytes()
    with pytest.raises(ValueError, match="differ in type or row length"):
        real("x", [weights["blk.1.ffn_gate.weight"], weights["blk.1.ffn_up.weight"]])
    # the stacked product gives the unfused oracle's bits
    graph = graphs(GraphParams(n_tokens=3, n_ctx=16))
    inputs = graph_inputs(np.array([4, 8, 15]), 0)
    oracle = Runtime([CpuBackend(Device("cpu"), kernels="definition")], weights)
    (out,) = graph.outputs
    assert runtime.run(graph, inputs)[out].tobytes() == oracle.run(graph, inputs)[out].tobytes()


def test_reset_zeroes_caches_on_the_device(model):
    backend = Counting()
    session = session_on(backend, model)
    session.prefill([1, 2, 3], greedy=True)
    backend.moved()
    session.runtime.reset()
    states = session.runtime.states
    assert backend.moved() == (0, 0) and backend.zeroes == len(states) > 0
    assert all(not s.buffers["counting"].any() for s in states.values())


# -- capture --------------------------------------------------------------------------------


class Graphs(CpuBackend):
    """Captures like CUDA graphs do: the replay is bound to the captured executable's memory,
    which it checks at every replay."""

    name = "graphs"

    def __init__(self):
        super().__init__(Device("graphs"))
        self.replays = 0

    def capture(self, exe):
        replay = Executable(exe.split, exe.inputs, exe.outputs)
        replay.eager = exe
        replay.addresses = {
            i: b.ctypes.data for i, b in (*exe.inputs.items(), *exe.outputs.items())
        }
        return CaptureResult(executable=replay)

    def execute(self, exe):
        if not hasattr(exe, "eager"):
            return super().execute(exe)
        now = {i: b.ctypes.data for i, b in (*exe.inputs.items(), *exe.outputs.items())}
        assert now == exe.addresses, "a buffer moved after capture"
        self.replays += 1
        super().execute(exe.eager)


def _addresses(exe):
    return {i: b.ctypes.data for i, b in (*exe.inputs.items(), *exe.outputs.items())}


def test_decode_is_captured_verified_and_replayed(model_file):
    backend = Graphs()
    model = parity.load(model_file, backends=[backend], n_ctx=64, verify_capture=True)
    want = parity.load(model_file, backends=[CpuBackend(Device("cpu"))], n_ctx=64)
    got = model.generate("abc", max_tokens=12, temperature=0, ignore_eos=True).complete()
    ref = want.generate("abc", max_tokens=12, temperature=0, ignore_eos=True).complete()
    assert got.tokens == ref.tokens and backend.replays >= 8
    decode = model.session.decode_graph(True, 0)
    assert model.runtime.capture_status(decode) == [""]


class Snapshotting(Graphs):
    """A broken capture: its replay reads copies of the inputs made at capture time (stale
    data on the very buffers), which only a replay on new inputs can show."""

    name = "snapshotting"

    def capture(self, exe):
        result = super().capture(exe)
        result.executable.frozen = {i: b.copy() for i, b in exe.inputs.items()}
        return result

    def execute(self, exe):
        if not hasattr(exe, "eager"):
            return super().execute(exe)
        live = {i: b.copy() for i, b in exe.inputs.items()}
        for i, b in exe.frozen.items():
            exe.inputs[i][...] = b
        super().execute(exe)
        for i, b in live.items():
            exe.inputs[i][...] = b


def test_verify_checks_a_capture_on_the_next_steps_inputs(model):
    spec, weights = model
    graph = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=16, output="argmax"))
    want = Runtime([CpuBackend(Device("cpu"))], weights)
    runtime = Runtime([Snapshotting()], weights, verify_capture=True)
    for p in range(6):
        inputs = graph_inputs(np.array([(7 * p) % spec.n_vocab]), p)
        got, ref = (rt.run(graph, inputs)[graph.outputs[0]] for rt in (runtime, want))
        assert got.tobytes() == ref.tobytes(), p
    (reason,) = runtime.capture_status(graph)
    assert "captured replay differs from eager" in reason


def test_a_released_step_cannot_run_and_a_session_renews_its_steps(model):
    session = session_on(CpuBackend(Device("cpu")), model)
    old = session._decode[(True, 0)]
    token = session.prefill([1, 2, 3], greedy=True)
    session.runtime.clear_states()  # e.g. to change the context size
    with pytest.raises(BackendError, match="this step was released"):
        old.run()
    session.reset()
    got = [session.prefill([1, 2, 3], greedy=True)]
    got.append(session.step(got[-1], greedy=True))
    fresh = session_on(CpuBackend(Device("cpu")), model)
    ref = [fresh.prefill([1, 2, 3], greedy=True)]
    ref.append(fresh.step(ref[-1], greedy=True))
    assert got == ref and token == ref[0] and session._decode[(True, 0)] is not old


def test_run_feeds_every_given_input_from_the_host(model):
    spec, weights = model
    runtime = Runtime([CpuBackend(Device("cpu"))], weights)
    graph = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=16, output="argmax"))
    step = runtime.step(graph)
    step.inputs["tokens"][0], step.inputs["positions"][0] = 3, 0
    step.keep("positions", advance=1)
    step.run()
    with pytest.raises(InputError, match="input 'positions' holds 99"):
        runtime.run(graph, graph_inputs(np.array([3]), 99))  # checked, not the kept value
    runtime.reset()
    a = runtime.run(graph, graph_inputs(np.array([3]), 0))[graph.outputs[0]]
    b = Runtime([CpuBackend(Device("cpu"))], weights).run(graph, graph_inputs(np.array([3]), 0))
    assert a.tobytes() == b[graph.outputs[0]].tobytes()


def test_a_step_feeding_another_is_not_evicted(model):
    spec, weights = model
    runtime = Runtime([CpuBackend(Device("cpu"))], weights, max_plans=2)
    graph = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=16, output="argmax"))
    decode = runtime.step(graph, pin=True)  # as a session holds its decode steps
    prefill = runtime.step(build_decoder(spec, GraphParams(n_tokens=2, n_ctx=16, output="argmax")))
    decode.feed("tokens", prefill)
    for n in (3, 4, 5):  # more graphs than the runtime keeps
        runtime.step(build_decoder(spec, GraphParams(n_tokens=n, n_ctx=16)))
    assert not prefill.released and prefill.dependents == 1
    decode.feed_host("tokens")
    assert prefill.dependents == 0


def test_a_bad_rewrite_is_named_with_what_is_wrong(model):
    spec, weights = model
    graph = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=16))

    class NoOrigin(CpuBackend):
        name = "noorigin"

        def rewrite(self, graph):
            return type(graph)(graph.nodes, graph.outputs)  # a copy, its origin forgotten

    with pytest.raises(BackendError, match=r"noorigin\.rewrite returned a graph without origin"):
        Runtime([NoOrigin(Device("x"))], weights).step(graph)


def test_an_input_nothing_reads_is_accepted(model):
    from parity.core.builder import GraphBuilder

    b = GraphBuilder()
    x = b.input("x", DType.F32, (2, 4))
    b.input("unused", DType.I32, (2,))
    graph = b.build(b.op(Op.ADD, x, x))
    out = Runtime([CpuBackend(Device("cpu"))], {}).run(
        graph, {"x": np.ones((2, 4), np.float32), "unused": np.zeros(2, np.int32)}
    )
    assert out[graph.outputs[0]].tolist() == [[2.0] * 4] * 2


@pytest.mark.parametrize("queued", [False, True])
def test_decode_across_the_shallow_reach_switches_graphs_and_keeps_the_tokens(
    model, queued, monkeypatch
):
    """With SHALLOW_REACH set, a session's decode steps at positions below it run graphs that
    promise so (GraphParams.reach); from there on the ones without. Greedy decoding across the
    switch (``queued``: with two steps started ahead, the first deep one fed on the device by
    the last shallow one) and a sampled step after it, then back below the reach (a prompt that
    reuses 21 cached tokens; a reset and a prompt of 23: the shallow steps' positions set
    again) give the tokens and logits of a session without the shallow graphs; each graph ran
    where it should (a shallow graph run at or past its reach is refused: the host checks)."""
    from parity.generation import session as sessions

    monkeypatch.setattr(sessions, "SHALLOW_REACH", 24)

    def decode(session: Session) -> tuple[list[int], np.ndarray]:
        tokens = _greedy(session, list(range(1, 20)), 10)  # positions 19 .. 28, across 24
        logits = session.step(tokens[-1], greedy=False).copy()
        tokens += _greedy(session, list(range(1, 20)) + tokens[:3], 6)  # (reuses 21: 22 .. 27)
        session.reset()
        tokens += _greedy(session, list(range(2, 25)), 4)  # 23 .. 26
        return tokens, logits

    backend = Queued() if queued else CpuBackend(Device("cpu"))
    session = session_on(backend, model)
    got = decode(session)
    assert set(session.decode_graphs) == {(g, r) for g in (False, True) for r in (24, 0)}
    shallow, deep = session.decode_graph(True, 23), session.decode_graph(True, 24)
    reaches = [{n.arg.reach for n in g.nodes if n.op is Op.ATTENTION} for g in (shallow, deep)]
    assert reaches == [{24}, {0}]
    assert len(session.greedy_steps) == (4 if queued else 2)
    for graph in (shallow, deep):
        session.runtime.capture_status(graph)  # (raises for a graph that never ran)
    if queued:  # the deep steps fed on the device, the first by the last shallow one
        assert all(session._fed_from[step] is not None for step in session.greedy_pair(24))
    assert len(sessions.session_graphs(session.graphs, N_CTX)) == 6
    monkeypatch.setattr(sessions, "SHALLOW_REACH", 0)  # (no shallow graphs)
    plain = session_on(CpuBackend(Device("cpu")), model)
    assert set(plain.decode_graphs) == {(False, 0), (True, 0)}
    want = decode(plain)
    assert got[0] == want[0] and got[1].tobytes() == want[1].tobytes()


@pytest.mark.parametrize("queued", [False, True])
def test_a_one_token_prompt_runs_the_decode_graph_of_its_position(model, queued, monkeypatch):
    """A one-token prefill is a decode step: below SHALLOW_REACH it runs the shallow decode
    graph (which the decode steps there run, so a backend captures it early), past it the deep
    one; greedy decoding after it, across the reach, gives the tokens of a session without the
    shallow graphs."""
    from parity.generation import session as sessions

    monkeypatch.setattr(sessions, "SHALLOW_REACH", 24)
    backend = Queued() if queued else CpuBackend(Device("cpu"))
    session = session_on(backend, model)
    shallow, deep = session._steps_at[24][True], session._steps_at[0][True]
    got = [session.prefill([7], greedy=True)]
    assert (shallow.runs, deep.runs) == (2 if queued else 1, 0)  # (queued: the step at 2 too)
    for _ in range(28):  # positions 1 .. 28, across 24
        got.append(session.step(got[-1], greedy=True))
    held = session.tokens.tolist()
    runs = deep.runs
    got.append(session.prefill([*held, got[-1]], greedy=True))  # (reuses 29: a token at 29)
    assert deep.runs == runs + (2 if queued else 1) and session.reused == len(held)
    monkeypatch.setattr(sessions, "SHALLOW_REACH", 0)
    plain = session_on(CpuBackend(Device("cpu")), model)
    want = [plain.prefill([7], greedy=True)]
    for _ in range(28):
        want.append(plain.step(want[-1], greedy=True))
    want.append(plain.prefill([*plain.tokens.tolist(), want[-1]], greedy=True))
    assert got == want


def test_a_reach_must_cover_the_step(model):
    """GraphParams.reach covers the step's tokens and lies within the context; a graph run at a
    position at or past its reach is refused on the host (a GPU kernel would trap)."""
    GraphParams(n_tokens=1, n_ctx=64, reach=64)
    with pytest.raises(ValueError, match="reach"):
        GraphParams(n_tokens=8, n_ctx=64, reach=4)
    with pytest.raises(ValueError, match="reach"):
        GraphParams(n_tokens=1, n_ctx=64, reach=65)
    spec, weights = model
    graph = DecoderGraphs(spec)(GraphParams(n_tokens=1, n_ctx=N_CTX, output="argmax", reach=24))
    runtime = Runtime([CpuBackend(Device("cpu"))], weights)
    runtime.run(graph, graph_inputs(np.array([3]), 23))
    with pytest.raises(InputError, match="below 24 this graph reaches"):
        runtime.run(graph, graph_inputs(np.array([3]), 24))
