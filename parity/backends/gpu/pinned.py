"""Host memory for a GPU's transfers: one self-held pinned (page-locked) pool.

The runtime allocates every step's host buffers once, through ``Backend.alloc_host``; on a GPU
they come from this pool, so copies to and from the device are true asynchronous DMA and a
decode step allocates nothing. The pool grows on demand, by at least ``HEADROOM`` beyond what
is asked, so a model's handful of step buffers land in one or two pinned blocks. Earlier
blocks stay alive as long as arrays carved from them do.

If pinning fails (a locked-memory limit, a driver that refuses), one warning is given and the
pool hands out ordinary pageable memory from then on: slower copies, same results. Pinning can
also be turned off for A/B runs with ``PARITY_PINNED=0``, read once when a backend is created.
Pinned memory is never allocated during a CUDA graph capture: the runtime's host buffers all
exist before a step first runs, and the pool refuses to grow while a capture is under way.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

HEADROOM = 4 << 20  # bytes a pool grows by beyond a request, at least
ALIGN = 64
ENV_VAR = "PARITY_PINNED"


class PinnedWarning(UserWarning):
    """Pinned host memory could not be had; transfers use pageable memory."""


def pinning_wanted(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(ENV_VAR, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


class PinnedPool:
    """Carves host arrays out of pinned blocks made by ``allocate(nbytes)`` (a torch pinned
    uint8 tensor on a GPU runtime), or out of plain numpy memory once pinning is off or
    failed. ``capturing()`` says whether a graph capture is under way (growth is then refused).
    """

    def __init__(
        self,
        allocate: Callable[[int], Any],
        *,
        pinned: bool = True,
        capturing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._allocate = allocate
        self.pinned = pinned
        self._capturing = capturing
        self._block: np.ndarray | None = None  # the current block, as bytes
        self._keep: list[Any] = []  # every block's owner, alive while the pool is
        self._used = 0
        self.reserved = 0  # bytes of pinned memory held

    def empty(self, dtype: np.dtype | str, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialised host array of ``dtype`` and ``shape``, pinned when possible."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not self.pinned:
            return np.empty(shape, dtype)
        start = -(-self._used // ALIGN) * ALIGN
        if self._block is None or start + nbytes > self._block.size:
            if not self._grow(nbytes):
                return np.empty(shape, dtype)
            start = 0
        self._used = start + nbytes
        return self._block[start : start + nbytes].view(dtype).reshape(shape)

    def _grow(self, nbytes: int) -> bool:
        if self._capturing():
            raise RuntimeError(
                "pinned host memory was requested during a CUDA graph capture; host buffers "
                "must be allocated before a step is captured"
            )
        size = nbytes + HEADROOM
        try:
            owner = self._allocate(size)
        except Exception as e:  # the driver's or torch's refusal, whatever its type
            self.pinned = False
            warnings.warn(
                f"could not pin {size} bytes of host memory ({e}); transfers use pageable "
                "memory, which is slower",
                PinnedWarning,
                stacklevel=3,
            )
            return False
        self._keep.append(owner)
        self._block = owner.numpy() if hasattr(owner, "numpy") else np.asarray(owner)
        self._used = 0
        self.reserved += size
        return True
