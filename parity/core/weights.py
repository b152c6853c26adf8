"""Weights as the runtime sees them: a name, a type, a logical shape and raw bytes (a view into
a memory-mapped file, never a copy)."""

from __future__ import annotations

import attrs
import numpy as np

from parity.core.dtypes import DType


@attrs.frozen
class WeightData:
    """A weight's raw, still-packed bytes. ``shape`` is numpy order (rows, cols): for a
    quantized type each row is a whole number of blocks, stored contiguously."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    data: np.ndarray = attrs.field(eq=False, repr=False)  # uint8, or the element type for F32

    def __attrs_post_init__(self) -> None:
        n = int(np.prod(self.shape))
        expected = self.dtype.nbytes(n)
        if self.data.nbytes != expected:
            raise ValueError(
                f"weight {self.name!r}: {self.dtype.name}{list(self.shape)} needs "
                f"{expected} bytes, got {self.data.nbytes}"
            )

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def raw(self) -> np.ndarray:
        """The bytes as a flat uint8 view (no copy)."""
        return np.ascontiguousarray(self.data).reshape(-1).view(np.uint8)
