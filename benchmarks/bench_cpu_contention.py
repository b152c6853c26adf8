"""Decode speed of the cpu backend with and without a competing busy loop, started here: the
default thread policy (all cores, fewer while that is faster) against fixed counts. The default
must never fall below the single-thread speed. Prints a table, and JSON with ``--json``.

    python benchmarks/bench_cpu_contention.py [-m smollm2-135m] [-g 64] [--competitors 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time


def busy() -> None:
    while True:
        pass


def decode(model: str, gen: int, threads: int | None) -> dict:
    cmd = [sys.executable, "-m", "parity", "bench", "-m", model, "-b", "cpu", "-p", "8",
           "-g", str(gen), "--json"]  # fmt: skip
    if threads is not None:
        cmd += ["-j", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-g", "--gen", type=int, default=64)
    ap.add_argument("--competitors", type=int, default=1, help="busy-loop processes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for load in (0, args.competitors):
        procs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(load)]
        for p in procs:
            p.start()
        time.sleep(0.5)
        try:
            for threads in (None, cores, 1):
                r = decode(args.model, args.gen, threads)
                rows.append({"competitors": load, "threads": threads or "default",
                             "decode_tok_s": r["decode_tok_s"],
                             "step_ms": r["step_ms"]})  # fmt: skip
        finally:
            for p in procs:
                p.terminate()
    if args.json:
        print(json.dumps({"cores": cores, "model": args.model, "rows": rows}))
        return
    print(f"{args.model}, {cores} cores, decode {args.gen} tokens after an 8-token prompt")
    print(f"{'competitors':>11} {'threads':>8} {'tok/s':>8} {'step ms':>8}")
    for r in rows:
        print(f"{r['competitors']:>11} {r['threads']!s:>8} {r['decode_tok_s']:>8.1f} "
              f"{r['step_ms']:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
