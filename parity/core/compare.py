"""Oracle comparison: run one graph on two runtimes, compare every node's output.

The report counts differing elements, the largest distance in units in the last place (ULP),
the normalized mean squared error, and names the first divergent node in topological order,
which is where a kernel bug shows itself before its error spreads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import attrs
import numpy as np

from parity.core.ir import Graph
from parity.core.runtime import Runtime


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


def diff_arrays(node: int, op: str, a: np.ndarray, b: np.ndarray) -> NodeDiff:
    if a.shape != b.shape:
        raise ValueError(f"node %{node} {op}: shapes differ, {a.shape} vs {b.shape}")
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


@attrs.frozen
class CompareReport:
    reference: str
    candidate: str
    nodes: tuple[NodeDiff, ...]

    @property
    def first_divergent(self) -> NodeDiff | None:
        return next((d for d in self.nodes if not d.identical), None)

    @property
    def bit_identical(self) -> bool:
        return self.first_divergent is None

    @property
    def identical_share(self) -> float:
        return sum(d.identical for d in self.nodes) / len(self.nodes) if self.nodes else 1.0

    def summary(self) -> str:
        worst_ulp = max((d.max_ulp for d in self.nodes), default=0.0)
        worst_nmse = max((d.nmse for d in self.nodes), default=0.0)
        head = (
            f"{self.candidate} vs {self.reference}: {len(self.nodes)} nodes compared, "
            f"{self.identical_share:.1%} bit-identical, max ULP {worst_ulp:g}, "
            f"worst NMSE {worst_nmse:.3g}"
        )
        first = self.first_divergent
        return head if first is None else f"{head}\nfirst divergent node: {first.describe()}"

    def to_dict(self) -> dict:
        first = self.first_divergent
        return {
            "reference": self.reference,
            "candidate": self.candidate,
            "bit_identical": self.bit_identical,
            "first_divergent": None if first is None else attrs.asdict(first),
            "nodes": [attrs.asdict(d) for d in self.nodes],
        }

    def to_json(self) -> str:
        return json.dumps(jsonable(self.to_dict()))


def jsonable(value):
    """``value`` with every non-finite float as a string ("inf", "nan"): strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def compare_runtimes(
    graph: Graph,
    inputs: Mapping[str, np.ndarray],
    reference: Runtime,
    candidate: Runtime,
) -> CompareReport:
    """Run ``graph`` once on each runtime (each with its own states) and compare every
    computed node's output, in topological order."""
    computed = tuple(i for i, n in enumerate(graph.nodes) if not n.op.is_leaf)
    ref = reference.run(graph, inputs, expose=computed)
    cand = candidate.run(graph, inputs, expose=computed)
    diffs = tuple(diff_arrays(i, graph.nodes[i].op.name, ref[i], cand[i]) for i in computed)
    return CompareReport(_label(reference), _label(candidate), diffs)


def _label(runtime: Runtime) -> str:
    return "+".join(b.name for b in runtime.backends)
