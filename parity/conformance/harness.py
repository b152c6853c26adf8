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

from parity.conformance.case import Case, node_case
from parity.core.backend import Backend, Buffer, Device, Executable, Split, bound_alike
from parity.core.compare import NodeDiff, diff_arrays, jsonable
from parity.core.dtypes import DType, host_layout, numpy_dtype
from parity.core.ir import Graph, Node, Op
from parity.core.tiers import EXACT, Tier, manifest_of

MARGIN = 64  # sentinel elements on each side of a guarded buffer or readback window
# the sentinel's bytes, repeated: as float32 a quiet NaN with a payload, as int32 a large number
_SENTINEL = np.array([0x7FC0DEAD], np.uint32).view(np.uint8)
VERDICTS = ("unsupported", "exact", "bound", "FAIL")  # in order of severity
FUSION = "FUSION"  # the op column of a case that checks a backend's rewrite


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
    tiers: tuple[Tier, ...] = ()  # each diff's node's declared tier (the case's where absent)

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
        tiers = self.tiers or (self.tier,) * len(self.diffs)
        lines += [f"{d.describe()} (declared tier: {t})" for d, t in zip(self.diffs, tiers,
                  strict=True) if not d.identical]  # fmt: skip
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
    sentinel margins, and checks the margins afterwards. A value whose buffer cannot be sliced
    (an immutable array, a quantized value's several arrays) gets a plain one."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.alloc = backend.alloc
        self.buffers: list[tuple[Buffer, DType, int]] = []  # (padded buffer, dtype, size)
        self.unguarded = 0

    def __call__(self, dtype: DType, shape: tuple[int, ...]) -> Buffer:
        if dtype is DType.Q8A:
            self.unguarded += 1
            return self.alloc(dtype, shape)
        n = math.prod(shape)
        padded = self.alloc(dtype, (n + 2 * MARGIN,))
        try:
            view = padded[MARGIN : MARGIN + n].reshape(shape)
        except Exception:  # not sliceable (e.g. immutable arrays): unguarded
            self.unguarded += 1
            return self.alloc(dtype, shape)
        host = np.zeros(n + 2 * MARGIN, numpy_dtype(dtype))
        host[:MARGIN] = host[-MARGIN:] = _sentinel(host.dtype, MARGIN)
        self.backend.upload(padded, host)
        self.backend.synchronize()
        self.buffers.append((padded, dtype, n))
        return view

    @property
    def works(self) -> bool:
        return bool(self.buffers)

    def check(self) -> list[str]:
        problems = []
        for padded, dtype, n in self.buffers:
            host = np.empty(n + 2 * MARGIN, numpy_dtype(dtype))
            self.backend.download(padded, host)
            self.backend.synchronize()
            for side, margin in (("before", host[:MARGIN]), ("after", host[-MARGIN:])):
                if not _is_sentinel(margin):
                    problems.append(
                        f"wrote {side} the end of a {host.dtype}[{n}] buffer it allocated "
                        "(out-of-bounds write)"
                    )
        return problems


def _download(backend: Backend, buf: Buffer, node: Node, problems: list[str]) -> np.ndarray:
    """Read a node's buffer through a host window flanked by sentinels, which must survive."""
    np_dtype, shape = host_layout(node.dtype, node.shape)
    n = math.prod(shape)
    host = _sentinel(np_dtype, n + 2 * MARGIN).copy()
    window = host[MARGIN : MARGIN + n].reshape(shape)
    backend.download(buf, window)
    backend.synchronize()
    if not (_is_sentinel(host[:MARGIN]) and _is_sentinel(host[-MARGIN:])):
        problems.append("download wrote outside its host array")
    return window.copy()


def execute(
    backend: Backend, case: Case, graph: Graph | None = None, *, guard: bool = True
) -> Execution:
    """Run ``case`` on ``backend`` as one split holding every computed node of ``graph`` (the
    case's own, or the backend's rewrite of it); ``outputs`` are keyed by that graph's ids."""
    graph = case.graph if graph is None else graph
    nodes = graph.nodes
    computed = tuple(i for i, n in enumerate(nodes) if not n.op.is_leaf)
    leaves = tuple(sorted({s for i in computed for s in nodes[i].src if nodes[s].op.is_leaf}))
    split = Split(0, backend.name, graph, computed, leaves, computed)
    alloc = _GuardedAlloc(backend)
    if guard:
        backend.alloc = alloc  # type: ignore[method-assign]  # the backend's own calls too
    problems: list[str] = []
    try:
        weights = [case.weights[nodes[s].arg] for s in leaves if nodes[s].op is Op.WEIGHT]
        backend.register_weights(weights, splits=[split])
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
        exe = backend.prepare(split, bound)
        missing = [i for i in computed if i not in exe.outputs]
        if missing:
            raise ValueError(f"prepare made no output buffer for node(s) {missing}")
        backend.execute(exe)
        first = _read(backend, graph, computed, exe, problems)
        states = {nodes[s].arg: _download(backend, bound[s], nodes[s], problems)
                  for s in leaves if nodes[s].op is Op.STATE}  # fmt: skip
        for s, host in uploaded.items():
            node = nodes[s]
            if node.op is Op.INPUT:
                after = _download(backend, bound[s], node, problems)
                if after.tobytes() != host.tobytes():
                    problems.append(f"wrote into its input {node.arg!r} (%{s}), which is read-only")
        backend.execute(exe)
        _same(first, _read(backend, graph, computed, exe, problems),
              "executing the same step again", problems)  # fmt: skip
        captured = backend.capture(exe)
        if captured.captured:
            replay = captured.executable
            if not bound_alike(replay, exe):
                problems.append("capture returned an executable on other buffers than prepare's")
            backend.execute(replay)
            _same(first, _read(backend, graph, computed, replay, problems), "the captured replay",
                  problems)  # fmt: skip
            backend.release(replay)
        if len(computed) > 1:
            _outputs_only(backend, graph, bound, first, problems)
        _device_slots(backend, graph, exe, first, bound, uploaded, problems)
        backend.release(exe)
        if guard:
            problems.extend(alloc.check())
    finally:
        if guard:
            del backend.alloc
    return Execution(first, states, tuple(dict.fromkeys(problems)), guard and alloc.works)


def _outputs_only(
    backend: Backend,
    graph: Graph,
    bound: Mapping[int, Buffer],
    first: Mapping[int, np.ndarray],
    problems: list[str],
) -> None:
    """The same step with only the graph's outputs leaving it, as a model's plan runs it: the
    backend's own intermediates and scratch carry the rest, and must give the same bits."""
    nodes = graph.nodes
    computed = tuple(i for i, n in enumerate(nodes) if not n.op.is_leaf)
    inputs = tuple(sorted(bound))
    split = Split(0, backend.name, graph, computed, inputs, tuple(graph.outputs))
    exe = backend.prepare(split, {s: bound[s] for s in inputs})
    backend.execute(exe)  # idempotent: the caches get the rows they already hold
    got = _read(backend, graph, graph.outputs, exe, problems)
    _same({o: first[o] for o in graph.outputs}, got,
          "the step with only its outputs leaving it (intermediates in the backend's own memory)",
          problems)  # fmt: skip
    backend.release(exe)


def _device_slots(
    backend: Backend,
    graph: Graph,
    exe: Executable,
    first: Mapping[int, np.ndarray],
    bound: Mapping[int, Buffer],
    uploaded: Mapping[int, np.ndarray],
    problems: list[str],
) -> None:
    """``copy_from`` on the backend itself, ``increment`` of an int32 input and ``zero`` of
    every state, each read back through a sentinel window."""
    nodes = graph.nodes
    for i, buf in exe.outputs.items():
        node = nodes[i]
        copy = backend.alloc(node.dtype, node.shape)
        if backend.copy_from(copy, buf, backend):
            _same({i: first[i]}, {i: _download(backend, copy, node, problems)},
                  "copy_from of its own buffer", problems)  # fmt: skip
        break  # one value is enough
    for s, host in uploaded.items():
        node = nodes[s]
        if node.op is Op.INPUT and node.dtype is DType.I32:
            backend.increment(bound[s], DType.I32, node.shape, 3)
            if _download(backend, bound[s], node, problems).tobytes() != (host + 3).tobytes():
                problems.append(f"increment of {node.arg!r} by 3 did not add 3 to every element")
            backend.increment(bound[s], DType.I32, node.shape, -3)
        if node.op is Op.STATE:
            backend.zero(bound[s], node.dtype, node.shape)
            if _download(backend, bound[s], node, problems).view(np.uint32).any():
                problems.append(f"zero left state {node.arg!r} with bits other than +0.0")


def _read(
    backend: Backend, graph: Graph, ids: Sequence[int], exe: Executable, problems: list[str]
) -> dict[int, np.ndarray]:
    return {i: _download(backend, exe.outputs[i], graph.nodes[i], problems) for i in ids}


def _same(first: Mapping[int, np.ndarray], other: Mapping[int, np.ndarray], what: str,
          problems: list) -> None:  # fmt: skip
    for i, value in first.items():
        if value.tobytes() != other[i].tobytes():
            problems.append(f"{what} gave other bits at %{i} (not deterministic or not idempotent)")
            return


def oracle(case: Case) -> Execution:
    """The oracle's outputs for a case: the readable definition (the cpu backend's
    ``definition`` kernels), on the case's graph as written."""
    from parity.backends.cpu.backend import CpuBackend

    return execute(CpuBackend(Device("cpu"), kernels="definition"), case, guard=False)


def judge(backend_factory: Callable[[], Backend], case: Case) -> CaseResult:
    """Run ``case`` on a fresh backend from ``backend_factory`` and judge every node against
    the oracle under the tiers the backend declares. A case of a fusion (``case.rewrite``) runs
    as the backend rewrites it: every original node that still exists is judged, a fused node
    against the composition it replaces, a node the rewrite put in (a QUANTIZE) against the
    oracle's value of it on the oracle's inputs; a node past a looser one (``_inheriting``)
    against the oracle's value on the backend's inputs. Whatever the backend raises, from its
    constructor on, is a finding (FAIL), not an error of the kit."""
    original = case.graph
    subject = original.outputs[0]
    op_name, type_name = case.subject.op.name, (case.weight_type or case.subject.dtype).name
    if case.rewrite:  # a pattern for a rewrite: labelled by the matrices it multiplies by
        op_name = FUSION
        matrices = [n for n in original.nodes if n.op is Op.WEIGHT and len(n.shape) == 2]
        type_name = matrices[0].dtype.name if matrices else type_name
    tier = EXACT

    def result(verdict: str, diffs=(), problems=(), guarded=False, tiers=()) -> CaseResult:
        return CaseResult(case.id, op_name, type_name, tier, verdict, tuple(diffs),
                          tuple(problems), guarded, tuple(tiers))  # fmt: skip

    backend = None
    try:
        backend = backend_factory()
        graph = backend.rewrite(original) if case.rewrite else original
        if case.rewrite and graph is original:
            return result("unsupported", problems=[
                f"{backend.name}'s rewrite fuses nothing here: the pattern runs as written"
            ])  # fmt: skip
        srcs_of = [[graph.nodes[s] for s in n.src] for n in graph.nodes]
        manifest = manifest_of(backend)
        ran = graph.rewritten().get(subject)
        if ran is None:
            raise ValueError(f"the rewrite lost the value of the case's output %{subject}")
        tier = manifest.tier_of(graph.nodes[ran], srcs_of[ran])
        for i, node in enumerate(graph.nodes):
            if not node.op.is_leaf and not backend.supports_op(node, srcs_of[i]):
                return result("unsupported", problems=[backend.why_unsupported(node, srcs_of[i])])
        got = execute(backend, case, graph)
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
    tiers = [EXACT if n.op.is_leaf else manifest.tier_of(n, srcs_of[r])
             for r, n in enumerate(graph.nodes)]  # fmt: skip
    inheriting = {r: _alone(graph, r, got.outputs, case)  # any node past a looser one
                  for r in _inheriting(graph, tiers)}  # fmt: skip
    states = dict(reference.states)  # (a cache written with rows a looser node made: those rows)
    for r, (_, after) in inheriting.items():
        if graph.nodes[r].op is Op.KV_WRITE:
            name = graph.nodes[graph.nodes[r].src[0]].arg
            states[name] = after[name]
    for name, want in states.items():
        differ = got.states[name].view(np.uint32) != want.view(np.uint32)
        if differ.any():
            row = int(np.argmax(differ.any(axis=-1)))
            problems.append(f"state {name!r} differs from the oracle's after the step, first at "
                            f"row {row} (a write to the wrong rows?)")  # fmt: skip
    want = {r: reference.outputs[o] for r, o in _origins(graph) if o in reference.outputs}
    for r, node in enumerate(graph.nodes):  # nodes the rewrite put in, on the oracle's inputs
        if not node.op.is_leaf and graph.original(r) < 0:
            values = {s: reference.outputs[graph.original(s)] for s in node.src
                      if graph.original(s) in reference.outputs}  # fmt: skip
            want[r] = _alone(graph, r, values, case)[0]
    for r, (value, _) in inheriting.items():
        if r in want:
            want[r] = value
    diffs, verdict = [], "FAIL" if problems else "exact"
    for r, value in sorted(want.items()):
        d = diff_arrays(r, graph.nodes[r].op.name, value, got.outputs[r])
        diffs.append(d)
        verdict = max(verdict, tiers[r].verdict(d), key=VERDICTS.index)
    return result(verdict, diffs, problems, got.guarded, [tiers[d.node] for d in diffs])


def _inheriting(graph: Graph, tiers: Sequence[Tier]) -> list[int]:
    """The computed nodes that read, directly or not, a node of a tier looser than exact (a
    fast tier's attention before the QUANTIZE and product of its output, its products before
    the cache writes and the attention after them): the oracle's values of those carry the
    looser node's rounding, so such a node is judged under its own tier on the inputs the
    backend gave it (``_alone`` on its values), as docs/numerics.md measures a tier: "against
    the oracle on the same inputs"."""
    loose: set[int] = set()
    found = []
    for r, node in enumerate(graph.nodes):  # (sources come first)
        past = any(s in loose for s in node.src)
        if past:
            found.append(r)
        if past or not tiers[r].exact:
            loose.add(r)
    return found


def _alone(
    graph: Graph, r: int, values: Mapping[int, np.ndarray], case: Case
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The oracle's value of node ``r`` alone, its computed sources given ``values`` (a
    KV_WRITE source computed again in the case, from the rows ``values`` give), and the
    states after it."""
    alone = node_case(graph, r, values, case.inputs, case.weights, case.states, case.id)
    ran = oracle(alone)
    return ran.outputs[alone.graph.outputs[0]], ran.states


def _origins(graph: Graph) -> list[tuple[int, int]]:
    """(node id here, original id) of every computed node with an original."""
    return [(i, graph.original(i)) for i, n in enumerate(graph.nodes)
            if not n.op.is_leaf and graph.original(i) >= 0]  # fmt: skip
