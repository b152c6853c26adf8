"""What the GPU backends (cuda, triton) share on top of the runtime: their executables (the
launches a split became, the buffers they point at, the CUDA graph they were captured as),
capture and release, and the Backend API's memory calls (weights resident as the GGUF's bytes,
values in the runtime's buffers, Q8A values as their three parts), so a backend brings only
its kernels: ``supports_op``, ``rewrite``, ``prepare``, ``execute``."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from parity.core.backend import Backend, Buffer, CaptureResult, Executable
from parity.core.dtypes import DType, host_layout
from parity.core.ir import MATMULS, Op
from parity.core.weights import WeightData

# programmatic dependent launch (where a backend has it) for splits of at most this many tokens:
# a decode step gains (docs/perf.md), a 512-token prefill loses
PDL_TOKENS = 16


VIEWS = (Op.RESHAPE, Op.SLICE_ROWS)  # ops whose value can be a view of their source's


def view_of(x: Any, node) -> Any:
    """The value of a RESHAPE or SLICE_ROWS ``node`` as a view of its source's tensor ``x``."""
    if node.op is Op.RESHAPE:
        return x.view(tuple(node.shape))
    return x[node.arg.start : node.arg.start + node.arg.count]


@attrs.define(eq=False)
class _Mark:
    """A step's place in the stream: its event, and the Q8A downloads queued before it."""

    event: Any
    queued: int = 0


class GpuExecutable(Executable):
    def __init__(self, split, inputs, outputs, launches, keep) -> None:
        super().__init__(split, inputs, outputs)
        self.launches = launches  # (callable, args) or callables, in order
        self.keep = keep  # buffers and scratch the launches point at
        self.graph: Any = None  # the CUDA graph, once captured


