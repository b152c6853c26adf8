"""What the GPU backends (cuda, triton) share on top of the runtime: their executables (the
launches a split became, the buffers they point at, the CUDA graph they were captured as),
capture and release, and the Backend API's memory calls (weights resident as the GGUF's bytes,
values in the runtime's buffers, Q8A values as their three parts), so a backend brings only
its kernels: ``supports_op``, ``rewrite``, ``prepare``, ``execute``."""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.core.backend import Backend, Buffer, CaptureResult, Executable
from parity.core.dtypes import DType, host_layout
from parity.core.ir import MATMULS, Op
from parity.core.weights import WeightData

# programmatic dependent launch (where a backend has it) for splits of at most this many tokens:
# a decode step gains (docs/perf.md), a 512-token prefill loses
PDL_TOKENS = 16


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

    # -- weights and buffers -----------------------------------------------------------------

    def load_weight(self, weight: WeightData) -> None:
        self._weights[weight.name] = self.rt.upload_weight(weight.raw(), f"weight {weight.name}")

    def alloc(self, dtype: DType, shape: tuple[int, ...]) -> Buffer:
        return self.rt.value(dtype, tuple(shape))

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
            self._pending.append((out, parts))  # interleaved into ``out`` at synchronize
            return
        self.rt.download(buffer, out)

    def synchronize(self) -> None:
        self.rt.synchronize()
        pending, self._pending = self._pending, []
        for out, (q, d, s) in pending:
            out["q"] = q.reshape(out["q"].shape)
            out["d"], out["s"] = d, s

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
