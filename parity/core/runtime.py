"""Run graphs on a set of backends: plan once per graph, register weights once, keep states
(KV caches) across steps, move values between splits, read results back into host arrays.

Buffers are stable: every input slot, cross-backend copy target and state buffer is allocated
once and refilled in place, so a backend may capture an executable and replay it.

Graph capture policy (DESIGN.md): a split is offered to its backend's ``capture`` once the same
(graph, split) has run a third time; one-shot work never pays for capture. ``run(capture=...)``
overrides the runtime's default per call (the model layer uses it to keep prefill eager when
asked). With ``verify_capture`` the first replay is compared bit for bit with the eager run of
that step, and a mismatch keeps the split eager, with the reason in ``capture_status``.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from parity.core.backend import Backend, Buffer
from parity.core.dtypes import numpy_dtype
from parity.core.ir import Graph, Node, Op
from parity.core.scheduler import HOST, Plan, schedule
from parity.core.weights import WeightData
from parity.errors import BackendError

CAPTURE_AFTER_RUNS = 3


@attrs.define
class _State:
    """A persistent buffer (a KV cache) with one copy per backend that has used it."""

    node: Node  # the STATE leaf that declared it
    buffers: dict[str, Buffer]
    owner: str  # the backend whose copy is current


@attrs.define
class _Prepared:
    plan: Plan
    executables: list[Any]
    runs: list[int]
    capture_reason: list[str]  # per split: why it is not captured ("" once captured)
    capture_tried: list[bool]
    slots: dict[tuple[int, str], Buffer]  # (node, backend) -> input slot or copy target
    staging: dict[int, np.ndarray]  # host arrays for cross-backend copies
    inputs: dict[str, int]  # INPUT leaf name -> node id


class Runtime:
    """Executes graphs over ``backends`` (priority order; put ``cpu`` last for fallback)."""

    def __init__(
        self,
        backends: Sequence[Backend],
        weights: Mapping[str, WeightData],
        *,
        strict: bool = False,
        capture: bool = True,
        verify_capture: bool = False,
        max_plans: int = 64,
    ) -> None:
        if not backends:
            raise BackendError("a runtime needs at least one backend; pass at least cpu")
        self.backends = list(backends)
        self.by_name = {b.name: b for b in self.backends}
        if len(self.by_name) != len(self.backends):
            raise BackendError("a runtime takes one instance per backend name")
        self.weights = weights
        self.strict = strict
        self.capture = capture
        self.verify_capture = verify_capture
        self.max_plans = max_plans
        self.states: dict[str, _State] = {}
        self._prepared: OrderedDict[tuple[Graph, tuple[int, ...]], _Prepared] = OrderedDict()

    # -- planning ---------------------------------------------------------------------------

    def plan(self, graph: Graph, expose: Sequence[int] = ()) -> Plan:
        return self._prepare(graph, tuple(expose)).plan

    def _prepare(self, graph: Graph, expose: tuple[int, ...]) -> _Prepared:
        key = (graph, expose)
        prepared = self._prepared.get(key)
        if prepared is not None:
            self._prepared.move_to_end(key)
            return prepared
        plan = schedule(graph, self.backends, strict=self.strict, expose=expose)
        for split in plan.splits:
            backend = self.by_name[split.backend]
            for s in split.inputs:
                node = graph.nodes[s]
                if node.op is Op.WEIGHT:
                    backend.register_weight(self._weight(node))
        slots, staging = {}, {}
        for c in plan.copies:
            node = graph.nodes[c.node]
            slots[c.node, c.dst] = self.by_name[c.dst].alloc(node.dtype, node.shape)
            if c.src != HOST:
                src = self.by_name[c.src]
                staging[c.node] = src.alloc_host(numpy_dtype(node.dtype), node.shape)
        exes = [self.by_name[s.backend].prepare(s) for s in plan.splits]
        n = len(plan.splits)
        reasons = ["not run often enough yet" if self.capture else "capture is off"] * n
        prepared = _Prepared(
            plan, exes, [0] * n, reasons, [False] * n, slots, staging, graph.leaves(Op.INPUT)
        )
        self._prepared[key] = prepared
        if len(self._prepared) > self.max_plans:
            _, evicted = self._prepared.popitem(last=False)
            self._release(evicted)
        return prepared

    def _release(self, prepared: _Prepared) -> None:
        for split, exe in zip(prepared.plan.splits, prepared.executables, strict=True):
            self.by_name[split.backend].release(exe)

    def _weight(self, node: Node) -> WeightData:
        w = self.weights.get(node.arg)
        if w is None:
            raise BackendError(
                f"the graph reads weight {node.arg!r}, which the model does not have; "
                "check that the graph was built for this model"
            )
        if (w.dtype, w.shape) != (node.dtype, node.shape):
            raise BackendError(
                f"weight {node.arg!r} is {w.dtype.name}{list(w.shape)}, the graph expects "
                f"{node.dtype.name}{list(node.shape)}; rebuild the graph from this model's spec"
            )
        return w

    def capture_status(self, graph: Graph, expose: Sequence[int] = ()) -> list[str]:
        """Per split of a graph that has run: "" if captured, else why it runs eagerly."""
        prepared = self._prepared.get((graph, tuple(expose)))
        if prepared is None:
            raise BackendError("this graph has not run on this runtime")
        return list(prepared.capture_reason)

    # -- states -----------------------------------------------------------------------------

    def _state(self, node: Node, backend: Backend) -> Buffer:
        state = self.states.get(node.arg)
        if state is None:
            buf = backend.alloc(node.dtype, node.shape)
            state = self.states[node.arg] = _State(node, {backend.name: buf}, backend.name)
        if (state.node.dtype, state.node.shape) != (node.dtype, node.shape):
            have, want = state.node, node
            raise BackendError(
                f"state {node.arg!r} holds {have.dtype.name}{list(have.shape)}, this graph "
                f"needs {want.dtype.name}{list(want.shape)}: the graphs of one sequence must "
                "share n_ctx; call clear_states() to start over with another size"
            )
        if state.owner != backend.name:
            # the plan placed this state's writer on another backend: bring its copy up to date
            warnings.warn(
                f"state {node.arg!r} copied from {state.owner} to {backend.name}", stacklevel=3
            )
            if backend.name not in state.buffers:
                state.buffers[backend.name] = backend.alloc(node.dtype, node.shape)
            src = self.by_name[state.owner]
            dst = state.buffers[backend.name]
            if not backend.copy_from(dst, state.buffers[state.owner], src):
                host = src.alloc_host(numpy_dtype(node.dtype), node.shape)
                src.download(state.buffers[state.owner], host)
                backend.upload(dst, host)
            state.owner = backend.name
        return state.buffers[backend.name]

    def reset(self) -> None:
        """Zero every state (KV cache) in place: the next step starts a new sequence. The
        buffers themselves are kept, so captured executables stay valid."""
        for state in self.states.values():
            zeros = np.zeros(state.node.shape, numpy_dtype(state.node.dtype))
            for name, buf in state.buffers.items():
                self.by_name[name].upload(buf, zeros)

    def clear_states(self) -> None:
        """Drop every state and every prepared plan (which may hold captured state addresses),
        e.g. to change the context size."""
        for prepared in self._prepared.values():
            self._release(prepared)
        self._prepared.clear()
        self.states.clear()

    # -- running ----------------------------------------------------------------------------

    def run(
        self,
        graph: Graph,
        inputs: Mapping[str, np.ndarray],
        *,
        expose: Sequence[int] = (),
        out: Mapping[int, np.ndarray] | None = None,
        capture: bool | None = None,
    ) -> dict[int, np.ndarray]:
        """Run ``graph`` with its INPUT leaves bound by name. Returns host arrays for the graph's
        outputs and ``expose``d nodes; pass ``out`` (node id -> array) to reuse host buffers.
        ``capture`` overrides the runtime's capture setting for this call."""
        prepared = self._prepare(graph, tuple(expose))
        plan = prepared.plan
        host_inputs = self._check_inputs(graph, prepared.inputs, inputs)
        produced: dict[int, Buffer] = {}  # computed node -> buffer on its backend
        copies = iter(plan.copies)
        pending = next(copies, None)
        for k, split in enumerate(plan.splits):
            backend = self.by_name[split.backend]
            while pending is not None and pending.split == k:
                self._copy(prepared, pending.node, pending.src, backend, host_inputs, produced)
                pending = next(copies, None)
            bound: dict[int, Buffer] = {}
            for s in split.inputs:
                node = graph.nodes[s]
                if node.op is Op.WEIGHT:
                    continue
                if node.op is Op.STATE:
                    bound[s] = self._state(node, backend)
                elif (s, backend.name) in prepared.slots:
                    bound[s] = prepared.slots[s, backend.name]
                else:  # computed by an earlier split on this same backend
                    bound[s] = produced[s]
            use_capture = self.capture if capture is None else capture
            produced.update(self._execute(prepared, k, backend, bound, use_capture))
        results = {}
        for i in dict.fromkeys((*graph.outputs, *expose)):
            node = graph.nodes[i]
            dst = out.get(i) if out else None
            if dst is None:
                dst = np.empty(node.shape, numpy_dtype(node.dtype))
            self.by_name[plan.backend_of(i)].download(produced[i], dst)
            results[i] = dst
        return results

    def _copy(
        self,
        prepared: _Prepared,
        node: int,
        src_name: str,
        dst: Backend,
        host_inputs: Mapping[int, np.ndarray],
        produced: Mapping[int, Buffer],
    ) -> None:
        slot = prepared.slots[node, dst.name]
        if src_name == HOST:
            dst.upload(slot, host_inputs[node])
            return
        src = self.by_name[src_name]
        if not dst.copy_from(slot, produced[node], src):
            host = prepared.staging[node]
            src.download(produced[node], host)
            dst.upload(slot, host)

    def _execute(
        self, prepared: _Prepared, k: int, backend: Backend, bound: dict[int, Buffer], capture: bool
    ) -> dict[int, Buffer]:
        prepared.runs[k] += 1
        exe = prepared.executables[k]
        if not capture or prepared.runs[k] < CAPTURE_AFTER_RUNS or prepared.capture_tried[k]:
            return backend.execute(exe, bound)
        eager = backend.execute(exe, bound)
        prepared.capture_tried[k] = True
        captured = backend.capture(exe)
        if not captured.captured:
            prepared.capture_reason[k] = captured.reason
            return eager
        if self.verify_capture:
            want = self._read_back(prepared.plan.graph, backend, eager)
            replay = backend.execute(captured.executable, bound)
            got = self._read_back(prepared.plan.graph, backend, replay)
            for i, value in want.items():
                if value.tobytes() != got[i].tobytes():
                    node = prepared.plan.graph.nodes[i]
                    prepared.capture_reason[k] = (
                        f"captured replay differs from eager at %{i} {node.op.name}; "
                        "this split runs eagerly"
                    )
                    backend.release(captured.executable)
                    return backend.execute(exe, bound)  # splits are idempotent: redo eagerly
            eager = replay
        prepared.executables[k] = captured.executable
        prepared.capture_reason[k] = ""
        return eager

    def _read_back(
        self, graph: Graph, backend: Backend, buffers: Mapping[int, Buffer]
    ) -> dict[int, np.ndarray]:
        values = {}
        for i, buf in buffers.items():
            node = graph.nodes[i]
            values[i] = np.empty(node.shape, numpy_dtype(node.dtype))
            backend.download(buf, values[i])
        return values

    def _check_inputs(
        self, graph: Graph, declared: Mapping[str, int], inputs: Mapping[str, np.ndarray]
    ) -> dict[int, np.ndarray]:
        missing = sorted(set(declared) - set(inputs))
        if missing:
            raise BackendError(f"missing graph input(s): {', '.join(missing)}")
        unknown = sorted(set(inputs) - set(declared))
        if unknown:
            raise BackendError(
                f"unknown graph input(s): {', '.join(unknown)}; the graph takes "
                f"{', '.join(sorted(declared))}"
            )
        host = {}
        for name, i in declared.items():
            node = graph.nodes[i]
            value = np.asarray(inputs[name])
            want = np.dtype(numpy_dtype(node.dtype))
            if value.shape != node.shape or not np.can_cast(value.dtype, want, "same_kind"):
                raise BackendError(
                    f"input {name!r} must be {want}{list(node.shape)}, "
                    f"got {value.dtype}{list(value.shape)}"
                )
            if want.kind == "i" and value.dtype != want and value.size:
                info = np.iinfo(want)
                if value.min() < info.min or value.max() > info.max:
                    raise BackendError(f"input {name!r} has values outside the {want} range")
            host[i] = np.ascontiguousarray(value, dtype=want)
        return host
