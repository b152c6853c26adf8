"""Whole-model speed of the jax backend in its two jit modes, on a synthetic twin of a real
model (real shapes and quant types, random weights), both modes in one run.

    python plugins/parity-jax/benchmarks/bench_jax_decode.py [--model smollm2-135m]
        [--modes graph op] [--prompt 8] [--steps 16]

Per mode, on a fresh backend: the first prefill of ``--prompt`` tokens (``compile_prefill_s``,
which compiles), a second prefill (``prefill_s``), the first decode step (``compile_step_s``)
and the median of ``--steps`` decode steps after it (``step_ms``, with min and max), each fed
its token and position from the host; then the median of ``--steps`` more decode steps fed on
the device as greedy decoding runs them (``device_step_ms``: the token copied from the last
step's ARGMAX, the position kept and advanced on the device). Steps run through the runtime's
prepared ``Step`` (buffers bound once); every step reads its greedy token back to the host, so
the time includes the device's work. Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np
from parity_jax.backend import JaxBackend

from parity.arch.decoder import build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import REAL_SPECS, synthetic_twin
from parity.core.backend import Device
from parity.core.runtime import Runtime


def timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def measure(model: str, mode: str, prompt: int, steps: int) -> dict:
    spec, weights = synthetic_twin(model)  # the RoPE tables included
    backend = JaxBackend(Device("jax"), jit=mode)
    runtime = Runtime([backend], weights, strict=True)
    n_ctx = prompt + 2 * steps + 1  # host-fed steps, then as many fed on the device
    prefill = build_decoder(spec, GraphParams(n_tokens=prompt, n_ctx=n_ctx, output="argmax"))
    step = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=n_ctx, output="argmax"))
    first, decode = runtime.step(prefill), runtime.step(step, pin=True)

    def run(s, tokens: np.ndarray, start: int) -> None:
        for name, value in graph_inputs(tokens, start).items():
            s.inputs[name][...] = value
        s.run()

    tokens = np.arange(1, prompt + 1)
    compile_prefill = timed(lambda: run(first, tokens, 0))
    again = timed(lambda: run(first, tokens, 0))
    compile_step = timed(lambda: run(decode, np.array([5]), prompt))
    times = [
        timed(lambda p=p: run(decode, np.array([5]), p))
        for p in range(prompt + 1, prompt + 1 + steps)
    ]
    decode.feed("tokens", decode)  # greedy: each step reads the token the one before chose
    decode.inputs["positions"][...] = prompt + 1 + steps
    decode.keep("positions", advance=1)
    device = [timed(decode.run) for _ in range(steps)]
    return {
        "model": model,
        "jit": mode,
        "device": str(jax.devices()[0]),
        "machine": platform.node(),
        "prompt": prompt,
        "compile_prefill_s": round(compile_prefill, 2),
        "prefill_s": round(again, 4),
        "compile_step_s": round(compile_step, 2),
        "step_ms": round(statistics.median(times) * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "step_ms_max": round(max(times) * 1e3, 2),
        "device_step_ms": round(statistics.median(device) * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(REAL_SPECS))
    parser.add_argument("--modes", nargs="+", default=["graph", "op"], choices=["graph", "op"])
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    for mode in args.modes:
        print(json.dumps(measure(args.model, mode, args.prompt, args.steps)), flush=True)


if __name__ == "__main__":
    main()
