"""The cuda backend on the CPU: its lowering, its launches and its CUDA C kernels exactly as on a
GPU, with host memory for device memory (``HostRuntime``, torch CPU tensors) and the emulator
running each launch. What it leaves out: CUDA graphs (capture says it cannot) and programmatic
dependent launch (off, as on a GPU older than sm_90).

    backend = EmulatedCudaBackend(Device("cuda", 0))

is a ``CudaBackend`` for the conformance kit, ``compare_steps`` and the runtime.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cuda_emulator import Library, compile_kernels
from parity.backends.cuda.backend import ADVANCE, CudaBackend
from parity.backends.gpu.backend import GpuBackend
from parity.core.backend import Availability, Device


class EmulatedLibrary:
    """``cuda.library.Library``'s interface over the emulator: a kernel's handle is its index."""

    def __init__(self) -> None:
        self._handles: dict[tuple[str, str], int] = {}
        self._kernels: list[tuple[Library, str]] = []

    def ensure(self, wanted: Iterable[tuple[str, str]]) -> None:
        """Build each kernel not loaded yet, one library a kernel: a build is reused by every
        backend, test and worker that wants the same kernel (compile_kernels' cache)."""
        for source, name in dict.fromkeys(wanted):
            if (source, name) not in self._handles:
                self._kernels.append((compile_kernels(source, [name]), name))
                self._handles[source, name] = len(self._kernels)  # (0 would read as "none")

    def function(self, source: str, name: str, shared: int = 0) -> int:
        self.ensure([(source, name)])
        return self._handles[source, name]

    def kernel(self, handle: int) -> tuple[Library, str]:
        return self._kernels[handle - 1]


class EmulatedDriver:
    """The driver calls the cuda backend makes in a step: launches, run at once."""

    def __init__(self, library: EmulatedLibrary) -> None:
        self.library = library
        self.launched: list[str] = []  # every kernel launched, by name
        self.reverse = False  # resume each block's threads last to first (Library.reverse)

    def launch(self, launch: Any, stream: int) -> None:
        lib, name = self.library.kernel(launch.fn)
        lib.reverse = self.reverse
        lib.launch_params(name, launch.grid, launch.block, launch.params, launch.shared)
        self.launched.append(name)


class EmulatedCudaBackend(CudaBackend):
    """``CudaBackend`` with the emulator for the GPU (see the module's docstring)."""

    def __init__(self, device: Device, guarded: bool = False, **kwargs: Any) -> None:
        """``guarded``: every value and weight ends against a page no one may touch
        (``cuda_emulator.guarded``), so a kernel that reads past one faults."""
        GpuBackend.__init__(self, device, **kwargs)
        from cuda_emulator.guarded import GuardedHostRuntime
        from parity.backends.gpu.host import HostRuntime

        self.pdl = False
        self.multiprocessors = 1  # (wide grids of a few blocks in tests)
        self.clusters = True  # (a grid's blocks run in order: a cluster's last block last)
        self.rt = GuardedHostRuntime() if guarded else HostRuntime()
        self.rt.handle = 0  # (the stream the launches name: none, they run at once)
        self.library = EmulatedLibrary()
        self.driver = EmulatedDriver(self.library)
        self.library.ensure([ADVANCE])
        self._advance = {}
        self.init_memory()

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    @classmethod
    def devices(cls) -> list[Device]:
        return [Device("cuda", 0, "the CUDA C emulator (CPU)")]
