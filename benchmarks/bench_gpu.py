"""parity's GPU backends beside llama.cpp on the same model files, in one run: decode tok/s at
context depths, prefill tok/s and time to first token at prompt sizes (llama.cpp's: its prompt
time, a lower bound, as llama-bench times no first token), and the first decode step against
the steady one. Prints one table and writes JSON.

    python benchmarks/bench_gpu.py MODEL.gguf [MODEL.gguf ...]
        [--runners cuda:exact,triton:exact,triton:fast] [--depths 0,4096] [--prefill 128,512]
        [--gen 128] [--repeat 3] [--llama-bench /tmp/lcpp/build/bin/llama-bench] [--json F]

A runner is BACKEND:NUMERICS, optionally with environment settings its backend reads when it
is made, ``cuda:exact:PARITY_PDL=0``, and switches of the cuda lowering held while it runs,
``cuda:exact:lowering.NORM_AFTER_PRODUCT=1`` (benchmarks/with_lowering.py sets them for a
whole process). Each (runner, size) is ``parity bench``'s measurement
(a warm-up pass, then a greedy generation after a prompt of that many seeded random tokens),
repeated ``--repeat`` times, on the model loaded with a cache of the size plus the generation
and 16 rows (llama-bench sizes its context per test the same way); the table gives medians.
Sizes whose run does not fit a model's trained context are left out for it ("past ctx").
Decode at depth d is the steady step after a d-token prompt (d = 0: a 1-token prompt).
llama.cpp runs when ``--llama-bench`` names a build: ``-ngl 99 -fa 1``, prefill at depth 0 and
tg128 at each depth, ``-r`` = repeat; the table gives the median of its samples (± their
standard deviation), the ratios are against it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import parity
from parity.arch.model_file import read_model_file
from parity.measure.bench import bench

CTX_SPARE = 16  # cache rows past a run's prompt and generation


def run_parity(model: str, runner: str, sizes: list[int], gen: int, repeat: int) -> dict:
    """Each size on the model loaded anew with a cache of that size plus the generation (as
    llama-bench sizes its context per test), so a short run does not carry a long cache."""
    backend, numerics, *env = runner.split(":")
    settings = dict(e.split("=", 1) for e in env)
    switches = {k.removeprefix("lowering."): v for k, v in settings.items()
                if k.startswith("lowering.")}  # fmt: skip
    settings = {k: v for k, v in settings.items() if not k.startswith("lowering.")}
    out: dict = {"load_s": {}, "sizes": {}}
    for size in sizes:
        t0 = time.perf_counter()
        with _lowering(switches):
            with _environment(settings):
                m = parity.load(model, backend=backend, numerics=numerics, strict=True,
                                n_ctx=max(size, 1) + gen + CTX_SPARE)  # fmt: skip
            out["load_s"][size] = round(time.perf_counter() - t0, 3)
            try:
                runs = [bench(m, max(size, 1), gen) for _ in range(repeat)]
            finally:
                m.close()
        med = {key: statistics.median(getattr(r, key) for r in runs)
               for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "first_step_ms",
                           "step_ms")}  # fmt: skip
        med["decode_capture"] = runs[-1].decode_capture
        out["sizes"][size] = med
    return out


@contextlib.contextmanager
def _environment(settings: dict[str, str]):
    """``settings`` in the environment while a backend is made (it reads them then)."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _lowering(switches: dict[str, str]):
    """The cuda lowering's switches (NAME or NAME[KEY] of a dict switch) set while a runner
    loads and runs (steps are lowered when first run), then restored."""
    from with_lowering import set_switch

    restore = [set_switch(f"{name}={value}") for name, value in switches.items()]
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def run_llama(llama_bench: str, model: str, depths: list[int], prefill: list[int], gen: int,
              repeat: int) -> dict:  # fmt: skip
    common = [llama_bench, "-m", model, "-ngl", "99", "-fa", "1", "-r", str(repeat), "-o", "json"]
    rows = []
    runs = [
        (prefill, ["-p", ",".join(map(str, prefill)), "-n", "0"]),
        (depths, ["-p", "0", "-n", str(gen), "-d", ",".join(map(str, depths))]),
    ]
    for extra in (args for sizes, args in runs if sizes):  # (none may fit the model's context)
        done = subprocess.run(common + extra, capture_output=True, text=True, check=True)
        rows += json.loads(done.stdout)
    out: dict = {"prefill": {}, "decode": {}}
    for r in rows:
        key = "prefill" if r["n_gen"] == 0 else "decode"
        size = r["n_prompt"] if key == "prefill" else r.get("n_depth", 0)
        samples = r.get("samples_ts") or [r["avg_ts"]]  # (a slow first sample pulls the mean)
        out[key][size] = {"tok_s": round(statistics.median(samples), 1),
                          "mean": round(r["avg_ts"], 1), "stddev": round(r["stddev_ts"], 1),
                          "samples": [round(x, 1) for x in samples]}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--runners", default="cuda:exact,triton:exact,triton:fast")
    ap.add_argument("--depths", default="0,4096")
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    prefill = [int(p) for p in args.prefill.split(",")]
    sizes = sorted(set(depths) | set(prefill))
    results: dict = {}
    for model in args.models:
        name = Path(model).stem
        results[name] = {}
        trained = read_model_file(model).spec.n_ctx_train  # sizes past it are left out
        fit = [s for s in sizes if max(s, 1) + args.gen + CTX_SPARE <= trained]
        for runner in filter(None, args.runners.split(",")):  # (none: llama.cpp alone)
            results[name][runner] = run_parity(model, runner, fit, args.gen, args.repeat)
            print(f"{name} {runner}: {json.dumps(results[name][runner]['sizes'])}", flush=True)
        if args.llama_bench:
            results[name]["llama.cpp"] = run_llama(
                args.llama_bench, model, [d for d in depths if d in fit],
                [p for p in prefill if p in fit], args.gen, args.repeat)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results, depths, prefill)


