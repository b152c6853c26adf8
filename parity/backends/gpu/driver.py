"""The few CUDA driver calls parity's GPU backends make themselves, through ctypes: load a
cubin, find its kernels, launch them, copy memory and launch captured graphs on the runtime's
stream.

These are a step's hot path. torch's copies and its ``torch.cuda.stream`` context cost tens of
microseconds of Python a call, more than the copy; a driver call through ctypes costs a few.
Launches are built once, when a split is prepared: a ``Launch`` holds its kernel, grid, block,
shared memory and the packed ``void*[]`` of its arguments (buffers are bound at prepare, so the
pointers never change). A launch is then one foreign call. Inside a CUDA graph capture the same
calls are recorded.

torch owns the context (the device's primary context); ``Driver`` makes it current on the
calling thread before loading modules, so kernels and torch's tensors live in one context.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from parity.errors import BackendError

_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING
_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # (cuda.h's CUlaunchAttributeID)
PDL_ENV = "PARITY_PDL"


def pdl_wanted(env: Mapping[str, str] | None = None) -> bool:
    """``PARITY_PDL``, read once by a backend: anything but 0/false/no/off leaves programmatic
    dependent launch on (where the GPU has it)."""
    value = (os.environ if env is None else env).get(PDL_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx``."""

    _fields_ = [
        *((name, ctypes.c_uint) for name in ("gx", "gy", "gz", "bx", "by", "bz", "shared")),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("n_attrs", ctypes.c_uint),
    ]


