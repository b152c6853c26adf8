"""Run graphs on a set of backends: rewrite and plan once per graph, register weights once, keep
states (KV caches) across steps, bind every buffer once, move values between splits, read
results back into host arrays the runtime owns.

A graph is run through its ``Step`` (``Runtime.step``): the graph rewritten by the first
backend, scheduled, and prepared on its backends with every buffer bound, plus host buffers for
its inputs and outputs allocated once with the backends' ``alloc_host`` (pinned memory on a
GPU). A caller writes token ids and positions into ``step.inputs``, calls ``step.run()`` and
reads ``step.outputs``; a decode step allocates nothing. An input can instead be fed on the
device: from an earlier step's output (``feed``: the ARGMAX of step t is the tokens of step
t+1) or kept on the device and advanced there after each run (``keep``: positions), so greedy
decode on a device reads back one 4-byte token per step and moves nothing else.

Inputs are checked before any backend sees them: ids against the table they index, positions
against the context (``InputError``), so a device gather never reads out of bounds.

Graph capture policy (DESIGN.md): a split is offered to its backend's ``capture`` once it has
run a third time; one-shot work never pays for capture. ``run(capture=...)`` overrides the
step's default per call. A captured executable must be bound to the eager one's very buffers
(inputs, outputs). With ``verify_capture`` its first replay, at the next run, on that run's
fresh inputs, is compared bit for bit (outputs and the states it writes) with the eager
executable run on the same inputs, and a mismatch keeps the split eager, with the reason in
``capture_status``.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from parity.core.backend import Backend, Buffer, Executable, Progress, Split, bound_alike
from parity.core.dtypes import DType, host_empty
from parity.core.ir import Graph, Node, Op, verify
from parity.core.scheduler import HOST, Plan, schedule
from parity.core.weights import WeightData
from parity.errors import BackendError, GraphError, InputError

CAPTURE_AFTER_RUNS = 3
Action = tuple[Callable[..., Any], tuple[Any, ...]]


@attrs.define(eq=False)
class _State:
    """A persistent buffer (a KV cache) with one copy per backend that has used it."""

    node: Node  # the STATE leaf that declared it
    buffers: dict[str, Buffer]
    owner: str  # the backend whose copy is current


@attrs.frozen
class Bound:
    """What an input may hold: values in 0..limit-1 (None: anything), distinct within a step
    when ``distinct``; ``what`` names the limit for the user."""

    limit: int | None = None
    distinct: bool = False
    what: str = ""


def input_bounds(graph: Graph) -> dict[str, Bound]:
    """Per INPUT leaf, the range its values must lie in, from the ops that read them: ids a
    table's rows, positions the RoPE tables, the KV caches and what attention reads (below a
    graph's reach, AttentionArg.reach, where it has one)."""
    indexes = {  # op -> (source read as indices, source whose rows they index, what)
        Op.GET_ROWS: (1, 0, "the {rows} rows of {table}: the vocabulary"),
        Op.ROPE: (1, 2, "the {rows} positions of the RoPE tables"),
        Op.KV_WRITE: (2, 0, "the context: a KV cache of {rows} positions"),
        Op.ATTENTION: (3, 1, "the context: a KV cache of {rows} positions"),
    }
    bounds: dict[str, Bound] = {}
    for node in graph.nodes:
        if node.op not in indexes:
            continue
        at, table, what = indexes[node.op]
        src = graph.nodes[node.src[at]]
        if src.op is not Op.INPUT:
            continue
        rows = graph.nodes[node.src[table]]
        known = bounds.get(src.arg, Bound())
        limit = rows.shape[0]
        reach = node.arg.reach if node.op is Op.ATTENTION else 0
        if reach and reach < limit:  # (a shallow decode graph's promise: GraphParams.reach)
            limit, what = reach, "the positions below {rows} this graph reaches (its reach)"
        if known.limit is None or limit < known.limit:
            text = what.format(table=rows.arg or f"%{node.src[table]}", rows=limit)
            known = Bound(limit, known.distinct, text)
        bounds[src.arg] = attrs.evolve(known, distinct=known.distinct or node.op is Op.KV_WRITE)
    return bounds


