"""Random packed weights of every supported type, for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from parity.core.dtypes import DType
from parity.quant.blocks import parse_type

FP16_FIELDS = {
    DType.Q4_0: (0,),
    DType.Q4_1: (0, 2),
    DType.Q5_0: (0,),
    DType.Q8_0: (0,),
    DType.Q4_K: (0, 2),
    DType.Q6_K: (208,),
}
"""Byte offsets of the fp16 scale fields (d, m / dmin) inside one block."""

EDGE_FP16 = np.array(
    [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00], np.uint16
).view(np.float16)
"""+0, -0, smallest subnormals, largest subnormal, smallest normal, +-65504, +-1."""


# rough RMS of the integer factor a scale field multiplies (quants, times sub-block scales)
QUANT_RMS = {DType.Q4_0: 4.6, DType.Q4_1: 8.8, DType.Q5_0: 9.2, DType.Q8_0: 74.0,
             DType.Q4_K: 270.0, DType.Q6_K: 1370.0}  # fmt: skip


def random_weight(
    dtype: DType | str,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    edge: bool = False,
    std: float = 0.1,
) -> np.ndarray:
    """Packed bytes (uint8) of a ``dtype`` tensor of ``shape``: random quants, finite scales.

    Values come out with a standard deviation of roughly ``std``: scale fields are random
    normal fp16 sized for it. With ``edge``, every other block's scale fields take values from
    EDGE_FP16 instead.
    """
    dtype = parse_type(dtype)
    n = int(np.prod(shape))
    if dtype is DType.F32:
        return (rng.standard_normal(n).astype(np.float32) * np.float32(std)).view(np.uint8)
    if dtype is DType.F16:
        return (rng.standard_normal(n) * std).astype(np.float16).view(np.uint8)
    if dtype is DType.BF16:
        f32 = (rng.standard_normal(n) * std).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (n // dtype.block_size, dtype.block_bytes), dtype=np.uint8)
    sigma = std / QUANT_RMS[dtype]
    for at in FP16_FIELDS[dtype]:
        scale = (rng.standard_normal(blocks.shape[0]) * sigma).astype(np.float16)
        if edge:
            scale[::2] = rng.choice(EDGE_FP16, size=scale[::2].size)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)
