"""Whole-model speed of the cpu backend on synthetic twins of the real models, its kernel
modes (and, with ``--unfused``, each without its fusions) compared in one run.

    python benchmarks/bench_cpu_decode.py [--model smollm2-135m] [--kernels numpy numba]
        [--unfused | --ab] [--prefill 128 512] [--prompt 32] [--steps 24] [--repeats 3]
        [--threads N] [--cold]

Per model and variant, ``--repeats`` times on a fresh backend: the first decode step
(``first_call_s``: weight preparation and, for numba, loading the compiled kernels from the
cache), a prefill of each ``--prefill`` length, then ``--steps`` greedy decode steps after a
``--prompt``-token prefill, through a Session as generation runs them (the token fed back on
the device, the position kept there; the median step after 2 warm-up steps). Reported: the
median over repeats and the spread (min-max). ``--cold`` also times the first call with an
empty numba cache, in a subprocess, which is what a first run on a new machine pays. ``--ab``
instead runs each mode with and without its fusions side by side in one process, their
prefills and steps in turns, and reports medians and unfused/fused ratios. Weights are random
payloads in the real files' layouts and quant types; only speed means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from parity.arch.decoder import DecoderGraphs, DecoderSpec, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import REAL_SPECS, synthetic_twin
from parity.backends.cpu.backend import CpuBackend
from parity.core.backend import Device
from parity.core.runtime import Runtime
from parity.generation.session import Session


def measure(
    spec: DecoderSpec,
    weights: dict,
    kernels: str,
    fused: bool,
    threads: int | None,
    args: argparse.Namespace,
) -> dict:
    """One fresh backend: first call, prefills, decode steps."""
    n_ctx = max([args.prompt + args.steps + 1, *args.prefill])
    graphs = DecoderGraphs(spec)
    tokens = np.random.default_rng(0).integers(0, spec.n_vocab, n_ctx, dtype=np.int32)
    step = graphs(GraphParams(n_tokens=1, n_ctx=n_ctx, output="argmax"))

    t0 = time.perf_counter()
    backend = CpuBackend(Device("cpu"), kernels=kernels, threads=threads)
    runtime = Runtime([backend], weights, rewrite=fused)
    runtime.run(step, graph_inputs(tokens[:1], 0))
    out = {"first_call_s": time.perf_counter() - t0}

    for n in args.prefill:
        runtime.reset()
        graph = graphs(GraphParams(n_tokens=n, n_ctx=n_ctx, n_out=1, output="argmax"))
        t0 = time.perf_counter()
        runtime.run(graph, graph_inputs(tokens[:n], 0))
        out[f"prefill{n}_tok_s"] = n / (time.perf_counter() - t0)

    runtime.reset()
    session = Session(runtime, graphs, n_ctx)
    token = session.prefill(tokens[: args.prompt].tolist(), greedy=True)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        token = session.step(token, greedy=True)
        times.append(time.perf_counter() - t0)
    out["decode_step_ms"] = statistics.median(times[2:] if args.steps > 4 else times) * 1e3
    return out


def fused_against_unfused(
    spec: DecoderSpec, weights: dict, kernels: str, threads: int | None, args: argparse.Namespace
) -> dict:
    """The same backend with and without its fusions, their prefills and decode steps taken
    in turns (fused, unfused, fused, ...) so that drift in the machine's speed hits both."""
    n_ctx = max([args.prompt + args.steps + 1, *args.prefill])
    graphs = DecoderGraphs(spec)
    tokens = np.random.default_rng(0).integers(0, spec.n_vocab, n_ctx, dtype=np.int32)
    sides = {}
    for fused in (True, False):
        backend = CpuBackend(Device("cpu"), kernels=kernels, threads=threads)
        sides[fused] = Session(Runtime([backend], weights, rewrite=fused), graphs, n_ctx)
    times: dict[str, dict[bool, list[float]]] = {}
    for n in args.prefill:
        for _ in range(args.repeats):
            for fused, session in sides.items():
                session.reset()
                t0 = time.perf_counter()
                session.prefill(tokens[:n].tolist(), greedy=True)
                times.setdefault(f"prefill{n}_ms", {}).setdefault(fused, []).append(
                    (time.perf_counter() - t0) * 1e3
                )
    next_token = {}
    for fused, session in sides.items():
        session.reset()
        next_token[fused] = session.prefill(tokens[: args.prompt].tolist(), greedy=True)
    for _ in range(args.steps):
        for fused, session in sides.items():
            t0 = time.perf_counter()
            next_token[fused] = session.step(next_token[fused], greedy=True)
            times.setdefault("decode_step_ms", {}).setdefault(fused, []).append(
                (time.perf_counter() - t0) * 1e3
            )
    out: dict = {}
    for key, by_side in times.items():
        for fused, values in by_side.items():
            values = values[2:] if key == "decode_step_ms" and len(values) > 4 else values
            out[f"{key}_{'fused' if fused else 'unfused'}"] = round(statistics.median(values), 3)
        out[f"{key}_ratio"] = round(out[f"{key}_unfused"] / out[f"{key}_fused"], 3)
    return out


