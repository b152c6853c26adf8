"""The contract's tanh and GELU against float64, over every float32 input (exhaustive) or a
sample: the largest error in ulps of the exact value, where it is, and the share of inputs
that get the correctly rounded result. Prints one line per function.

    python benchmarks/measure_accuracy.py [--functions tanh,gelu] [--sample N]

tanh is odd and computed from |x|, so its run covers the non-negative inputs; GELU's line for
x < 0, where it is ill-conditioned, also gives its largest error in units of 2^-24 |x| (over
|x| >= 2^-100). The reference is float64 (``np.tanh``; GELU as the two-sided logistic of 2u,
u = sqrt(2/pi) (x + 0.044715 x^3), the tanh form without cancellation or overflow); results
whose exact value is below half the smallest subnormal must be +-0.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from parity.numerics import gelu, tanh

CHUNK = 1 << 24


def ulp_of_exact(y: np.ndarray) -> np.ndarray:
    """The float32 ulp at |float64 values| y: 2^(exponent - 23), 2^-149 for subnormals."""
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.abs(y)))
    return np.exp2(np.maximum(e, -126.0) - 23.0)


def reference(name: str, x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    if name == "tanh":
        return np.tanh(x64)
    with np.errstate(over="ignore", invalid="ignore"):
        u = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)
        return x64 * np.exp(np.minimum(2.0 * u, 0.0)) / (1.0 + np.exp(-2.0 * np.abs(u)))


def measure(name: str, bits: np.ndarray, state: dict) -> None:
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    if not x.size:
        return
    got = (tanh if name == "tanh" else gelu)(x).astype(np.float64)
    ref = reference(name, x)
    zero = np.abs(ref) < 2.0**-150
    bad_zero = int(np.count_nonzero(got[zero] != 0.0))
    x, got, ref = x[~zero], got[~zero], ref[~zero]
    err = np.abs(got - ref) / ulp_of_exact(ref)
    if err.size and err.max() > state["max"]:
        i = int(np.argmax(err))
        state["max"], state["at"] = float(err[i]), float(x[i])
    big = np.abs(x) >= 2.0**-100  # (on subnormal x one rounding is many 2^-24 |x|)
    if np.any(big):
        scaled = np.abs(got[big] - ref[big]) / (2.0**-24 * np.abs(x[big].astype(np.float64)))
        state["abs"] = max(state["abs"], float(scaled.max()))
    state["n"] += x.size + int(zero.sum())
    state["exact"] += int(np.count_nonzero(got == ref.astype(np.float32))) + int(zero.sum())
    state["bad_zero"] += bad_zero


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--functions", default="tanh,gelu")
    ap.add_argument("--sample", type=int, default=0, help="random inputs instead of all")
    args = ap.parse_args()
    for name in args.functions.split(","):
        halves = [("", 0)] if name == "tanh" else [(" x >= 0", 0), (" x < 0", 1 << 31)]
        for label, base in halves:
            state = {"max": 0.0, "at": 0.0, "n": 0, "exact": 0, "bad_zero": 0, "abs": 0.0}
            t0 = time.perf_counter()
            if args.sample:
                rng = np.random.default_rng(0)
                picks = rng.integers(0, 1 << 31, args.sample, dtype=np.uint64) + base
                measure(name, picks.astype(np.uint32), state)
            else:
                for lo in range(base, base + (1 << 31), CHUNK):
                    bits = np.arange(lo, lo + CHUNK, dtype=np.uint64).astype(np.uint32)
                    measure(name, bits, state)
            print(
                f"{name}{label}: {state['n']:,} finite inputs, max error {state['max']:.4f} ulp "
                f"at {np.float32(state['at']).item().hex()}, largest error "
                f"{state['abs']:.4f} x 2^-24 |x|, {state['exact'] / state['n']:.2%} correctly "
                f"rounded, {state['bad_zero']} nonzero where the exact value rounds to 0, "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
