"""Host memory whose every buffer ends against a page no one may touch: the emulated backend
over it (``EmulatedCudaBackend(..., guarded=True)``) makes a kernel that reads or writes past a
value's last element (or past a weight's padding) fault at once, where plain host memory would
hand it whatever lies next on the heap and a GPU's allocator usually has memory mapped there
too. A fault ends the process: run a guarded case in a process of its own."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

from parity.backends.gpu.host import HostRuntime
from parity.backends.gpu.runtime import WEIGHT_PAD, Q8Value
from parity.core.dtypes import QK, DType

PROT_NONE = 0


class GuardedHostRuntime(HostRuntime):
    """HostRuntime whose values and weights end where a PROT_NONE page begins."""

    def __init__(self) -> None:
        super().__init__()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._maps: list[Any] = []  # the mappings, alive as long as the runtime

    def _guarded(self, nbytes: int) -> np.ndarray:
        """``nbytes`` zero bytes whose last is the last before a PROT_NONE page."""
        page = mmap.PAGESIZE
        body = -(-max(nbytes, 1) // page) * page
        m = mmap.mmap(-1, body + page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if self._libc.mprotect(base + body, page, PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of a guard page failed")
        self._maps.append(m)
        return np.frombuffer(m, np.uint8, count=nbytes, offset=body - nbytes)

    def _tensor(self, np_dtype: Any, shape: tuple[int, ...]) -> Any:
        n = int(np.prod(shape, dtype=np.int64))
        size = np.dtype(np_dtype).itemsize
        return self.torch.from_numpy(self._guarded(n * size).view(np_dtype).reshape(shape))

    def value(self, dtype: DType, shape: tuple[int, ...]) -> Any:
        if dtype is DType.Q8A:
            t, k = shape
            return Q8Value(self._tensor(np.int8, (t, k)), self._tensor(np.float32, (t, k // QK)),
                           self._tensor(np.float32, (t, k // QK)))  # fmt: skip
        if dtype is DType.F32:
            return self._tensor(np.float32, tuple(shape))
        if dtype is DType.I32:
            return self._tensor(np.int32, tuple(shape))
        return super().value(dtype, shape)

    def upload_weight(self, raw: np.ndarray, what: str, progress: Any = None) -> Any:
        data = raw.reshape(-1).view(np.uint8)
        padded = self._guarded(data.size + WEIGHT_PAD)
        padded[: data.size] = data
        if progress is not None:
            progress(data.size)
        return self.torch.from_numpy(padded)[: data.size]
