"""What NVIDIA GPUs this machine has, asked of the driver itself (``libcuda``) through ctypes.

Discovery must be cheap and must not import torch or the CUDA Python bindings (seconds, and a
context on every GPU), so it calls five driver functions directly: ``cuInit``,
``cuDeviceGetCount``, ``cuDeviceGet``, ``cuDeviceGetName``, ``cuDeviceTotalMem_v2`` and
``cuDeviceGetAttribute`` for the compute capability. ``cuInit`` creates no context; the
driver honours ``CUDA_VISIBLE_DEVICES``, so ``cuda:N`` is the N-th visible GPU, the same
numbering torch uses.

The answer is computed once per process (``probe``): GPUs do not come and go under a running
program, and ``available``/``devices`` are asked often.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
from pathlib import Path

import attrs

MIN_CAPABILITY = (8, 0)  # sm_80 and newer: what the kernels are written and measured for
_CC_MAJOR, _CC_MINOR, _SM_COUNT = 75, 76, 16  # CUdevice_attribute values
_LIBRARIES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


@attrs.frozen
class Gpu:
    index: int
    name: str
    memory: int  # bytes
    capability: tuple[int, int]
    multiprocessors: int

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        return (
            f"{self.name}, {self.memory / 2**30:.0f} GiB, {self.arch}, "
            f"{self.multiprocessors} multiprocessors"
        )


@attrs.frozen
class Probe:
    """The GPUs the driver reports, or why there are none (one line, for the user)."""

    gpus: tuple[Gpu, ...] = ()
    reason: str = ""
    driver_version: int = 0  # e.g. 13000 for CUDA 13.0

    @property
    def usable(self) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if g.capability >= MIN_CAPABILITY)


@functools.cache
def probe() -> Probe:
    return probe_driver(_LIBRARIES)


def probe_driver(names: tuple[str, ...]) -> Probe:
    """Ask the first driver library of ``names`` that loads for its GPUs."""
    lib = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return Probe(reason="no NVIDIA driver: libcuda could not be loaded")
    try:
        return _ask(lib)
    except _DriverError as e:
        return Probe(reason=str(e))


class _DriverError(Exception):
    pass


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result == 0:
        return
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value:
        code = name.value.decode()
    else:
        code = f"error {result}"
    if code == "CUDA_ERROR_NO_DEVICE":
        raise _DriverError("no GPU: the NVIDIA driver is loaded but sees no device")
    raise _DriverError(f"the NVIDIA driver failed at {what}: {code}")


def _ask(lib: ctypes.CDLL) -> Probe:
    _check(lib, lib.cuInit(0), "cuInit")
    version = ctypes.c_int()
    _check(lib, lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    count = ctypes.c_int()
    _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    gpus = []
    for i in range(count.value):
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
        name = ctypes.create_string_buffer(256)
        _check(lib, lib.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
        memory = ctypes.c_size_t()
        _check(lib, lib.cuDeviceTotalMem_v2(ctypes.byref(memory), dev), "cuDeviceTotalMem")
        attrs_ = []
        for attribute in (_CC_MAJOR, _CC_MINOR, _SM_COUNT):
            value = ctypes.c_int()
            _check(
                lib,
                lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev),
                "cuDeviceGetAttribute",
            )
            attrs_.append(value.value)
        gpus.append(
            Gpu(
                i,
                name.value.decode(errors="replace"),
                memory.value,
                (attrs_[0], attrs_[1]),
                attrs_[2],
            )
        )
    if not gpus:
        return Probe(
            reason="no GPU: the NVIDIA driver sees no device", driver_version=version.value
        )
    return Probe(tuple(gpus), driver_version=version.value)


def missing_packages() -> str:
    """Why the Python side cannot run (torch or the NVRTC bindings absent), or ""."""
    torch = importlib.util.find_spec("torch")
    if torch is None:
        return "torch is not installed; pip install 'parity[cuda]'"
    folders = list(torch.submodule_search_locations or ())
    if folders and not any(any((Path(f) / "lib").glob("libtorch_cuda*")) for f in folders):
        return "the installed torch is a CPU-only build; install a CUDA build of torch"
    if (
        importlib.util.find_spec("cuda") is None
        or importlib.util.find_spec("cuda.bindings") is None
    ):
        return (
            "the CUDA Python bindings (cuda-bindings, for NVRTC) are not installed; "
            "pip install 'parity[cuda]'"
        )
    return ""
