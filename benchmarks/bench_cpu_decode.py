"""Whole-model speed of the cpu oracle on synthetic twins of the real models.

    python benchmarks/bench_cpu_decode.py [--model smollm2-135m] [--prompt 32] [--steps 16]

Times prefill of a prompt and greedy-sized decode steps (median after warm-up) through the
same graph, scheduler and runtime a real model uses. Weights are random, so only speed means
anything here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from parity.backends.cpu.backend import CpuBackend
from parity.core.backend import Device
from parity.core.params import GraphParams
from parity.core.runtime import Runtime
from parity.models.decoder import DecoderGraphs, graph_inputs
from parity.models.synthetic import REAL_SPECS, synthetic_twin


def bench(name: str, prompt: int, steps: int, n_ctx: int) -> dict:
    spec, weights = synthetic_twin(name)
    runtime = Runtime([CpuBackend(Device("cpu"))], weights)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, spec.n_vocab, prompt + steps + 2, dtype=np.int32)

    graphs = DecoderGraphs(spec)
    t0 = time.perf_counter()
    warm = graphs(GraphParams(n_tokens=1, n_ctx=n_ctx, output="argmax"))
    runtime.run(warm, graph_inputs(tokens[:1], 0))  # unpacks every weight once
    first_use_s = time.perf_counter() - t0
    runtime.reset()

    pre = graphs(GraphParams(n_tokens=prompt, n_ctx=n_ctx, output="argmax"))
    t0 = time.perf_counter()
    runtime.run(pre, graph_inputs(tokens[:prompt], 0))
    prefill_s = time.perf_counter() - t0

    step = graphs(GraphParams(n_tokens=1, n_ctx=n_ctx, output="argmax"))
    times = []
    for i in range(steps):
        pos = prompt + i
        t0 = time.perf_counter()
        runtime.run(step, graph_inputs(tokens[pos : pos + 1], pos))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[2:] if steps > 4 else times)
    return {
        "model": name,
        "weights_mb": round(sum(w.nbytes for w in weights.values()) / 1e6, 1),
        "first_use_s": round(first_use_s, 2),
        "prefill_tokens": prompt,
        "prefill_tok_s": round(prompt / prefill_s, 1),
        "decode_step_ms": round(step_s * 1e3, 2),
        "decode_tok_s": round(1 / step_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(REAL_SPECS))
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for name in args.model or sorted(REAL_SPECS):
        result = bench(name, args.prompt, args.steps, args.n_ctx)
        print(json.dumps(result) if args.json else "  ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
