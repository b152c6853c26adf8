"""The triton backend without a GPU: its kernels in Triton's interpreter (``TRITON_INTERPRET=1``,
which Triton reads when a kernel is defined, hence a fresh process), judged case by case by the
conformance kit; and its discovery, which imports neither triton nor torch."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from parity.conformance.suite import op_suite

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="triton and torch are not installed (pip install 'parity[triton]')",
)


def _interpreter_runs_loops() -> bool:
    """Triton 3.6's interpreter turns a loop's run-time bound into an int with ``int()`` of a
    one-element array, which NumPy 2.4 refuses (Triton 3.7 squeezes it first): there, every
    kernel with such a loop fails in the interpreter, though the GPU runs it (the device's
    Triton 3.6 with NumPy 2.4.6)."""
    if importlib.util.find_spec("triton") is None:
        return True  # (needs_triton skips)
    import numpy as np

    release = tuple(int(p) for p in importlib.metadata.version("triton").split(".")[:2])
    try:
        int(np.ones(1))
    except TypeError:
        return release >= (3, 7)
    return True


needs_interpreter = pytest.mark.skipif(
    not _interpreter_runs_loops(),
    reason="Triton before 3.7 under a NumPy that refuses int() of a one-element array (2.4 "
    "does): its interpreter cannot run our kernels' loops (these tests need triton>=3.7 or an "
    "older NumPy; the GPU is unaffected)",
)


JUDGE = """
import json, sys
from parity.conformance.harness import judge
from parity.conformance.suite import op_suite
from parity.core.plugins import load_backends

cls = load_backends().backends["triton"]
wanted = set(json.loads(sys.argv[1]))
numerics = sys.argv[2] if len(sys.argv) > 2 else "exact"
results = []
for spec in op_suite():
    if spec.id in wanted:
        r = judge(lambda: cls(cls.devices()[0], numerics=numerics), spec.build())
        results.append({"case": spec.id, "op": spec.op, "result": r.verdict, "tier": str(r.tier),
                        "explain": "" if r.verdict == "exact" else r.explain()})
print(json.dumps(results))
"""


# decode attention deep in a cache, beyond one case a head width: the kernels take the depth
# and the GQA group as arguments (9x3x64-p4000 and 8x2x128-p4000 keep 17 chunks, the window of
# 9,000 at 9,500 keeps 40); these three took 58 s of the interpreter's 170
DEEP_TWINS = {"attention-14x2x64-p8600-t1", "attention-9x3x64-p8600-t1",
              "attention-14x2x64-p4000-t1"}  # fmt: skip


def interpreter_cases() -> list[str]:
    """The suite's cases the interpreter runs in the tests: every case except products of more
    than 400,000 multiply-adds, attention over more than 20 tokens and DEEP_TWINS, whose code
    paths smaller cases take too (the interpreter costs about a millisecond per operation of a
    program). The large cases run on the GPU (`parity conformance triton`), or here with
    TRITON_INTERPRET=1."""
    keep = []
    for spec in op_suite():
        if spec.id in DEEP_TWINS:
            continue
        parts = spec.id.split("-")
        tokens = next((int(p[1:]) for p in parts if p[:1] == "t" and p[1:].isdigit()), 1)
        shape = next((p.split("x") for p in parts if p.replace("x", "").isdigit()), [])
        if spec.op.startswith("MATMUL") or spec.op == "FUSION":
            size = int(shape[0]) * int(shape[-1]) * tokens if shape else 0
            if size > 400_000:
                continue
        if spec.op == "ATTENTION" and tokens > 20:
            continue
        keep.append(spec.id)
    return keep


INTERPRETER_PARTS = 3  # processes the interpreter's cases run in (spread over the workers)


def test_the_interpreters_cases_cover_every_op():
    from parity.backends.triton.backend import OPS

    wanted = set(interpreter_cases())
    ops = {op.name for op in OPS} - {"KV_WRITE"} | {"FUSION"}  # (KV_WRITE: inside attention)
    assert {spec.op for spec in op_suite() if spec.id in wanted} == ops


@needs_triton
@needs_interpreter
@pytest.mark.long
@pytest.mark.parametrize("part", range(INTERPRETER_PARTS))
def test_conformance_in_the_interpreter_is_bit_exact_on_every_op(part):
    """Every case of interpreter_cases(), a third of them a process."""
    wanted = interpreter_cases()[part::INTERPRETER_PARTS]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "-c", JUDGE, json.dumps(wanted)], env=env,
                         capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert [r["case"] for r in results] == wanted
    wrong = [r for r in results if r["result"] != "exact"]
    assert not wrong, wrong


GPU_TILING = """
import parity.backends.triton.backend as b
b.PRODUCT_ROWS[True], b.PRODUCT_GROUP[True], b.ATTENTION_TILE[True] = (
    b.PRODUCT_ROWS[False], b.PRODUCT_GROUP[False], b.ATTENTION_TILE[False])
