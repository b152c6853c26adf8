"""Run graphs on a set of backends: plan once per graph, register weights once, keep states
(KV caches) across steps, move values between splits, read results back into host arrays.

Graph capture policy (DESIGN.md): a split is offered to its backend's ``capture`` once the same
(graph, split) has run a third time; one-shot work never pays for capture. With
``verify_capture`` the first replay is compared bit for bit with the eager run of that step.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from parity.core.backend import Backend
from parity.core.dtypes import numpy_dtype
from parity.core.ir import Graph, Op
from parity.core.scheduler import HOST, Plan, schedule
from parity.core.weights import WeightData
from parity.errors import BackendError

CAPTURE_AFTER_RUNS = 3


@attrs.define
class _Prepared:
    plan: Plan
    executables: list[Any]
    runs: list[int]
    capture_reason: list[str]  # per split: why it is not captured ("" once captured)
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
    ) -> None:
        if not backends:
            raise BackendError("a runtime needs at least one backend")
        self.backends = list(backends)
        self.by_name = {b.name: b for b in self.backends}
        self.weights = weights
        self.strict = strict
        self.capture = capture
        self.verify_capture = verify_capture
        self.states: dict[str, tuple[str, Any]] = {}  # name -> (backend, buffer)
        self._prepared: dict[tuple[Graph, tuple[int, ...]], _Prepared] = {}

    # -- planning ---------------------------------------------------------------------------

    def plan(self, graph: Graph, expose: Sequence[int] = ()) -> Plan:
        return self._prepare(graph, tuple(expose)).plan

    def _prepare(self, graph: Graph, expose: tuple[int, ...]) -> _Prepared:
        key = (graph, expose)
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared
        plan = schedule(graph, self.backends, strict=self.strict, expose=expose)
        for split in plan.splits:
            backend = self.by_name[split.backend]
            for s in split.inputs:
                node = graph.nodes[s]
                if node.op is Op.WEIGHT:
                    backend.register_weight(self._weight(node.arg, node))
        staging = {
            c.node: np.empty(graph.nodes[c.node].shape, numpy_dtype(graph.nodes[c.node].dtype))
            for c in plan.copies
            if c.src != HOST
        }
        exes = [self.by_name[s.backend].prepare(s) for s in plan.splits]
        n = len(plan.splits)
        reasons = ["not run often enough yet" if self.capture else "capture is off"] * n
        prepared = _Prepared(plan, exes, [0] * n, reasons, staging, graph.leaves(Op.INPUT))
        self._prepared[key] = prepared
        return prepared

    def _weight(self, name: str, node: Any) -> WeightData:
        w = self.weights.get(name)
        if w is None:
            raise BackendError(f"the graph reads weight {name!r}, which the model does not have")
        if (w.dtype, w.shape) != (node.dtype, node.shape):
            raise BackendError(
                f"weight {name!r} is {w.dtype.name}{list(w.shape)}, the graph expects "
                f"{node.dtype.name}{list(node.shape)}"
            )
        return w

    def capture_status(self, graph: Graph, expose: Sequence[int] = ()) -> list[str]:
        """Per split of ``graph``: "" if captured, else the reason it runs eagerly."""
        return list(self._prepare(graph, tuple(expose)).capture_reason)

    # -- states -----------------------------------------------------------------------------

    def _state(self, graph: Graph, node_id: int, backend: Backend) -> Any:
        node = graph.nodes[node_id]
        held = self.states.get(node.arg)
        if held is not None and held[0] != backend.name:
            # the plan moved this state's writer to another backend: migrate it once
            warnings.warn(
                f"state {node.arg!r} moves from {held[0]} to {backend.name}", stacklevel=3
            )
            host = np.empty(node.shape, numpy_dtype(node.dtype))
            self.by_name[held[0]].download(held[1], host)
            held = (backend.name, backend.upload(host))
            self.states[node.arg] = held
        if held is None:
            held = (backend.name, backend.alloc(node.dtype, node.shape))
            self.states[node.arg] = held
        return held[1]

    def reset(self) -> None:
        """Forget all states (KV caches): the next step starts a new sequence."""
        self.states.clear()

    # -- running ----------------------------------------------------------------------------

    def run(
        self,
        graph: Graph,
        inputs: Mapping[str, np.ndarray],
        *,
        expose: Sequence[int] = (),
        out: Mapping[int, np.ndarray] | None = None,
    ) -> dict[int, np.ndarray]:
        """Run ``graph`` with its INPUT leaves bound by name. Returns host arrays for the graph's
        outputs and ``expose``d nodes; pass ``out`` (node id -> array) to reuse host buffers."""
        prepared = self._prepare(graph, tuple(expose))
        plan = prepared.plan
        host_inputs = self._check_inputs(graph, prepared.inputs, inputs)
        values: dict[int, dict[str, Any]] = {}  # node -> backend -> buffer
        for exe_index, split in enumerate(plan.splits):
            backend = self.by_name[split.backend]
            bound: dict[int, Any] = {}
            for s in split.inputs:
                node = graph.nodes[s]
                if node.op is Op.WEIGHT:
                    continue
                if node.op is Op.STATE:
                    bound[s] = self._state(graph, s, backend)
                    continue
                held = values.setdefault(s, {})
                if backend.name not in held:
                    if node.op is Op.INPUT:
                        held[backend.name] = backend.upload(host_inputs[s])
                    else:
                        src_name, src_buf = next(iter(held.items()))
                        host = prepared.staging[s]
                        self.by_name[src_name].download(src_buf, host)
                        held[backend.name] = backend.upload(host)
                bound[s] = held[backend.name]
            result = self._execute(prepared, exe_index, backend, bound)
            for i, buf in result.items():
                values[i] = {backend.name: buf}
        wanted = dict.fromkeys((*graph.outputs, *expose))
        results = {}
        for i in wanted:
            node = graph.nodes[i]
            dst = out.get(i) if out else None
            if dst is None:
                dst = np.empty(node.shape, numpy_dtype(node.dtype))
            src_name, src_buf = next(iter(values[i].items()))
            self.by_name[src_name].download(src_buf, dst)
            results[i] = dst
        return results

    def _execute(self, prepared: _Prepared, k: int, backend: Backend, bound: dict) -> dict:
        prepared.runs[k] += 1
        exe = prepared.executables[k]
        if not (self.capture and prepared.runs[k] == CAPTURE_AFTER_RUNS):
            return backend.execute(exe, bound)
        eager = backend.execute(exe, bound)
        captured = backend.capture(exe)
        if not captured.captured:
            prepared.capture_reason[k] = captured.reason
            return eager
        if self.verify_capture:
            replay = backend.execute(captured.executable, bound)
            for i, buf in eager.items():
                node = prepared.plan.graph.nodes[i]
                a = np.empty(node.shape, numpy_dtype(node.dtype))
                b = np.empty_like(a)
                backend.download(buf, a)
                backend.download(replay[i], b)
                if a.tobytes() != b.tobytes():
                    prepared.capture_reason[k] = (
                        f"captured replay differs from eager at %{i} {node.op.name}; "
                        "running eagerly"
                    )
                    return eager
        prepared.executables[k] = captured.executable
        prepared.capture_reason[k] = ""
        return eager

    def _check_inputs(
        self, graph: Graph, declared: Mapping[str, int], inputs: Mapping[str, np.ndarray]
    ) -> dict[int, Any]:
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
            host[i] = np.ascontiguousarray(value, dtype=want)
        return host
