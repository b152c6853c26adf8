"""The backend API: what a backend must do, what it may do, and the small types it trades in.

A backend class is registered by a plugin (``parity_register_backends``); registering it starts
nothing. The class answers cheap questions (``available``, ``devices``, ``score``) without
importing heavy modules or touching a device; an instance is created for one device only when a
runtime is about to use it.

Life of a graph on a backend::

    register_weight(w) ...            once per weight, idempotent; uploaded once
    exe = prepare(split)              once per (graph, split): kernels chosen, buffers planned
    upload(slot, host)                per step, into buffers the runtime allocated once
    outs = execute(exe, inputs)       per step; inputs and outputs are backend Buffers
    download(outs[i], host_array)     readback into a caller-provided host array
    capture(exe)                      (optional) record exe for replay (CUDA graphs)
    release(exe)                      (optional) when the runtime evicts a plan

Stable buffers: for one executable the runtime passes the same buffer objects on every call
(it refills its own input slots in place and keeps state buffers for the runtime's life), and
values produced by an earlier split are the buffers that split returned. A backend whose
``execute`` returns the same output buffers every call (as a captured graph does) therefore
gets fully stable inputs downstream, which is what makes a captured replay valid.

Idempotence: running a split twice on the same inputs gives the same outputs and leaves states
as one run does (KV_WRITE rewrites the same rows). Capture verification relies on it.

Buffers are whatever the backend uses for device memory (a numpy array on cpu, a torch tensor on
a GPU); the core only passes them back to the backend that made them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np

from parity.core.dtypes import DType
from parity.core.ir import Graph, Node
from parity.core.weights import WeightData

PLUGIN_API_VERSION = 1
NUMERICS = ("exact", "fast")

Buffer = Any


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


@attrs.frozen
class CaptureResult:
    """The answer to ``capture``: a replayable executable, or the reason there is none."""

    executable: Any = None
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
        """A zero-filled buffer on this backend's device."""
        raise NotImplementedError("need alloc")

    def upload(self, buffer: Buffer, host: np.ndarray) -> None:
        """Copy ``host`` into the existing ``buffer`` (same dtype and shape)."""
        raise NotImplementedError("need upload")

    def download(self, buffer: Buffer, out: np.ndarray) -> None:
        """Copy ``buffer`` into the caller's host array ``out`` (same dtype and shape); the
        data is in ``out`` when this returns."""
        raise NotImplementedError("need download")

    def prepare(self, split: Split) -> Any:
        """Turn a split into an executable for ``execute``; called once per (graph, split)."""
        raise NotImplementedError("need prepare")

    def execute(self, executable: Any, inputs: Mapping[int, Buffer]) -> dict[int, Buffer]:
        """Run a prepared split. ``inputs`` maps each of ``split.inputs`` that is not a WEIGHT
        to a buffer (STATE buffers are updated in place); returns ``split.outputs``' buffers."""
        raise NotImplementedError("need execute")

    # -- optional ---------------------------------------------------------------------------

    def op_numerics(self, node: Node, srcs: Sequence[Node]) -> str:
        # (optional) "exact" or "fast": how this backend would compute a node it supports.
        # Under numerics = "exact" the scheduler gives a node only to an exact backend. A node
        # whose declared tier (manifest) is a bound counts as "fast" whatever this returns.
        return "exact"

    def why_unsupported(self, node: Node, srcs: Sequence[Node]) -> str:
        # (optional) a precise reason for the explain plan when supports_op says no
        return f"{self.name} has no kernel for {node.op.name} on {describe_sources(srcs)}"

    def alloc_host(self, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        # (optional) a host array for staging this backend's transfers (pinned on a GPU)
        return np.empty(shape, dtype)

    def copy_from(self, dst: Buffer, src: Buffer, source: Backend) -> bool:
        # (optional) copy another backend's buffer into ``dst`` without a host round trip
        # (e.g. two backends sharing one GPU); False makes the runtime go through the host
        return False

    def synchronize(self) -> None:
        # (optional) wait for queued device work; eager backends have none
        return None

    def capture(self, executable: Any) -> CaptureResult:
        # (optional) record an executable for replay (CUDA graphs); say why when you cannot
        return CaptureResult(reason=f"{self.name} does not capture graphs")

    def release(self, executable: Any) -> None:
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


def describe_sources(srcs: Sequence[Node]) -> str:
    return ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in srcs) or "no sources"
