"""The GPU runtime parity's GPU backends share (cuda, triton): PyTorch provides the memory, one
stream per runtime, events, pinned host buffers and CUDA graphs; the backends bring kernels.

Everything a backend enqueues goes on the runtime's one stream, in the order called, which is
the Backend API's queue; ``synchronize`` waits for it once per step. A step's own transfers and
graph replays go straight to the driver (``Driver``: a few microseconds a call, where torch's
copies under a stream context cost tens). Values live in torch tensors: F32 and I32 values as
themselves, Q8A values as ``Q8Value`` (quants, scales, sums). Weights are uploaded once, from
the memory-mapped GGUF bytes in slices (no host copy of the file), and stay resident as the
GGUF's own bytes.

Imports torch when constructed, never at module import, so discovery stays light.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from parity.backends.gpu.driver import Driver
from parity.backends.gpu.pinned import PinnedPool
from parity.core.dtypes import QK, DType
from parity.errors import BackendError

UPLOAD_SLICE = 64 << 20  # bytes of a weight copied at a time (progress, and no giant staging)
WEIGHT_PAD = 16  # bytes allocated past a weight's end: kernels may load its last 16-byte word whole


@attrs.define(eq=False)
class Q8Value:
    """A Q8A value on the device: int8 quants (T, K), float32 d and s (T, K/32)."""

    q: Any
    d: Any
    s: Any


class GpuRuntime:
    """One GPU: device ``index`` (torch's numbering, the same as the driver's)."""

    def __init__(self, index: int, *, pinned: bool = True) -> None:
        import torch

        if not torch.cuda.is_available():
            raise BackendError(
                "torch sees no CUDA GPU (torch.cuda.is_available() is False); check the "
                "driver, CUDA_VISIBLE_DEVICES and that torch is a CUDA build"
            )
        count = torch.cuda.device_count()
        if index >= count:
            raise BackendError(f"there is no GPU cuda:{index}; torch sees {count}")
        self.torch = torch
        self.index = index
        self.device = torch.device("cuda", index)
        with torch.cuda.device(self.device):
            torch.cuda.init()
            self.stream = torch.cuda.Stream(self.device)
        self.handle = self.stream.cuda_stream  # the CUstream the driver calls take
        self.driver = Driver(index)
        self.properties = torch.cuda.get_device_properties(self.device)
        self.capturing = False
        self.pool = PinnedPool(self._pin, pinned=pinned, capturing=lambda: self.capturing)
        self._dtypes = {
            DType.F32: torch.float32,
            DType.I32: torch.int32,
            DType.F16: torch.float16,  # (scratch only: FAST_GEMM_HALF's operands)
        }
        # matmul of float16 operands into float32 sums (torch.mm's out_dtype: torch 2.8 on)
        self.half_gemm = "dtype_out" in torch.ops.aten.mm.overloads()

    # -- memory ------------------------------------------------------------------------------

    def _pin(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def empty(self, torch_dtype: Any, shape: tuple[int, ...], what: str = "a value") -> Any:
        try:
            return self.torch.empty(shape, dtype=torch_dtype, device=self.device)
        except self.torch.cuda.OutOfMemoryError:
            raise self.out_of_memory(shape, torch_dtype, what) from None

    def out_of_memory(self, shape: tuple[int, ...], torch_dtype: Any, what: str) -> BackendError:
        free, total = self.torch.cuda.mem_get_info(self.device)
        nbytes = (
            int(np.prod(shape, dtype=np.int64))
            * self.torch.empty((), dtype=torch_dtype).element_size()
        )
        return BackendError(
            f"GPU out of memory on cuda:{self.index} allocating {nbytes / 2**20:.1f} MiB for "
            f"{what} ({free / 2**30:.2f} of {total / 2**30:.1f} GiB free); use a shorter "
            "context (n_ctx), fewer tokens per step, or another GPU"
        )

    def value(self, dtype: DType, shape: tuple[int, ...]) -> Any:
        """A zero-filled device buffer for a graph value."""
        with self.torch.cuda.stream(self.stream):
            if dtype is DType.Q8A:
                t, k = shape
                q = self.empty(self.torch.int8, (t, k), "a Q8A value")
                d = self.empty(self.torch.float32, (t, k // QK), "a Q8A value")
                s = self.empty(self.torch.float32, (t, k // QK), "a Q8A value")
                for part in (q, d, s):
                    part.zero_()
                return Q8Value(q, d, s)
            if dtype not in self._dtypes:
                raise BackendError(f"{dtype.name} is not a value type a GPU buffer holds")
            buffer = self.empty(self._dtypes[dtype], tuple(shape))
            buffer.zero_()
            return buffer

    def host_empty(self, np_dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return self.pool.empty(np_dtype, shape)

    # -- transfers (queued on the stream) -----------------------------------------------------

    def upload(self, dst: Any, host: np.ndarray) -> None:
        """Copy a host array into a device tensor of the same bytes."""
        host = np.ascontiguousarray(host)
        self._check_bytes(dst, host.nbytes, "upload")
        self.driver.copy("h2d", dst.data_ptr(), host.ctypes.data, host.nbytes, self.handle)

    def download(self, src: Any, out: np.ndarray) -> None:
        """Queue a copy of a device tensor into a host array of the same bytes (complete once
        the stream is synchronized)."""
        if not out.flags.c_contiguous:  # a reshape would copy, and the data land elsewhere
            raise BackendError("download needs a C-contiguous host array")
        self._check_bytes(src, out.nbytes, "download")
        self.driver.copy("d2h", out.ctypes.data, src.data_ptr(), out.nbytes, self.handle)

    def copy(self, dst: Any, src: Any) -> None:
        """Queue a device copy between tensors: one driver call when both are contiguous and the
        same size, else torch's strided copy."""
        nbytes = src.numel() * src.element_size()
        if (
            dst.is_contiguous()
            and src.is_contiguous()
            and dst.numel() * dst.element_size() == nbytes
        ):
            self.driver.copy("d2d", dst.data_ptr(), src.data_ptr(), nbytes, self.handle)
            return
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def matmul(self, out: Any, a: Any, b: Any, add: Any = None) -> None:
        """Queue out = a b^T (+ add: out's shape, or a row broadcast over its rows) in float32
        on the tensor cores (TF32 inputs, float32 sums: the fast tier's products, cuBLAS
        through torch); float16 a and b: their float32 sums, without ``add``. TF32 is
        torch's global float32 matmul precision: set to "high" for this call only (through
        the call that keeps torch's old and new TF32 settings consistent) and put back as it
        was; another thread's matmuls meanwhile would see it."""
        torch = self.torch
        if a.dtype == torch.float16:  # (FAST_GEMM_HALF: float16 operands, float32 sums, no add)
            assert add is None and self.half_gemm, "float16 operands: no add, torch 2.8 or later"
            with torch.cuda.stream(self.stream):
                torch.mm(a, b.t(), out_dtype=torch.float32, out=out)
            return
        before = torch.get_float32_matmul_precision()
        with torch.cuda.stream(self.stream):
            torch.set_float32_matmul_precision("high")
            try:
                if add is None:
                    torch.mm(a, b.t(), out=out)
                else:
                    torch.addmm(add, a, b.t(), out=out)
            finally:
                torch.set_float32_matmul_precision(before)

    @staticmethod
    def _check_bytes(tensor: Any, nbytes: int, what: str) -> None:
        if not tensor.is_contiguous() or tensor.numel() * tensor.element_size() != nbytes:
            raise BackendError(
                f"{what} of a {nbytes}-byte host array against a device buffer of "
                f"{tuple(tensor.shape)} {tensor.dtype}: it must be contiguous and as large"
            )

    def upload_weight(
        self, raw: np.ndarray, what: str, progress: Callable[[int], None] | None = None
    ) -> Any:
        """A device copy of a weight's bytes (a view of the mapped file), uploaded in slices,
        in a buffer WEIGHT_PAD bytes longer (zeros) than the view returned."""
        data = raw.reshape(-1).view(np.uint8)
        padded = self.empty(self.torch.uint8, (data.size + WEIGHT_PAD,), what)
        with self.torch.cuda.stream(self.stream):
            padded[data.size :].zero_()
        out = padded[: data.size]
        with self.torch.cuda.stream(self.stream):
            for start in range(0, data.size, UPLOAD_SLICE):
                part = data[start : start + UPLOAD_SLICE]
                with warnings.catch_warnings():  # a read-only map: torch only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    host = self.torch.from_numpy(part)
                out[start : start + part.size].copy_(host)
                if progress is not None:
                    progress(part.size)
        return out

    def zero(self, *tensors: Any) -> None:
        """Queue a fill of each tensor with zeros."""
        with self.torch.cuda.stream(self.stream):
            for t in tensors:
                t.zero_()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def event(self) -> Any:
        """A CUDA event for ``record`` and ``wait`` (a step's mark in the stream)."""
        return self.driver.event()

    def record(self, event: Any) -> None:
        self.driver.record(event, self.handle)

    def wait(self, event: Any) -> None:
        """Wait for what the stream held when ``event`` was recorded, not what came after."""
        self.driver.wait(event)

    def destroy(self, event: Any) -> None:
        self.driver.destroy(event)

    # -- graphs --------------------------------------------------------------------------------

    def capture(self, record: Callable[[], None]) -> Any:
        """A CUDA graph of what ``record`` enqueues on the stream (replay with ``.replay()``)."""
        graph = self.torch.cuda.CUDAGraph()
        self.synchronize()
        self.capturing = True
        try:  # (not torch.cuda.graph(), whose gc.collect() costs a Python-heavy process ~1 s)
            with self.torch.cuda.stream(self.stream):
                graph.capture_begin()
                try:
                    record()
                finally:
                    graph.capture_end()
        finally:
            self.capturing = False
        return graph

    def replay(self, graph: Any) -> None:
        """Queue a replay of a graph made by ``capture``."""
        graph_exec = getattr(graph, "raw_cuda_graph_exec", None)
        if graph_exec is None:  # torch before 2.8: its own replay, on the current stream
            with self.torch.cuda.stream(self.stream):
                graph.replay()
            return
        self.driver.launch_graph(graph_exec(), self.handle)
