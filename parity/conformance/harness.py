"""Run one case on one backend through the Backend API, and judge it against the oracle.

The harness drives the backend the way a runtime does (register weights, prepare a split of
every computed node, allocate and upload inputs and states, execute, download) and checks, besides
every node's value against the tier the backend declares for it:

- **Guards.** Every buffer the backend allocates through ``alloc`` while the case runs (input
  slots, states, and any output or scratch buffer the backend takes from its own ``alloc``) is
  carved out of a larger one whose margins hold a sentinel; a write past either end changes a
  margin. Backends whose buffers cannot be sliced into views (immutable arrays) run unguarded,
  and the result says so.
- **Read-only operands.** Input buffers hold the same bits after the step as before.
- **States.** The KV caches after the step equal the oracle's, every row: rows not written keep
  their sentinel, so a write to a wrong row shows.
- **Readback.** ``download`` writes into a host window flanked by sentinels, and must stay in it.
- **Determinism and idempotence.** Executing the step again gives the same bits; if the backend
  captures the step (CUDA graphs), the replay gives them too.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np

from parity.conformance.case import Case
from parity.core.backend import Backend, Buffer, Device, Split
from parity.core.compare import NodeDiff, diff_arrays, jsonable
from parity.core.dtypes import DType, numpy_dtype
from parity.core.ir import Graph, Node, Op
from parity.core.tiers import EXACT, Tier, backend_manifest

MARGIN = 64  # sentinel elements on each side of a guarded buffer or readback window
# the sentinel's bytes, repeated: as float32 a quiet NaN with a payload, as int32 a large number
_SENTINEL = np.array([0x7FC0DEAD], np.uint32).view(np.uint8)
VERDICTS = ("unsupported", "exact", "bound", "FAIL")  # in order of severity


def _sentinel(dtype: str, n: int) -> np.ndarray:
    """``n`` elements of ``dtype`` made of the sentinel's bytes (any element size)."""
    dtype = np.dtype(dtype)
    return np.resize(_SENTINEL, n * dtype.itemsize).view(dtype)


def _is_sentinel(values: np.ndarray) -> bool:
    return values.tobytes() == _sentinel(values.dtype, values.size).tobytes()


@attrs.frozen
class Execution:
    """What one backend computed for a case: every computed node, the final states."""

    outputs: dict[int, np.ndarray]
    states: dict[str, np.ndarray]
    problems: tuple[str, ...]
    guarded: bool


@attrs.frozen
class CaseResult:
    case: str
    op: str
    type: str
    tier: Tier  # the declared tier of the case's subject node
    verdict: str  # "exact", "bound", "FAIL" or "unsupported"
    diffs: tuple[NodeDiff, ...] = ()
    problems: tuple[str, ...] = ()
    guarded: bool = False

    @property
    def failed(self) -> bool:
        return self.verdict == "FAIL"

    @property
    def max_ulp(self) -> float:
        return max((d.max_ulp for d in self.diffs), default=0.0)

    @property
    def nmse(self) -> float:
        return max((d.nmse for d in self.diffs), default=0.0)

    def explain(self) -> str:
        """Why the case failed (or was skipped), one finding per line."""
        lines = list(self.problems)
        lines += [f"{d.describe()} (declared tier: {self.tier})" for d in self.diffs
                  if not d.identical]  # fmt: skip
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return jsonable(
            {
                "case": self.case,
                "op": self.op,
                "type": self.type,
                "declared": str(self.tier),
                "result": self.verdict,
                "max_ulp": self.max_ulp,
                "worst_nmse": self.nmse,
                "problems": list(self.problems),
                "guarded": self.guarded,
            }
        )


