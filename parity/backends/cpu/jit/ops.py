"""The compiled kernels as CpuBackend ops, in two forms with the same results bit for bit:

- writers, ``*_into(out, *sources, arg)``: what the backend runs, into the buffers it bound at
  prepare (``WRITERS``). They check nothing: the graph was verified, the runtime checked ids and
  positions, and the backend made the buffers.
- ``*_op(...)``: the numpy definition's signature and argument checks (``ops.py``), then the
  writer into a new array; for direct use and the tests.

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
from parity.core.ir import AttentionArg, Op, RopeArg, SliceArg
from parity.core.weights import WeightData
from parity.quant import Q8Activations
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


def quantize_into(out: Q8Activations, x: np.ndarray, arg: object = None) -> None:
    """QUANTIZE: ``parity.quant.quantize_activations`` of float32 (T, K) into ``out``."""
    t, k = x.shape
    if t * k < PARALLEL_WORK or t < 2:
        activation.quantize_rows(x, out.q, out.d, out.s)
    else:
        activation.quantize_parallel(x, out.q, out.d, out.s)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``parity.quant.quantize_activations`` of float32 (T, K): (q int8, d, s float32)."""
    t, k = x.shape
    if k % 32:
        raise ValueError(f"quantize_activations needs K a multiple of 32, got K = {k}")
    out = Q8Activations(np.empty((t, k), np.int8), np.empty((t, k // 32), F32),
                        np.empty((t, k // 32), F32))  # fmt: skip
    quantize_into(out, np.ascontiguousarray(x))
    return out.q, out.d, out.s


def matmul_into(
    out: np.ndarray, x: np.ndarray | Q8Activations, weight: PackedWeight, *rest: object
) -> None:
    """MATMUL into ``out`` (T, N): x float32 for a float weight, quantized (``Q8Activations``)
    for a quantized one; ``rest`` is (bias, arg) or (arg,)."""
    n, k = weight.shape
    t = out.shape[0]
    if t:
        split = chunks(t * n * k, n)
        if weight.dtype.is_quantized:
            matmul.QUANT[weight.dtype.value](weight.raw, x.q, x.d, x.s, F16_TABLE, out, split)
        else:
            matmul.FLOAT[weight.dtype.value](weight.raw, x, F16_TABLE, out, split)
    if len(rest) == 2:
        np.add(out, rest[0], out)  # fl(y + bias)


def matmul_op(x: np.ndarray, weight: PackedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """``ops.matmul`` on a PackedWeight (a shared quantization is a QUANTIZE node's value,
    which ``matmul_into`` reads)."""
    n, k = weight.shape
    if not isinstance(x, np.ndarray) or x.dtype != F32 or x.ndim != 2 or x.shape[1] != k:
        got = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(
            f"matmul needs float32 x of shape (T, {k}) for a {weight.dtype.name} weight of shape "
            f"{weight.shape}; got {got}"
        )
    x = np.ascontiguousarray(x)
    y = np.empty((x.shape[0], n), F32)
    if weight.dtype.is_quantized and x.shape[0]:
        x = Q8Activations(*quantize(x))
    matmul_into(y, x, weight, None)
    if bias is not None:
        y = ops.add(y, bias)
    return y


def get_rows_into(out: np.ndarray, weight: PackedWeight, ids: np.ndarray, arg: object) -> None:
    """GET_ROWS into ``out``: rows ``ids`` (in range), dequantized."""
    matmul.GET_ROWS[weight.dtype.value](weight.raw, ids, F16_TABLE, out)


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
    get_rows_into(out, weight, ids.astype(np.int64), None)
    return out


def _by_rows(rows: Callable[..., None], parallel: Callable[..., None], out, *srcs) -> None:
    """An elementwise row kernel over ``srcs`` into ``out``: serially, or split into row
    ranges run in parallel (a row's result never depends on which)."""
    n = srcs[0].shape[0]
    split = chunks(srcs[0].size, n)
    if split == 1:
        rows(*srcs, out, 0, n)
    else:
        parallel(*srcs, out, split)


def silu_into(out: np.ndarray, x: np.ndarray, arg: object = None) -> None:
    _by_rows(elementwise.silu_rows, elementwise.silu_parallel, out, x)


def silu_op(x: np.ndarray) -> np.ndarray:
    ops.check_rows("silu", x)
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    silu_into(out, x)
    return out


def swiglu_into(out: np.ndarray, gate: np.ndarray, up: np.ndarray, arg: object = None) -> None:
    _by_rows(elementwise.swiglu_rows, elementwise.swiglu_parallel, out, gate, up)


def swiglu_op(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    ops.check_swiglu(gate, up)
    gate, up = np.ascontiguousarray(gate), np.ascontiguousarray(up)
    out = np.empty_like(gate)
    swiglu_into(out, gate, up)
    return out


def rms_norm_into(out: np.ndarray, x: np.ndarray, eps: float) -> None:
    split = chunks(x.size, x.shape[0])
    if split == 1:
        elementwise.rms_norm_rows(x, F32(eps), out, 0, x.shape[0])
    else:
        elementwise.rms_norm_parallel(x, F32(eps), out, split)


def rms_norm_op(x: np.ndarray, eps: float) -> np.ndarray:
    ops.check_rms_norm(x, eps)
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    rms_norm_into(out, x, eps)
    return out


def rms_norm_mul_into(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> None:
    """RMS_NORM_MUL: fl(fl(x * scale) * w), both roundings of the composition kept."""
    split = chunks(x.size, x.shape[0])
    if split == 1:
        elementwise.rms_norm_mul_rows(x, F32(eps), w, out, 0, x.shape[0])
    else:
        elementwise.rms_norm_mul_parallel(x, F32(eps), w, out, split)


def rope_into(
    out: np.ndarray, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
    arg: RopeArg,
) -> None:  # fmt: skip
    n_head, head_dim, n_rot, neox = arg.n_head, arg.head_dim, arg.n_rot, arg.mode == "neox"
    split = chunks(x.size, x.shape[0])
    if split == 1:
        elementwise.rope_rows(
            x, positions, cos, sin, n_head, head_dim, n_rot, neox, out, 0, x.shape[0]
        )
    else:
        elementwise.rope_parallel(x, positions, cos, sin, n_head, head_dim, n_rot, neox, out, split)


def rope_op(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, arg: RopeArg
) -> np.ndarray:
    n_head, head_dim, n_rot, mode = arg.n_head, arg.head_dim, arg.n_rot, arg.mode
    ops.check_rope(x, positions, cos, sin, n_head=n_head, head_dim=head_dim, n_rot=n_rot, mode=mode)
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    rope_into(out, x, positions, cos, sin, arg)
    return out


def attention_into(
    out: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
    arg: AttentionArg,
) -> None:  # fmt: skip
    if q.shape[0] == 0:
        return
    n_head, n_head_kv, scale = arg.n_head, arg.n_head_kv, F32(arg.scale)
    n_keys = int(positions.max()) + 1
    pairs = q.shape[0] * n_head
    split = chunks(pairs * n_keys * arg.head_dim * 2, pairs)
    window = arg.window
    if split == 1:
        kt = attention.keys_by_dim(k, n_keys, n_head_kv)
        attention.attention_rows(q, kt, v, positions, n_head, scale, window, out, 0, pairs)
    else:
        attention.attention_parallel(
            q, k, v, positions, n_head, n_head_kv, scale, window, out, split
        )


def attention_op(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, *, arg: AttentionArg
) -> np.ndarray:
    n_head, n_head_kv, head_dim, scale = arg.n_head, arg.n_head_kv, arg.head_dim, arg.scale
    ops.check_attention(
        q, k, v, positions, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, scale=scale,
        window=arg.window,
    )  # fmt: skip
    q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
    out = np.empty_like(q)
    attention_into(out, q, k, v, positions, arg)
    return out


def kv_write_into(
    out: np.ndarray, cache: np.ndarray, rows: np.ndarray, positions: np.ndarray, arg: object
) -> None:
    """KV_WRITE: rows into the cache (``out`` is the cache itself)."""
    elementwise.kv_write_rows(cache, rows, positions)


def argmax_into(out: np.ndarray, x: np.ndarray, arg: object) -> None:
    elementwise.argmax_rows(x, out)


def gelu_into(out: np.ndarray, x: np.ndarray, arg: object = None) -> None:
    _by_rows(elementwise.gelu_rows, elementwise.gelu_parallel, out, x)


def geglu_into(out: np.ndarray, gate: np.ndarray, up: np.ndarray, arg: object = None) -> None:
    _by_rows(elementwise.geglu_rows, elementwise.geglu_parallel, out, gate, up)


def scale_into(out: np.ndarray, x: np.ndarray, arg: float) -> None:
    np.multiply(x, np.float32(arg), out)


def add_into(out: np.ndarray, a: np.ndarray, b: np.ndarray, arg: object) -> None:
    np.add(a, b, out)


def mul_into(out: np.ndarray, a: np.ndarray, b: np.ndarray, arg: object) -> None:
    np.multiply(a, b, out)


def slice_rows_into(out: np.ndarray, x: np.ndarray, arg: SliceArg) -> None:
    np.copyto(out, x[arg.start : arg.start + arg.count])


def reshape_into(out: np.ndarray, x: np.ndarray, arg: tuple[int, int]) -> None:
    np.copyto(out, x.reshape(arg))


# op -> writer(out, *source values, arg) for every op that is one kernel call; matrix products
# of F32 x by a quantized weight, and the fused ops, are sequences of these (the backend's
# expansion), with their temporaries in the arena
WRITERS: dict[Op, Callable[..., None]] = {
    Op.GET_ROWS: get_rows_into,
    Op.SLICE_ROWS: slice_rows_into,
    Op.RESHAPE: reshape_into,
    Op.ADD: add_into,
    Op.MUL: mul_into,
    Op.SILU: silu_into,
    Op.SWIGLU: swiglu_into,
    Op.GELU: gelu_into,
    Op.GEGLU: geglu_into,
    Op.SCALE: scale_into,
    Op.RMS_NORM: rms_norm_into,
    Op.RMS_NORM_MUL: rms_norm_mul_into,
    Op.MATMUL: matmul_into,
    Op.QUANTIZE: quantize_into,
    Op.ROPE: rope_into,
    Op.KV_WRITE: kv_write_into,
    Op.ATTENTION: attention_into,
    Op.ARGMAX: argmax_into,
}