class GpuBackend(Backend):
    """A backend on ``self.rt`` (a ``GpuRuntime``, or a ``HostRuntime`` for an interpreter),
    whose ``execute`` replays ``executable.graph`` when it is set. Subclasses set ``self.rt``
    and call ``init_memory()`` in their constructor."""

    rt: Any

    @staticmethod
    def decode_sized(split) -> bool:
        """Whether a split's products and attention take at most PDL_TOKENS tokens."""
        counted = (*MATMULS, Op.ATTENTION)
        nodes = [split.graph.nodes[i] for i in split.nodes]
        return max((n.shape[0] for n in nodes if n.op in counted), default=1) <= PDL_TOKENS

    def init_memory(self) -> None:
        self._weights: dict[str, Any] = {}
        self._pending: list[tuple[np.ndarray, tuple[np.ndarray, ...]]] = []
        self._queued = self._landed = 0  # Q8A downloads ever queued, and ever interleaved

    # -- weights and buffers -----------------------------------------------------------------

    def load_weight(self, weight: WeightData) -> None:
        self._weights[weight.name] = self.rt.upload_weight(weight.raw(), f"weight {weight.name}")

    def alloc(self, dtype: DType, shape: tuple[int, ...]) -> Buffer:
        return self.rt.value(dtype, tuple(shape))

    def split_values(self, split, inputs) -> tuple[dict[int, Any], frozenset[int]]:
        """Every value a split's launches read or write, and the nodes whose value is a view:
        its inputs and a buffer per node, except that a KV_WRITE's value is its cache (written
        in place) and a RESHAPE or SLICE_ROWS of a value the split computes is a view of it,
        which takes no copy and no launch (Gemma 3's per-head norms have four a layer). Values
        of another split are copied: their buffers may change under a view."""
        graph = split.graph
        values: dict[int, Any] = dict(inputs)
        own: set[int] = set()  # values this split computes (and views of them)
        views: set[int] = set()
        for i in split.nodes:
            node = graph.nodes[i]
            x = node.src[0] if node.src else None
            if node.op is Op.KV_WRITE:
                values[i] = values[x]  # the cache
                continue
            if x in own and node.op in VIEWS and node.dtype is not DType.Q8A:  # (3 parts)
                values[i] = view_of(values[x], node)
                views.add(i)
            else:
                values[i] = self.alloc(node.dtype, node.shape)
            own.add(i)
        return values, frozenset(views)

    def alloc_host(self, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        np_dtype, host_shape = host_layout(dtype, shape)
        return self.rt.host_empty(np_dtype, host_shape)

    def upload(self, buffer: Buffer, host: np.ndarray) -> None:
        from parity.backends.gpu.runtime import Q8Value

        if isinstance(buffer, Q8Value):
            for part, field in ((buffer.q, "q"), (buffer.d, "d"), (buffer.s, "s")):
                self.rt.upload(part, np.ascontiguousarray(host[field]).reshape(part.shape))
            self.rt.synchronize()  # the staging copies above are temporaries
            return
        self.rt.upload(buffer, host)

    def download(self, buffer: Buffer, out: np.ndarray) -> None:
        from parity.backends.gpu.runtime import Q8Value

        if isinstance(buffer, Q8Value):
            parts = tuple(
                np.empty(tuple(p.shape), dtype)
                for p, dtype in (
                    (buffer.q, np.int8),
                    (buffer.d, np.float32),
                    (buffer.s, np.float32),
                )
            )
            for p, host in zip((buffer.q, buffer.d, buffer.s), parts, strict=True):
                self.rt.download(p, host)
            self._pending.append((out, parts))  # interleaved into ``out`` once waited for
            self._queued += 1
            return
        self.rt.download(buffer, out)

    def synchronize(self) -> None:
        self.rt.synchronize()
        self._land(self._queued)

    def new_mark(self) -> _Mark:
        return _Mark(self.rt.event())

    def place_mark(self, mark: _Mark) -> None:
        self.rt.record(mark.event)
        mark.queued = self._queued

    def wait_mark(self, mark: _Mark) -> None:
        self.rt.wait(mark.event)
        self._land(mark.queued)

    def drop_mark(self, mark: _Mark) -> None:
        self.rt.destroy(mark.event)

    def _land(self, upto: int) -> None:
        """Interleave the Q8A downloads queued before the first ``upto`` into their arrays."""
        n = upto - self._landed
        if n <= 0:
            return
        for out, (q, d, s) in self._pending[:n]:
            out["q"] = q.reshape(out["q"].shape)
            out["d"], out["s"] = d, s
        del self._pending[:n]
        self._landed = upto

    def copy_from(self, dst: Buffer, src: Buffer, source: Backend) -> bool:
        from parity.backends.gpu.runtime import Q8Value

        if type(source) is not type(self) or source.device != self.device:
            return False
        pairs = (
            ((dst.q, src.q), (dst.d, src.d), (dst.s, src.s))
            if isinstance(dst, Q8Value)
            else ((dst, src),)
        )
        for a, b in pairs:
            self.rt.copy(a, b)
        return True

    def zero(self, buffer: Buffer, dtype: DType, shape: tuple[int, ...]) -> None:
        self.rt.zero(*((buffer.q, buffer.d, buffer.s) if dtype is DType.Q8A else (buffer,)))

    def close(self) -> None:
        self._weights.clear()
        super().close()

    # -- graphs ------------------------------------------------------------------------------

    def capture(self, executable: GpuExecutable) -> CaptureResult:
        try:
            graph = self.rt.capture(lambda: self.execute(executable))
        except Exception as e:  # the driver's reason, whatever its type
            return CaptureResult(reason=f"CUDA graph capture failed: {e}")
        replay = type(executable)(
            executable.split, executable.inputs, executable.outputs, executable.launches,
            executable.keep,
        )  # fmt: skip
        replay.graph = graph
        return CaptureResult(replay)

    def release(self, executable: GpuExecutable) -> None:
        executable.graph = None
        executable.launches = []
        executable.keep = None
