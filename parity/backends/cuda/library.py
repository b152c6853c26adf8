"""The cuda backend's kernels: CUDA C sources in ``kernels/``, one compiled module per kernel
instantiation (``gemv_q<3, 1, 2>`` in ``matmul.cu``), so each is compiled once per machine and
shared by every model and graph that needs it. ``ensure`` compiles what a split needs before it
runs (in parallel: NVRTC is thread-safe), never inside a step or a capture.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from parity.backends.cuda.nvrtc import Compiler
from parity.backends.gpu.driver import Driver

KERNELS = Path(__file__).parent / "kernels"


@cache
def sources() -> tuple[dict[str, str], dict[str, str]]:
    """The ``.cu`` sources and ``.cuh`` headers, by file name."""
    cu = {p.name: p.read_text() for p in sorted(KERNELS.glob("*.cu"))}
    cuh = {p.name: p.read_text() for p in sorted(KERNELS.glob("*.cuh"))}
    return cu, cuh


class Library:
    def __init__(self, driver: Driver | None, compiler: Compiler) -> None:
        self.driver = driver
        self.compiler = compiler
        compiler.notice = False  # the library says it once for a batch
        self._functions: dict[tuple[str, str], int] = {}
        self._shared: dict[tuple[str, str], int] = {}  # dynamic shared memory over 48 KiB
        self._modules: list[object] = []  # loaded modules, alive as long as the library

    def ensure(self, wanted: Iterable[tuple[str, str]]) -> None:
        """Compile (or load from the cache) every (source, instantiation) not loaded yet."""
        missing = [w for w in dict.fromkeys(wanted) if w not in self._functions]
        if not missing:
            return
        cu, cuh = sources()
        for source, _ in missing:
            if source not in cu:
                raise KeyError(f"no kernel source {source!r} in {KERNELS}")
        to_build = sum(not self.compiler.cached(cu[s], [n], cuh) for s, n in missing)
        start = time.perf_counter()
        if to_build:
            print(
                f"parity: compiling {to_build} CUDA kernel(s) for {self.compiler.arch}; this "
                f"happens once, the results are cached in {self.compiler.cache_dir}",
                file=sys.stderr,
                flush=True,
            )
        workers = min(len(missing), os.cpu_count() or 1, 16)
        with ThreadPoolExecutor(workers) as pool:
            modules = list(
                pool.map(lambda w: self.compiler.compile(w[0], cu[w[0]], [w[1]], cuh), missing)
            )
        if to_build:
            seconds = time.perf_counter() - start
            print(f"parity: compiled in {seconds:.1f} s", file=sys.stderr, flush=True)
        for (source, name), module in zip(missing, modules, strict=True):
            if self.driver is None:
                self._functions[source, name] = 0  # compiled only (no GPU here)
                continue
            handle = self.driver.load(module.cubin)
            self._modules.append(handle)
            self._functions[source, name] = self.driver.function(handle, module.names[name])

    def function(self, source: str, name: str, shared: int = 0) -> int:
        """The kernel's handle, able to launch with ``shared`` bytes of dynamic shared
        memory."""
        self.ensure([(source, name)])
        fn = self._functions[source, name]
        if shared > self._shared.get((source, name), 48 << 10) and self.driver is not None:
            self.driver.allow_shared(fn, shared, name)
            self._shared[source, name] = shared
        return fn