def cold_first_call(model: str, kernels: str, threads: int | None) -> float:
    """First call with an empty numba cache, in a fresh process (so nothing is compiled yet)."""
    code = (
        "import sys, time, numpy as np\n"
        "from benchmarks.bench_cpu_decode import first_call\n"
        f"print(first_call({model!r}, {kernels!r}, {threads!r}))\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
        )
    if done.returncode:
        raise RuntimeError(done.stderr)
    return float(done.stdout.split()[-1])


def first_call(model: str, kernels: str, threads: int | None) -> float:
    """Seconds from a new backend to the end of its first decode step (weights already built)."""
    spec, weights = synthetic_twin(model)
    step = DecoderGraphs(spec)(GraphParams(n_tokens=1, n_ctx=64, output="argmax"))
    t0 = time.perf_counter()
    runtime = Runtime([CpuBackend(Device("cpu"), kernels=kernels, threads=threads)], weights)
    runtime.run(step, graph_inputs(np.zeros(1, np.int32), 0))
    return time.perf_counter() - t0


def summary(runs: list[dict]) -> dict:
    """Median and (min, max) of every metric over the repeats."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = round(statistics.median(values), 3)
        out[key + "_range"] = [round(min(values), 3), round(max(values), 3)]
    out["decode_tok_s"] = round(1e3 / out["decode_step_ms"], 1)
    return out


def machine() -> dict:
    import numba

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
        commit += " (uncommitted changes)" if dirty.stdout.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "commit": commit,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": numba.__version__,
        "load_avg": [round(v, 2) for v in os.getloadavg()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(REAL_SPECS))
    modes = ["numba", "numpy", "definition"]
    ap.add_argument("--kernels", nargs="+", default=["numpy", "numba"], choices=modes)
    ap.add_argument("--unfused", action="store_true", help="also each mode without its fusions")
    ap.add_argument(
        "--ab", action="store_true", help="fused against unfused, steps in turns (ratios)"
    )
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    ap.add_argument("--cold", action="store_true", help="also time a first call, empty cache")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    print(json.dumps(machine()) if args.json else machine())
    for name in args.model or sorted(REAL_SPECS):
        spec, weights = synthetic_twin(name)
        if args.ab:
            for kernels in args.kernels:
                result = fused_against_unfused(spec, weights, kernels, args.threads, args)
                result = {"model": name, "kernels": kernels, **result}
                result["load_avg"] = [round(v, 2) for v in os.getloadavg()]
                line = "  ".join(f"{k}={v}" for k, v in result.items())
                print(json.dumps(result) if args.json else line, flush=True)
            continue
        for kernels, fused in [
            (k, f) for k in args.kernels for f in (True, False)[: 1 + args.unfused]
        ]:
            runs = [
                measure(spec, weights, kernels, fused, args.threads, args)
                for _ in range(args.repeats)
            ]
            result = {"model": name, "kernels": kernels, "fused": fused, **summary(runs)}
            if args.cold and kernels == "numba":
                result["first_call_cold_s"] = round(cold_first_call(name, kernels, args.threads), 2)
            result["load_avg"] = [round(v, 2) for v in os.getloadavg()]
            line = "  ".join(f"{k}={v}" for k, v in result.items())
            print(json.dumps(result) if args.json else line, flush=True)


if __name__ == "__main__":
    main()
