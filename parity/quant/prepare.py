"""PreparedWeight: a 2-D weight unpacked once into the layout the numpy MATMUL runs fast on."""

from __future__ import annotations

import attrs
import numpy as np

from parity.core.dtypes import DType
from parity.quant.blocks import FLOAT_TYPES, SUB_BLOCK, check_bytes, parse_type, unpack
from parity.quant.dequant import float_weight

F32 = np.float32


@attrs.frozen(eq=False)
class PreparedWeight:
    """A weight W of ``shape`` (N, K), ready for ``matmul`` and ``get_rows``.

    Quantized types keep the sub-block form transposed block-major: ``qw`` float32
    (n_sub, L, N) holding the integer quants (exact in float32), ``a`` and ``m`` float32
    (n_sub, 1, N), ``block_of_sub`` (n_sub,) the activation 32-block each sub-block lies in.
    Float types keep ``wt`` float32 (K, N). ``raw`` is the packed bytes, for ``get_rows``.
    """

    dtype: DType
    shape: tuple[int, int]
    raw: np.ndarray
    qw: np.ndarray | None = None
    a: np.ndarray | None = None
    m: np.ndarray | None = None
    min_sign: int = 0
    block_of_sub: np.ndarray | None = None
    wt: np.ndarray | None = None

    @property
    def nbytes_packed(self) -> int:
        """Bytes of the packed weight as stored in the GGUF file."""
        return int(self.raw.size)


def prepare_weight(
    dtype: DType | str | int, raw: np.ndarray, shape: tuple[int, int]
) -> PreparedWeight:
    """Unpack a (N, K) weight's bytes once for ``matmul``; keeps ``raw`` for ``get_rows``."""
    dtype = parse_type(dtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise ValueError(f"a matmul weight is 2-D (N, K); got shape {shape}")
    n, k = shape
    data = check_bytes(dtype, raw, shape)
    if dtype in FLOAT_TYPES:
        wt = np.ascontiguousarray(float_weight(dtype, data).reshape(n, k).T)  # (K, N)
        return PreparedWeight(dtype, shape, data, wt=wt)
    sub = unpack(dtype, data, shape)  # qw (N, n_sub, L), a/m (N, n_sub)
    n_sub, sub_len = k // SUB_BLOCK[dtype], SUB_BLOCK[dtype]
    qw = np.empty((n_sub, sub_len, n), F32)
    qw[...] = sub.qw.transpose(1, 2, 0)  # exact int8 -> float32

    def lead(v: np.ndarray | None) -> np.ndarray | None:
        return None if v is None else np.ascontiguousarray(v.T)[:, None, :]  # (n_sub, 1, N)

    block_of_sub = np.arange(n_sub) * sub_len // 32
    return PreparedWeight(
        dtype, shape, data, qw, lead(sub.a), lead(sub.m), sub.min_sign, block_of_sub
    )
