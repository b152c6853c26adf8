"""`parity compare`: every node of every step, tiers enforced, violations saved and replayable."""

from __future__ import annotations

import json

import numpy as np
import pytest
from faulty_backends import (
    HEAD_ROWS,
    BoundedButWrongHead,
    HonestSloppyBackend,
    PartialBackend,
    SloppyBackend,
)

from parity.arch.model_file import read_model_file
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.backends.cpu.backend import CpuBackend
from parity.cli.main import main
from parity.conformance.case import load_case
from parity.conformance.compare_steps import compare_steps
from parity.conformance.harness import judge
from parity.core.backend import Device
from parity.errors import SchedulingError
from parity.gguf.writer import tiny_bpe_tokenizer

PROMPT = [1, 17, 42, 99, 7]


def make(cls, **kwargs):
    return lambda: cls(Device("cpu"), **kwargs)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    spec, weights = synthetic_model(tiny_spec(request.param), seed=11)
    return request.param, spec, weights


def run(model, candidate, tmp_path=None, n_tokens=4):
    name, spec, weights = model
    return compare_steps(name, spec, weights, PROMPT, n_tokens, make(CpuBackend), candidate,
                         case_dir=tmp_path)  # fmt: skip


def test_identical_implementations_agree_everywhere(model):
    report = run(model, make(CpuBackend, kernels="numpy"))
    assert report.steps == 4 and report.first_divergent is None and report.violation is None
    nodes_per_step = report.nodes_compared / 4
    assert nodes_per_step > 20 and report.identical_share == 1.0
    assert report.tokens_agree == 4 and len(report.reference_tokens) == 4
    assert "100.00% bit-identical" in report.summary()
    assert "sampled tokens agree: 4/4" in report.summary()


def test_a_node_beyond_its_tier_is_named_saved_and_replayable(model, tmp_path):
    report = run(model, make(SloppyBackend), tmp_path)
    v = report.violation
    assert v is not None and v.step == 0 and v.diff.op == "SWIGLU" and v.sources_identical
    assert report.first_divergent == (0, v.diff)
    assert "VIOLATION: step 0 %" in report.summary() and "beyond its declared tier (exact)" in (
        report.summary()
    )
    case = load_case(v.case_path)
    assert case.subject.op.name == "SWIGLU" and set(case.inputs) == {
        n.arg for n in case.graph if n.op.name == "INPUT"
    }
    assert judge(make(SloppyBackend), case).failed  # the saved case reproduces the fault
    assert judge(make(CpuBackend), case).verdict == "exact"


def test_inherited_differences_are_not_violations(model, tmp_path):
    """A bounded SWIGLU changes every later node; replayed alone, each stays exact."""
    report = run(model, make(HonestSloppyBackend, numerics="fast"), tmp_path)
    assert report.violation is None, report.summary()
    assert report.first_divergent[1].op == "SWIGLU"
    assert report.identical_share < 0.9 and report.max_ulp > 0
    assert not list(tmp_path.iterdir())


def test_compare_command(sloppy_plugin, tmp_path, capsys, monkeypatch):
    spec, weights = synthetic_model(tiny_spec("llama"), seed=5)
    path = tmp_path / "tiny.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer())
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "-m", str(path), "--backends", "cpu,cpu", "-n", "3"]) == 0
    out = capsys.readouterr().out
    assert "cpu vs cpu on" in out and "sampled tokens agree: 3/3" in out
    assert not (tmp_path / "parity-cases").exists()  # made only to hold a case
    assert main(["compare", "-m", str(path), "--backends", "cpu,sloppy", "-n", "2", "--json"]) == 3
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["violation"]["node"]["op"] == "SWIGLU" and report["steps"] == 2
    saved = report["violation"]["case"]
    assert saved.startswith("parity-cases/") and (tmp_path / saved).is_file()
    assert f"parity conformance sloppy --case {saved}" in captured.err
    assert main(["conformance", "sloppy", "--case", saved]) == 3
    (tmp_path / "file").write_text("")
    argv = ["compare", "-m", str(path), "--backends", "cpu,cpu", "--save-dir", "file/cases"]
    assert main(argv) == 1
    assert "cannot save cases under --save-dir file/cases" in capsys.readouterr().err
    assert main(["compare", "-m", str(path), "--backends", "cpu"]) == 1
    assert "--backends takes two names" in capsys.readouterr().err
    assert main(["compare", "-m", str(path), "--backends", "cpu,nosuch"]) == 1
    assert "unknown backend 'nosuch'" in capsys.readouterr().err


