"""The cuda backend's CUDA C kernels, compiled by the host C++ compiler and run on the CPU.

``emu.hpp`` maps CUDA's threads, barriers, warp intrinsics and shared memory onto fibers (see
its header comment), so a kernel's logic, its barriers and its bits can be tested on a machine
without a GPU, against the cpu oracle. It says nothing about speed, and nothing about what
only the device does (PTX assembly, memory ordering between concurrent blocks).

    lib = compile_kernels("attention.cu", ["attention_rows<64>"])
    lib.launch("attention_rows<64>", grid=(n_head, t), block=(256,), args=[AttnArg(...)])

Pointers in the arguments are host addresses (numpy arrays' ``ctypes.data``, CPU tensors'
``data_ptr()``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import parity.backends.cuda as cuda_pkg

KERNELS = Path(cuda_pkg.__file__).parent / "kernels"
HEADER = Path(__file__).parent / "emu.hpp"
FLAGS = ["-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
         "-w"]  # fmt: skip

# `extern __shared__ T name[];` (dynamic shared memory): the launch's buffer
_DYNAMIC = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def compiler() -> str | None:
    """The host C++ compiler, or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout


# A launch releases the GIL, and the emulator's state is a library's global: one launch at a
# time. (g++ makes a template's or inline function's statics process-wide symbols, so two
# libraries built from different versions of a kernel, as a test run that outlives an edit
# loads, would share storage sized by either: -fno-gnu-unique keeps each library's own.)
_LAUNCH = threading.Lock()


class EmulatorError(RuntimeError):
    """A kernel failed in the emulator (a barrier some threads never reach, a bad block)."""


class Library:
    """A compiled set of kernels; ``launch`` runs one over a grid."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self._lib = ctypes.CDLL(str(path))
        self._lib.emu_launch.restype = ctypes.c_int
        self._lib.emu_launch.argtypes = (
            [ctypes.c_int]
            + [ctypes.c_uint] * 6
            + [
                ctypes.c_void_p,
                ctypes.c_size_t,
            ]
        )
        self._lib.emu_error.restype = ctypes.c_char_p
        self._lib.emu_reverse.argtypes = [ctypes.c_int]
        self._lib.emu_late_write.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t]
        self._index = {name: i for i, name in enumerate(names)}
        # resume a block's threads last to first between barriers: a missing barrier whose
        # writer precedes its reader in one order shows in the other
        self.reverse = False

    def launch(
        self,
        name: str,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: list[ctypes._SimpleCData | ctypes.Structure],
        dynamic_smem: int = 0,
    ) -> None:
        """Run kernel ``name`` over ``grid`` with ``args`` (ctypes values, in order)."""
        params = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(a) for a in args])
        self.launch_params(name, grid, block, params, dynamic_smem)

    def late_write(self, dst: int, poison: int, truth: int, nbytes: int) -> None:
        """For the next launch only: ``nbytes`` at address ``dst`` hold the bytes at ``poison``
        when each block starts and those at ``truth`` once its threads pass pdl_begin (a write
        of the kernel before, seen by a kernel under PDL; emu.hpp's Late). The caller keeps the
        three buffers alive."""
        self._lib.emu_late_write(dst, poison, truth, nbytes)

    def launch_params(self, name: str, grid, block, params, dynamic_smem: int = 0) -> None:
        """``launch`` with the arguments as CUDA's ``void** params`` (``Launch.params``)."""
        if name not in self._index:
            raise EmulatorError(f"{name} was not compiled into this library: {list(self._index)}")
        g = (*grid, 1, 1)[:3]
        b = (*block, 1, 1)[:3]
        with _LAUNCH:
            self._lib.emu_reverse(int(self.reverse))
            rc = self._lib.emu_launch(self._index[name], *g, *b, params, dynamic_smem)
            if rc != 0:
                raise EmulatorError(f"{name}: {self._lib.emu_error().decode()}")


# a kernel source's own headers, and a function or variable at file scope
_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.M)
_FILE_SCOPE = re.compile(r"^__device__ ", re.M)


def _inlined(path: Path, seen: set[Path]) -> str:
    """Kernel source ``path`` with its own headers inlined, each once (#pragma once), and its
    file-scope __device__ functions and variables static: a library compiles only those its
    kernels use (norm.cuh's three, unused by most of matmul.cu's kernels, took a third of each
    of its libraries' build)."""
    if path in seen:
        return ""
    seen.add(path)
    text = path.read_text().replace("#pragma once", "")
    text = _INCLUDE.sub(lambda m: _inlined(path.parent / m.group(1), seen), text)
    text = _FILE_SCOPE.sub("static __device__ ", text)
    return _DYNAMIC.sub(r"\1* \2 = static_cast<\1*>(emu::dynamic_smem());", text)


def _source(files: list[str], names: list[str]) -> str:
    lines = ['#include "emu.hpp"']
    seen: set[Path] = set()
    for f in files:
        lines.append(_inlined(KERNELS / f, seen))
    lines.append('extern "C" const char* emu_error() { return emu::state().error; }')
    lines.append('extern "C" void emu_reverse(int on) { emu::state().reverse = on != 0; }')
    lines.append(
        'extern "C" void emu_late_write(void* dst, const void* poison, const void* truth,'
        " size_t n) { emu::state().late.push_back({dst, poison, truth, n}); }"
    )
    lines.append(
        'extern "C" int emu_launch(int k, unsigned gx, unsigned gy, unsigned gz, unsigned bx,'
        " unsigned by, unsigned bz, void* const* params, size_t dyn) {"
    )
    lines.append("    const dim3 g{gx, gy, gz}, b{bx, by, bz};")
    lines.append("    switch (k) {")
    for i, name in enumerate(names):
        lines.append(f"    case {i}: return emu::launch(&{name}, params, g, b, dyn);")
    lines.append("    }")
    lines.append("    return -2;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def compile_kernels(files: str | list[str], names: list[str], cache: Path | None = None) -> Library:
    """Compile kernel source ``files`` (in the cuda backend's kernels folder) with the kernels
    ``names`` (instantiations written as in CUDA C, e.g. ``attention_rows_gqa<64, 7>``) for the
    CPU; reuses a build of the same sources, header, names and flags."""
    files = [files] if isinstance(files, str) else list(files)
    cxx = compiler()
    if cxx is None:
        raise EmulatorError("no C++ compiler (g++ or clang++, or $CXX) to build the kernels with")
    src = _source(files, names)
    includes = sorted(KERNELS.glob("*.cu*"))
    flags = FLAGS + ([] if "clang" in _compiler_version(cxx) else ["-fno-gnu-unique"])
    parts = [src, HEADER.read_text(), cxx, _compiler_version(cxx), *flags]
    parts += [p.read_text() for p in includes]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    if cache is None:  # a folder of this user's alone: what is loaded from it is what was built
        cache = Path(tempfile.gettempdir()) / f"parity-cuda-emulator-{os.getuid()}"
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    lib = cache / f"{key}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cpp = Path(tmp) / "kernels.cpp"
            cpp.write_text(src)
            out = Path(tmp) / "kernels.so"
            cmd = [cxx, *flags, "-I", str(HEADER.parent), "-o", str(out), str(cpp)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise EmulatorError(f"compiling {files} failed:\n{done.stderr[-4000:]}")
            os.replace(out, lib)  # atomic: parallel test workers may build the same library
    return Library(lib, names)
