"""One model's decode step on a GPU backend, taken apart: splits, fallbacks, kernel launches per
step, capture status, and the step's time three ways (the whole ``Step.run`` on the host clock;
the executable alone between CUDA events, eager and as a replayed graph). Medians after
warm-up. Prints one JSON line.

    python benchmarks/bench_gpu_steps.py MODEL.gguf [--backend cuda] [--ctx 1024] [--runs 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import parity
from parity.arch.decoder import graph_inputs
from parity.arch.params import GraphParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--position", type=int, default=100)
    ap.add_argument("--profile", action="store_true", help="time every kernel of eager steps")
    args = ap.parse_args()
    import torch

    model = parity.load(args.model, backend=args.backend, n_ctx=args.ctx, verify_capture=True)
    rt = model.runtime
    graph = model.graphs(GraphParams(n_tokens=1, n_ctx=args.ctx, output="argmax"))
    step = rt.step(graph, ())
    backend = model.backends[0]
    splits = step._splits
    launches = sum(len(getattr(s.eager, "launches", ())) for s in splits)

    def run(p: int) -> None:
        step.write(graph_inputs(np.asarray([p % 1000], np.int32), args.position + p % 8))
        step.run()

    host = []
    for p in range(args.runs + 10):
        t0 = time.perf_counter()
        run(p)
        host.append(time.perf_counter() - t0)
    host = host[10:]

    def events(exe) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.runs):
            start.record(backend.rt.stream)
            backend.execute(exe)
            end.record(backend.rt.stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    main_split = max(splits, key=lambda s: len(s.eager.split.nodes))
    eager_s = events(main_split.eager)
    replay_s = (
        events(main_split.executable) if main_split.executable is not main_split.eager else None
    )
    if args.profile:
        prefill = model.graphs(GraphParams(n_tokens=512, n_ctx=args.ctx, n_out=1))
        pstep = rt.step(prefill, ())
        pstep.write(graph_inputs(np.arange(512, dtype=np.int32) % 1000, 0))
        pstep.run()
        for what, exe in (("decode", main_split.eager), ("prefill512", pstep._splits[0].eager)):
            print(what, json.dumps(kernel_times(exe, backend, torch)))
    print(json.dumps({
        "model": model.name, "backend": backend.device.id, "ctx": args.ctx,
        "splits": len(splits), "fallbacks": len(step.plan.fallbacks),
        "launches_per_step": launches, "capture_status": step.capture_status,
        "step_ms_host": round(statistics.median(host) * 1e3, 4),
        "step_ms_eager_events": round(eager_s * 1e3, 4),
        "step_ms_replay_events": None if replay_s is None else round(replay_s * 1e3, 4),
        "decode_tok_s_host": round(1 / statistics.median(host), 1),
    }))  # fmt: skip


def kernel_times(exe, backend, torch, runs: int = 5) -> dict:
    """Milliseconds per kernel name over one eager run (the median of ``runs``), each launch
    between its own CUDA events."""
    stream = backend.rt.stream
    per_run = []
    for _ in range(runs):
        marks = []
        for fn, fargs in exe.launches:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn(*fargs)
            end.record(stream)
            marks.append((getattr(fargs[0], "name", "copy"), start, end))
        stream.synchronize()
        totals: dict[str, float] = {}
        for name, start, end in marks:
            totals[name] = totals.get(name, 0.0) + start.elapsed_time(end)
        per_run.append(totals)
    names = per_run[0]
    table = {n: round(statistics.median(r[n] for r in per_run), 4) for n in names}
    counts: dict[str, int] = {}
    for _, fargs in exe.launches:
        name = getattr(fargs[0], "name", "copy")
        counts[name] = counts.get(name, 0) + 1
    return {
        "total_ms": round(sum(table.values()), 3),
        "kernels": dict(sorted(((n, (t, counts[n])) for n, t in table.items()),
                               key=lambda kv: -kv[1][0])),
    }  # fmt: skip


if __name__ == "__main__":
    main()
