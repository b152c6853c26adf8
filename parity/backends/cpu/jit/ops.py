"""The compiled kernels as CpuBackend ops: the numpy definition's argument checks (``ops.py``),
then the kernel; same signatures, same results bit for bit.

Weights arrive as ``PackedWeight``: the GGUF bytes where they lie, never unpacked. Each op runs
serially when its work is small (a parallel region costs a few microseconds to start) and over
row ranges in parallel otherwise; rows are independent, so the split never changes a bit.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numba
import numpy as np

from parity.backends.cpu import ops
from parity.backends.cpu.jit import activation, attention, elementwise, matmul
from parity.backends.cpu.jit.blocks import F16_TABLE
from parity.core.dtypes import DType
from parity.core.ir import AttentionArg, Op, RopeArg
from parity.core.weights import WeightData
from parity.quant.blocks import check_bytes, parse_type

F32 = np.float32
PARALLEL_WORK = 1 << 16
"""Multiply-adds (or elements) below which an op runs on one thread."""


@attrs.frozen(eq=False)
class PackedWeight:
    """A 2-D weight as the compiled MATMUL and GET_ROWS read it: ``raw`` is its GGUF bytes
    (uint8, rows back to back; a view of the mapped file), ``shape`` (N, K)."""

    dtype: DType
    shape: tuple[int, int]
    raw: np.ndarray


def pack_weight(weight: WeightData) -> PackedWeight:
    """A zero-copy PackedWeight of a registered 2-D weight (bytes and shape checked)."""
    dtype = parse_type(weight.dtype)
    if len(weight.shape) != 2:
        raise ValueError(f"weight {weight.name!r} must be 2-D (rows, cols), got {weight.shape}")
    raw = check_bytes(dtype, weight.raw(), weight.shape)
    return PackedWeight(dtype, (int(weight.shape[0]), int(weight.shape[1])), raw)


def chunks(work: int, rows: int) -> int:
    """Row ranges to split ``rows`` into: 1 (serial) for small work, else a few per thread."""
    if work < PARALLEL_WORK or rows < 2:
        return 1
    return min(rows, 4 * numba.get_num_threads())


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``parity.quant.quantize_activations`` of float32 (T, K): (q int8, d, s float32)."""
    t, k = x.shape
    if k % 32:
        raise ValueError(f"quantize_activations needs K a multiple of 32, got K = {k}")
    q = np.empty((t, k), np.int8)
    d = np.empty((t, k // 32), F32)
    s = np.empty((t, k // 32), F32)
    if t * k < PARALLEL_WORK or t < 2:
        activation.quantize_rows(x, q, d, s)
    else:
        activation.quantize_parallel(x, q, d, s)
    return q, d, s


def matmul_op(
    x: np.ndarray,
    weight: PackedWeight,
    bias: np.ndarray | None = None,
    xq: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """``ops.matmul`` on a PackedWeight; ``xq`` is x already quantized (shared by the matmuls
    that read the same x)."""
    n, k = weight.shape
    if not isinstance(x, np.ndarray) or x.dtype != F32 or x.ndim != 2 or x.shape[1] != k:
        got = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(
            f"matmul needs float32 x of shape (T, {k}) for a {weight.dtype.name} weight of shape "
            f"{weight.shape}; got {got}"
        )
    x = np.ascontiguousarray(x)
    t = x.shape[0]
    y = np.empty((t, n), F32)
    if t:
        split = chunks(t * n * k, n)
        if weight.dtype.is_quantized:
            q, d, s = quantize(x) if xq is None else xq
            matmul.QUANT[weight.dtype.value](weight.raw, q, d, s, F16_TABLE, y, split)
        else:
            matmul.FLOAT[weight.dtype.value](weight.raw, x, F16_TABLE, y, split)
    if bias is not None:
        y = ops.add(y, bias)
    return y


def get_rows_op(weight: PackedWeight, ids: np.ndarray) -> np.ndarray:
    """``ops.get_rows`` on a PackedWeight: rows ``ids``, dequantized, float32 (len(ids), K)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"get_rows needs a 1-D integer id array, got {ids.dtype} {ids.shape}")
    n_rows, k = weight.shape
    bad = (ids < 0) | (ids >= n_rows)
    if bad.any():
        raise IndexError(
            f"get_rows: id {int(ids[bad][0])} is out of range for a weight of {n_rows} rows"
        )
    out = np.empty((ids.size, k), F32)
    matmul.GET_ROWS[weight.dtype.value](weight.raw, ids.astype(np.int64), F16_TABLE, out)
    return out


def silu_op(x: np.ndarray) -> np.ndarray:
    ops.check_rows("silu", x)
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    split = chunks(x.size, x.shape[0])
    if split == 1:
        elementwise.silu_rows(x, out, 0, x.shape[0])
    else:
        elementwise.silu_parallel(x, out, split)
    return out


def swiglu_op(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    ops.check_swiglu(gate, up)
    gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
    out = np.empty_like(gate)
    split = chunks(gate.size, gate.shape[0])
    if split == 1:
        elementwise.swiglu_rows(gate, up, out, 0, gate.shape[0])
    else:
        elementwise.swiglu_parallel(gate, up, out, split)
    return out


def rms_norm_op(x: np.ndarray, eps: float) -> np.ndarray:
    ops.check_rms_norm(x, eps)
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    split = chunks(x.size, x.shape[0])
    if split == 1:
        elementwise.rms_norm_rows(x, F32(eps), out, 0, x.shape[0])
    else:
        elementwise.rms_norm_parallel(x, F32(eps), out, split)
    return out


def rope_op(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, arg: RopeArg
) -> np.ndarray:
    n_head, head_dim, n_rot, mode = arg.n_head, arg.head_dim, arg.n_rot, arg.mode
    ops.check_rope(x, positions, cos, sin, n_head=n_head, head_dim=head_dim, n_rot=n_rot, mode=mode)
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    neox = mode == "neox"
    split = chunks(x.size, x.shape[0])
    if split == 1:
        elementwise.rope_rows(
            x, positions, cos, sin, n_head, head_dim, n_rot, neox, out, 0, x.shape[0]
        )
    else:
        elementwise.rope_parallel(x, positions, cos, sin, n_head, head_dim, n_rot, neox, out, split)
    return out


def attention_op(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, *, arg: AttentionArg
) -> np.ndarray:
    n_head, n_head_kv, head_dim, scale = arg.n_head, arg.n_head_kv, arg.head_dim, arg.scale
    ops.check_attention(
        q, k, v, positions, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, scale=scale
    )
    q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
    out = np.empty_like(q)
    if q.shape[0] == 0:
        return out
    pairs = q.shape[0] * n_head
    work = pairs * (int(positions.max()) + 1) * head_dim * 2
    split = chunks(work, pairs)
    if split == 1:
        kt = attention.keys_by_dim(k, int(positions.max()) + 1, n_head_kv)
        attention.attention_rows(q, kt, v, positions, n_head, F32(scale), out, 0, pairs)
    else:
        attention.attention_parallel(q, k, v, positions, n_head, n_head_kv, F32(scale), out, split)
    return out


# op -> f(*source values, arg=node.arg), as in backend.KERNELS; the ops not listed here
# (ADD, MUL, SLICE_ROWS, KV_WRITE, ARGMAX) are single numpy calls already
KERNELS: dict[Op, Callable[..., np.ndarray]] = {
    Op.GET_ROWS: lambda w, ids, arg: get_rows_op(w, ids),
    Op.SILU: lambda x, arg: silu_op(x),
    Op.SWIGLU: lambda g, u, arg: swiglu_op(g, u),
    Op.RMS_NORM: lambda x, arg: rms_norm_op(x, arg),
    Op.MATMUL: lambda x, w, b=None, arg=None: matmul_op(x, w, b),
    Op.ROPE: lambda x, pos, cos, sin, arg: rope_op(x, pos, cos, sin, arg=arg),
    Op.ATTENTION: lambda q, k, v, pos, arg: attention_op(q, k, v, pos, arg=arg),
}