@attrs.define(eq=False)
class _Split:
    backend: Backend
    eager: Executable
    executable: Executable  # the eager one, or its captured replay
    copies: list[Action]  # cross-backend copies into this split's slots, before it runs
    states: tuple[tuple[int, Node], ...]  # the STATE inputs it updates: (node id, leaf)
    runs: int = 0
    tried: bool = False
    pending: Executable | None = None  # a replay to check against eager at the next run
    reason: str = ""


@attrs.define(eq=False)
class _Feed:
    """How one INPUT reaches its slots: ``host`` (uploaded every run), ``device`` (copied from
    another step's output before every run) or ``kept`` (uploaded once, then left on the device
    and advanced by ``advance`` after every run)."""

    kind: str = "host"
    source: Step | None = None
    node: int = -1
    advance: int = 0
    fresh: bool = True  # kept: the host value still has to be uploaded
    high: int = 0  # kept: the largest value on the device, tracked on the host


class Step:
    """One graph prepared on a runtime. Write ``inputs`` (host arrays by input name), ``run``,
    read ``outputs`` (host arrays by node id of the graph as given: its outputs and the exposed
    nodes the rewrite kept). Buffers are the runtime's: valid until the next run."""

    def __init__(
        self, runtime: Runtime, graph: Graph, expose: tuple[int, ...], inserted: bool = False
    ) -> None:
        for i in expose:
            if not (0 <= i < len(graph.nodes)) or graph.nodes[i].op.is_leaf:
                raise GraphError(
                    f"cannot expose %{i}: only computed nodes have values to read back"
                )
        self.runtime = runtime
        self.graph = graph
        self.rewritten = runtime.rewrite(graph)
        new_id = self.rewritten.rewritten()
        self._new_id = new_id  # (graphs are immutable: the maps are made once, not per feed)
        self._input_ids = self.rewritten.leaves(Op.INPUT)
        missing = [o for o in graph.outputs if o not in new_id]
        if missing:
            raise BackendError(f"the rewrite lost the value of output(s) {missing}")
        self.exposed = tuple(i for i in expose if i in new_id and i not in graph.outputs)
        wanted = tuple(dict.fromkeys((*graph.outputs, *self.exposed)))
        new = [  # the nodes a rewrite put in, read back too when asked for
            i
            for i, n in enumerate(self.rewritten.nodes)
            if inserted and not n.op.is_leaf and self.rewritten.original(i) < 0
        ]
        read = (*(new_id[i] for i in self.exposed), *new)
        self.plan = runtime.schedule(self.rewritten, tuple(read))
        self.bounds = input_bounds(self.rewritten)
        self._capture = runtime.capture
        self.released = False
        self.in_flight = False  # started, not finished
        self.dependents = 0  # steps fed on the device from this one (which keeps it alive)
        self._prepare(runtime, {new_id[i]: i for i in wanted}, new)

    # -- building -----------------------------------------------------------------------------

    def _prepare(self, rt: Runtime, wanted: Mapping[int, int], new: Sequence[int]) -> None:
        graph, plan = self.rewritten, self.plan
        rt.register_plan(plan)
        slots: dict[tuple[int, str], Buffer] = {}  # (node, backend) -> input slot or copy target
        produced: dict[int, tuple[Backend, Buffer]] = {}  # computed node -> its buffer
        self._feeds: dict[str, _Feed] = {}
        self._input_slots: dict[str, list[tuple[Backend, Buffer]]] = {}
        host_inputs: dict[str, np.ndarray] = {}
        splits: list[_Split] = []
        layout = []
        copies = list(plan.copies)
        for split in plan.splits:
            backend = rt.by_name[split.backend]
            split_copies: list[Action] = []
            for c in [c for c in copies if c.split == split.index]:
                node = graph.nodes[c.node]
                slot = slots[c.node, c.dst] = backend.alloc(node.dtype, node.shape)
                if c.src == HOST:
                    name = node.arg
                    self._input_slots.setdefault(name, []).append((backend, slot))
                    if name not in host_inputs:
                        host_inputs[name] = backend.alloc_host(node.dtype, node.shape)
                        self._feeds[name] = _Feed()
                    continue
                source, buffer = produced[c.node]
                split_copies.append(rt.transfer(source, buffer, backend, slot, node))
            inputs: dict[int, Buffer] = {}
            states = []
            for s in split.inputs:
                node = graph.nodes[s]
                if node.op is Op.WEIGHT:
                    continue
                if node.op is Op.STATE:
                    inputs[s] = rt.state_buffer(node, backend)
                    layout.append((node.arg, backend.name))
                    states.append((s, node))
                elif (s, backend.name) in slots:
                    inputs[s] = slots[s, backend.name]
                else:  # computed by an earlier split on this same backend
                    inputs[s] = produced[s][1]
            exe = backend.prepare(split, inputs)
            if set(exe.outputs) != set(split.outputs):
                raise BackendError(
                    f"{backend.name}.prepare returned buffers for {sorted(exe.outputs)}, the "
                    f"split's outputs are {sorted(split.outputs)}"
                )
            for i in split.outputs:
                produced[i] = (backend, exe.outputs[i])
            reason = "not run often enough yet" if self._capture else "capture is off"
            splits.append(_Split(backend, exe, exe, split_copies, tuple(states), reason=reason))
        self._splits = splits
        self._layout = rt.intern_layout(tuple(layout))
        self._produced = produced
        self.inputs: Mapping[str, np.ndarray] = host_inputs
        outputs: dict[int, np.ndarray] = {}
        downloads: list[Action] = []
        for here, old in wanted.items():
            backend, buffer = produced[here]
            node = graph.nodes[here]
            outputs[old] = backend.alloc_host(node.dtype, node.shape)
            downloads.append((backend.download, (buffer, outputs[old])))
        inserted: dict[int, np.ndarray] = {}
        for i in new:
            backend, buffer = produced[i]
            node = graph.nodes[i]
            inserted[i] = backend.alloc_host(node.dtype, node.shape)
            downloads.append((backend.download, (buffer, inserted[i])))
        self.outputs: Mapping[int, np.ndarray] = outputs
        self.inserted: Mapping[int, np.ndarray] = inserted  # by id in ``rewritten``
        self._downloads = downloads
        self._sync = tuple(dict.fromkeys(s.backend for s in splits))
        # where this step's work ends in each backend's queue (``finish`` waits there only)
        self._marks = tuple(backend.new_mark() for backend in self._sync)
        # every backend queues its work: ``start`` returns before the step is done
        self.queues = all(backend.queues for backend in self._sync)
        self._build_feeds()

    def _build_feeds(self) -> None:
        """The per-run actions of the inputs, from their feeds."""
        host: list[Action] = []
        before: list[Action] = []
        after: list[Action] = []
        for name, feed in self._feeds.items():
            for backend, slot in self._input_slots[name]:
                if feed.kind == "host":
                    host.append((backend.upload, (slot, self.inputs[name])))
                elif feed.kind == "device":
                    source, buffer = feed.source.buffer_of(feed.node)
                    node = self.rewritten.nodes[self._input_ids[name]]
                    before.append(self.runtime.transfer(source, buffer, backend, slot, node))
                else:
                    shape = self.inputs[name].shape
                    after.append((backend.increment, (slot, DType.I32, shape, feed.advance)))
        self._host_actions = host
        self._device_actions = before
        self._advance_actions = after
        self._kept = [(name, f) for name, f in self._feeds.items() if f.kind == "kept"]
        self._checked = [
            (name, self.inputs[name], self.bounds[name], feed)
            for name, feed in self._feeds.items()
            if name in self.bounds
        ]

    def buffer_of(self, node: int) -> tuple[Backend, Buffer]:
        """The backend and device buffer holding the value of ``node`` (an id of ``graph``; one
        of its outputs or exposed nodes) after a run."""
        new = self._new_id.get(node)
        if new is None or new not in self._produced:
            raise BackendError(f"%{node} is not an output of this step; expose it")
        return self._produced[new]

    # -- feeds ------------------------------------------------------------------------------

    def feed(self, name: str, source: Step, node: int | None = None) -> None:
        """From the next run on, input ``name`` is copied on the device from ``source``'s value
        of ``node`` (default: its first output) before every run; the host buffer is unused.
        An input the graph indexes with (ids, positions) takes only values that stay in range
        by construction: an ARGMAX over no more columns than the table it indexes."""
        node = source.graph.outputs[0] if node is None else node
        self._check_name(name)
        if source.runtime is not self.runtime:
            raise BackendError("a step is fed only from a step of its own runtime")
        leaf = self.rewritten.nodes[self._input_ids[name]]
        value = source.graph.nodes[node]
        if (value.dtype, value.shape) != (leaf.dtype, leaf.shape):
            raise BackendError(
                f"cannot feed input {name!r} ({leaf.dtype.name}{list(leaf.shape)}) from "
                f"%{node} {value.op.name} ({value.dtype.name}{list(value.shape)})"
            )
        bound = self.bounds.get(name)
        if bound is not None and bound.limit is not None:
            width = source.graph.nodes[value.src[0]].shape[1] if value.op is Op.ARGMAX else None
            if width is None or width > bound.limit:
                raise BackendError(
                    f"cannot feed input {name!r} from %{node} {value.op.name}: its values must "
                    f"stay within {bound.what}, which only an ARGMAX over at most "
                    f"{bound.limit} columns guarantees"
                )
        source.buffer_of(node)  # it is a value the source step keeps
        self._set_feed(name, _Feed("device", source, node))

    def keep(self, name: str, advance: int = 0) -> None:
        """From the next run on, input ``name`` stays on the device: that run uploads the host
        buffer's values (write them first), each run after it reads what the device holds, and
        after every run the device values advance by ``advance`` (decode positions: 1)."""
        self._check_name(name)
        self._set_feed(name, _Feed("kept", advance=advance))

    def feed_host(self, name: str) -> None:
        """Input ``name`` is uploaded from its host buffer at every run (the default)."""
        self._check_name(name)
        if self._feeds[name].kind != "host":
            self._set_feed(name, _Feed())

    def _set_feed(self, name: str, feed: _Feed) -> None:
        old = self._feeds[name].source
        if old is not None:
            old.dependents -= 1
        if feed.source is not None:
            feed.source.dependents += 1  # kept alive while it feeds this step
        self._feeds[name] = feed
        self._build_feeds()

    def _check_name(self, name: str) -> None:
        if name not in self._feeds:
            raise BackendError(
                f"the graph has no input {name!r}; it takes {', '.join(sorted(self._feeds))}"
            )

    def write(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Copy ``inputs`` (every input some node reads; one nothing reads may be given too)
        into the host buffers, checked for names, types and shapes, each fed from the host."""
        declared = self.inputs  # the inputs some node reads
        unread = set(self.graph.leaves(Op.INPUT)) - set(declared)  # declared, read by nothing
        missing = sorted(set(declared) - set(inputs))
        if missing:
            raise BackendError(f"missing graph input(s): {', '.join(missing)}")
        unknown = sorted(set(inputs) - set(declared) - unread)
        if unknown:
            raise BackendError(
                f"unknown graph input(s): {', '.join(unknown)}; the graph takes "
                f"{', '.join(sorted(declared))}"
            )
        for name, host in declared.items():
            self.feed_host(name)  # given here: from the host, whatever the step was set to
            value = np.asarray(inputs[name])
            if value.shape != host.shape or not np.can_cast(value.dtype, host.dtype, "same_kind"):
                raise BackendError(
                    f"input {name!r} must be {host.dtype}{list(host.shape)}, "
                    f"got {value.dtype}{list(value.shape)}"
                )
            if host.dtype.kind == "i" and value.dtype != host.dtype and value.size:
                info = np.iinfo(host.dtype)
                if value.min() < info.min or value.max() > info.max:
                    raise InputError(f"input {name!r} has values outside the {host.dtype} range")
            host[...] = value

    # -- running ----------------------------------------------------------------------------

    def run(self, *, capture: bool | None = None) -> None:
        """One step: inputs checked and moved in, every split executed, outputs downloaded into
        ``outputs``, each backend waited for once (``finish``) before this returns."""
        self.start(capture=capture)
        self.finish()

    def start(self, *, capture: bool | None = None) -> None:
        """``run`` without the wait: everything is queued (inputs, splits, downloads, the kept
        inputs' advance) and, on a backend that queues (``Backend.queues``), still running when
        this returns. ``finish`` waits for it; until then ``outputs`` are not valid, and the
        host buffers the step uploads from must not be written."""
        self.finish()  # (a run still in flight first: its host buffers are about to change)
        if self.released:
            raise BackendError(
                "this step was released (its runtime cleared its states or evicted it); get "
                "a new one with Runtime.step"
            )
        rt = self.runtime
        if rt.layout is not self._layout:
            rt.place_states(self._layout)
        self._check_inputs()
        for fn, args in self._host_actions:
            fn(*args)
        for fn, args in self._device_actions:
            fn(*args)
        for name, feed in self._kept:
            if feed.fresh:
                self._upload_kept(name, feed)
        use_capture = self._capture if capture is None else capture
        for split in self._splits:
            for fn, args in split.copies:
                fn(*args)
            self._execute(split, use_capture)
        for fn, args in self._downloads:
            fn(*args)
        for fn, args in self._advance_actions:  # (queued after the splits that read them)
            fn(*args)
        for _, feed in self._kept:
            feed.high += feed.advance
        for backend, mark in zip(self._sync, self._marks, strict=True):
            backend.place_mark(mark)
        self.in_flight = True

    def finish(self) -> None:
        """Wait for the run ``start`` queued: each backend once, at the mark the run placed
        after its work (``Backend.wait_mark``; a backend without marks synchronizes), so a
        step started after this one may still be running. ``outputs`` then hold its values,
        and its host buffers may be written. Returns at once when nothing is in flight."""
        if not self.in_flight:
            return
        self.in_flight = False
        for backend, mark in zip(self._sync, self._marks, strict=True):
            backend.wait_mark(mark)

    def _upload_kept(self, name: str, feed: _Feed) -> None:
        for backend, slot in self._input_slots[name]:
            backend.upload(slot, self.inputs[name])
        feed.fresh = False
        values = self.inputs[name]
        feed.high = int(values.max()) if values.size else 0

    def _check_inputs(self) -> None:
        for name, values, bound, feed in self._checked:
            if feed.kind == "host" or (feed.kind == "kept" and feed.fresh):
                check_values(name, values, bound)
            elif feed.kind == "kept" and bound.limit is not None and feed.high >= bound.limit:
                raise InputError(
                    f"input {name!r} kept on the device would reach {feed.high}, outside "
                    f"0..{bound.limit - 1} ({bound.what})"
                )

    def _execute(self, split: _Split, capture: bool) -> None:
        split.runs += 1
        backend = split.backend
        if split.pending is not None:
            self._check_replay(split)
            return
        if not capture or split.tried or split.runs < CAPTURE_AFTER_RUNS:
            backend.execute(split.executable)
            return
        split.tried = True
        eager = split.eager
        backend.execute(eager)
        captured = backend.capture(eager)
        if not captured.captured:
            split.reason = captured.reason
            return
        replay = captured.executable
        if not bound_alike(replay, eager):
            backend.release(replay)
            split.reason = (
                f"{backend.name}.capture returned an executable on other buffers than the "
                "eager one's; a replay must read and write the buffers bound at prepare"
            )
            return
        if self.runtime.verify_capture:
            split.pending = replay
            split.reason = "captured; its first replay is checked against eager at the next run"
            return
        split.executable = replay
        split.reason = ""

    def _check_replay(self, split: _Split) -> None:
        """The first replay of a capture, on this run's inputs, against the eager executable on
        the same inputs: outputs and states bit for bit (splits are idempotent, so the eager
        run, second, leaves the step's values either way)."""
        backend, replay = split.backend, split.pending
        split.pending = None
        backend.execute(replay)
        got = self._read_back(split)
        backend.execute(split.eager)
        want = self._read_back(split)
        for key, value in want.items():
            if value.tobytes() != got[key].tobytes():
                where = (
                    key if isinstance(key, str) else f"%{key} {self.rewritten.nodes[key].op.name}"
                )
                split.reason = (
                    f"captured replay differs from eager at {where}; this split runs eagerly"
                )
                backend.release(replay)
                return
        split.executable = replay
        split.reason = ""

    def _read_back(self, split: _Split) -> dict[int | str, np.ndarray]:
        values: dict[int | str, np.ndarray] = {}
        exe = split.eager
        for i, buf in exe.outputs.items():
            node = self.rewritten.nodes[i]
            values[i] = host_empty(node.dtype, node.shape)
            split.backend.download(buf, values[i])
        for s, node in split.states:
            values[f"state {node.arg!r}"] = host_empty(node.dtype, node.shape)
            split.backend.download(exe.inputs[s], values[f"state {node.arg!r}"])
        split.backend.synchronize()
        return values

    @property
    def capture_status(self) -> list[str]:
        """Per split: "" if captured, else why it runs eagerly."""
        return [s.reason for s in self._splits]

    @property
    def runs(self) -> int:
        """How many times this step has run."""
        return self._splits[0].runs if self._splits else 0

    def release(self) -> None:
        """Free what the backends made for this step; it cannot run again."""
        if self.released:
            return
        self.finish()  # nothing it queued is still running on what is released
        self.released = True
        for name in self._feeds:  # let go of the steps that fed this one
            self._set_feed(name, _Feed())
        for split in self._splits:
            for exe in {id(e): e for e in (split.executable, split.pending) if e}.values():
                if exe is not split.eager:
                    split.backend.release(exe)
            split.backend.release(split.eager)
        for backend, mark in zip(self._sync, self._marks, strict=True):
            backend.drop_mark(mark)


def check_values(name: str, values: np.ndarray, bound: Bound) -> None:
    """InputError unless every value lies in 0..limit-1 (and is distinct when asked)."""
    if not values.size or bound.limit is None:
        return
    if values.size == 1:  # a decode step: no reduction (each costs an allocation)
        low = high = values.item()
    else:
        low, high = values.min(), values.max()
    if low < 0 or high >= bound.limit:
        bad = int(low) if low < 0 else int(high)
        raise InputError(
            f"input {name!r} holds {bad}, outside 0..{bound.limit - 1} ({bound.what}); "
            "check the token ids and the positions against the model and the context size"
        )
    if bound.distinct and values.size > 1 and np.unique(values).size != values.size:
        raise InputError(
            f"input {name!r} repeats a position within one step; positions are distinct"
        )


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
        rewrite: bool = True,
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
        self.apply_rewrites = rewrite
        self.max_plans = max_plans
        self.states: dict[str, _State] = {}
        self.layout: tuple[tuple[str, str], ...] | None = None
        self._layouts: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] = {}
        # (graph, exposed nodes, inserted, copy) -> its step
        self._steps: OrderedDict[tuple[Graph, tuple[int, ...], bool, int], Step] = OrderedDict()
        self._pinned: dict[tuple[Graph, tuple[int, ...], bool, int], Step] = {}
        self._rewrites: OrderedDict[Graph, Graph] = OrderedDict()
        self._plans: OrderedDict[tuple[Graph, tuple[int, ...]], Plan] = OrderedDict()

    # -- planning ---------------------------------------------------------------------------

    def rewrite(self, graph: Graph) -> Graph:
        """``graph`` as the first backend rewrites it (fused ops), checked and cached; as
        written when the runtime was made with ``rewrite=False`` (a reference: every node
        keeps its value)."""
        found = self._rewrites.get(graph)
        if found is None:
            found = self.backends[0].rewrite(graph) if self.apply_rewrites else graph
            if found is not graph:
                _check_rewrite(self.backends[0].name, graph, found)
            self._rewrites[graph] = found
            _bound(self._rewrites, self.max_plans)
        return found

    def schedule(self, graph: Graph, expose: tuple[int, ...] = ()) -> Plan:
        """The plan of a (rewritten) graph, cached."""
        key = (graph, expose)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = schedule(
                graph, self.backends, strict=self.strict, expose=expose
            )
            _bound(self._plans, self.max_plans)
        return plan

    def plan(self, graph: Graph, expose: Sequence[int] = ()) -> Plan:
        """Where each node of ``graph`` (rewritten) runs, and why."""
        rewritten = self.rewrite(graph)
        new_id = rewritten.rewritten()
        return self.schedule(rewritten, tuple(new_id[i] for i in expose if i in new_id))

    def step(
        self,
        graph: Graph,
        expose: Sequence[int] = (),
        *,
        pin: bool = False,
        inserted: bool = False,
        copy: int = 0,
    ) -> Step:
        """The prepared step of ``graph`` (with ``expose``d nodes read back too, and with
        ``inserted`` the nodes the rewrite put in: ``Step.inserted``), made once. Steps are kept
        for the ``max_plans`` graphs used last, while another step is fed from them, and for
        ever when ``pin``ned (the decode steps a session holds on to). ``copy`` > 0: another
        step of the same graph, on buffers of its own, that may be in flight with the first
        (a session's greedy decode steps, two queued at once)."""
        key = (graph, tuple(expose), inserted, copy)
        step = self._pinned.get(key) or self._steps.get(key)
        if step is None:
            step = Step(self, graph, tuple(expose), inserted)
        if pin:
            self._steps.pop(key, None)
            self._pinned[key] = step
            return step
        if key in self._pinned:
            return step
        self._steps[key] = step
        self._steps.move_to_end(key)
        if len(self._steps) > self.max_plans:
            evict = next((k for k, s in self._steps.items() if not s.dependents), None)
            if evict is not None:
                self._steps.pop(evict).release()
        return step

    def capture_status(self, graph: Graph, expose: Sequence[int] = ()) -> list[str]:
        """Per split of a graph that has a step: "" if captured, else why it runs eagerly."""
        key = (graph, tuple(expose), False, 0)
        step = self._pinned.get(key) or self._steps.get(key)
        if step is None:
            raise BackendError("this graph has not run on this runtime")
        return step.capture_status

    # -- weights ----------------------------------------------------------------------------

    def register(
        self, graphs: Sequence[Graph], progress: Callable[[str], Progress] | None = None
    ) -> None:
        """Register every weight ``graphs`` read, as planned, on the backends that read them,
        one batch per backend (``register_weights``); ``progress(backend name)`` gives the
        callback a backend reports its upload to."""
        plans = [self.schedule(self.rewrite(g)) for g in graphs]
        self._register(plans, progress)

    def register_plan(self, plan: Plan) -> None:
        """Register what a plan reads that is not registered yet (a graph the model did not
        register at load)."""
        self._register([plan], None)

    def _register(self, plans: Sequence[Plan], progress: Callable[[str], Progress] | None) -> None:
        weights: dict[str, dict[str, WeightData]] = {}
        splits: dict[str, list[Split]] = {}
        for plan in plans:
            for split in plan.splits:
                splits.setdefault(split.backend, []).append(split)
                for s in split.inputs:
                    node = plan.graph.nodes[s]
                    if node.op is Op.WEIGHT:
                        weights.setdefault(split.backend, {})[node.arg] = self._weight(node)
        for name, ws in weights.items():
            todo = self._unregistered(self.by_name[name], ws)
            if todo:
                report = progress(name) if progress is not None else None
                self.by_name[name].register_weights(todo, splits=splits[name], progress=report)

    @staticmethod
    def _unregistered(backend: Backend, weights: Mapping[str, WeightData]) -> list[WeightData]:
        """The weights ``backend`` does not hold yet; one it holds under the same name must be
        the same weight (``register_weight`` says so when it is not)."""
        todo = []
        for w in weights.values():
            if w.name in backend.weights:
                backend.register_weight(w)  # a no-op for the same weight, an error otherwise
            else:
                todo.append(w)
        return todo

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

    # -- states -----------------------------------------------------------------------------

    def state_buffer(self, node: Node, backend: Backend) -> Buffer:
        """The buffer of state ``node`` on ``backend`` (made there, zeroed, on first use)."""
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
        if backend.name not in state.buffers:
            state.buffers[backend.name] = backend.alloc(node.dtype, node.shape)
        return state.buffers[backend.name]

    def intern_layout(self, layout: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        return self._layouts.setdefault(layout, layout)

    def place_states(self, layout: tuple[tuple[str, str], ...]) -> None:
        """Bring every state a step reads up to date on the backend that reads it."""
        for name, where in layout:
            state = self.states[name]
            if state.owner == where:
                continue
            warnings.warn(f"state {name!r} copied from {state.owner} to {where}", stacklevel=4)
            src, dst = self.by_name[state.owner], self.by_name[where]
            node = state.node
            fn, args = self.transfer(
                src, state.buffers[state.owner], dst, state.buffers[where], node
            )
            fn(*args)
            dst.synchronize()
            state.owner = where
        self.layout = layout

    def reset(self) -> None:
        """Zero every state (KV cache) where it lives (``Backend.zero``): the next step starts a
        new sequence. The buffers themselves are kept, so prepared and captured steps stay valid."""
        for state in self.states.values():
            node = state.node
            self.by_name[state.owner].zero(state.buffers[state.owner], node.dtype, node.shape)

    def clear_states(self) -> None:
        """Drop every state and every prepared step (which hold state buffers), e.g. to change
        the context size."""
        for step in (*self._steps.values(), *self._pinned.values()):
            step.release()  # bound to the dropped states: they can never run again
        self._steps.clear()
        self._pinned.clear()
        self.states.clear()
        self.layout = None

    # -- moving values ----------------------------------------------------------------------

    def transfer(
        self, src: Backend, buffer: Buffer, dst: Backend, slot: Buffer, node: Node
    ) -> Action:
        """The action that copies ``buffer`` (on ``src``) into ``slot`` (on ``dst``): on the
        device where ``dst.copy_from`` can, else through a host array made once."""
        return (_Transfer(src, buffer, dst, slot, node), ())

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
        """Run ``graph`` once with its INPUT leaves bound by name: a convenience over ``step``
        that copies the inputs in and returns copies of the outputs and of the ``expose``d nodes
        the rewrite kept (into ``out[id]`` where given). Hot loops use ``step`` directly."""
        step = self.step(graph, expose)
        step.write(inputs)
        step.run(capture=capture)
        results = {}
        for i, value in step.outputs.items():
            dst = out.get(i) if out else None
            if dst is None:
                dst = value.copy()
            else:
                np.copyto(dst, value, casting="no")
            results[i] = dst
        return results


class _Transfer:
    """Copies one buffer into another backend's (or the same backend's) buffer: on the device
    when the destination's ``copy_from`` can, else through a host array made on first need."""

    def __init__(self, src: Backend, buffer: Buffer, dst: Backend, slot: Buffer, node: Node):
        self.src, self.buffer, self.dst, self.slot = src, buffer, dst, slot
        self.dtype, self.shape = node.dtype, node.shape
        self.direct = True
        self.host: np.ndarray | None = None

    def __call__(self) -> None:
        if self.direct and self.dst.copy_from(self.slot, self.buffer, self.src):
            return
        self.direct = False
        if self.host is None:
            self.host = self.src.alloc_host(self.dtype, self.shape)
        self.src.download(self.buffer, self.host)
        self.src.synchronize()  # the host reads the staged value next
        self.dst.upload(self.slot, self.host)


def _check_rewrite(backend: str, graph: Graph, rewritten: Graph) -> None:
    """A rewrite keeps the graph valid and each value where its origin says: BackendError
    naming the backend otherwise."""
    if rewritten.origin is None:
        raise BackendError(
            f"{backend}.rewrite returned a graph without origin; build rewrites with "
            "parity.core.fusion so their nodes keep where they came from"
        )
    try:
        verify(rewritten)
    except GraphError as e:
        raise BackendError(f"{backend}.rewrite returned an invalid graph: {e}") from None
    for i, node in enumerate(rewritten.nodes):
        o = rewritten.original(i)
        if o >= 0 and (node.dtype, node.shape) != (graph.nodes[o].dtype, graph.nodes[o].shape):
            raise BackendError(
                f"{backend}.rewrite put %{i} {node.op.name} {node.dtype.name}{list(node.shape)} "
                f"in place of %{o} {graph.nodes[o].op.name}, which is "
                f"{graph.nodes[o].dtype.name}{list(graph.nodes[o].shape)}"
            )


def _bound(cache: OrderedDict, capacity: int) -> None:
    while len(cache) > capacity:
        cache.popitem(last=False)