def print_table(results: dict, depths: list[int], prefill: list[int]) -> None:
    head = ([f"decode d{d}" for d in depths] + [f"pp{p}" for p in prefill]
            + [f"TTFT {prefill[-1]} ms", "first/steady"])  # fmt: skip
    print("| model | runner | " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * len(head))
    for name, runners in results.items():
        peer = runners.get("llama.cpp")
        for runner, r in runners.items():
            if runner == "llama.cpp":
                cells = [_tok(r["decode"].get(d)) for d in depths]
                cells += [_tok(r["prefill"].get(p)) for p in prefill]
                last = r["prefill"].get(prefill[-1])  # (llama-bench times no first token:
                # its prompt's time is a lower bound, parity's TTFT takes the prompt and token)
                cells += ["" if not last else f">= {1e3 * prefill[-1] / last['tok_s']:.2f}", ""]
            else:
                s = r["sizes"]
                cells = [_ratio(s[d]["decode_tok_s"], peer and peer["decode"].get(d))
                         if d in s else BEYOND for d in depths]  # fmt: skip
                cells += [_ratio(s[p]["prefill_tok_s"], peer and peer["prefill"].get(p))
                          if p in s else BEYOND for p in prefill]  # fmt: skip
                last = s.get(prefill[-1])
                cells += (
                    ["", ""]
                    if last is None
                    else [
                        f"{last['ttft_ms']:.2f}",
                        f"{last['first_step_ms'] / last['step_ms']:.2f}x",
                    ]
                )
            print(f"| {name} | {runner} | " + " | ".join(cells) + " |")


BEYOND = "past ctx"  # the size and its generation do not fit the model's trained context


def _tok(r: dict | None) -> str:
    return "" if r is None else f"{r['tok_s']:,.1f} ± {r['stddev']:,.1f}"


def _ratio(value: float, peer: dict | None) -> str:
    return f"{value:,.1f}" + ("" if not peer else f" ({value / peer['tok_s']:.2f}x)")


if __name__ == "__main__":
    main()
