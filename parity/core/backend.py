"""The backend API: what a backend must do, what it may do, and the small types it trades in.

A backend class is registered by a plugin (``parity_register_backends``); registering it starts
nothing. The class answers cheap questions (``available``, ``devices``, ``score``) without
importing heavy modules or touching a device; an instance is created for one device only when a
runtime is about to use it.

Life of a model on a backend::

    graph = rewrite(graph)            (optional) fused ops in place of their compositions
    register_weights(ws, splits=...)  once, at load: every weight the splits read, uploaded
                                      once (idempotent); derived weights may be built here
    exe = prepare(split, inputs)      once per (graph, split): kernels chosen, buffers bound
    -- per step --
    upload(slot, host)                host-fed inputs, into the buffers bound at prepare
    copy_from(slot, buffer, source)   inputs fed from an earlier step's outputs (on device)
    execute(exe)                      reads exe.inputs, writes exe.outputs (and the states)
    download(exe.outputs[i], host)    readback into the runtime's own host arrays
    increment(slot, I32, shape, 1)    (positions kept on the device advance for the next step)
    synchronize()                     once, before the host reads anything
    -- now and then --
    capture(exe) -> replayable exe    (optional) once a step has run a few times (CUDA graphs)
    zero(state)                       a new sequence
    release(exe)                      when the runtime evicts a plan

Buffers are bound once. ``prepare`` receives every buffer the split reads (input slots, KV
cache states, the outputs of earlier splits) and makes the buffers it writes; ``execute`` takes
no buffers at all. Between steps the runtime refills the bound input buffers in place, so a
captured executable, which records those very buffers, always replays on current data: replaying
on stale addresses is impossible by construction, because there is no way to hand ``execute``
others.

Ordering: a backend may enqueue ``upload``, ``copy_from``, ``execute``, ``download``, ``zero``
and ``increment`` on one queue (a CUDA stream) and return at once; they must take effect in the
order called. The runtime waits once per step, after the last download and before the host reads
any result (``wait_mark`` on the mark the step placed after its work, which by default is
``synchronize``), and synchronizes before it reads a host array it staged a cross-backend copy
in. Host arrays handed to ``upload`` are left unchanged until that wait: when ``wait_mark(m)``
returns, every upload and download queued before ``place_mark(m)`` is complete. A backend
that queues says so (``queues = True``): a session may then start the next greedy decode steps
before it waits for the current one (``Step.start`` / ``Step.finish``), so the host's work
overlaps the device's. Such a backend may also offer marks (``new_mark``, ``place_mark``,
``wait_mark``: CUDA events), so that ``Step.finish`` waits for its own step's work and not for
a step queued after it; without them it synchronizes.

Idempotence: running a split twice on the same inputs gives the same outputs and leaves states
as one run does (KV_WRITE rewrites the same rows). Capture verification relies on it.

Buffers are whatever the backend uses for device memory (a numpy array on cpu, a torch tensor on
a GPU); the core only passes them back to the backend that made them. Their host form (what
``upload`` reads and ``download`` writes) is ``parity.core.dtypes.host_layout``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np

from parity.core.dtypes import DType, host_empty, host_zeros
from parity.core.ir import Graph, Node
from parity.core.weights import WeightData

PLUGIN_API_VERSION = 2
NUMERICS = ("exact", "fast")

Buffer = Any
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@attrs.frozen
class Device:
    """One place a backend can run: ``cpu:0``, ``cuda:1``, ..."""

    backend: str
    index: int = 0
    description: str = ""

    @property
    def id(self) -> str:
        return f"{self.backend}:{self.index}"


@attrs.frozen
class Availability:
    """Whether a backend can run on this machine, and if not, why (for the user)."""

    ok: bool
    reason: str = ""


@attrs.frozen
class Split:
    """A run of consecutive nodes that one backend executes in one call.

    ``inputs`` are ids the split reads but does not compute (leaves and values from other
    splits); ``outputs`` are ids it computes that something outside the split needs.
    """

    index: int
    backend: str
    graph: Graph = attrs.field(repr=False)
    nodes: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


class Executable:
    """A split prepared on a backend and bound to its buffers, as ``prepare`` returns it.

    ``inputs`` maps every non-WEIGHT id of ``split.inputs`` to the buffer ``prepare`` was given
    for it; ``outputs`` maps every id of ``split.outputs`` to the buffer ``execute`` writes its
    value into (a KV_WRITE's value is its cache: the STATE buffer itself). Both are fixed for
    the executable's life. Backends subclass this to keep their programs beside the buffers.
    """

    def __init__(
        self, split: Split, inputs: Mapping[int, Buffer], outputs: Mapping[int, Buffer]
    ) -> None:
        self.split = split
        self.inputs = inputs
        self.outputs = outputs


@attrs.frozen
class CaptureResult:
    """The answer to ``capture``: a replayable executable (bound to the captured one's very
    buffers), or the reason there is none."""

    executable: Executable | None = None
    reason: str = ""

    @property
    def captured(self) -> bool:
        return self.executable is not None


class Backend:
    """Base class of every backend. Subclasses set ``name`` and implement the required methods.

    Constructed as ``Backend(device, numerics=..., options=...)``; ``options`` are the backend's
    own settings from the config file (``[backends.NAME]``), read once here, never in a hot loop.
    """

    name: ClassVar[str] = ""
    api_version: ClassVar[int] = PLUGIN_API_VERSION
    numerics_modes: ClassVar[tuple[str, ...]] = ("exact",)  # modes this backend can honour
    # parity tier per op (parity.core.tiers): "exact" or a bound such as "ulp<=2" or
    # "nmse<=1e-5", keyed "OP:TYPE", "OP" or "*"; the conformance kit and `parity compare`
    # enforce it, and the scheduler reads it (a bounded node is "fast")
    manifest: ClassVar[Mapping[str, str]] = {"*": "exact"}
    # the tiers under numerics = "fast", for a backend whose fast kernels differ from its exact
    # ones (None: the same kernels, ``manifest``, either way); exact is then ``manifest``
    fast_manifest: ClassVar[Mapping[str, str] | None] = None
    # True when the per-step calls enqueue and return before the work is done (a GPU stream);
    # False when they compute on the spot (cpu), where starting a step early gains nothing
    queues: ClassVar[bool] = False

    def __init__(
        self,
        device: Device,
        *,
        numerics: str = "exact",
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if numerics not in self.numerics_modes:
            raise ValueError(
                f"backend {self.name!r} offers numerics {', '.join(self.numerics_modes)}, "
                f"not {numerics!r}; pick one of those"
            )
        self.device = device
        self.numerics = numerics
        self.options = dict(options or {})
        self.weights: dict[str, WeightData] = {}
        self._host_arrays: dict[tuple[DType, tuple[int, ...], str], np.ndarray] = {}

    # -- discovery: classmethods, cheap, no device work ------------------------------------

    @classmethod
    def available(cls) -> Availability:
        raise NotImplementedError("need available")

    @classmethod
    def devices(cls) -> list[Device]:
        raise NotImplementedError("need devices")

    @classmethod
    def score(cls, device: Device) -> int:
        # (optional) preference under backend = "auto": the highest score wins per device
        return 0

    # -- required ---------------------------------------------------------------------------

    def supports_op(self, node: Node, srcs: Sequence[Node]) -> bool:
        """Can this backend run ``node`` (whose sources are ``srcs``) at all?"""
        raise NotImplementedError("need supports_op")

    def load_weight(self, weight: WeightData) -> None:
        """Make ``weight`` resident (upload it, or keep the mapped view). Called once per name."""
        raise NotImplementedError("need load_weight")

    def alloc(self, dtype: DType, shape: tuple[int, ...]) -> Buffer:
        """A zero-filled buffer on this backend's device for a value of ``dtype`` and ``shape``."""
        raise NotImplementedError("need alloc")

    def upload(self, buffer: Buffer, host: np.ndarray) -> None:
        """Copy ``host`` (``host_layout`` of the buffer's value) into the existing ``buffer``."""
        raise NotImplementedError("need upload")

    def download(self, buffer: Buffer, out: np.ndarray) -> None:
        """Copy ``buffer`` into the host array ``out`` (its ``host_layout``); the data is in
        ``out`` after the next ``synchronize`` (at once, for a backend without a queue)."""
        raise NotImplementedError("need download")

    def prepare(self, split: Split, inputs: Mapping[int, Buffer]) -> Executable:
        """Bind a split to its buffers: ``inputs`` maps each of ``split.inputs`` that is not a
        WEIGHT to the buffer it reads (STATE buffers are updated in place). Allocate the output
        buffers here, choose kernels, plan scratch; called once per (graph, split)."""
        raise NotImplementedError("need prepare")

    def execute(self, executable: Executable) -> None:
        """Run a prepared split on its bound buffers (may return before the work is done)."""
        raise NotImplementedError("need execute")

    # -- optional ---------------------------------------------------------------------------

    def rewrite(self, graph: Graph) -> Graph:
        # (optional) the graph this backend runs in place of ``graph``, applied before
        # scheduling when this backend is the runtime's first choice: fused ops for their
        # compositions (parity.core.fusion), each a node the scheduler will give this
        # backend (parity.core.scheduler.accepts: supported, and in the run's numerics); the
        # result records its nodes' origin and must keep every output's value.
        return graph

    def register_weights(
        self,
        weights: Sequence[WeightData],
        *,
        splits: Sequence[Split] = (),
        progress: Progress | None = None,
    ) -> None:
        # (optional) register many weights at once, at model load, before the first request.
        # ``splits`` are the splits (of rewritten graphs) this backend will run on them: the
        # place to build derived weights (gate and up stacked for a fused FFN), deciding
        # whether one can be built from dtypes and shapes alone (can_concat_rows).
        # ``progress(done, total)`` counts bytes. The default registers one weight at a time.
        total = sum(w.nbytes for w in weights)
        done = 0
        for w in weights:
            self.register_weight(w)
            done += w.nbytes
            if progress is not None:
                progress(done, total)

    def op_numerics(self, node: Node, srcs: Sequence[Node]) -> str:
        # (optional) "exact" or "fast": how this backend would compute a node it supports.
        # Under numerics = "exact" the scheduler gives a node only to an exact backend. A node
        # whose declared tier (manifest) is a bound counts as "fast" whatever this returns.
        return "exact"

    def why_unsupported(self, node: Node, srcs: Sequence[Node]) -> str:
        # (optional) a precise reason for the explain plan when supports_op says no
        return f"{self.name} has no kernel for {node.op.name} on {describe_sources(srcs)}"

    def alloc_host(self, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        # (optional) a host array for this backend's transfers, in the value's host_layout
        # (pinned memory on a GPU); the runtime allocates its step buffers with it, once
        return host_empty(dtype, shape)

    def copy_from(self, dst: Buffer, src: Buffer, source: Backend) -> bool:
        # (optional) copy a buffer into ``dst`` without a host round trip: ``source`` is the
        # backend that made ``src`` (this one, or another sharing its device). False makes the
        # runtime go through the host
        return False

    def zero(self, buffer: Buffer, dtype: DType, shape: tuple[int, ...]) -> None:
        # (optional) set a buffer to zeros (a KV cache, for a new sequence). Override with a
        # device fill: this default, a fallback that works everywhere, uploads zeros from a
        # host array made once per shape
        self.upload(buffer, self._host_array(dtype, shape, "zeros"))

    def increment(self, buffer: Buffer, dtype: DType, shape: tuple[int, ...], by: int) -> None:
        # (optional) add ``by`` to every element of an I32 buffer in place (positions kept on
        # the device, advancing one decode step at a time). Override with a device kernel;
        # this default goes through the host and waits for it
        host = self._host_array(dtype, shape, "counter")
        self.download(buffer, host)
        self.synchronize()
        host += by
        self.upload(buffer, host)
        self.synchronize()

    def _host_array(self, dtype: DType, shape: tuple[int, ...], use: str) -> np.ndarray:
        key = (dtype, tuple(shape), use)
        if key not in self._host_arrays:
            self._host_arrays[key] = host_zeros(dtype, shape)
        return self._host_arrays[key]

    def synchronize(self) -> None:
        # (optional) wait for queued device work; eager backends have none
        return None

    def new_mark(self) -> Any:
        # (optional, a backend that queues) a mark a step places in the queue after its work,
        # made once per step: ``wait_mark`` then waits for the work queued before
        # ``place_mark`` and not for what was queued after it (the next greedy decode step),
        # and the downloads queued before it have landed. Default: none, and waiting
        # synchronizes
        return None

    def place_mark(self, mark: Any) -> None:
        # (optional) put ``mark`` (``new_mark``'s) in the queue, after the work queued so far
        return None

    def wait_mark(self, mark: Any) -> None:
        # (optional) wait for the work queued before ``place_mark(mark)``; default: all of it
        self.synchronize()

    def drop_mark(self, mark: Any) -> None:
        # (optional) free what ``new_mark`` made (its step is released)
        return None

    def capture(self, executable: Executable) -> CaptureResult:
        # (optional) record an executable for replay (CUDA graphs): the replay must read
        # executable.inputs and write executable.outputs, the buffers bound at prepare (the
        # runtime checks), and own whatever scratch it recorded: memory shared with other
        # executables must not move under a capture. Say why when you cannot
        return CaptureResult(reason=f"{self.name} does not capture graphs")

    def release(self, executable: Executable) -> None:
        # (optional) free what prepare/capture allocated for an executable the runtime evicts
        return None

    def close(self) -> None:
        # (optional) free device memory held by this instance
        self.weights.clear()

    # -- provided ---------------------------------------------------------------------------

    def register_weight(self, weight: WeightData) -> None:
        """Idempotent: the first registration of a name loads it; registering the same weight
        again is a no-op, so a rebuilt graph never copies or re-uploads a weight. A different
        weight under a registered name is refused: a backend instance serves one model."""
        known = self.weights.get(weight.name)
        if known is None:
            self.load_weight(weight)
            self.weights[weight.name] = weight
            return
        if known is weight or (
            (known.dtype, known.shape) == (weight.dtype, weight.shape)
            and known.data.ctypes.data == weight.data.ctypes.data  # the same mapped bytes
        ):
            return
        raise ValueError(
            f"{self.name} already holds a different weight named {weight.name!r} "
            f"({known.dtype.name}{list(known.shape)}); a backend instance serves one model, "
            "so create new backend instances for another model"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.device.id} numerics={self.numerics}>"


def bound_alike(replay: Executable, eager: Executable) -> bool:
    """Is ``replay`` (a capture) bound to exactly ``eager``'s buffers, inputs and outputs?"""
    return all(
        set(a) == set(b) and all(a[i] is b[i] for i in b)
        for a, b in ((replay.inputs, eager.inputs), (replay.outputs, eager.outputs))
    )


def describe_sources(srcs: Sequence[Node]) -> str:
    return ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in srcs) or "no sources"
