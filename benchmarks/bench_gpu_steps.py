"""One model's decode step on a GPU backend, taken apart: splits, fallbacks, kernel launches per
step, capture status, and the step's time three ways (the whole ``Step.run`` on the host clock;
the executable alone between CUDA events, eager and as a replayed graph). Medians after
warm-up. Prints one JSON line.

    python benchmarks/bench_gpu_steps.py MODEL.gguf [--backend cuda] [--ctx 1024] [--runs 200]
        [--profile | --first-step | --look-ahead-ab | --host-profile]
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
    ap.add_argument(
        "--reach",
        type=int,
        default=0,
        help="the decode graph's GraphParams.reach (a session's below its SHALLOW_REACH: "
        "flash decoding sized to it, not to --ctx; 0: none); the positions stay below it",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="time every kernel of a step (under programmatic dependent launch a kernel starts "
        "before the one before it ends and waits for it, and CUPTI counts the wait: "
        "PARITY_PDL=0 for each kernel's own time)",
    )
    ap.add_argument(
        "--prefill",
        type=int,
        default=512,
        help="tokens of the prefill --profile times (0: none, the decode step alone)",
    )
    ap.add_argument("--numerics", default="exact")
    ap.add_argument(
        "--first-step",
        action="store_true",
        help="profile the first decode step after a 512-token prefill",
    )
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after loading")
    ap.add_argument(
        "--look-ahead-ab",
        action="store_true",
        help="parity bench's figures with greedy look-ahead 2 deep, 1 deep and off, 3 rounds",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="where a steady greedy decode step's host time goes (cProfile, by own time)",
    )
    args = ap.parse_args()
    model = parity.load(args.model, backend=args.backend, n_ctx=args.ctx, verify_capture=True,
                        numerics=args.numerics)  # fmt: skip
    if args.gc_freeze:
        import gc

        gc.freeze()
    if args.first_step:
        first_step(model)
        return
    if args.look_ahead_ab:
        look_ahead_ab(model)
        return
    if args.host_profile:
        host_profile(model)
        return
    import torch

    rt = model.runtime
    if args.reach and args.position + 8 > args.reach:
        raise SystemExit(f"--position {args.position} (+7) is not below --reach {args.reach}")
    graph = model.graphs(GraphParams(n_tokens=1, n_ctx=args.ctx, output="argmax", reach=args.reach))
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
        n = args.prefill
        if n:
            prefill = model.graphs(GraphParams(n_tokens=n, n_ctx=args.ctx, n_out=1))
            pstep = rt.step(prefill, ())
            pstep.write(graph_inputs(np.arange(n, dtype=np.int32) % 1000, 0))
            pstep.run()
            step.write(graph_inputs(np.asarray([7], np.int32), args.position))
            step.run()  # the decode step's inputs again, after the prefill's
        print("decode", json.dumps(kernel_times(main_split.executable, backend, torch)))
        if n:
            print(f"prefill{n}", json.dumps(kernel_times(pstep._splits[0].eager, backend, torch)))
            print(f"prefill{n}_ms_events", round(events(pstep._splits[0].eager) * 1e3, 4))
    print(json.dumps({
        "model": model.name, "backend": backend.device.id, "ctx": args.ctx,
        "splits": len(splits), "fallbacks": len(step.plan.fallbacks),
        "launches_per_step": launches, "capture_status": step.capture_status,
        "step_ms_host": round(statistics.median(host) * 1e3, 4),
        "step_ms_eager_events": round(eager_s * 1e3, 4),
        "step_ms_replay_events": None if replay_s is None else round(replay_s * 1e3, 4),
        "decode_tok_s_host": round(1 / statistics.median(host), 1),
    }))  # fmt: skip


def first_step(model, prompt_tokens: int = 512, runs: int = 3) -> None:
    """The first decode step after a prefill against the later ones (host clock), and where the
    first one's host time goes (cProfile, in one more run)."""
    import cProfile
    import gc
    import io
    import pstats

    from parity.generation.session import Session

    prefill, step = Session.prefill, Session.step
    state: dict = {"first": False, "times": [], "now": "other"}

    def timed_prefill(self, *a, **k):
        state["first"] = True
        return prefill(self, *a, **k)

    def timed_step(self, *a, **k):
        profiler = cProfile.Profile() if state["first"] and state["profile_it"] else None
        current.clear()
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        state["now"] = "first" if state["first"] else "later"
        out = step(self, *a, **k)
        if profiler is not None:
            profiler.disable()
            state["profile"] = profiler
        took = time.perf_counter() - t0
        phases[state["now"]].append({"session_step": took, **current})
        state["now"] = "other"
        state["times"].append((state["first"], took))
        state["first"] = False
        return out

    Session.prefill, Session.step = timed_prefill, timed_step
    backend = model.backends[0]
    # host time of each Session.step (first after the prefill, later ones), in pieces: the
    # steps' starts (inputs, feeds, the enqueue, downloads), the executable's enqueue within
    # them, the wait for the GPU. With a step started ahead, a Session.step waits for its own
    # step and starts the next; the first decode step itself starts inside the prefill.
    from parity.core.runtime import Step

    phases: dict = {"first": [], "later": []}
    sync = backend.synchronize
    current: dict = {}

    def timed_sync():
        t0 = time.perf_counter()
        sync()
        current["sync"] = current.get("sync", 0.0) + time.perf_counter() - t0

    backend.synchronize = timed_sync
    # the pieces of Step.run's own host work, each timed where it is looked up at call time
    # (instance attributes of the backend and its GPU runtime, methods of Step and Runtime)
    patched: list = []

    def time_piece(owner, attr: str, key: str) -> None:
        original = getattr(owner, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                current[key] = current.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)
        patched.append((owner, attr, original))

    pieces = [(Step, "start", "start"), (Step, "_check_inputs", "check"),
              (Step, "_upload_kept", "kept_upload"),
              (type(model.runtime), "place_states", "place_states"),
              (backend, "copy_from", "device_copy"), (backend, "increment", "advance"),
              (backend, "upload", "upload"), (backend, "download", "download")]  # fmt: skip
    if hasattr(backend, "rt"):
        pieces += [(backend.rt, "replay", "replay")]
    for owner, attr, key in pieces:
        time_piece(owner, attr, key)
    execute = backend.execute
    gpu: list = []  # (where, start event, end event) of every execute
    gc_ms: list = []  # (where, ms) of every garbage collection
    if hasattr(backend, "rt"):
        import torch

        def timed_execute(exe):
            if backend.rt.capturing:  # events recorded into a graph cannot be timed
                return execute(exe)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(backend.rt.stream)
            t0 = time.perf_counter()
            execute(exe)
            current["execute"] = current.get("execute", 0.0) + time.perf_counter() - t0
            end.record(backend.rt.stream)
            gpu.append((state["now"], start, end))

        backend.execute = timed_execute
    gc_start: list = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_ms.append((state["now"], (time.perf_counter() - gc_start[0]) * 1e3))

    gc.callbacks.append(on_gc)
    prompt = np.random.default_rng(0).integers(0, model.spec.n_vocab, prompt_tokens).tolist()
    for run in range(runs + 1):  # the last, profiled, is not timed
        state["profile_it"] = run == runs
        if run == runs:
            state["times_clean"] = list(state["times"])
        model.reset()
        model.generate(prompt, max_tokens=32, temperature=0.0, ignore_eos=True).complete()
    Session.prefill, Session.step = prefill, step
    backend.execute = execute
    backend.synchronize = sync
    for owner, attr, original in reversed(patched):
        if owner in (Step, type(model.runtime)):
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)  # back to the class's method
    keys = ("session_step", "execute", "sync", *dict.fromkeys(key for _, _, key in pieces))
    print(json.dumps({  # first: the runs' first steps (the profiled run's included)
        f"host_us_{now}": {k: round(statistics.median(p.get(k, 0.0) for p in runs) * 1e6, 1)
                           for k in keys}
        for now, runs in phases.items() if runs
    }))  # fmt: skip
    gc.callbacks.remove(on_gc)
    if gpu:
        gpu[-1][2].synchronize()
        ms = [(now, s.elapsed_time(e)) for now, s, e in gpu]
        print(json.dumps({
            "gpu_first_step_ms": [round(t, 3) for now, t in ms if now == "first"],
            "gpu_later_step_ms_median": round(
                statistics.median(t for now, t in ms if now == "later"), 3),
        }))  # fmt: skip
    print(json.dumps({
        "gc_ms_in_steps": {k: [round(t, 3) for now, t in gc_ms if now == k]
                           for k in ("first", "later")},
        "gc_ms_elsewhere": round(sum(t for now, t in gc_ms if now == "other"), 3),
    }))  # fmt: skip
    firsts = [t for f, t in state["times_clean"] if f]
    later = [t for f, t in state["times_clean"] if not f]
    print(
        json.dumps(
            {
                "first_step_ms": [round(t * 1e3, 3) for t in firsts],
                "later_step_ms_median": round(statistics.median(later) * 1e3, 3),
            }
        )
    )
    text = io.StringIO()
    pstats.Stats(state["profile"], stream=text).sort_stats("cumulative").print_stats(18)
    print(text.getvalue()[-4000:])


