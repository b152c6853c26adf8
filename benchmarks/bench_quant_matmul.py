"""Time the cpu oracle's MATMUL on the real models' weight shapes and quant types.

    python benchmarks/bench_quant_matmul.py [--tokens 1 64] [--repeats 5] [--kernels numba]
        [--json]

``--kernels numpy`` (the default) times ``parity.quant.matmul`` on float32 planes, ``numba``
the compiled kernel on the packed bytes (on every core numba may use), activation
quantization included in both.

Weights are random payloads in the real layouts (``parity.quant.synthetic``); speed does not
depend on the values. GB/s counts the packed (GGUF) weight bytes read per call.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter

import numpy as np

from parity.arch.synthetic import twin_layout
from parity.core.dtypes import DType
from parity.core.weights import WeightData
from parity.quant import matmul, prepare_weight
from parity.quant.synthetic import random_weight

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")


def matmul_shapes(model: str) -> list[tuple[str, str, int, int, int]]:
    """(weight, quant type, N, K, how many per forward) of every MATMUL in one forward of the
    real model's layout (parity.arch.synthetic), the head included: ``output`` or, when
    tied, the token embedding."""
    layout = twin_layout(model)
    head = "output.weight" if "output.weight" in layout else "token_embd.weight"
    counts: Counter[tuple[str, str, int, int]] = Counter()
    for name, (dtype, shape) in layout.items():
        if len(shape) == 2 and (name.startswith("blk.") or name == head):
            role = name.split(".")[-2] if name.startswith("blk.") else "output"
            counts[role, dtype.name, *shape] += 1
    return [(*key, n) for key, n in counts.items()]


def time_call(fn, repeats: int, warmup: int) -> float:
    """Median seconds of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64], help="T values")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", choices=MODELS, action="append", help="default: all")
    parser.add_argument("--kernels", choices=["numpy", "numba"], default="numpy")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    rows = []
    totals: dict[str, dict[int, float]] = {}
    for model in args.model or list(MODELS):
        for name, qtype, n, k, count in matmul_shapes(model):
            raw = random_weight(qtype, (n, k), rng)
            weight, fn = _prepared(args.kernels, qtype, raw, (n, k))
            for t in args.tokens:
                x = rng.standard_normal((t, k)).astype(np.float32)
                sec = time_call(lambda x=x, w=weight, f=fn: f(x, w), args.repeats, args.warmup)
                rows.append(
                    {"model": model, "weight": name, "type": qtype, "N": n, "K": k, "T": t,
                     "count": count, "ms": sec * 1e3, "gbps": raw.nbytes / sec / 1e9}
                )  # fmt: skip
                per_model = totals.setdefault(model, {})
                per_model[t] = per_model.get(t, 0.0) + count * sec * 1e3
            del weight

    machine = {
        "kernels": args.kernels,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": _blas_name(),
    }
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows, "total_ms": totals}, indent=2))
        return
    print(" ".join(f"{k}={v}" for k, v in machine.items()))
    print(f"{'model':<20}{'weight':<12}{'type':<6}{'N x K':>14}{'T':>5}{'ms':>10}{'GB/s':>8}")
    for r in rows:
        shape = f"{r['N']}x{r['K']}"
        print(
            f"{r['model']:<20}{r['weight']:<12}{r['type']:<6}{shape:>14}{r['T']:>5}"
            f"{r['ms']:>10.3f}{r['gbps']:>8.2f}"
        )
    for model, per_t in totals.items():
        for t, ms in per_t.items():
            print(
                f"{model}: all matmuls of one forward at T={t}: {ms:.1f} ms ({ms / t:.2f} ms/token)"
            )


def _prepared(kernels: str, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple:
    """(weight in the kernels' working form, matmul function)."""
    if kernels == "numpy":
        return prepare_weight(qtype, raw, shape), matmul
    from parity.backends.cpu.jit.ops import matmul_op, pack_weight

    return pack_weight(WeightData("w", DType.parse(qtype), shape, raw)), matmul_op


def _blas_name() -> str:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas['version']}"
    except Exception:  # show_config's layout differs across numpy versions
        return "unknown"


if __name__ == "__main__":
    main()
