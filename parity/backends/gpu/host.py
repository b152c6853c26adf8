"""The GPU runtime's interface over host memory, for Triton's interpreter (``TRITON_INTERPRET=1``):
the same values (torch tensors, ``Q8Value``), transfers and weight uploads as ``GpuRuntime``,
on torch CPU tensors, so a GPU backend's kernels run and are checked on a machine without a
GPU. Work happens on the spot: there is no stream to wait for and nothing to capture.

Imports torch when constructed, never at module import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.backends.gpu.runtime import WEIGHT_PAD, Q8Value
from parity.core.dtypes import QK, DType
from parity.errors import BackendError


class HostRuntime:
    """Device memory stood in for by host memory (torch CPU tensors)."""

    capturing = False

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.device = torch.device("cpu")
        self._dtypes = {DType.F32: torch.float32, DType.I32: torch.int32, DType.F16: torch.float16}
        self.half_gemm = True  # (matmul makes float16 operands floats itself)

    def empty(self, torch_dtype: Any, shape: tuple[int, ...], what: str = "a value") -> Any:
        return self.torch.empty(shape, dtype=torch_dtype)

    def value(self, dtype: DType, shape: tuple[int, ...]) -> Any:
        """A zero-filled buffer for a graph value."""
        if dtype is DType.Q8A:
            t, k = shape
            torch = self.torch
            return Q8Value(
                torch.zeros((t, k), dtype=torch.int8),
                torch.zeros((t, k // QK), dtype=torch.float32),
                torch.zeros((t, k // QK), dtype=torch.float32),
            )
        if dtype not in self._dtypes:
            raise BackendError(f"{dtype.name} is not a value type a GPU buffer holds")
        return self.torch.zeros(tuple(shape), dtype=self._dtypes[dtype])

    def host_empty(self, np_dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, np_dtype)

    def upload(self, dst: Any, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        self._view(dst, host.nbytes, "upload")[...] = host.reshape(-1).view(np.uint8)

    def download(self, src: Any, out: np.ndarray) -> None:
        if not out.flags.c_contiguous:  # a reshape would copy, and the data land elsewhere
            raise BackendError("download into a non-contiguous host array")
        out.reshape(-1).view(np.uint8)[...] = self._view(src, out.nbytes, "download")

    def copy(self, dst: Any, src: Any) -> None:
        if dst.is_contiguous() and src.is_contiguous() and dst.nbytes == src.nbytes:  # (RESHAPE)
            self._view(dst)[...] = self._view(src)
            return
        dst.copy_(src)

    def matmul(self, out: Any, a: Any, b: Any, add: Any = None) -> None:
        """out = a b^T (+ add) as GpuRuntime's TF32 GEMM makes it, near enough: the inputs cut
        to TF32's 10 bits of mantissa (the tensor cores read the top 19 bits of each float),
        float32 sums on the CPU. Float16 a and b (FAST_GEMM_HALF): as floats, exactly."""
        if a.dtype == self.torch.float16:
            assert add is None, "float16 operands: no add"
            self.torch.mm(a.float(), b.float().t(), out=out)
            return
        a, b = (self._tf32(v) for v in (a, b))
        if add is None:
            self.torch.mm(a, b.t(), out=out)
        else:
            self.torch.addmm(add, a, b.t(), out=out)

    def _tf32(self, v: Any) -> Any:
        bits = v.contiguous().view(self.torch.int32) & ~0x1FFF
        return bits.view(self.torch.float32)

    def upload_weight(self, raw: np.ndarray, what: str, progress: Any = None) -> Any:
        """The weight's bytes, WEIGHT_PAD zero bytes after them (as on a GPU)."""
        data = raw.reshape(-1).view(np.uint8)
        padded = self.torch.zeros(data.size + WEIGHT_PAD, dtype=self.torch.uint8)
        padded.numpy()[: data.size] = data
        if progress is not None:
            progress(data.size)
        return padded[: data.size]

    def zero(self, *tensors: Any) -> None:
        for t in tensors:
            t.zero_()

    def synchronize(self) -> None:
        return None

    def event(self) -> None:  # (every call is done when it returns: nothing to wait for)
        return None

    def record(self, event: None) -> None:
        return None

    def wait(self, event: None) -> None:
        return None

    def destroy(self, event: None) -> None:
        return None

    def _view(self, tensor: Any, nbytes: int | None = None, what: str = "copy") -> np.ndarray:
        """The tensor's bytes as a flat numpy view (no copy), checked against ``nbytes``."""
        size = tensor.numel() * tensor.element_size()
        if not tensor.is_contiguous() or (nbytes is not None and size != nbytes):
            raise BackendError(
                f"{what} of {nbytes} bytes against a buffer of {tuple(tensor.shape)} "
                f"{tensor.dtype}: it must be contiguous and as large"
            )
        return tensor.view(-1).view(self.torch.uint8).numpy()
