"""What the GPU backends' executables share: the launches a split became, the buffers they point
at, and the CUDA graph they were captured as (replayed by ``execute`` once there is one)."""

from __future__ import annotations

from typing import Any

from parity.core.backend import CaptureResult, Executable


class GpuExecutable(Executable):
    def __init__(self, split, inputs, outputs, launches, keep) -> None:
        super().__init__(split, inputs, outputs)
        self.launches = launches  # (callable, args) or callables, in order
        self.keep = keep  # buffers and scratch the launches point at
        self.graph: Any = None  # the CUDA graph, once captured


class CapturesGraphs:
    """``capture`` and ``release`` for a backend with ``self.rt`` (a ``GpuRuntime``) whose
    ``execute`` replays ``executable.graph`` when it is set."""

    rt: Any

    def execute(self, executable: GpuExecutable) -> None:  # (the backend's own)
        raise NotImplementedError

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
