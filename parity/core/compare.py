"""How far a backend's value is from the oracle's: per-node differences in bits, in units in the
last place (ULP) and as a normalized mean squared error, the measures that parity tiers bound
(``parity.core.tiers``) and that the kit and ``parity compare`` report."""

from __future__ import annotations

import math

import attrs
import numpy as np

from parity.core.dtypes import Q8A_BLOCK


def _ordered(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns -> integers whose order and differences follow the float line
    (so |a - b| counts the floats between); -0.0 and +0.0 both map to 0."""
    i = bits.astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise ULP distance of two float32 arrays. NaN vs NaN is 0; NaN or an infinity
    against anything else is inf, so a bound on ULPs never admits a misplaced special value."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    d = np.abs(_ordered(a.view(np.int32)) - _ordered(b.view(np.int32))).astype(np.float64)
    na, nb = np.isnan(a), np.isnan(b)
    d[na & nb] = 0
    d[(na ^ nb) | ((np.isinf(a) | np.isinf(b)) & (a != b))] = np.inf
    return d


@attrs.frozen
class NodeDiff:
    node: int
    op: str
    shape: tuple[int, ...]
    n_elements: int
    n_diff: int  # elements whose bits differ (-0.0 != +0.0; any NaN == any NaN)
    max_ulp: float  # inf where a NaN or inf is misplaced, or integer outputs (ids) differ
    nmse: float  # sum((a-b)^2) / sum(a^2), in float64; 0 when identical

    @property
    def identical(self) -> bool:
        return self.n_diff == 0

    def describe(self) -> str:
        return (
            f"%{self.node} {self.op}{list(self.shape)}: {self.n_diff}/{self.n_elements} elements "
            f"differ, max ULP {self.max_ulp:g}, NMSE {self.nmse:.3g}"
        )


def _as_floats(blocks: np.ndarray) -> np.ndarray:
    """Q8A blocks as float32 (..., 34): d, s and the quants (exact as floats), so that a wrong
    quant is a difference and NaN scales compare as NaN positions."""
    q = blocks["q"].astype(np.float32)
    return np.concatenate([blocks["d"][..., None], blocks["s"][..., None], q], axis=-1)


def diff_arrays(node: int, op: str, a: np.ndarray, b: np.ndarray) -> NodeDiff:
    if a.shape != b.shape:
        raise ValueError(f"node %{node} {op}: shapes differ, {a.shape} vs {b.shape}")
    if a.dtype == Q8A_BLOCK:
        a, b = _as_floats(a), _as_floats(b)
    if a.dtype.kind == "f":
        a = np.ascontiguousarray(a, dtype=np.float32)
        b = np.ascontiguousarray(b, dtype=np.float32)
        ulp = ulp_distance(a, b)
        differ = (a.view(np.int32) != b.view(np.int32)) & ~(np.isnan(a) & np.isnan(b))
        n_diff = int(np.count_nonzero(differ))
        max_ulp = float(ulp.max()) if ulp.size else 0.0
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(a64) & np.isfinite(b64)
        num = float(np.sum((a64[finite] - b64[finite]) ** 2))
        den = float(np.sum(a64[finite] ** 2))
        nmse = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    else:
        n_diff = int(np.count_nonzero(a != b))
        max_ulp, nmse = (0.0, 0.0) if n_diff == 0 else (float("inf"), 1.0)
    return NodeDiff(node, op, tuple(a.shape), int(a.size), n_diff, max_ulp, nmse)


def jsonable(value):
    """``value`` with every non-finite float as a string ("inf", "nan"): strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