b.ATTENTION_SPLIT_TOKENS = 1  # (2 tokens take a prefill's path: the interpreter's time)
merged = []  # each prepared split's groups of ROPEs and KV_WRITEs launched as one
_groups = b.TritonBackend._rope_kv_groups


def _recorded(self, split):
    merged.append(_groups(self, split))
    return merged[-1]


b.TritonBackend._rope_kv_groups = _recorded
"""


GPU_TILING_CASES = {  # (two processes, spread over the workers under -n)
    "products": ["matmul-Q4_1-192x576-t1", "matmul-Q5_0-128x896-t1",
                 "matmul-q8x-Q4_K-48x512-t7", "matmul-q8x-Q6_K-48x512-t7",
                 "matmul_add-F16-48x512-t5", "matmul-q8x-Q4_K-48x4864-t1",
                 "matmul_add-Q6_K-48x4864-t1", "matmul_add-F16-48x4864-t1"],
    "attention": ["attention-9x3x64-p300-t1", "attention-9x3x64-p511-t2",
                  "attention-window1-9x3x64-p5-t3", "attention-window512-4x1x256-p767-t1",
                  "attention-rope-normal64-9x3x64-p40-t1",
                  "attention-rope-neox128-4x1x256-p300-t2"],
}  # fmt: skip


@needs_triton
@needs_interpreter
@pytest.mark.long
@pytest.mark.parametrize("kind", list(GPU_TILING_CASES))
def test_the_gpus_tiling_gives_the_same_bits_in_the_interpreter(kind):
    """The interpreter takes a product's K and an attention chunk in one step; the GPU takes
    them in groups and sub-tiles (the same TREE, level for level): products of K 512, 576 and
    896 (one group) and 4864 (several, quantized and float), attention over two chunks, GQA
    and windows, a decode step's parts of a chunk (one sub-tile a program) and a prefill's
    chunks (a loop over sub-tiles, here from 2 tokens on), heads of 64 and 256, after the
    ROPEs and KV_WRITEs launched as one."""
    wanted = GPU_TILING_CASES[kind]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    script = GPU_TILING + JUDGE + "print(sum(map(len, merged)))"
    run = subprocess.run([sys.executable, "-c", script, json.dumps(wanted)],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    *_, line, groups = run.stdout.splitlines()
    results = json.loads(line)
    assert sorted(r["case"] for r in results) == sorted(wanted)
    assert all(r["result"] == "exact" for r in results), results
    if kind == "attention":
        assert int(groups) >= 2  # the two attention-rope cases' layers, each in one launch


# products and attention of 16 tokens or more: the fast kernels' cases (flash attention: heads
# of 64 over several query tiles, of 256, windows; the 300-token cases, 26 s more, take the
# same paths)
FAST_CASES = [
    *(spec.id for spec in op_suite()
      if spec.id.endswith(("-t33", "-t35", "-t37", "-t70")) and spec.op.startswith("MATMUL")),
    "attention-plain-window0-9x3x64-p100-t100", "attention-plain-window64-4x1x256-p200-t40",
    "attention-window7-9x3x64-p250-t20",
]  # fmt: skip


@needs_triton
@needs_interpreter
@pytest.mark.long
@pytest.mark.parametrize("half", [False, True], ids=["integer-dots", "float16"])
def test_fast_kernels_keep_their_declared_bounds_in_the_interpreter(half):
    """Under numerics = "fast" the tiled GEMMs (every weight type, bias and residual) and flash
    attention (GQA, windows, heads of 64 and 256) run, and stay within the fast_manifest; with
    PARITY_TRITON_HALF_GEMM=1 the products again (float16, or the integer dots where the
    suite's edge values ask for them), under their looser declared bound."""
    from parity.backends.triton.backend import HALF_GEMM_ENV, PRODUCTS
    from parity.core.tiers import Tier

    cases = [c for c in FAST_CASES if not half or c.startswith("matmul")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               **{HALF_GEMM_ENV: str(int(half))})  # fmt: skip
    run = subprocess.run([sys.executable, "-c", JUDGE, json.dumps(cases), "fast"], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert sorted(r["case"] for r in results) == sorted(cases)
    wrong = [r for r in results if r["result"] not in ("exact", "bound")]
    assert not wrong, wrong
    tiers = {op.name: "nmse<=1e-6" if half else "nmse<=1e-8" for op in PRODUCTS}
    if not half:
        tiers["ATTENTION"] = "nmse<=1e-8"
    assert {r["tier"] for r in results} == {str(Tier.parse(t)) for t in tiers.values()}
    assert {r["op"] for r in results if r["result"] == "bound"} == set(tiers)


HALF = """
import json, sys
import numpy as np
import parity.backends.triton.backend as tb
from parity.backends.cpu import ops  # noqa: F401 (the oracle's kernels, loaded once)
from parity.conformance.harness import execute
from parity.conformance.suite import op_suite
from parity.core.plugins import load_backends
from parity.core.weights import WeightData
from parity.quant.synthetic import random_weight

cls = load_backends().backends["triton"]
report = {}
specs = {spec.id: spec for spec in op_suite()}
made = []  # the kernels each backend's launches run, by name
kernel = tb.TritonBackend._kernel
tb.TritonBackend._kernel = lambda self, fn, *a, **k: made.append(fn.__name__) or kernel(
    self, fn, *a, **k)
# name: (case, whether its weights (made here, seeded) have the edge scales planted, a factor
# for its x or "normal": ordinary activations instead)
for name, (case_id, edge, factor) in json.loads(sys.argv[1]).items():
    got = []
    for half in (False, True):
        tb.FAST_GEMM_HALF = half
        case = specs[case_id].build()
        rng = np.random.default_rng(5)
        for w_name, w in case.weights.items():
            data = random_weight(w.dtype, w.shape, rng, edge=edge)
            case.weights[w_name] = WeightData(w_name, w.dtype, w.shape, data)
        if factor == "normal":  # ordinary activations in place of the suite's planted ones
            x = case.inputs["x"]
            case.inputs["x"] = np.random.default_rng(6).standard_normal(x.shape).astype(x.dtype)
        else:
            case.inputs["x"] *= np.float32(factor)
        made.clear()
        backend = cls(cls.devices()[0], numerics="fast")
        graph = backend.rewrite(case.graph) if case.rewrite else case.graph
        got.append(execute(backend, case, graph).outputs[graph.nodes.index(case.subject)])
    ints, half = got
    report[name] = {"same": ints.tobytes() == half.tobytes(), "to_half": made.count("to_half"),
                    "finite": bool(np.isfinite(half).all()),
                    "nmse": float(np.sum((half - ints) ** 2.0) / np.sum(ints ** 2.0))}
print(json.dumps(report))
"""


@needs_triton
@needs_interpreter
def test_the_float16_gemm_takes_the_integer_dots_where_float16_cannot_span_a_row():
    """PARITY_TRITON_HALF_GEMM: weights and activations of ordinary range go through float16
    (the values differ from the integer dots' by the roundings, an NMSE far below the declared
    1e-6); the suite's edge cases (weights' sub-block scales far apart, a 1e30 among ordinary
    activations) span more than 2^20 and take the integer dots, bit for bit those of gemm_q
    (float16 would have flushed the ordinary values), and so do activations of 1e-35 and 1e35
    (whose scale factors would leave float32). Gate and up (with ordinary activations)
    convert their shared x once."""
    plain = "matmul-plain-{}-64x512-t70"
    cases = {  # name: (case, edge weights, x's factor), whether the integer dots run
        "Q4_K": ((plain.format("Q4_K"), False, 1.0), False),
        "Q6_K": ((plain.format("Q6_K"), False, 1.0), False),
        "Q4_1": ((plain.format("Q4_1"), False, 1.0), False),
        "Q8_0": ((plain.format("Q8_0"), False, 1.0), False),
        "Q4_0 edge weights": ((plain.format("Q4_0"), True, 1.0), True),
        "Q5_0 1e30 activations": (("matmul-Q5_0-40x896-t33", True, 1.0), True),
        "Q8_0 x 1e-35": ((plain.format("Q8_0"), False, 1e-35), True),
        "Q8_0 x 1e35": ((plain.format("Q8_0"), False, 1e35), True),
        "Q4_K gate and up": (("matmul_swiglu-Q4_K-40x512-t35", False, "normal"), False),
    }
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    arg = json.dumps({name: spec for name, (spec, _) in cases.items()})
    run = subprocess.run([sys.executable, "-c", HALF, arg], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    for name, (_, integer) in cases.items():
        assert report[name]["same"] is integer, (name, report[name])
        assert report[name]["finite"] or integer, (name, report[name])
        assert integer or 1e-12 < report[name]["nmse"] < 1e-6, (name, report[name])
    # gate and up read one x: it is made float16 once, each weight once
    assert report["Q4_K gate and up"]["to_half"] == 3, report["Q4_K gate and up"]


def test_discovery_imports_neither_triton_nor_torch():
    code = (
        "import sys; from parity.core.plugins import load_backends; "
        "cls = load_backends().backends['triton']; cls.available(); cls.devices(); "
        "print(sorted(m for m in ('triton', 'torch') if m in sys.modules))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_the_interpreter_or_a_gpu_it_says_why(monkeypatch):
    from parity.backends.triton import discovery
    from parity.backends.triton.backend import TritonBackend

    monkeypatch.setattr(discovery, "interpreting", lambda: False)
    monkeypatch.setattr(
        discovery.importlib.util, "find_spec", lambda name: None if name == "triton" else True
    )
    ok = TritonBackend.available()
    assert not ok.ok and ok.reason == "triton is not installed; pip install 'parity[triton]'"


KERNELS = [  # (module, kernel, signature, constexprs)
    ("norm", "rms_norm_f32",
     {"out": "*fp32", "q": "*i8", "d": "*fp32", "s": "*fp32", "x": "*fp32", "w": "*fp32",
      "width": "i32", "eps": "fp32"}, {"MUL": True, "P": 1024, "LOG": 10, "QUANT": True}),
    ("elementwise", "unary_f32", {"out": "*fp32", "x": "*fp32", "n": "i32"},
     {"OP": 1, "BLOCK": 1024}),
    ("elementwise", "glu_f32", {"out": "*fp32", "gate": "*fp32", "up": "*fp32", "n": "i32"},
     {"OP": 0, "BLOCK": 1024}),
    ("elementwise", "binary_f32",
     {"out": "*fp32", "a": "*fp32", "b": "*fp32", "n": "i32", "width": "i32"},
     {"OP": 1, "ROW": True, "BLOCK": 1024}),
    ("elementwise", "scale_f32", {"out": "*fp32", "x": "*fp32", "n": "i32", "c": "fp32"},
     {"BLOCK": 1024}),
    ("rows", "rope_f32",
     {"out": "*fp32", "x": "*fp32", "positions": "*i32", "cos": "*fp32", "sin": "*fp32",
      "n_head": "i32", "head_dim": "i32", "half": "i32", "width": "i32"},
     {"NEOX": True, "BLOCK": 64}),
    ("rows", "rope_kv_f32",
     {"q_out": "*fp32", "q": "*fp32", "k_out": "*fp32", "k": "*fp32", "v": "*fp32",
      "k_cache": "*fp32", "v_cache": "*fp32", "positions": "*i32", "cos": "*fp32",
      "sin": "*fp32", "n_head": "i32", "n_kv": "i32", "head_dim": "i32", "half": "i32"},
     {"NEOX": False, "BLOCK": 256}),
    ("rows", "kv_write_f32", {"cache": "*fp32", "rows": "*fp32", "positions": "*i32",
                              "width": "i32"}, {"BLOCK": 1024}),
    ("rows", "argmax_parts", {"best": "*fp32", "at": "*i32", "x": "*fp32", "width": "i32"},
     {"BLOCK": 2048}),
    ("rows", "argmax_fold", {"out": "*i32", "best": "*fp32", "at": "*i32", "n_parts": "i32"},
     {"NP": 128}),
    ("rows", "add_i32", {"x": "*i32", "n": "i32", "by": "i32"}, {"BLOCK": 1024}),
    ("rows", "quantize_q8", {"q": "*i8", "d": "*fp32", "s": "*fp32", "x": "*fp32", "k": "i32",
                             "nb": "i32"}, {"BLOCKS": 32}),
    *(("dequant", "get_rows", {"out": "*fp32", "w": w, "ids": "*i32", "k": "i32",
                               "row_bytes": "i32"}, {"TYPE": code, "BLOCK": 1024})
      for w, code in (("*u8", 2), ("*u8", 3), ("*u8", 6), ("*u8", 8), ("*u8", 12), ("*u8", 14),
                      ("*fp16", 1), ("*i16", 30))),
    *(("dequant", "repack", {"q": "*i8", "a": "*fp32", "m": "*fp32", "w": "*u8", "n_rows": "i32",
                             "k": "i32", "row_bytes": "i32"},
       {"TYPE": code, "L": 16 if code == 14 else 32, "HAS_MIN": code in (3, 12), "R": 8,
        "BLOCK": 256})
      for code in (2, 3, 6, 8, 12, 14)),
    *(("matmul", "matmul_q", {"y": "*fp32", "xq": "*i8", "xd": "*fp32", "xs": "*fp32",
                              "wq": "*i8", "wa": "*fp32", "wm": "*fp32", "uq": "*i8",
                              "ua": "*fp32", "um": "*fp32", "bias": "*fp32", "res": "*fp32",
                              "k": "i32", "n_out": "i32"},
       {"MIN": minimum, "L": sub, "P": p, "LOG": p.bit_length() - 1, "G": 256 // sub,
        "LOGG": (256 // sub).bit_length() - 1, "BN": 4, "HAS_BIAS": True, "HAS_RES": True,
        "GLU": glu})
      for minimum, sub, p, glu in ((1, 32, 32, False), (2, 32, 256, True), (0, 16, 512, False))),
    ("matmul", "matmul_f", {"y": "*fp32", "x": "*fp32", "w": "*fp16", "bias": "*fp32",
                            "res": "*fp32", "k": "i32", "n_out": "i32", "row_bytes": "i32"},
     {"TYPE": 1, "P": 8192, "LOG": 13, "G": 256, "LOGG": 8, "BN": 4, "HAS_BIAS": False,
      "HAS_RES": False}),
    *(("attention", "chunk_max",
       {"mx": "*fp32", "q": "*fp32", "k": "*fp32", "positions": "*i32", "n_head": "i32",
        "group": "i32", "kv_width": "i32", "window": "i32", "scale": "fp32",
        "n_parts": "i32"}, {"D": d, "LOGD": d.bit_length() - 1, "SUB": 4096 // d, "PER": per})
      for d, per in ((64, 1), (256, 16))),
    *(("attention", "chunk_sums",
       {"dens": "*fp32", "nums": "*fp32", "mx": "*fp32", "q": "*fp32", "k": "*fp32",
        "v": "*fp32", "positions": "*i32", "n_head": "i32", "group": "i32", "kv_width": "i32",
        "window": "i32", "scale": "fp32", "n_parts": "i32"},
       {"D": d, "LOGD": d.bit_length() - 1, "SUB": 4096 // d,
        "LOGSUB": (4096 // d).bit_length() - 1, "PER": per, "LOGPER": per.bit_length() - 1,
        "NPP": 64})
      for d, per in ((64, 1), (64, 4), (256, 16))),
    *(("attention", "fold",
       {"out": "*fp32", "yq": "*i8", "yd": "*fp32", "ys": "*fp32", "dens": "*fp32",
        "nums": "*fp32", "positions": "*i32", "n_head": "i32", "window": "i32",
        "n_parts": "i32"},
       {"D": d, "PARTS": parts, "LOGPARTS": parts.bit_length() - 1, "QUANT": d == 64})
      for d, parts in ((64, 4), (256, 1))),
]  # fmt: skip

FAST_KERNELS = [  # the fast kernels, which may contract and flush
    *(("gemm_fast", "gemm_q", {"y": "*fp32", "xq": "*i8", "xd": "*fp32", "xs": "*fp32",
                               "wq": "*i8", "wa": "*fp32", "wm": "*fp32", "bias": "*fp32",
                               "res": "*fp32", "t": "i32", "k": "i32", "n_out": "i32"},
       {"MIN": minimum, "L": sub, "BM": 64, "BN": 64, "HAS_BIAS": True, "HAS_RES": True})
      for minimum, sub in ((1, 32), (2, 32), (0, 16))),
    *(("gemm_fast", "to_half", {"out": "*fp16", "scale": "*fp32", "q": "*i8", "a": "*fp32",
                                "m": "*fp32", "rows": "i32", "k": "i32"},
       {"MIN": minimum, "L": sub, "BR": 8, "BK": 64}) for minimum, sub in ((0, 32), (2, 16))),
    ("gemm_fast", "gemm_h", {"y": "*fp32", "xh": "*fp16", "sx": "*fp32", "wh": "*fp16",
                             "sw": "*fp32", "xq": "*i8", "xd": "*fp32", "xs": "*fp32",
                             "wq": "*i8", "wa": "*fp32", "wm": "*fp32", "bias": "*fp32",
                             "res": "*fp32", "t": "i32", "k": "i32", "n_out": "i32"},
     {"MIN": 2, "L": 32, "BM": 64, "BN": 128, "BK": 32, "HAS_BIAS": True, "HAS_RES": True}),
    ("gemm_fast", "gemm_f", {"y": "*fp32", "x": "*fp32", "w": "*i16", "bias": "*fp32",
                             "res": "*fp32", "t": "i32", "k": "i32", "n_out": "i32",
                             "row_bytes": "i32"},
     {"TYPE": 30, "BM": 64, "BN": 32, "BK": 32, "HAS_BIAS": False, "HAS_RES": False,
      "PRECISION": "tf32x3"}),
    *(("attention_fast", "flash",
       {"out": "*fp32", "q": "*fp32", "k": "*fp32", "v": "*fp32", "positions": "*i32",
        "t": "i32", "n_head": "i32", "group": "i32", "kv_width": "i32", "window": "i32",
        "scale": "fp32"}, {"D": d, "BM": bm, "BN": bn, "PRECISION": "tf32x3"})
      for d, bm, bn in ((64, 32, 32), (256, 16, 16))),
]  # fmt: skip


def _kernel_id(kernel) -> str:
    name, constants = kernel[1], kernel[3]
    keys = ("TYPE", "MIN", "L", "D", "PER", "PARTS")
    shape = (str(constants[c]) for c in keys if c in constants)
    return "-".join((name, *shape))


def _ptx(module: str, name: str, signature: dict, constants: dict) -> str:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"parity.backends.triton.kernels.{module}"), name)
    if "PDL" in fn.arg_names:  # (as on an H200: launched with programmatic dependent launch)
        constants = dict(constants, PDL=True)
    signature = dict(signature, **dict.fromkeys(constants, "constexpr"))
    src = ASTSource(fn=fn, signature=signature, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False}).asm["ptx"]  # fmt: skip


@needs_triton
@pytest.mark.parametrize(("module", "name", "signature", "constants"), KERNELS,
                         ids=[_kernel_id(k) for k in KERNELS])  # fmt: skip
def test_kernels_compile_for_sm90_without_contraction_or_flushing(module, name, signature,
                                                                   constants):  # fmt: skip
    """Triton compiles for a GPU target without a GPU: the PTX has no fused multiply-add, no
    flush-to-zero, and rounds divisions and square roots correctly."""
    ptx = _ptx(module, name, signature, constants)
    assert "fma." not in ptx and ".ftz" not in ptx
    assert "div.full" not in ptx and "div.approx" not in ptx and "sqrt.approx" not in ptx


@needs_triton
@pytest.mark.parametrize(("module", "name", "signature", "constants"),
                         [k for k in KERNELS + FAST_KERNELS if k[1] != "repack"],
                         ids=[_kernel_id(k) for k in KERNELS + FAST_KERNELS
                              if k[1] != "repack"])  # fmt: skip
def test_kernels_wait_for_the_previous_kernel_first(module, name, signature, constants):
    """Under programmatic dependent launch every graph kernel waits for the previous grid
    (``griddepcontrol.wait``) before it stores anything, and only products read memory
    before it: their weights, which no kernel writes."""
    ptx = _ptx(module, name, signature, constants)
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx[wait:]
    assert "st.global" not in ptx[:wait] and "atom." not in ptx[:wait]
    if name in ("matmul_q", "matmul_f"):
        assert "ld.global" in ptx[:wait]  # the first weights, ahead of the wait
    elif name != "rms_norm_f32":  # (which reads its weight row first)
        assert "ld.global" not in ptx[:wait]


@needs_triton
@pytest.mark.parametrize(("module", "name", "signature", "constants"), FAST_KERNELS,
                         ids=[_kernel_id(k) for k in FAST_KERNELS])  # fmt: skip
def test_fast_kernels_compile_for_sm90_onto_tensor_cores(module, name, signature, constants):
    """The quantized GEMM's integer dots run on the tensor cores (mma); the float GEMM and
    flash attention (IEEE float32 dots) compile."""
    ptx = _ptx(module, name, signature, constants)
    assert name not in ("gemm_q", "gemm_h") or "mma" in ptx
    if name == "gemm_h":  # float16 operands into float32 sums
        assert "f32.f16.f16" in ptx, [line for line in ptx.splitlines() if "mma" in line][:3]


WHOLE_MODEL = """
import json
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu.backend import CpuBackend
from parity.backends.gpu.backend import GpuBackend
from parity.backends.triton.backend import TritonBackend
from parity.conformance.compare_steps import compare_steps
from parity.core.backend import Device

views = []
_values = GpuBackend.split_values


def _recorded(self, split, inputs):
    values, made = _values(self, split, inputs)
    views.append(len(made))
    return values, made


GpuBackend.split_values = _recorded
alone = []  # QUANTIZEs of a norm launched on their own (the norm's launch should write them)
_lower = TritonBackend._lower


def _lowered(self, i, node, out, values):
    if node.op.name == "QUANTIZE" and "NORM" in self.graph_nodes[node.src[0]].op.name:
        alone.append(i)
    return _lower(self, i, node, out, values)


TritonBackend._lower = _lowered
spec, weights = synthetic_model(tiny_spec("gemma3", n_ctx_train=512), seed=5)
report = compare_steps("gemma3", spec, weights, [1, 2, 3], 3, lambda: CpuBackend(Device("cpu")),
                       lambda: TritonBackend(TritonBackend.devices()[0]))
print(json.dumps([report.violation is None, report.first_divergent is None,
                  report.identical_share, report.tokens_agree, sum(views), len(alone)]))
"""


@needs_triton
@needs_interpreter
def test_a_whole_gemma3_model_in_the_interpreter_is_bit_exact_with_its_reshapes_as_views():
    """A tiny Gemma 3 (per-head q and k norms: RESHAPEs of computed values, taken as views of
    their buffers, no copies) through prefill and decode steps: every node bit-identical to
    the cpu oracle's, and no norm's QUANTIZE launched apart from its norm."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "-c", WHOLE_MODEL], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    no_violation, none_divergent, share, tokens, views, alone = json.loads(
        run.stdout.splitlines()[-1])  # fmt: skip
    assert no_violation and none_divergent and share == 1.0 and tokens == 3
    assert views > 0
    assert alone == 0  # every norm's QUANTIZE written by the norm's own launch
