"""The conformance kit: tiers and manifests, the harness's checks against faulty backends,
case files, the `parity conformance` command and the pytest plugin."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from faulty_backends import (
    HonestSloppyBackend,
    PartialBackend,
    SloppyBackend,
    TwoModeBackend,
    add_in_place,
    add_noisy,
    crash,
    faulty,
    kv_write_one_row_late,
    mul_past_the_end,
)

from parity.backends.cpu.backend import KERNELS, CpuBackend
from parity.cli.main import main
from parity.conformance.case import Case, CaseFileError, load_case, save_case
from parity.conformance.harness import judge
from parity.conformance.suite import op_suite
from parity.core.backend import Device
from parity.core.builder import GraphBuilder
from parity.core.compare import diff_arrays
from parity.core.dtypes import DType
from parity.core.ir import AttentionArg, Op
from parity.core.plugins import Registry, _check_backend_class
from parity.core.tiers import Manifest, Tier, backend_manifest
from parity.errors import PluginError

SUITE = {s.id: s for s in op_suite()}


def _cpu(cls=CpuBackend):
    return lambda: cls(Device("cpu"))


# -- tiers and manifests -----------------------------------------------------------------------


def test_tier_parsing_and_printing():
    assert Tier.parse("exact").exact and str(Tier.parse(" exact ")) == "exact"
    assert Tier.parse("ulp<=2") == Tier(max_ulp=2.0)
    assert Tier.parse("ulp<=4, nmse<=1e-5") == Tier(4.0, 1e-5)
    assert str(Tier(4.0, 1e-5)) == "ulp<=4,nmse<=1e-05"
    for bad in ("fast", "ulp<2", "ulp<=-1", "nmse<=nan", "ulp<=1,ulp<=2", "ulp<=x", 3):
        with pytest.raises(ValueError, match="tier"):
            Tier.parse(bad)


def test_tier_admits():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = a.copy()
    b[0] = np.nextafter(b[0], np.float32(2))
    one_ulp = diff_arrays(0, "ADD", a, b)
    assert Tier().verdict(diff_arrays(0, "ADD", a, a)) == "exact"
    assert Tier().verdict(one_ulp) == "FAIL"
    assert Tier(max_ulp=1).verdict(one_ulp) == "bound"
    assert Tier(max_ulp=0.5).verdict(one_ulp) == "FAIL"
    assert Tier(max_nmse=1e-9).verdict(one_ulp) == "bound"
    nan = a.copy()
    nan[1] = np.nan
    assert Tier(max_nmse=1.0).verdict(diff_arrays(0, "ADD", a, nan)) == "FAIL"  # NaN vs number
    inf = a.copy()
    inf[2] = np.inf  # NMSE skips non-finite elements; a misplaced inf still fails any bound
    assert Tier(max_nmse=1.0).verdict(diff_arrays(0, "MATMUL", a, inf)) == "FAIL"
    ids = diff_arrays(0, "ARGMAX", np.array([3, 4], np.int32), np.array([3, 5], np.int32))
    assert Tier(max_ulp=8).verdict(ids) == "FAIL"  # a wrong id is never "close"


def test_declarations_stay_within_the_budgets():
    ok = Manifest.parse({"MATMUL": "nmse<=1e-6", "ATTENTION": "ulp<=64", "ADD": "ulp<=1"})
    assert ok.tiers["ATTENTION"] == Tier(max_ulp=64)  # a ULP bound implies a tiny NMSE
    for key, tier in (("MATMUL", "nmse<=1e-3"), ("ADD", "ulp<=2"), ("KV_WRITE", "ulp<=1"),
                      ("ARGMAX", "nmse<=1e-9"), ("MATMUL:Q4_K", "nmse<=1")):  # fmt: skip
        with pytest.raises(ValueError, match="looser than the budget"):
            Manifest.parse({key: tier})
    # "*" covers only the ops whose budget it fits; data movement stays exact
    broad = Manifest.parse({"*": "ulp<=1"})
    case = SUITE["add-576"].build()
    add = case.graph.nodes[case.graph.outputs[0]]
    srcs = [case.graph.nodes[s] for s in add.src]
    assert broad.tier_of(add, srcs) == Tier(max_ulp=1)
    rows = SUITE["get_rows-Q8_0"].build()
    node = rows.graph.nodes[rows.graph.outputs[0]]
    assert broad.tier_of(node, [rows.graph.nodes[s] for s in node.src]).exact


def test_tiers_key_on_the_packed_weight_type_f32_included():
    m = Manifest.parse({"MATMUL:F32": "nmse<=1e-6", "MATMUL": "nmse<=1e-5"})
    for case_id, want in (("matmul-F32-48x256-t1", 1e-6), ("matmul-Q5_0-bias-128x896-t3", 1e-5)):
        case = SUITE[case_id].build()
        node = case.graph.nodes[case.graph.outputs[0]]
        assert m.tier_of(node, [case.graph.nodes[s] for s in node.src]).max_nmse == want
    assert str(Tier(max_nmse=1.23456789e-5)) == "nmse<=1.23456789e-05"  # round-trips


def test_guards_work_for_every_element_size():
    from parity.conformance.harness import _GuardedAlloc
    from parity.core.dtypes import DType

    guard = _GuardedAlloc(CpuBackend(Device("cpu")))
    for dtype in (DType.F32, DType.F16, DType.I32):
        buf = guard(dtype, (3, 5))
        assert buf.shape == (3, 5) and not buf.any()
    assert guard.check() == []
    buf.base[-1] = 7  # the last margin element of the last (int32) buffer
    assert guard.check() == ["wrote after the end of a int32[15] buffer it allocated "
                             "(out-of-bounds write)"]  # fmt: skip


def test_manifest_lookup_most_specific_first():
    m = Manifest.parse({"*": "ulp<=8", "MATMUL": "nmse<=1e-5", "MATMUL:Q4_K": "exact"})
    from parity.core.dtypes import DType

    assert m.tier(Op.MATMUL, DType.Q4_K).exact
    assert m.tier(Op.MATMUL, DType.Q6_K) == Tier(max_nmse=1e-5)
    assert m.tier(Op.ADD) == Tier(max_ulp=8)
    assert Manifest.parse({}).tier(Op.ADD).exact  # unlisted: exact
    assert backend_manifest(HonestSloppyBackend).to_dict() == {"*": "exact", "SWIGLU": "ulp<=8"}


@pytest.mark.parametrize(
    "manifest, message",
    [
        ({"SWIGLUE": "exact"}, "unknown op 'SWIGLUE'"),
        ({"MATMUL:Q3_K": "exact"}, "unknown type 'Q3_K'"),
        ({"INPUT": "exact"}, "unknown op 'INPUT'"),
        ({"ADD": "fast"}, "bad tier 'fast'"),
        (["ADD"], "maps op keys to tiers"),
    ],
)
def test_bad_manifest_is_refused_at_registration(manifest, message):
    cls = type("BadManifest", (CpuBackend,), {"name": "badmanifest", "manifest": manifest})
    with pytest.raises(
        PluginError, match=f"backend 'badmanifest' declares a bad manifest: .*{message}"
    ):
        _check_backend_class(cls, Registry())


def test_bounded_ops_count_as_fast_numerics_for_the_scheduler():
    from parity.core.scheduler import schedule

    case = SUITE["swiglu-576"].build()
    exact = [HonestSloppyBackend(Device("cpu")), CpuBackend(Device("cpu"))]
    plan = schedule(case.graph, exact)
    assert plan.backend_of(case.graph.outputs[0]) == "cpu"  # exact numerics: not on a bound
    fast = [HonestSloppyBackend(Device("cpu"), numerics="fast"), CpuBackend(Device("cpu"))]
    assert schedule(case.graph, fast).backend_of(case.graph.outputs[0]) == "honest-sloppy"


def test_a_fast_manifest_holds_under_fast_numerics_only():
    from parity.conformance.report import checked_modes
    from parity.core.scheduler import schedule
    from parity.core.tiers import manifest_of

    assert backend_manifest(TwoModeBackend).all_exact
    assert backend_manifest(TwoModeBackend, "fast").to_dict() == {"*": "exact", "SWIGLU": "ulp<=8"}
    assert backend_manifest(HonestSloppyBackend, "fast") == backend_manifest(HonestSloppyBackend)
    exact, fast = TwoModeBackend(Device("cpu")), TwoModeBackend(Device("cpu"), numerics="fast")
    assert manifest_of(exact).all_exact and not manifest_of(fast).all_exact
    assert checked_modes(TwoModeBackend) == ["exact", "fast"]
    assert checked_modes(CpuBackend) == ["exact"]  # its fast numerics are its exact kernels
    case = SUITE["swiglu-576"].build()
    out = case.graph.outputs[0]
    assert schedule(case.graph, [exact, CpuBackend(Device("cpu"))]).backend_of(out) == "two-mode"
    plan = schedule(case.graph, [fast, CpuBackend(Device("cpu"))])
    assert plan.backend_of(out) == "two-mode" and plan.placements[out].numerics == "fast"
    assert judge(lambda: TwoModeBackend(Device("cpu")), case).verdict == "exact"
    within = judge(lambda: TwoModeBackend(Device("cpu"), numerics="fast"), case)
    assert within.verdict == "bound" and str(within.tier) == "ulp<=8"


def test_a_bad_fast_manifest_is_refused_at_registration():
    cls = type("BadFast", (TwoModeBackend,), {"name": "badfast", "fast_manifest": {"ADD": "fast"}})
    with pytest.raises(
        PluginError, match="backend 'badfast' declares a bad fast_manifest: bad tier 'fast'"
    ):
        _check_backend_class(cls, Registry())


# -- the harness catches faults ---------------------------------------------------------------


def test_declared_exact_but_inexact_fails_and_says_where():
    r = judge(_cpu(SloppyBackend), SUITE["swiglu-576"].build())
    assert r.failed and r.tier.exact
    assert "SWIGLU[4, 576]" in r.explain() and "declared tier: exact" in r.explain()


def test_declared_bound_is_enforced_not_just_reported():
    within = judge(_cpu(HonestSloppyBackend), SUITE["swiglu-576"].build())
    assert within.verdict == "bound" and 0 < within.max_ulp <= 8
    strict = type(
        "Strict", (SloppyBackend,), {"name": "strict", "manifest": {"SWIGLU": "ulp<=0.5"}}
    )
    assert judge(_cpu(strict), SUITE["swiglu-576"].build()).failed


def _swiglu_then_add() -> Case:
    """SWIGLU, then an ADD of its output: an exact op past one a backend may loosen."""
    b = GraphBuilder()
    g, u, r = (b.input(name, DType.F32, (4, 64)) for name in "gur")
    graph = b.build(b.op(Op.ADD, b.op(Op.SWIGLU, g, u), r))
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal((4, 64), dtype=np.float32) for name in "gur"}
    return Case("swiglu-then-add", graph, inputs, {}, {})


def _add_one_ulp(a, b, arg):
    return np.nextafter(np.add(a, b), np.float32(np.inf))


def _add_ulps(n: int):
    def add(a, b, arg):
        out = np.add(a, b)
        for _ in range(n):
            out = np.nextafter(out, np.float32(np.inf))
        return out

    return add


@pytest.mark.parametrize("ulps", [1, 2])
def test_a_bounded_op_past_a_looser_one_is_judged_on_the_inputs_it_was_given(ulps):
    """An ADD declared within 1 ULP, past the bounded SWIGLU (a fast tier's attention past its
    TF32 products): judged on the SWIGLU values the backend made, as docs/numerics.md measures
    a tier, it is within its bound 1 ULP off (against the oracle's chain it would not be) and
    fails 2 off."""
    kernels = {**HonestSloppyBackend.kernels, Op.ADD: _add_ulps(ulps)}
    manifest = {**HonestSloppyBackend.manifest, "ADD": "ulp<=1"}
    loose = type("LooseAdd", (HonestSloppyBackend,),
                 {"name": "loose-add", "kernels": kernels, "manifest": manifest})  # fmt: skip
    r = judge(_cpu(loose), _swiglu_then_add())
    assert r.failed == (ulps == 2), r.explain()


def test_an_exact_op_past_a_bounded_one_is_judged_on_the_inputs_it_was_given():
    """The ADD reads the bounded SWIGLU's rounding: it is exact when it adds exactly what it
    was given (the case is bound, not FAIL), and an ADD that is wrong on its own still fails."""
    r = judge(_cpu(HonestSloppyBackend), _swiglu_then_add())
    assert r.verdict == "bound", r.explain()
    assert "SWIGLU[4, 64]" in r.explain() and "(declared tier: ulp<=8)" in r.explain()
    assert "ADD" not in r.explain()
    kernels = {**HonestSloppyBackend.kernels, Op.ADD: _add_one_ulp}
    wrong = type("WrongAdd", (HonestSloppyBackend,), {"name": "wrong-add", "kernels": kernels})
    r = judge(_cpu(wrong), _swiglu_then_add())
    assert r.failed and "ADD[4, 64]: 256/256 elements differ, max ULP 1" in r.explain(), r.explain()


def _mul_then_kv_write() -> Case:
    """A MUL's rows written into a cache: the cache holds what a backend may loosen."""
    b = GraphBuilder()
    x, y = (b.input(name, DType.F32, (3, 64)) for name in "xy")
    pos = b.input("pos", DType.I32, (3,))
    graph = b.build(b.op(Op.KV_WRITE, b.state("k", (8, 64)), b.op(Op.MUL, x, y), pos))
    rng = np.random.default_rng(1)
    inputs = {n: rng.standard_normal((3, 64), dtype=np.float32) for n in "xy"}
    inputs["pos"] = np.array([2, 3, 4], np.int32)
    return Case("mul-then-kv-write", graph, inputs, {}, {"k": np.zeros((8, 64), np.float32)})


def _mul_then_attention() -> Case:
    """The MUL's rows as the keys of an exact ATTENTION (through the cache's KV_WRITE)."""
    b = GraphBuilder()
    x, y, v, q = (b.input(name, DType.F32, (3, 64)) for name in "xyvq")
    pos = b.input("pos", DType.I32, (3,))
    k = b.op(Op.KV_WRITE, b.state("k", (8, 64)), b.op(Op.MUL, x, y), pos)
    v = b.op(Op.KV_WRITE, b.state("v", (8, 64)), v, pos)
    graph = b.build(b.op(Op.ATTENTION, q, k, v, pos, arg=AttentionArg(1, 1, 64, 0.125, 0)))
    rng = np.random.default_rng(2)
    inputs = {n: rng.standard_normal((3, 64), dtype=np.float32) for n in "xyvq"}
    inputs["pos"] = np.array([0, 1, 2], np.int32)
    states = {n: np.zeros((8, 64), np.float32) for n in "kv"}
    return Case("mul-then-attention", graph, inputs, {}, states)


def _mul_one_ulp(a, b, arg):
    return np.nextafter(np.multiply(a, b), np.float32(np.inf))


def test_a_cache_written_from_a_bounded_op_holds_the_rows_the_backend_made():
    """The cache after the step is checked against the rows the bounded MUL gave, not the
    oracle's, and so is an exact ATTENTION that reads them: the cases are bound; a write one
    row late still fails."""
    kernels = {**KERNELS, Op.MUL: _mul_one_ulp}
    fields = {"name": "loose-mul", "kernels": kernels, "manifest": {"*": "exact", "MUL": "ulp<=1"}}
    loose = type("LooseMul", (CpuBackend,), fields)
    r = judge(_cpu(loose), _mul_then_kv_write())
    assert r.verdict == "bound", r.explain()
    r = judge(_cpu(loose), _mul_then_attention())  # (the keys: the rows the MUL gave)
    assert r.verdict == "bound" and "ATTENTION" not in r.explain(), r.explain()
    late = type("LateMul", (loose,), {"kernels": {**kernels, Op.KV_WRITE: kv_write_one_row_late}})
    r = judge(_cpu(late), _mul_then_kv_write())
    assert r.failed and "state 'k' differs from the oracle's after the step, first at row 2" in (
        r.explain()
    ), r.explain()


@pytest.mark.parametrize(
    "case, op, fn, message",
    [
        ("attention-9x3x64-p300-t1", Op.KV_WRITE, kv_write_one_row_late,
         "state 'k' differs from the oracle's after the step, first at row 300"),
        ("add-576", Op.ADD, add_in_place, "wrote into its input 'a'"),
        ("mul-576", Op.MUL, mul_past_the_end, "wrote after the end of a float32[2304] buffer"),
        ("add-576", Op.ADD, add_noisy, "executing the same step again gave other bits"),
        ("silu-1536", Op.SILU, crash, "raised RuntimeError: kernel launch failed"),
    ],
)  # fmt: skip
def test_harness_catches(case, op, fn, message):
    r = judge(_cpu(faulty(op, fn)), SUITE[case].build())
    assert r.failed and message in r.explain(), r.explain()


class ForgetfulZero(CpuBackend):
    name = "forgetful"

    def zero(self, buffer, dtype, shape):
        pass  # leaves the cache as it was


class OffByOne(CpuBackend):
    name = "offbyone"

    def increment(self, buffer, dtype, shape, by):
        super().increment(buffer, dtype, shape, by + 1)


class WrongWhenInternal(CpuBackend):
    """Right when every node leaves its split, wrong when some stay inside: a bug of the path
    a model's plan takes (intermediates in the backend's own memory)."""

    name = "internal"

    def execute(self, exe):
        super().execute(exe)
        if len(exe.split.outputs) < len(exe.split.nodes):
            for buf in exe.outputs.values():
                if buf.dtype == np.float32:
                    buf += np.float32(1)


@pytest.mark.parametrize(
    "cls, case, message",
    [
        (ForgetfulZero, "attention-9x3x64-p300-t1", "zero left state 'k' with bits"),
        (OffByOne, "attention-9x3x64-p300-t1", "increment of 'pos' by 3 did not add 3"),
        (WrongWhenInternal, "attention-9x3x64-p300-t1", "the step with only its outputs leaving"),
    ],
)
def test_the_kit_checks_the_device_slots(cls, case, message):
    r = judge(_cpu(cls), SUITE[case].build())
    assert r.failed and message in r.explain(), r.explain()


def test_unsupported_ops_are_reported_not_failed():
    r = judge(_cpu(PartialBackend), SUITE["rope-normal-9x64"].build())
    assert r.verdict == "unsupported" and "ROPE" in r.explain()


# -- case files ---------------------------------------------------------------------------------


def test_case_file_round_trip(tmp_path):
    case = SUITE["attention-14x2x64-p300-t1"].build()
    path = save_case(case, tmp_path / "sub" / "case.npz")
    back = load_case(path)
    assert back.graph == case.graph and back.id == case.id
    for name, value in case.inputs.items():
        assert back.inputs[name].tobytes() == value.tobytes()
    for name, value in case.states.items():
        assert back.states[name].tobytes() == value.tobytes()  # NaN sentinels, bit for bit
    assert judge(_cpu(), back).verdict == "exact"
    q = SUITE["matmul-Q4_K-896x4864-t7"].build()
    back = load_case(save_case(q, tmp_path / "q.npz"))
    assert back.weights["w"].raw().tobytes() == q.weights["w"].raw().tobytes()


def test_bad_case_files_say_what_is_wrong(tmp_path):
    with pytest.raises(CaseFileError, match="no case file at"):
        load_case(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(CaseFileError, match="not a readable parity case file"):
        load_case(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", meta=np.array(json.dumps({"format": "x"})))
    with pytest.raises(CaseFileError, match="is not a parity case file"):
        load_case(tmp_path / "other.npz")
    np.savez(tmp_path / "list.npz", meta=np.array(json.dumps([1, 2])))
    with pytest.raises(CaseFileError, match="is not a parity case file"):
        load_case(tmp_path / "list.npz")
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(CaseFileError, match="not a readable parity case file"):
        load_case(tmp_path / "empty.npz")
    good = save_case(SUITE["add-576"].build(), tmp_path / "good.npz")
    with np.load(good) as data:
        arrays = dict(data)
    meta = json.loads(str(arrays["meta"]))
    for damage, message in (("id", "KeyError"), ("shape", r"input 'a' is float32\[2, 576\]")):
        broken = dict(arrays)
        if damage == "id":
            broken["meta"] = np.array(json.dumps({k: v for k, v in meta.items() if k != "id"}))
        else:
            broken["input/a"] = arrays["input/a"][:2]
        np.savez(tmp_path / "broken.npz", **broken)
        with pytest.raises(CaseFileError, match=message):
            load_case(tmp_path / "broken.npz")


# -- `parity conformance` and the pytest plugin ------------------------------------------------


def test_conformance_command_table_and_exit_status(sloppy_plugin, capsys):
    argmax = [a for w in (1000, 49152, 151936) for a in ("-k", f"argmax-{w}")]
    assert main(["conformance", "cpu", "-k", "rms_norm-", *argmax]) == 0
    out = capsys.readouterr().out
    assert "RMS_NORM  F32   exact     2      exact" in out
    assert "cpu: 5 cases: 5 bit-exact, 0 within the declared bound, 0 FAIL" in out
    assert main(["conformance", "sloppy", "-k", "swiglu-576", "-k", "swiglu-4864", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert {c["result"] for c in report["cases"]} == {"FAIL"}


def test_conformance_replays_a_case_file(sloppy_plugin, tmp_path, capsys):
    path = save_case(SUITE["swiglu-4864"].build(), tmp_path / "swiglu.npz")
    assert main(["conformance", "sloppy", "--case", str(path)]) == 3
    out = capsys.readouterr().out
    assert "1 cases:" in out and "FAIL swiglu-4864" in out
    assert main(["conformance", "cpu", "--case", str(path)]) == 0


def test_conformance_command_errors(capsys):
    assert main(["conformance", "nosuch"]) == 1
    assert "unknown backend 'nosuch'; installed backends: cpu" in capsys.readouterr().err
    assert main(["conformance", "cpu", "-k", "zzz"]) == 1
    assert "no case matches zzz" in capsys.readouterr().err


def _pytest(cwd, *args):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_pytest_plugin_in_an_empty_repository(sloppy_plugin, tmp_path):
    repo = tmp_path / "author-repo"
    repo.mkdir()
    ok = _pytest(repo, "--parity-backend", "cpu", "-k", "rms_norm or rope and not attention")
    chosen = sum("rms_norm" in c or ("rope" in c and "attention" not in c) for c in SUITE)
    assert chosen > 2 and ok.returncode == 0, ok.stdout + ok.stderr  # (with _mul)
    assert f"{chosen} passed" in ok.stdout, ok.stdout
    bad = _pytest(repo, "--parity-backend", "sloppy", "-k", "swiglu")
    assert bad.returncode == 1 and "2 failed" in bad.stdout, bad.stdout + bad.stderr
    assert "SWIGLU[4, 576]" in bad.stdout and "declared tier: exact" in bad.stdout
    case = save_case(SUITE["swiglu-576"].build(), tmp_path / "c.npz")
    replay = _pytest(repo, "--parity-backend", "sloppy", "--parity-case", str(case), "-k", "replay")
    assert replay.returncode == 1 and "1 failed" in replay.stdout, replay.stdout
    unknown = _pytest(repo, "--parity-backend", "nosuch")
    assert unknown.returncode == 4 and "unknown backend 'nosuch'" in unknown.stderr
    device = _pytest(repo, "--parity-backend", "cpu", "--parity-device", "5")
    assert device.returncode == 4 and "has no device 5" in device.stderr
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"junk")
    damaged = _pytest(repo, "--parity-backend", "cpu", "--parity-case", str(junk))
    assert damaged.returncode == 4 and "not a readable parity case file" in damaged.stderr


def test_a_backend_that_cannot_even_start_is_a_finding():
    def factory():
        raise RuntimeError("CUDA driver too old")

    r = judge(factory, SUITE["add-576"].build())
    assert r.failed and "raised RuntimeError: CUDA driver too old" in r.explain()
