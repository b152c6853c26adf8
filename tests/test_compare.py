"""Node diffs: ULP distance, bit differences and NMSE (finding the first divergent node of a
whole model is tests/test_compare_steps.py's)."""

from __future__ import annotations

import numpy as np
import pytest

from parity.backends.cpu import ops
from parity.core.compare import diff_arrays, ulp_distance


def f32(*values):
    return np.array(values, dtype=np.float32)


def test_ulp_distance():
    one = f32(1.0)
    nxt = np.nextafter(one, f32(2.0))
    assert ulp_distance(one, nxt)[0] == 1
    assert ulp_distance(f32(0.0), f32(-0.0))[0] == 0
    tiny = f32(1e-45)  # the smallest subnormal: one step from zero on either side
    assert ulp_distance(tiny, -tiny)[0] == 2
    assert ulp_distance(f32(np.nan), f32(np.nan))[0] == 0
    assert ulp_distance(f32(np.nan), f32(1.0))[0] == np.inf
    # an infinity is a special value: against anything but itself it is infinitely far
    assert ulp_distance(f32(np.inf), f32(np.finfo(np.float32).max))[0] == np.inf
    assert ulp_distance(f32(np.inf, -np.inf), f32(np.inf, -np.inf)).tolist() == [0, 0]
    assert ulp_distance(f32(np.inf), f32(-np.inf))[0] == np.inf


def test_diff_arrays():
    a = f32(1.0, 2.0, 3.0)
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(3.0))
    d = diff_arrays(7, "ADD", a, b)
    assert (d.n_diff, d.max_ulp, d.identical) == (1, 1.0, False) and 0 < d.nmse < 1e-14
    ids = diff_arrays(0, "ARGMAX", np.array([1, 2]), np.array([1, 3]))
    assert ids.n_diff == 1 and ids.max_ulp == np.inf  # a wrong id is no small error
    # signed zeros are part of the contract: a differing sign is a difference, at 0 ULP
    zeros = diff_arrays(0, "ADD", f32(0.0, np.nan), f32(-0.0, np.nan))
    assert (zeros.n_diff, zeros.max_ulp, zeros.identical) == (1, 0.0, False)
    with pytest.raises(ValueError, match="shapes differ"):
        diff_arrays(0, "ADD", a, a[:2])


def test_sloppy_silu_really_differs_from_the_contract():
    x = np.linspace(-20, 20, 4001, dtype=np.float32).reshape(1, -1)
    exact = ops.silu(x)
    sloppy = x / (np.float32(1) + np.exp(-x))
    assert exact.tobytes() != sloppy.astype(np.float32).tobytes()
