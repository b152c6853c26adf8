"""Weights as the runtime sees them: a name, a type, a logical shape and raw bytes (a view into
a memory-mapped file, never a copy); and the derived weights a backend may build at load."""

from __future__ import annotations

from collections.abc import Sequence

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


def can_concat_rows(weights: Sequence[WeightData]) -> bool:
    """Can these 2-D weights be stacked into one (their rows one after the other), as a fused
    kernel reads gate and up? Metadata alone decides: one type, one row length."""
    first = weights[0]
    return len(first.shape) == 2 and all(
        (w.dtype, len(w.shape), w.shape[1:]) == (first.dtype, 2, first.shape[1:]) for w in weights
    )


def concat_rows(name: str, weights: Sequence[WeightData]) -> WeightData:
    """The weights' rows stacked, as one weight ``name`` (a copy: a derived weight, built once
    at load). ``can_concat_rows`` must hold: rows of one type are whole blocks, so the packed
    bytes concatenate row for row."""
    if not can_concat_rows(weights):
        described = ", ".join(f"{w.name} {w.dtype.name}{list(w.shape)}" for w in weights)
        raise ValueError(f"cannot stack the rows of {described}: they differ in type or row length")
    rows = sum(w.shape[0] for w in weights)
    data = np.concatenate([w.raw() for w in weights])
    if weights[0].dtype is DType.F32:
        data = data.view(np.float32).reshape(rows, weights[0].shape[1])
    return WeightData(name, weights[0].dtype, (rows, weights[0].shape[1]), data)
