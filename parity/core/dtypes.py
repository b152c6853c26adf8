"""Element types of graph values and weights, with the GGUF block layouts of quantized types, and
the host layout of every value type (what ``download`` fills and ``upload`` reads)."""

from __future__ import annotations

import enum

import numpy as np


class DType(enum.Enum):
    """A tensor's storage type. Activations are F32 (values) or I32 (ids, positions).

    Weight types keep GGUF's names and numbering (``ggml_type``), so a GGUF tensor's type maps
    to a DType without a table.
    """

    # value types of activations
    F32 = 0
    I32 = 26
    Q8A = 1000  # quantized activations: int8 per element, a float32 scale and sum per 32-block
    # float weight types
    F16 = 1
    BF16 = 30
    # block-quantized weight types: (block size, bytes per block) in QUANT_LAYOUT
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14

    @property
    def is_quantized(self) -> bool:
        return self in QUANT_LAYOUT

    @property
    def block_size(self) -> int:
        """Elements per block (1 for non-block types)."""
        return QUANT_LAYOUT[self][0] if self.is_quantized else 1

    @property
    def block_bytes(self) -> int:
        """Bytes per block (the item size for non-block types)."""
        return QUANT_LAYOUT[self][1] if self.is_quantized else ITEM_SIZE[self]

    def nbytes(self, n_elements: int) -> int:
        """Bytes that ``n_elements`` of this type take; ``n_elements`` must fill whole blocks."""
        if n_elements % self.block_size:
            raise ValueError(
                f"{self.name} stores elements in blocks of {self.block_size}; "
                f"{n_elements} is not a multiple"
            )
        return n_elements // self.block_size * self.block_bytes

    @classmethod
    def parse(cls, value: DType | str | int) -> DType:
        """Accept a DType, its name (``"q4_k"``, any case) or its ggml type number."""
        if isinstance(value, DType):
            return value
        try:
            return cls[value.upper()] if isinstance(value, str) else cls(value)
        except (KeyError, ValueError):
            known = ", ".join(t.name for t in cls)
            raise ValueError(f"unsupported tensor type {value!r}; parity knows {known}") from None


ITEM_SIZE = {DType.F32: 4, DType.I32: 4, DType.F16: 2, DType.BF16: 2}

# (elements per block, bytes per block), as GGUF stores them (ggml-common.h)
QUANT_LAYOUT = {
    DType.Q4_0: (32, 2 + 16),
    DType.Q4_1: (32, 2 + 2 + 16),
    DType.Q5_0: (32, 2 + 4 + 16),
    DType.Q8_0: (32, 2 + 32),
    DType.Q4_K: (256, 2 + 2 + 12 + 128),
    DType.Q6_K: (256, 128 + 64 + 16 + 2),
}

WEIGHT_TYPES = (DType.F32, DType.F16, DType.BF16, *QUANT_LAYOUT)

VALUE_TYPES = (DType.F32, DType.I32, DType.Q8A)

_NUMPY = {DType.F32: "float32", DType.I32: "int32", DType.F16: "float16"}

QK = 32  # elements per activation block (docs/numerics.md, "Activation quantization")
Q8A_BLOCK = np.dtype([("d", "<f4"), ("s", "<f4"), ("q", "i1", (QK,))])
"""The host layout of one Q8A block: its scale d, its scaled sum s = fl(d * sum(q)), its quants."""


def numpy_dtype(dtype: DType) -> str:
    """The numpy dtype of an element of a graph value of this type (F32, I32)."""
    if dtype not in _NUMPY:
        what = (
            "quantized activations (see host_layout)"
            if dtype is DType.Q8A
            else "a packed weight type"
        )
        raise ValueError(f"{dtype.name} is {what}, not an element type")
    return _NUMPY[dtype]


def host_layout(dtype: DType, shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...]]:
    """(numpy dtype, shape) of a graph value's host array: the value's own for F32 and I32; for
    Q8A of logical shape (T, K), T rows of K/32 ``Q8A_BLOCK`` records."""
    if dtype is DType.Q8A:
        if len(shape) != 2 or shape[1] % QK:
            raise ValueError(f"Q8A values are (rows, K) with K a multiple of {QK}, got {shape}")
        return Q8A_BLOCK, (shape[0], shape[1] // QK)
    return np.dtype(numpy_dtype(dtype)), tuple(shape)


def host_empty(dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised host array for a graph value of ``dtype`` and ``shape``."""
    np_dtype, host_shape = host_layout(dtype, shape)
    return np.empty(host_shape, np_dtype)


def host_zeros(dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    """A zero-filled host array for a graph value of ``dtype`` and ``shape``."""
    np_dtype, host_shape = host_layout(dtype, shape)
    return np.zeros(host_shape, np_dtype)
