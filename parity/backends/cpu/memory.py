"""Host memory for the values a split computes: where each one lives, planned once per split.

A value that leaves its split (an output) gets an array of its own, which the runtime and later
splits are bound to. A value that stays inside (an intermediate, a kernel's temporary) lives in
the backend's arena, one byte buffer shared by every executable of the backend (one runs at a
time): ``plan`` places each such value at an offset so that no two values live at once overlap
(greedy, largest first, lowest free offset), and ``carve`` makes its array out of the arena.
The arena only grows, to the largest split's need; an executable bound to an older arena binds
again before it next runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from parity.core.dtypes import DType, numpy_dtype
from parity.quant import Q8Activations

ALIGN = 64  # bytes: every value starts on a cache line


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def nbytes(dtype: DType, shape: tuple[int, ...]) -> int:
    """Bytes a value takes in the arena (Q8A: its quants, scales and sums, each aligned)."""
    if dtype is DType.Q8A:
        t, k = shape
        return _up(t * k) + 2 * _up(t * (k // 32) * 4)
    return _up(math.prod(shape) * np.dtype(numpy_dtype(dtype)).itemsize)


def new_value(dtype: DType, shape: tuple[int, ...]) -> np.ndarray | Q8Activations:
    """A zero-filled value of its own: an array, or for Q8A the three arrays of its blocks."""
    if dtype is DType.Q8A:
        t, k = shape
        return Q8Activations(
            np.zeros((t, k), np.int8), np.zeros((t, k // 32), np.float32),
            np.zeros((t, k // 32), np.float32),
        )  # fmt: skip
    return np.zeros(shape, numpy_dtype(dtype))


def carve(arena: np.ndarray, offset: int, dtype: DType, shape: tuple[int, ...]):
    """The value of ``dtype`` and ``shape`` at ``offset`` of the arena (views, no copy)."""
    if dtype is DType.Q8A:
        t, k = shape
        q = arena[offset : offset + t * k].view(np.int8).reshape(t, k)
        at = offset + _up(t * k)
        scales = [
            arena[o : o + t * (k // 32) * 4].view(np.float32).reshape(t, k // 32)
            for o in (at, at + _up(t * (k // 32) * 4))
        ]
        return Q8Activations(q, *scales)
    size = math.prod(shape) * np.dtype(numpy_dtype(dtype)).itemsize
    return arena[offset : offset + size].view(numpy_dtype(dtype)).reshape(shape)


@attrs.frozen
class Lifetime:
    """A value of ``size`` bytes, written at step ``first`` and last read at step ``last``."""

    size: int
    first: int
    last: int


def plan(values: Sequence[Lifetime]) -> tuple[list[int], int]:
    """(offset of each value, bytes in all): values whose lifetimes overlap never overlap."""
    offsets = [0] * len(values)
    placed: list[int] = []
    for i in sorted(range(len(values)), key=lambda i: (-values[i].size, values[i].first)):
        v = values[i]
        taken = sorted(
            (offsets[j], offsets[j] + values[j].size)
            for j in placed
            if values[j].first <= v.last and v.first <= values[j].last
        )
        at = 0
        for lo, hi in taken:
            if at + v.size <= lo:
                break
            at = max(at, hi)
        offsets[i] = at
        placed.append(i)
    total = max((offsets[i] + values[i].size for i in placed), default=0)
    return offsets, total


class Arena:
    """The backend's scratch bytes; ``generation`` changes whenever they move."""

    def __init__(self) -> None:
        self.buffer = np.zeros(0, np.uint8)
        self.generation = 0

    def reserve(self, size: int) -> None:
        if size > self.buffer.size:
            raw = np.zeros(_up(size) + ALIGN, np.uint8)
            skip = -raw.ctypes.data % ALIGN  # numpy aligns to 16: start on a cache line
            self.buffer = raw[skip : skip + _up(size)]
            self.generation += 1
