"""The few CUDA driver calls the cuda backend makes itself, through ctypes: load a cubin, find its
kernels, launch them on torch's stream.

Launches are the hot path of an eager step (prefill runs hundreds), so a ``Launch`` is built
once, when a split is prepared: its kernel, grid, block, shared memory and the packed
``void*[]`` of its arguments (buffers are bound at prepare, so the pointers never change). A
launch is then one foreign call. Inside a CUDA graph capture the same calls are recorded.

torch owns the context (the device's primary context); ``Driver`` makes it current on the
calling thread before loading modules, so kernels and torch's tensors live in one context.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import attrs

from parity.errors import BackendError

_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


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


class Q8Arg(ctypes.Structure):
    """``struct Q8`` of matmul.cu."""

    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("s", ctypes.c_void_p)]


class AttnArg(ctypes.Structure):
    """``struct AttnArgs`` of attention.cu."""

    _fields_ = (
        [
            (name, ctypes.c_void_p)
            for name in (
                "q",
                "k",
                "v",
                "positions",
                "out",
                "oq",
                "od",
                "os",
                "part",
                "pmax",
                "tickets",
            )
        ]
        + [
            (name, ctypes.c_int)
            for name in ("n_head", "n_head_kv", "n_ctx", "chunks_per_split", "n_split")
        ]
        + [("scale", ctypes.c_float)]
    )


class RopeArg(ctypes.Structure):
    """``struct RopeArgs`` of rows.cu (a second rope or the v rows: null / 0 when absent)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("y0", "x0", "cache0", "y1", "x1", "cache1", "v", "v_cache", "positions",
                     "cos_t", "sin_t")
    ] + [
        (name, ctypes.c_int)
        for name in ("heads0", "heads1", "v_width", "n_tokens", "head_dim", "n_rot")
    ]  # fmt: skip


class GemvSegArg(ctypes.Structure):
    """``struct GemvSeg`` of matmul.cu."""

    _fields_ = [
        ("y", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("row_bytes", ctypes.c_longlong),
        ("N", ctypes.c_int),
        ("blocks", ctypes.c_int),
    ]


class GemvSegsArg(ctypes.Structure):
    """``struct GemvSegs`` of matmul.cu: up to three products in one launch (unused: N = 0)."""

    _fields_ = [("s0", GemvSegArg), ("s1", GemvSegArg), ("s2", GemvSegArg)]


@attrs.define(eq=False)
class Launch:
    """One kernel launch with its arguments packed, ready to go."""

    name: str
    fn: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    args: tuple[Any, ...]  # the ctypes values (kept alive: ``params`` points at them)
    params: Any = None

    def __attrs_post_init__(self) -> None:
        self.params = (ctypes.c_void_p * len(self.args))(*[ctypes.addressof(a) for a in self.args])


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