def test_a_file_round_trip_is_what_compare_runs(tmp_path):
    spec, weights = synthetic_model(tiny_spec("qwen2"), seed=2)
    path = tmp_path / "q.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer())
    file = read_model_file(path)
    file_spec, file_weights = file.spec, file.weights
    report = compare_steps("q", file_spec, file_weights, PROMPT, 2, make(CpuBackend),
                           make(CpuBackend, kernels="numpy"))  # fmt: skip
    assert report.violation is None and report.identical_share == 1.0


def test_unsupported_ops_fall_back_and_are_counted(model):
    name, spec, weights = model
    report = compare_steps(name, spec, weights, PROMPT, 2, make(CpuBackend), make(PartialBackend),
                           fallback=make(CpuBackend))  # fmt: skip
    ropes = report.nodes_compared - report.nodes_on_candidate
    assert ropes == 2 * 2 * spec.n_layer  # q and k, per layer, per step
    assert "(the rest fell back)" in report.summary() and report.violation is None
    with pytest.raises(SchedulingError, match=r"no backend can run .* ROPE"):
        compare_steps(name, spec, weights, PROMPT, 1, make(CpuBackend), make(PartialBackend))


def test_a_fault_downstream_of_a_bounded_op_is_still_found(tmp_path):
    """Every node after the bounded SWIGLU differs by inheritance and is replayed alone; the
    output projection, wrong by itself, is found however far down it is."""
    spec, weights = synthetic_model(tiny_spec("llama", n_vocab=HEAD_ROWS), seed=4)
    wrong = make(BoundedButWrongHead, numerics="fast")
    report = compare_steps("m", spec, weights, PROMPT, 2, make(CpuBackend), wrong,
                           case_dir=tmp_path)  # fmt: skip
    v = report.violation
    assert v is not None and v.diff.op == "MATMUL" and v.diff.shape == (1, HEAD_ROWS)
    assert not v.sources_identical and v.replay == "replayed alone it breaks its tier too"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_every_node_kind_becomes_a_faithful_case(arch, tmp_path):
    """node_case cuts any node out of a run (two steps, so caches hold history), and the
    oracle, run on the saved file, gives back the node's bits."""
    from parity.arch.decoder import build_decoder, graph_inputs
    from parity.arch.params import GraphParams
    from parity.conformance.case import node_case, save_case
    from parity.conformance.harness import oracle
    from parity.core.ir import Op
    from parity.core.runtime import Runtime

    spec, weights = synthetic_model(tiny_spec(arch), seed=6)
    runtime = Runtime([CpuBackend(Device("cpu"))], weights, rewrite=False)
    fusing = Runtime([CpuBackend(Device("cpu"))], weights)  # its rewrite: the fused nodes
    states: dict = {}
    kinds = set()
    for step, tokens in enumerate(([3, 9, 27], [81])):
        graph = build_decoder(spec, GraphParams(n_tokens=len(tokens), n_ctx=8))
        inputs = graph_inputs(np.array(tokens), 3 * step)
        computed = [i for i, n in enumerate(graph.nodes) if not n.op.is_leaf]
        out = runtime.run(graph, inputs, expose=computed)
        for name, s in graph.leaves(Op.STATE).items():
            states.setdefault(name, np.zeros(graph.nodes[s].shape, np.float32))
        fused = fusing.rewrite(graph)
        values = {r: out[o] for o, r in fused.rewritten().items() if o in out}
        for g, ids, vals in ((graph, computed, out), (fused, list(values), values)):
            for i in ids:
                case = node_case(g, i, vals, inputs, weights, states, f"n{i}")
                back = load_case(save_case(case, tmp_path / f"{step}-{i}.npz"))
                got = oracle(back).outputs[back.graph.outputs[0]]
                want = out[g.original(i)]
                assert got.tobytes() == want.tobytes(), f"step {step} %{i} {g.nodes[i].op}"
                kinds.add(g.nodes[i].op)
        for i in computed:
            if graph.nodes[i].op is Op.KV_WRITE:
                states[graph.nodes[graph.nodes[i].src[0]].arg] = out[i]
    # every op of both graphs, the fused ones included (a QUANTIZE is computed inside the
    # cases of the products that read it)
    gemma = {Op.GEGLU, Op.SCALE, Op.RESHAPE}  # Gemma 3's alone
    # llama's and qwen2's alone (Gemma's post norms keep the residual ADD from the products)
    llama = {Op.SWIGLU, Op.MATMUL_SWIGLU, Op.MATMUL_ADD}
    other = gemma if arch != "gemma3" else llama
    unused = {Op.ARGMAX, Op.SILU, Op.GELU, Op.QUANTIZE}  # (GELU: inside GEGLU)
    assert kinds == {op for op in Op if not op.is_leaf} - unused - other
