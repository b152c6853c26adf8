"""The cuda backend on a GPU: whole models bit for bit against the cpu oracle, batch invariance,
captured replays, and clear errors. Every test here carries the ``gpu`` marker and skips
cleanly where the backend cannot run (no torch, no driver, no GPU): CI has none. The per-op
conformance of the backend is tests/test_backend_ops.py's (``--backend cuda``)."""

from __future__ import annotations

import numpy as np
import pytest

from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu.backend import CpuBackend
from parity.backends.cuda.backend import CudaBackend
from parity.conformance.compare_steps import compare_steps
from parity.core.backend import Device
from parity.core.runtime import Runtime
from parity.errors import BackendError, InputError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not CudaBackend.available().ok, reason=f"cuda: {CudaBackend.available().reason}"
    ),
]


def cuda() -> CudaBackend:
    return CudaBackend(CudaBackend.devices()[0])


def cpu() -> CpuBackend:
    return CpuBackend(Device("cpu"))


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def model(request):
    spec, weights = synthetic_model(tiny_spec(request.param, n_ctx_train=2048), seed=5)
    return request.param, spec, weights


@pytest.mark.parametrize("prompt_len", [1, 7, 300, 600])
def test_every_node_and_token_matches_the_oracle(model, prompt_len):
    name, spec, weights = model
    rng = np.random.default_rng(prompt_len)
    prompt = [int(t) for t in rng.integers(0, spec.n_vocab, prompt_len)]
    report = compare_steps(name, spec, weights, prompt, 64, cpu, cuda)
    assert report.violation is None, report.summary()
    assert report.first_divergent is None, report.summary()
    assert report.identical_share == 1.0
    assert report.tokens_agree == 64


def _logits(runtime: Runtime, graphs, tokens: list[int], start: int) -> np.ndarray:
    from parity.arch.decoder import graph_inputs
    from parity.arch.params import GraphParams

    graph = graphs(GraphParams(n_tokens=len(tokens), n_ctx=1024, n_out=len(tokens)))
    step = runtime.step(graph, ())
    step.write(graph_inputs(np.asarray(tokens, np.int32), start))
    step.run()
    return step.outputs[graph.outputs[0]].copy()


def test_batch_invariance_prefill_of_one_and_of_512_and_decode(model):
    from parity.arch.decoder import DecoderGraphs

    _, spec, weights = model
    graphs = DecoderGraphs(spec)
    rng = np.random.default_rng(1)
    tokens = [int(t) for t in rng.integers(0, spec.n_vocab, 512)]
    rt = Runtime([cuda()], weights)
    whole = _logits(rt, graphs, tokens, 0)  # one 512-token prefill
    rt.reset()
    first = _logits(rt, graphs, tokens[:1], 0)  # a 1-token prefill ...
    assert first.tobytes() == whole[:1].tobytes()
    for p in range(1, 40):  # ... then decode steps, token by token
        row = _logits(rt, graphs, tokens[p : p + 1], p)
        assert row.tobytes() == whole[p : p + 1].tobytes(), f"position {p}"


def test_a_captured_replay_equals_eager(model):
    from parity.arch.decoder import DecoderGraphs, graph_inputs
    from parity.arch.params import GraphParams

    _, spec, weights = model
    graphs = DecoderGraphs(spec)
    graph = graphs(GraphParams(n_tokens=1, n_ctx=256, output="argmax"))
    runs = {}
    for capture in (False, True):
        rt = Runtime([cuda()], weights, capture=capture, verify_capture=True)
        step = rt.step(graph, ())
        got = []
        for p in range(12):
            step.write(graph_inputs(np.asarray([(7 * p) % spec.n_vocab], np.int32), p))
            step.run()
            got.append(int(step.outputs[graph.outputs[0]][0]))
        runs[capture] = got
        if capture:
            assert step.capture_status == [""], step.capture_status  # captured and verified
    assert runs[True] == runs[False]


def test_greedy_decode_two_steps_ahead_matches_the_oracle(model):
    """A session's greedy decode keeps two steps queued (two copies of the decode step take
    turns, each fed by the other on the device, each captured, each waiting for its own work
    by a CUDA event): the oracle's tokens, and again after a forced token drops the steps
    started ahead."""
    from parity.arch.decoder import DecoderGraphs
    from parity.generation.session import Session

    _, spec, weights = model
    syncs = {"steps 20-39": 0}

    def counted(sync):
        def synchronize() -> None:
            syncs["steps 20-39"] += 1
            sync()

        return synchronize

    def greedy(backend) -> tuple[Session, list[int]]:
        session = Session(Runtime([backend], weights), DecoderGraphs(spec), 256)
        tokens = [session.prefill([5, 9, 13, 2], greedy=True)]
        for i in range(40):
            if i == 20 and hasattr(backend, "rt"):  # (both copies captured and checked)
                sync = backend.rt.synchronize
                backend.rt.synchronize = counted(sync)
            tokens.append(session.step(tokens[-1], greedy=True))
        if hasattr(backend, "rt"):
            backend.rt.synchronize = sync
        tokens.append(session.step((tokens[-1] + 1) % spec.n_vocab, greedy=True))
        for _ in range(8):
            tokens.append(session.step(tokens[-1], greedy=True))
        return session, tokens

    session, got = greedy(cuda())
    assert len(session._ahead) == 2
    assert [step.capture_status for step in session.greedy_steps] == [[""], [""]]
    assert syncs == {"steps 20-39": 0}, "a step waited for the whole stream, not its event"
    assert got == greedy(cpu())[1]