class Driver:
    def __init__(self, device_index: int) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise BackendError(f"the NVIDIA driver (libcuda) could not be loaded: {e}") from None
        self.lib = lib
        vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        lib.cuLaunchKernel.restype = i
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), vp, vp, vp]
        lib.cuLaunchKernelEx.restype = i
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [vp, i, i]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), i]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuModuleUnload.argtypes = [vp]
        device = ctypes.c_int()
        self.check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        context = vp()
        self.check(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain"
        )
        self.context = context
        self.make_current()
        self._launch = lib.cuLaunchKernel
        self._launch_ex = lib.cuLaunchKernelEx
        size = ctypes.c_size_t
        copies = {  # (the _v2 symbols are the 64-bit ones cuda.h's names stand for)
            "h2d": (lib.cuMemcpyHtoDAsync_v2, [ctypes.c_uint64, vp, size, vp]),
            "d2h": (lib.cuMemcpyDtoHAsync_v2, [vp, ctypes.c_uint64, size, vp]),
            "d2d": (lib.cuMemcpyDtoDAsync_v2, [ctypes.c_uint64, ctypes.c_uint64, size, vp]),
        }
        for fn, argtypes in copies.values():
            fn.argtypes, fn.restype = argtypes, i
        self._copies = {kind: fn for kind, (fn, _) in copies.items()}
        lib.cuGraphLaunch.argtypes, lib.cuGraphLaunch.restype = [vp, vp], i
        self._graph_launch = lib.cuGraphLaunch
        lib.cuEventCreate.argtypes = [ctypes.POINTER(vp), u]
        lib.cuEventRecord.argtypes, lib.cuEventRecord.restype = [vp, vp], i
        lib.cuEventSynchronize.argtypes, lib.cuEventSynchronize.restype = [vp], i
        lib.cuEventDestroy_v2.argtypes = [vp]
        self._event_record = lib.cuEventRecord
        self._event_synchronize = lib.cuEventSynchronize

    def make_current(self) -> None:
        self.check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def check(self, result: int, what: str) -> None:
        if result == 0:
            return
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(result, ctypes.byref(name))
        code = name.value.decode() if name.value else f"error {result}"
        if code == "CUDA_ERROR_OUT_OF_MEMORY":
            raise BackendError(f"GPU out of memory at {what}; use a shorter context or another GPU")
        raise BackendError(f"the CUDA driver failed at {what}: {code}")

    def load(self, cubin: bytes) -> ctypes.c_void_p:
        module = ctypes.c_void_p()
        self.make_current()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        return module

    def function(self, module: ctypes.c_void_p, name: str) -> int:
        fn = ctypes.c_void_p()
        self.check(
            self.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()),
            f"cuModuleGetFunction({name})",
        )
        return fn.value

    def allow_shared(self, fn: int, shared: int, name: str) -> None:
        """Let ``fn`` launch with ``shared`` bytes of dynamic shared memory (more than the
        default 48 KiB needs the opt-in)."""
        self.check(
            self.lib.cuFuncSetAttribute(
                ctypes.c_void_p(fn), _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED, shared
            ),
            f"cuFuncSetAttribute({name}, {shared} bytes of shared memory)",
        )

    def launch(self, launch: Launch, stream: int) -> None:
        if launch.config is not None:  # programmatic dependent launch
            launch.config.stream = stream
            result = self._launch_ex(ctypes.byref(launch.config), launch.fn, launch.params, None)
            if result:
                self.check(result, f"launching {launch.name}")
            return
        g, b = launch.grid, launch.block
        result = self._launch(
            launch.fn,
            g[0],
            g[1],
            g[2],
            b[0],
            b[1],
            b[2],
            launch.shared,
            stream,
            launch.params,
            None,
        )
        if result:
            self.check(result, f"launching {launch.name}")

    def copy(self, kind: str, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` on ``stream``: ``kind`` is ``h2d``, ``d2h`` or ``d2d``;
        ``dst`` and ``src`` are addresses (a device pointer, or a host array's data). From
        pageable host memory the driver stages the bytes before it returns."""
        if nbytes:
            result = self._copies[kind](dst, src, nbytes, stream)
            if result:
                self.check(result, f"a {nbytes}-byte {kind} copy")

    def event(self) -> ctypes.c_void_p:
        """A new CUDA event that records no time (cheaper to record and wait on)."""
        event = ctypes.c_void_p()
        self.make_current()
        self.check(
            self.lib.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate"
        )
        return event

    def record(self, event: ctypes.c_void_p, stream: int) -> None:
        """Queue ``event`` on ``stream``, after the work queued so far."""
        result = self._event_record(event, stream)
        if result:
            self.check(result, "cuEventRecord")

    def wait(self, event: ctypes.c_void_p) -> None:
        """Wait for the work queued before ``event`` was last recorded."""
        result = self._event_synchronize(event)
        if result:
            self.check(result, "waiting for the GPU (cuEventSynchronize)")

    def destroy(self, event: ctypes.c_void_p) -> None:
        self.lib.cuEventDestroy_v2(event)

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        """Queue a replay of an instantiated CUDA graph on ``stream``."""
        result = self._graph_launch(graph_exec, stream)
        if result:
            self.check(result, "launching a captured graph")


@attrs.define(eq=False)
class Launch:
    """One kernel launch with its arguments packed, ready to go. With ``pdl`` it is launched
    with programmatic dependent launch (sm_90+): it may start before the kernel ahead of it on
    the stream ends, and waits for it inside (kernels/common.cuh, ``pdl_begin``)."""

    name: str
    fn: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    args: tuple[Any, ...]  # the ctypes values (kept alive: ``params`` points at them)
    pdl: bool = False
    params: Any = None
    config: Any = None  # cuLaunchKernelEx's, made once (with pdl)
    attrs: Any = None  # (kept alive: ``config`` points at it)

    def __attrs_post_init__(self) -> None:
        self.params = (ctypes.c_void_p * len(self.args))(*[ctypes.addressof(a) for a in self.args])
        if self.pdl:
            self.attrs = _LaunchAttribute(_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            self.attrs.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed
            self.config = _LaunchConfig(
                *self.grid, *self.block, self.shared, None, ctypes.pointer(self.attrs), 1
            )


def pointer(tensor: Any) -> ctypes.c_void_p:
    """A kernel argument for a tensor (or None: a null pointer)."""
    return ctypes.c_void_p(None if tensor is None else tensor.data_ptr())


def pack(values: Sequence[Any]) -> tuple[Any, ...]:
    """Python values as kernel arguments: ctypes objects pass through; ints become ``int``
    (use ``ctypes.c_longlong`` for 64-bit ones) and floats ``float``."""
    out = []
    for v in values:
        if isinstance(v, ctypes._SimpleCData | ctypes.Structure):
            out.append(v)
        elif isinstance(v, bool | int):
            out.append(ctypes.c_int(int(v)))
        elif isinstance(v, float):
            out.append(ctypes.c_float(v))
        else:
            raise TypeError(f"cannot pass {type(v).__name__} to a kernel")
    return tuple(out)