class _GuardedAlloc:
    """Stands in for ``backend.alloc`` while a case runs: hands out views into buffers with
    sentinel margins, and checks the margins afterwards."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.alloc = backend.alloc
        self.buffers: list[tuple[Buffer, str, int]] = []  # (padded buffer, numpy dtype, size)
        self.works = True

    def __call__(self, dtype: DType, shape: tuple[int, ...]) -> Buffer:
        if not self.works:
            return self.alloc(dtype, shape)
        n = math.prod(shape)
        padded = self.alloc(dtype, (n + 2 * MARGIN,))
        try:
            view = padded[MARGIN : MARGIN + n].reshape(shape)
        except Exception:  # not sliceable (e.g. immutable arrays): run unguarded
            self.works = False
            return self.alloc(dtype, shape)
        np_dtype = numpy_dtype(dtype)
        host = np.zeros(n + 2 * MARGIN, np_dtype)
        host[:MARGIN] = host[-MARGIN:] = _sentinel(np_dtype, MARGIN)
        self.backend.upload(padded, host)
        self.buffers.append((padded, np_dtype, n))
        return view

    def check(self) -> list[str]:
        problems = []
        for padded, np_dtype, n in self.buffers:
            host = np.empty(n + 2 * MARGIN, np_dtype)
            self.backend.download(padded, host)
            for side, margin in (("before", host[:MARGIN]), ("after", host[-MARGIN:])):
                if not _is_sentinel(margin):
                    problems.append(
                        f"wrote {side} the end of a {np_dtype}[{n}] buffer it allocated "
                        "(out-of-bounds write)"
                    )
        return problems


def _download(backend: Backend, buf: Buffer, node: Node, problems: list[str]) -> np.ndarray:
    """Read a node's buffer through a host window flanked by sentinels, which must survive."""
    np_dtype = numpy_dtype(node.dtype)
    n = math.prod(node.shape)
    host = _sentinel(np_dtype, n + 2 * MARGIN).copy()
    window = host[MARGIN : MARGIN + n].reshape(node.shape)
    backend.download(buf, window)
    if not (_is_sentinel(host[:MARGIN]) and _is_sentinel(host[-MARGIN:])):
        problems.append("download wrote outside its host array")
    return window.copy()


def execute(backend: Backend, case: Case, *, guard: bool = True) -> Execution:
    """Run ``case`` on ``backend`` as one split holding every computed node."""
    graph = case.graph
    nodes = graph.nodes
    computed = tuple(i for i, n in enumerate(nodes) if not n.op.is_leaf)
    leaves = tuple(sorted({s for i in computed for s in nodes[i].src if nodes[s].op.is_leaf}))
    split = Split(0, backend.name, graph, computed, leaves, computed)
    alloc = _GuardedAlloc(backend)
    if guard:
        backend.alloc = alloc  # type: ignore[method-assign]  # the backend's own calls too
    problems: list[str] = []
    try:
        for w in case.weights.values():
            backend.register_weight(w)
        bound, uploaded = {}, {}
        for s in leaves:
            node = nodes[s]
            if node.op is Op.WEIGHT:
                continue
            if node.op is Op.INPUT:
                host = np.ascontiguousarray(case.inputs[node.arg])
            else:  # a state the case does not fill starts at zero, as a runtime's does
                host = np.asarray(case.states.get(node.arg, np.zeros(node.shape, np.float32)))
            bound[s] = backend.alloc(node.dtype, node.shape)
            backend.upload(bound[s], host)
            uploaded[s] = host
        exe = backend.prepare(split)
        first = _read(backend, graph, computed, backend.execute(exe, bound), problems)
        states = {nodes[s].arg: _download(backend, bound[s], nodes[s], problems)
                  for s in leaves if nodes[s].op is Op.STATE}  # fmt: skip
        for s, host in uploaded.items():
            node = nodes[s]
            if node.op is Op.INPUT:
                after = _download(backend, bound[s], node, problems)
                if after.tobytes() != host.tobytes():
                    problems.append(f"wrote into its input {node.arg!r} (%{s}), which is read-only")
        again = _read(backend, graph, computed, backend.execute(exe, bound), problems)
        _same(first, again, "executing the same step again", problems)
        captured = backend.capture(exe)
        if captured.captured:
            replay = backend.execute(captured.executable, bound)
            _same(first, _read(backend, graph, computed, replay, problems), "the captured replay",
                  problems)  # fmt: skip
            backend.release(captured.executable)
        backend.release(exe)
        if guard:
            problems.extend(alloc.check())
    finally:
        if guard:
            del backend.alloc
    return Execution(first, states, tuple(dict.fromkeys(problems)), guard and alloc.works)


