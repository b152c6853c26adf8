"""A backend (cuda by default) against the cpu oracle (or another backend) on one model file:
every node of every step bit for bit (``compare_steps``) after prompts of 1, 7, 300 and 600
tokens with 64 decode steps each, then 256 greedy tokens generated on each backend after a
prompt of 7 (``--greedy-prompt``: one that ends near 512 takes the greedy run across the
session's SHALLOW_REACH, from its shallow decode graphs to its deep ones). Prompts are seeded
random ids (twins have random weights; any ids do). One line per check.

    python benchmarks/gpu_compare.py MODEL.gguf [--prompts 1,7,300,600] [--steps 64]
        [--greedy 256] [--greedy-prompt 7] [--candidate cuda] [--reference cpu]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import parity
from parity.backends.cpu.backend import CpuBackend
from parity.conformance.compare_steps import compare_steps
from parity.conformance.report import backend_factory
from parity.core.backend import Device
from parity.core.plugins import load_backends


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", default="1,7,300,600")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--greedy", type=int, default=256)
    ap.add_argument("--greedy-prompt", type=int, default=7)
    ap.add_argument("--candidate", default="cuda")
    ap.add_argument("--reference", default="cpu")
    args = ap.parse_args()
    file = parity.load(args.model, backends=())
    name = file.name
    failed = 0
    if args.reference == "cpu":
        reference = lambda: CpuBackend(Device("cpu"))  # noqa: E731 (the numba oracle)
    else:
        reference = backend_factory(load_backends(), args.reference, reference=True)
    for n in (int(p) for p in args.prompts.split(",")):
        prompt = [int(t) for t in np.random.default_rng(n).integers(0, file.spec.n_vocab, n)]
        t0 = time.perf_counter()
        report = compare_steps(
            name, file.spec, file.file.weights, prompt, args.steps,
            reference, backend_factory(load_backends(), args.candidate),
        )  # fmt: skip
        ok = report.violation is None and report.first_divergent is None
        failed += not ok
        print(f"compare prompt {n} + {args.steps} steps ({time.perf_counter() - t0:.0f} s): "
              + " | ".join(report.summary().splitlines()))  # fmt: skip
    prompt = [
        int(t) for t in np.random.default_rng(0).integers(0, file.spec.n_vocab, args.greedy_prompt)
    ]
    n_ctx = 512  # (past 512 positions: the next power of two, whose sessions split at the reach)
    while n_ctx < len(prompt) + args.greedy:
        n_ctx *= 2
    tokens = {}
    for backend in (args.reference, args.candidate):
        model = parity.load(args.model, backend=backend, n_ctx=n_ctx)
        gen = model.generate(prompt, max_tokens=args.greedy, temperature=0.0, ignore_eos=True)
        tokens[backend] = gen.complete().tokens
    same = tokens[args.reference] == tokens[args.candidate]
    failed += not same
    verdict = "identical" if same else "DIFFER"
    print(f"greedy {args.greedy} tokens after {len(prompt)}: {args.reference} and "
          f"{args.candidate} {verdict} ({len(tokens[args.candidate])} generated)")  # fmt: skip
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
