"""Activation quantization against a per-element reference, with the special values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity.quant import quantize_activations
from parity.quant.activation import round_half_away

F32 = np.float32
TINY = float(np.finfo(F32).smallest_subnormal)


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contract, one element at a time, with Python ints for the rounding."""
    t, k = x.shape
    q = np.zeros((t, k), np.int8)
    d = np.zeros((t, k // 32), F32)
    s = np.zeros((t, k // 32), F32)
    for i in range(t):
        for b in range(k // 32):
            block = [F32(v) for v in x[i, 32 * b : 32 * b + 32]]
            mags = [abs(float(v)) for v in block]
            amax = math.nan if any(math.isnan(m) for m in mags) else max(mags)
            with np.errstate(invalid="ignore"):
                db = F32(amax) / F32(127)
            total = 0
            for j, v in enumerate(block):
                with np.errstate(invalid="ignore", divide="ignore"):
                    quot = float(v / db)
                if db == 0 or math.isnan(quot):
                    qj = 0
                else:
                    qj = int(math.copysign(math.floor(abs(quot) + 0.5), quot))  # exact in f64
                    qj = max(-127, min(127, qj))
                q[i, 32 * b + j] = qj
                total += qj
            d[i, b] = db
            with np.errstate(invalid="ignore", over="ignore"):
                s[i, b] = db * F32(total)
    return q, d, s


def check(x: np.ndarray) -> None:
    got = quantize_activations(x)
    q, d, s = reference(x)
    assert got.q.dtype == np.int8 and got.d.dtype == F32 and got.s.dtype == F32
    np.testing.assert_array_equal(got.q, q)
    np.testing.assert_array_equal(got.d.view(np.uint32), d.view(np.uint32))
    np.testing.assert_array_equal(got.s.view(np.uint32), s.view(np.uint32))


def test_random_blocks_of_many_scales() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(F32)
    x *= np.repeat(F32(10.0) ** rng.integers(-30, 30, (3, 8)).astype(F32), 32, axis=1)
    check(x)


def test_ties_round_half_away_from_zero() -> None:
    # amax = 127/8 gives d = 1/8 exactly, so x = (k + 0.5)/8 has quotient exactly k + 0.5
    ks = np.arange(-63, 63, 4, dtype=F32)[:31]
    block = np.concatenate([[F32(127)], ks + F32(0.5)]) / F32(8)
    x = np.stack([block, -block]).astype(F32)
    got = quantize_activations(x)
    assert got.d[0, 0] == F32(0.125)
    expected = np.concatenate([[127], np.sign(ks + 0.5) * np.floor(np.abs(ks + 0.5) + 0.5)])
    np.testing.assert_array_equal(got.q[0], expected.astype(np.int8))
    np.testing.assert_array_equal(got.q[1], -expected.astype(np.int8))
    check(x)


def test_round_half_away_just_below_half() -> None:
    v = np.array([0.49999997, -0.49999997, 0.5, -0.5, 1.5, 2.5, -2.5, 126.5, 0.0], F32)
    np.testing.assert_array_equal(round_half_away(v), [0, -0, 1, -1, 2, 3, -3, 127, 0])


def test_zero_negative_zero_and_all_equal_blocks() -> None:
    x = np.zeros((2, 128), F32)
    x[0, 32:64] = -0.0
    x[0, 64:96] = F32(3.25)  # all equal: q = 127
    x[0, 96:128] = F32(-7.0)
    x[1] = F32(1.0)
    got = quantize_activations(x)
    assert (got.q[0, :64] == 0).all() and (got.d[0, :2] == 0).all() and (got.s[0, :2] == 0).all()
    assert (got.q[0, 64:96] == 127).all() and (got.q[0, 96:] == -127).all()
    check(x)


def test_subnormals_give_zero_scale_or_clamp() -> None:
    x = np.zeros((1, 128), F32)
    x[0, 0] = F32(TINY * 63)  # amax/127 rounds to 0: d = 0 although amax > 0, so q = 0
    x[0, 32] = F32(TINY * 190)  # d rounds to one subnormal step: quotient 190, clamped to 127
    x[0, 33] = F32(-TINY * 100)
    x[0, 64:96] = F32(TINY * 5000)
    x[0, 96:128] = np.linspace(-1e-39, 1e-39, 32, dtype=F32)
    got = quantize_activations(x)
    assert got.d[0, 0] == 0 and got.q[0, 0] == 0
    assert got.q[0, 32] == 127 and got.q[0, 33] == -100
    check(x)


def test_large_magnitudes() -> None:
    rng = np.random.default_rng(1)
    x = (rng.uniform(-1, 1, (2, 64)) * 3e38).astype(F32)
    x[0, 0] = np.finfo(F32).max
    x[1, 32] = -np.finfo(F32).max
    check(x)


def test_non_finite_inputs_propagate_to_scales() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 96)).astype(F32)
    x[0, 5] = np.nan
    x[1, 40] = np.inf
    x[1, 70] = -np.inf
    x[1, 71] = np.nan
    got = quantize_activations(x)
    assert np.isnan(got.d[0, 0]) and (got.q[0, :32] == 0).all() and np.isnan(got.s[0, 0])
    assert got.d[1, 1] == np.inf and (got.q[1, 32:64] == 0).all() and np.isnan(got.s[1, 1])
    assert np.isnan(got.d[1, 2])
    assert np.isfinite(got.d[0, 1:]).all()  # other blocks are untouched
    check(x)


def test_shape_and_dtype_errors() -> None:
    with pytest.raises(ValueError, match="K a multiple of 32, got K = 40"):
        quantize_activations(np.zeros((1, 40), F32))
    with pytest.raises(ValueError, match=r"float32 \(T, K\), got float64"):
        quantize_activations(np.zeros((1, 32)))
    with pytest.raises(ValueError, match=r"float32 \(T, K\)"):
        quantize_activations(np.zeros(32, F32))