def look_ahead_ab(model, rounds: int = 3) -> None:
    """``parity bench``'s decode figures (prompts of 1 and 512 tokens, 128 generated) with the
    session's look-ahead two steps deep (as shipped), one step deep, and off, alternated in one
    process; medians over the rounds."""
    from parity.generation import session
    from parity.measure.bench import bench

    keys = ("decode_tok_s", "ttft_ms", "first_step_ms", "step_ms")
    shipped = session.LOOK_AHEAD
    depths = (shipped, 1, 0)  # (the session queues at most its two copies)
    for prompt in (1, 512):
        runs: dict = {depth: [] for depth in depths}
        try:
            for _ in range(rounds):
                for depth in depths:
                    model.session.look_ahead = depth > 0
                    session.LOOK_AHEAD = max(depth, 1)
                    runs[depth].append(bench(model, prompt, 128).to_dict())
        finally:
            model.session.look_ahead, session.LOOK_AHEAD = True, shipped
        print(json.dumps({
            "prompt_tokens": prompt,
            **{f"look_ahead_{depth}": {
                k: round(statistics.median(r[k] for r in rs), 3) for k in keys}
               for depth, rs in runs.items()},
        }))  # fmt: skip


def host_profile(model, steps: int = 200) -> None:
    """Greedy decode after a 1-token prompt; the steps after the first 16 run under cProfile."""
    import cProfile
    import io
    import pstats

    gen = model.generate([1], max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    it = iter(gen)
    for _ in range(16):
        next(it)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    n = sum(1 for _ in it)
    profiler.disable()
    print(f"host profile: {n} steps, {(time.perf_counter() - t0) / n * 1e3:.3f} ms a step "
          "(profiled)")  # fmt: skip
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[-6000:])


def kernel_times(exe, backend, torch, runs: int = 10) -> dict:
    """Device microseconds per run of each kernel (CUPTI, through torch.profiler, captured
    graphs included; under PDL a kernel's time holds its wait for the kernel before), their
    count per run, and the run's busy total."""
    from torch.profiler import ProfilerActivity, profile

    backend.execute(exe)
    backend.rt.stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            backend.execute(exe)
        backend.rt.stream.synchronize()
    table = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and not e.key.startswith(("Memcpy", "Memset", "cudaGraph")):
            table[e.key[:60]] = (round(us / runs, 1), e.count // runs)
    return {
        "busy_us": round(sum(t for t, _ in table.values()), 1),
        "kernels_us_count": dict(sorted(table.items(), key=lambda kv: -kv[1][0])),
    }


if __name__ == "__main__":
    main()