def test_ids_out_of_range_are_refused_before_the_gpu_sees_them(model):
    from parity.arch.decoder import DecoderGraphs, graph_inputs
    from parity.arch.params import GraphParams

    _, spec, weights = model
    graph = DecoderGraphs(spec)(GraphParams(n_tokens=2, n_ctx=64))
    step = Runtime([cuda()], weights).step(graph, ())
    step.write(graph_inputs(np.asarray([1, spec.n_vocab], np.int32), 0))
    with pytest.raises(InputError, match="outside"):
        step.run()


def test_gpu_out_of_memory_is_one_clear_error(model):
    from parity.arch.decoder import DecoderGraphs
    from parity.arch.params import GraphParams

    _, spec, weights = model
    graph = DecoderGraphs(spec)(GraphParams(n_tokens=1, n_ctx=1 << 30))
    with pytest.raises(BackendError, match="GPU out of memory"):
        Runtime([cuda()], weights).step(graph, ())


@pytest.mark.parametrize("half", [False, True])
def test_fast_products_on_the_tensor_cores_keep_their_tiers_and_capture(half, model, monkeypatch):
    """FAST_GEMM under numerics = "fast" (cuBLAS's TF32 GEMM through torch, or with ``half``
    its float16 one, gemm_mma for flagged rows): a 300-token prompt and its decode steps
    within every node's tier (compare_steps), a captured 64-token prefill verified against
    eager, and torch's TF32 switch left as it was."""
    import torch

    from parity.arch.decoder import DecoderGraphs, graph_inputs
    from parity.arch.params import GraphParams
    from parity.backends.cuda import lowering
    from parity.backends.gpu.runtime import GpuRuntime

    monkeypatch.setattr(lowering, "FAST_GEMM", True)
    monkeypatch.setattr(lowering, "FAST_GEMM_MIN_ELEMENTS", 0)  # (a tiny model's products)
    monkeypatch.setattr(lowering, "FAST_GEMM_HALF", half)
    before = torch.get_float32_matmul_precision()
    gemms = []
    matmul = GpuRuntime.matmul

    def counted(self, *args) -> None:
        gemms.append(args[1].dtype)
        matmul(self, *args)

    monkeypatch.setattr(GpuRuntime, "matmul", counted)

    def fast() -> CudaBackend:
        return CudaBackend(CudaBackend.devices()[0], numerics="fast")

    name, spec, weights = model
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, spec.n_vocab, 300)]
    report = compare_steps(name, spec, weights, prompt, 4, cpu, fast)
    assert report.violation is None, report.summary()
    assert gemms, "no product took the float GEMM"
    assert set(gemms) == {torch.float16 if half else torch.float32}, gemms
    graph = DecoderGraphs(spec)(GraphParams(n_tokens=64, n_ctx=256, output="logits"))
    rt = Runtime([fast()], weights, capture=True, verify_capture=True)
    step = rt.step(graph, ())
    runs = []
    for _ in range(4):
        step.write(graph_inputs(np.asarray(prompt[:64], np.int32), 0))
        step.run()
        runs.append(step.outputs[graph.outputs[0]].copy())
    assert step.capture_status == [""], step.capture_status  # captured and verified
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)
    assert torch.get_float32_matmul_precision() == before
    assert torch.backends.cuda.matmul.allow_tf32 == (before != "highest")  # (not mixed: no raise)


def test_a_session_decodes_across_the_shallow_reach_as_the_oracle_does(model, monkeypatch):
    """With SHALLOW_REACH at 512, greedy decoding from position 500 to 524 on the GPU (captured
    decode graphs, two taking turns: the shallow ones, whose flash decoding is sized to the
    reach, then the deep ones from 512), then a sampled step: the tokens and the logits the
    cpu oracle's session gives."""
    from parity.arch.decoder import DecoderGraphs
    from parity.generation import session as sessions

    monkeypatch.setattr(sessions, "SHALLOW_REACH", 512)
    _, spec, weights = model
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, spec.n_vocab, 500)]

    def decode(backend) -> tuple[list[int], np.ndarray]:
        session = sessions.Session(Runtime([backend], weights), DecoderGraphs(spec), 1024)
        tokens = [session.prefill(prompt, greedy=True)]
        for _ in range(24):
            tokens.append(session.step(tokens[-1], greedy=True))
        assert session.decode_graph(True, 500) != session.decode_graph(True, 520)
        return tokens, session.step(tokens[-1], greedy=False).copy()

    got, want = decode(cuda()), decode(cpu())
    assert got[0] == want[0] and got[1].tobytes() == want[1].tobytes()