def _read(
    backend: Backend,
    graph: Graph,
    ids: Sequence[int],
    buffers: Mapping[int, Buffer],
    problems: list[str],
) -> dict[int, np.ndarray]:
    backend.synchronize()
    missing = [i for i in ids if i not in buffers]
    if missing:
        raise ValueError(f"execute returned no buffer for node(s) {missing}")
    return {i: _download(backend, buffers[i], graph.nodes[i], problems) for i in ids}


def _same(first: Mapping[int, np.ndarray], other: Mapping[int, np.ndarray], what: str,
          problems: list) -> None:  # fmt: skip
    for i, value in first.items():
        if value.tobytes() != other[i].tobytes():
            problems.append(f"{what} gave other bits at %{i} (not deterministic or not idempotent)")
            return


def oracle(case: Case) -> Execution:
    """The cpu oracle's outputs for a case."""
    from parity.backends.cpu.backend import CpuBackend

    return execute(CpuBackend(Device("cpu")), case, guard=False)


def judge(backend_factory: Callable[[], Backend], case: Case) -> CaseResult:
    """Run ``case`` on a fresh backend from ``backend_factory`` and judge every node against
    the cpu oracle under the tiers the backend declares. Whatever the backend raises, from its
    constructor on, is a finding (FAIL), not an error of the kit."""
    graph = case.graph
    srcs_of = [[graph.nodes[s] for s in n.src] for n in graph.nodes]
    op_name = case.subject.op.name
    type_name = (case.weight_type or case.subject.dtype).name
    subject = graph.outputs[0]
    tier = EXACT

    def result(verdict: str, diffs=(), problems=(), guarded=False) -> CaseResult:
        return CaseResult(case.id, op_name, type_name, tier, verdict, tuple(diffs),
                          tuple(problems), guarded)  # fmt: skip

    backend = None
    try:
        backend = backend_factory()
        manifest = backend_manifest(type(backend))
        tier = manifest.tier_of(graph.nodes[subject], srcs_of[subject])
        for i, node in enumerate(graph.nodes):
            if not node.op.is_leaf and not backend.supports_op(node, srcs_of[i]):
                return result("unsupported", problems=[backend.why_unsupported(node, srcs_of[i])])
        got = execute(backend, case)
    except Exception as e:  # a crash is a finding, not the end of the run
        where = traceback.extract_tb(e.__traceback__)[-1]
        return result("FAIL", problems=[
            f"raised {type(e).__name__}: {e} (at {where.filename}:{where.lineno})"
        ])  # fmt: skip
    finally:
        if backend is not None:
            backend.close()
    reference = oracle(case)
    problems = list(got.problems)
    for name, want in reference.states.items():
        differ = got.states[name].view(np.uint32) != want.view(np.uint32)
        if differ.any():
            row = int(np.argmax(differ.any(axis=-1)))
            problems.append(f"state {name!r} differs from the oracle's after the step, first at "
                            f"row {row} (a write to the wrong rows?)")  # fmt: skip
    diffs, verdict = [], "FAIL" if problems else "exact"
    for i, want in reference.outputs.items():
        d = diff_arrays(i, graph.nodes[i].op.name, want, got.outputs[i])
        diffs.append(d)
        node_verdict = manifest.tier_of(graph.nodes[i], srcs_of[i]).verdict(d)
        verdict = max(verdict, node_verdict, key=VERDICTS.index)
    return result(verdict, diffs, problems, got.guarded)
