"""GGUF block layouts unpacked into the contract's *sub-block form* (docs/numerics.md).

Every quantized row is a sequence of sub-blocks of length L, each with integer quants ``qw``,
a float32 scale ``a`` and, for the min types, a float32 min ``m``, such that gguf's
dequantization is exactly ``w = fl(a * qw)``, ``fl(fl(a * qw) + m)`` (Q4_1) or
``fl(fl(a * qw) - m)`` (Q4_K). Dequantization and MATMUL both start from this form.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from parity.core.dtypes import DType

F32 = np.float32

QUANT_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q8_0, DType.Q4_K, DType.Q6_K)
FLOAT_TYPES = (DType.F32, DType.F16, DType.BF16)
SUPPORTED_TYPES = (*FLOAT_TYPES, *QUANT_TYPES)

SUB_BLOCK = {t: 32 for t in QUANT_TYPES} | {DType.Q6_K: 16}
"""Sub-block length L per quantized type."""

MIN_SIGN = {DType.Q4_1: 1, DType.Q4_K: -1}
"""How a type applies its min: +1 adds m (Q4_1), -1 subtracts m (Q4_K); others have none."""


@attrs.frozen(eq=False)
class SubBlocks:
    """A quantized tensor of ``rows`` rows in sub-block form.

    ``qw`` int8 (rows, n_sub, L); ``a`` float32 (rows, n_sub); ``m`` float32 (rows, n_sub) or
    None; ``min_sign`` +1 / -1 / 0 (how ``m`` enters, see MIN_SIGN).
    """

    qw: np.ndarray
    a: np.ndarray
    m: np.ndarray | None
    min_sign: int


def parse_type(qtype: DType | str | int) -> DType:
    """A supported weight type, or a ValueError naming the supported ones."""
    dtype = DType.parse(qtype)
    if dtype not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"no dequantization for tensor type {dtype.name}; supported: {names}")
    return dtype


def as_bytes(raw: np.ndarray) -> np.ndarray:
    """``raw``'s bytes as a flat uint8 array (no copy when ``raw`` is contiguous)."""
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def check_bytes(dtype: DType, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Validate that ``raw`` holds exactly a ``dtype`` tensor of ``shape``; return its bytes."""
    if len(shape) == 0 or any(int(s) < 0 for s in shape):
        raise ValueError(
            f"{dtype.name} tensor needs a shape of >= 1 non-negative dims, got {shape}"
        )
    cols = int(shape[-1])
    if cols % dtype.block_size:
        raise ValueError(
            f"{dtype.name} tensor of shape {tuple(shape)}: the last (contiguous) dim {cols} is not "
            f"a multiple of the block size {dtype.block_size}"
        )
    data = as_bytes(raw)
    expected = dtype.nbytes(math.prod(int(s) for s in shape))
    if data.size != expected:
        raise ValueError(
            f"{dtype.name} tensor of shape {tuple(shape)} needs {expected} bytes, got {data.size}"
        )
    return data


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte offset ``at`` of each block, converted exactly to float32."""
    return blocks[:, at : at + 2].view(np.float16)[:, 0].astype(F32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) packed bytes -> (nb, 32): low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4)."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc, mn


def _unpack_blocks(dtype: DType, blocks: np.ndarray) -> SubBlocks:
    """(nb, block_bytes) uint8 -> sub-block form with qw (nb, block/L, L)."""
    nb = blocks.shape[0]
    if dtype is DType.Q4_0:
        qw = _nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
        return SubBlocks(qw[:, None], _f16(blocks, 0)[:, None], None, 0)
    if dtype is DType.Q4_1:
        qw = _nibbles(blocks[:, 4:20]).astype(np.int8)
        return SubBlocks(qw[:, None], _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None], 1)
    if dtype is DType.Q5_0:
        qh = blocks[:, 2:6].view("<u4")  # (nb, 1): bit j is the 5th bit of element j
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        qw = (_nibbles(blocks[:, 6:22]) | (high << 4)).astype(np.int8) - np.int8(16)
        return SubBlocks(qw[:, None], _f16(blocks, 0)[:, None], None, 0)
    if dtype is DType.Q8_0:
        qw = blocks[:, 2:34].view(np.int8)
        return SubBlocks(qw[:, None], _f16(blocks, 0)[:, None], None, 0)
    if dtype is DType.Q4_K:
        d, dmin = _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1
        qs = blocks[:, 16:144].reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        qw = (qs & 0x0F).reshape(nb, 8, 32).astype(np.int8)
        with np.errstate(invalid="ignore", over="ignore"):
            return SubBlocks(qw, d * sc.astype(F32), dmin * mn.astype(F32), -1)
    if dtype is DType.Q6_K:
        # ql (128 bytes) holds the low 4 bits, qh (64 bytes) the high 2 bits, per 128-half h:
        # element 128h + 32c + i takes ql[64h + 32(c%2) + i] >> 4(c//2) and qh[32h + i] >> 2c
        ql = blocks[:, 0:128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        ql = (ql & 0x0F).reshape(nb, 256)
        qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        qh = (qh & 0x03).reshape(nb, 256)
        qw = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
        sc = blocks[:, 192:208].view(np.int8).astype(F32)
        with np.errstate(invalid="ignore", over="ignore"):
            a = _f16(blocks, 208)[:, None] * sc
        return SubBlocks(qw.reshape(nb, 16, 16), a, None, 0)
    raise ValueError(f"{dtype.name} is not a block-quantized type")


def unpack(dtype: DType, raw: np.ndarray, shape: tuple[int, ...]) -> SubBlocks:
    """A quantized tensor's bytes -> sub-block form over its rows (all dims but the last)."""
    data = check_bytes(dtype, raw, shape)
    rows = math.prod(int(s) for s in shape[:-1])
    n_sub = int(shape[-1]) // SUB_BLOCK[dtype]
    sub = _unpack_blocks(dtype, data.reshape(-1, dtype.block_bytes))
    qw = sub.qw.reshape(rows, n_sub, SUB_BLOCK[dtype])
    m = None if sub.m is None else sub.m.reshape(rows, n_sub)
    return SubBlocks(qw, sub.a.reshape(rows, n_sub), m, sub.min_sign)


def to_float(sub: SubBlocks) -> np.ndarray:
    """Sub-block form -> float32 (rows, n_sub, L): fl(a * qw), then +m or -m."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales propagate, quietly
        w = sub.a[..., None] * sub.qw.astype(F32)
        if sub.min_sign > 0:
            w += sub.m[..., None]
        elif sub.min_sign < 0:
            w -= sub.m[..., None]
    return w
