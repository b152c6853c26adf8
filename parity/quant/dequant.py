"""Weight dequantization and GET_ROWS, bit-identical to ``gguf.quants.dequantize``."""

from __future__ import annotations

import numpy as np

from parity.core.dtypes import DType
from parity.quant.blocks import FLOAT_TYPES, check_bytes, parse_type, to_float, unpack

F32 = np.float32


def float_weight(dtype: DType, data: np.ndarray) -> np.ndarray:
    """Flat bytes of an F32/F16/BF16 tensor -> flat float32, converted exactly."""
    if dtype is DType.F32:
        return data.view(F32)
    if dtype is DType.F16:
        return data.view(np.float16).astype(F32)
    # bf16 is the top half of a float32
    return (data.view(np.uint16).astype(np.uint32) << 16).view(F32)


def dequantize(qtype: DType | str | int, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of a weight of ``shape`` (numpy order) stored as ``raw`` bytes."""
    dtype = parse_type(qtype)
    shape = tuple(int(s) for s in shape)
    if dtype in FLOAT_TYPES:
        return float_weight(dtype, check_bytes(dtype, raw, shape)).reshape(shape)
    return to_float(unpack(dtype, raw, shape)).reshape(shape)


def get_rows(w: object, ids: np.ndarray) -> np.ndarray:
    """GET_ROWS: rows ``ids`` of a 2-D weight, dequantized exactly as ``dequantize`` would.

    ``w`` is a PreparedWeight or a ``(dtype, raw, shape)`` tuple; only the selected rows'
    bytes are read. Returns float32 (len(ids), K).
    """
    dtype, raw, shape = w if isinstance(w, tuple) else (w.dtype, w.raw, w.shape)
    dtype = parse_type(dtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise ValueError(f"get_rows needs a 2-D weight (rows, cols), got shape {shape}")
    data = check_bytes(dtype, raw, shape)
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"get_rows needs a 1-D integer id array, got {ids.dtype} {ids.shape}")
    n_rows, cols = shape
    bad = (ids < 0) | (ids >= n_rows)
    if bad.any():
        raise IndexError(
            f"get_rows: id {int(ids[bad][0])} is out of range for a weight of {n_rows} rows"
        )
    # fancy indexing a memmap reads only the selected rows' bytes
    rows = data.reshape(n_rows, dtype.nbytes(cols))[ids]  # (n, row_bytes)
    return dequantize(dtype, rows, (ids.size, cols))
