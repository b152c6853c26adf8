"""Element types of graph values and weights, with the GGUF block layouts of quantized types."""

from __future__ import annotations

import enum


class DType(enum.Enum):
    """A tensor's storage type. Activations are F32 (values) or I32 (ids, positions).

    Weight types keep GGUF's names and numbering (``ggml_type``), so a GGUF tensor's type maps
    to a DType without a table.
    """

    # value types of activations
    F32 = 0
    I32 = 26
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

_NUMPY = {DType.F32: "float32", DType.I32: "int32", DType.F16: "float16"}


def numpy_dtype(dtype: DType) -> str:
    """The numpy dtype of a graph value of this type (activations are F32 or I32)."""
    if dtype not in _NUMPY:
        raise ValueError(f"{dtype.name} is a packed weight type, not a value type")
    return _NUMPY[dtype]
