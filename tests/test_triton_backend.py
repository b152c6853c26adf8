"""The triton backend without a GPU: its kernels in Triton's interpreter (``TRITON_INTERPRET=1``,
which Triton reads when a kernel is defined, hence a fresh process), judged case by case by the
conformance kit; and its discovery, which imports neither triton nor torch."""

from __future__ import annotations

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


def interpreted(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "parity", *argv], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip


@needs_triton
def test_conformance_in_the_interpreter_is_bit_exact_on_every_claimed_op():
    from parity.backends.triton.backend import OPS

    run = interpreted("conformance", "triton", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    claimed = {op.name for op in OPS}
    ran = [c for c in report["cases"] if c["result"] != "unsupported"]
    wrong = [c for c in ran if c["result"] != "exact"]
    assert ran and not wrong, wrong
    want = {s.id for s in op_suite() if s.op in claimed}
    assert {c["case"] for c in ran} == want  # every case of a claimed op ran, and only those


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
     {"out": "*fp32", "x": "*fp32", "w": "*fp32", "width": "i32", "eps": "fp32"},
     {"MUL": True, "P": 1024, "LOG": 10}),
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
    ("rows", "kv_write_f32", {"cache": "*fp32", "rows": "*fp32", "positions": "*i32",
                              "width": "i32"}, {"BLOCK": 1024}),
    ("rows", "argmax_f32", {"out": "*i32", "x": "*fp32", "width": "i32"},
     {"NBLK": 13, "BLOCK": 4096}),
    ("rows", "quantize_q8", {"q": "*i8", "d": "*fp32", "s": "*fp32", "x": "*fp32", "k": "i32",
                             "nb": "i32"}, {"BLOCKS": 32}),
    *(("dequant", "get_rows", {"out": "*fp32", "w": w, "ids": "*i32", "k": "i32",
                               "row_bytes": "i32"}, {"TYPE": code, "BLOCK": 1024})
      for w, code in (("*u8", 2), ("*u8", 3), ("*u8", 6), ("*u8", 8), ("*u8", 12), ("*u8", 14),
                      ("*fp16", 1), ("*i16", 30))),
]  # fmt: skip


@needs_triton
@pytest.mark.parametrize(("module", "name", "signature", "constants"), KERNELS,
                         ids=[f"{k[1]}-{k[3].get('TYPE', '')}" for k in KERNELS])  # fmt: skip
def test_kernels_compile_for_sm90_without_contraction_or_flushing(module, name, signature,
                                                                   constants):  # fmt: skip
    """Triton compiles for a GPU target without a GPU: the PTX has no fused multiply-add, no
    flush-to-zero, and rounds divisions and square roots correctly."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"parity.backends.triton.kernels.{module}"), name)
    signature = dict(signature, **dict.fromkeys(constants, "constexpr"))
    src = ASTSource(fn=fn, signature=signature, constexprs=constants)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"enable_fp_fusion": False}).asm["ptx"]  # fmt: skip
    assert "fma." not in ptx and ".ftz" not in ptx
    assert "div.full" not in ptx and "div.approx" not in ptx and "sqrt.approx" not in ptx
