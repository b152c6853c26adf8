"""Weights on the device and the contract's GET_ROWS, activation quantization and MATMUL.

A weight is prepared once on the host (``prepare_weight``, numpy) and uploaded once. Quantized
weights keep parity.quant's sub-block form, laid out block-major like the numpy oracle: ``qw``
int8 ``(S, L, N)`` (sub-block, element, row), scales ``a`` and mins ``m`` as carriers
``(S, N)``. Float weights (F32, F16, BF16) are their exact values as a carrier ``(N, K)`` (or
``(K,)`` for a row vector). The jax functions below run on carriers (``binary32``).

Quantized activations (a Q8A value) are a ``Q8``: int8 quants ``q`` (T, K), the blocks' scales
``d`` and scaled sums ``s`` (T, K/32), as carriers inside a program and as float32 arrays
outside (in a buffer, between programs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parity.core.dtypes import DType
from parity.core.weights import WeightData
from parity.quant.blocks import FLOAT_TYPES, MIN_SIGN, unpack
from parity.quant.dequant import dequantize
from parity_jax.binary32 import F64, add, div, mul, sub, tree_sum

QK = 32  # elements per activation block
TEMP_ELEMENTS = 1 << 22  # largest (terms, rows, columns) temporary formed at once: 32 MiB
DOT_ROWS = 2  # XLA:CPU turns a one-row batched dot into a slow loop (10x); two rows are not

Weight = dict[str, jax.Array]


class Q8(NamedTuple):
    """A Q8A value: ``q`` int8 (T, K), ``d`` and ``s`` (T, K/32); a pytree (a tuple)."""

    q: jax.Array
    d: jax.Array
    s: jax.Array


def prepare_weight(weight: WeightData) -> dict[str, np.ndarray]:
    """A weight's device form, as host arrays (see the module docstring)."""
    raw, shape = weight.raw(), weight.shape
    if weight.dtype in FLOAT_TYPES:
        return {"w": dequantize(weight.dtype, raw, shape).astype(np.float64)}
    blocks = unpack(weight.dtype, raw, shape)  # qw (N, S, L), a and m (N, S)
    form = {
        "qw": np.ascontiguousarray(blocks.qw.transpose(1, 2, 0)),
        "a": np.ascontiguousarray(blocks.a.T, dtype=np.float64),
    }
    if blocks.m is not None:
        form["m"] = np.ascontiguousarray(blocks.m.T, dtype=np.float64)
    return form


def _dequantize_columns(w: Weight, dtype: DType, cols: jax.Array) -> jax.Array:
    """fl(a * qw) (then +/- m) of the rows ``cols`` of a quantized weight, as (len, K)."""
    qw = w["qw"][:, :, cols].astype(F64)  # (S, L, n)
    values = mul(w["a"][:, None, cols], qw)
    if "m" in w:
        combine = add if MIN_SIGN[dtype] > 0 else sub
        values = combine(values, w["m"][:, None, cols])
    return values.transpose(2, 0, 1).reshape(len(cols), -1)


def get_rows(w: Weight, dtype: DType, ids: jax.Array) -> jax.Array:
    """GET_ROWS: rows ``ids`` of the weight, dequantized, (len(ids), K). ids are valid (the
    host checks them before a graph runs)."""
    if "w" in w:
        return w["w"][ids]
    return _dequantize_columns(w, dtype, ids)


def nan_max(x: jax.Array, axis: int) -> jax.Array:
    """The maximum along ``axis``, NaN where the values hold a NaN (max is exact in any order).
    The NaN is tested for on its own: XLA:CPU's vectorized max reduction may drop it."""
    return jnp.where(jnp.isnan(x).any(axis=axis), jnp.nan, jnp.max(x, axis=axis))


def quantize_activations(x: jax.Array) -> Q8:
    """The contract's Q8 activations of carrier x (T, K): int8 q (T, K), scale d and scaled sum
    s (T, K/32) as carriers (QUANTIZE, and what MATMUL does to an F32 x)."""
    t, k = x.shape
    xb = x.reshape(t, k // QK, QK)
    amax = nan_max(jnp.abs(xb), axis=-1)  # exact; NaN propagates
    d = div(amax, 127.0)
    v = div(xb, d[..., None])  # correctly rounded, not x * (1 / d)
    v = jnp.where(jnp.isfinite(v), v, 0.0)  # d = 0, NaN or inf: the whole block is 0
    q = jnp.clip(jnp.trunc(v + jnp.copysign(0.5, v)), -127.0, 127.0)  # ties away; exact
    s = mul(d, jnp.sum(q, axis=-1))  # the sum of <= 32 small integers is exact
    return Q8(q.astype(jnp.int8).reshape(t, k), d, s)


def _matmul_quant(x: jax.Array | Q8, w: Weight, dtype: DType) -> jax.Array:
    """term_s = fl(fl(a * d_x) * isum_s) (+/- fl(m * s_x)), TREE over sub-blocks s; x is a
    carrier (quantized here) or already quantized."""
    n_sub, sub_len, _ = w["qw"].shape
    q, d, s = x if isinstance(x, Q8) else quantize_activations(x)
    t = q.shape[0]
    qs = q.reshape(t, n_sub, sub_len).transpose(1, 0, 2)  # (S, T, L)
    if t < DOT_ROWS:
        qs = jnp.pad(qs, ((0, 0), (0, DOT_ROWS - t), (0, 0)))
    isum = lax.dot_general(  # exact int32 dot products per sub-block: (S, T', N)
        qs, w["qw"], (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.int32
    )[:, :t]
    per_block = QK // sub_len  # sub-blocks per activation block (2 for Q6_K)
    dx = jnp.repeat(d.T, per_block, axis=0)[:, :, None]  # (S, T, 1): d_x of each sub-block
    terms = mul(mul(w["a"][:, None, :], dx), isum.astype(F64))  # (S, T, N)
    if "m" in w:
        sx = jnp.repeat(s.T, per_block, axis=0)[:, :, None]
        combine = add if MIN_SIGN[dtype] > 0 else sub
        terms = combine(terms, mul(w["m"][:, None, :], sx))
    return tree_sum(terms, axis=0)


def _matmul_float(x: jax.Array, w: Weight) -> jax.Array:
    """y[t, n] = TREE over k of fl(x[t, k] * w[n, k])."""
    products = mul(x.T[:, :, None], w["w"].T[:, None, :])  # (K, T, N)
    return tree_sum(products, axis=0)


def matmul(x: jax.Array | Q8, w: Weight, dtype: DType) -> jax.Array:
    """MATMUL without bias: x (T, K) carrier, or a ``Q8`` for a quantized weight -> (T, N)
    carrier.

    Rows and columns are independent, so large products are formed in blocks (token blocks in
    a ``lax.map``, column blocks one after another) to bound memory; no value depends on it.
    """
    quantized = "qw" in w
    if isinstance(x, Q8) and not quantized:
        raise ValueError("matmul: quantized activations need a quantized weight")
    n = w["qw"].shape[2] if quantized else w["w"].shape[0]
    terms = w["qw"].shape[0] if quantized else x.shape[1]
    rows = tuple(x) if isinstance(x, Q8) else (x,)  # arrays with a common row axis

    def kernel(wb: Weight, *xb: jax.Array) -> jax.Array:
        xb = Q8(*xb) if len(xb) == 3 else xb[0]
        return _matmul_quant(xb, wb, dtype) if quantized else _matmul_float(xb, wb)

    per_row = n * terms
    if per_row > TEMP_ELEMENTS:  # one row is already too big: columns in blocks
        step = max(1, TEMP_ELEMENTS // terms)
        blocks = [_columns(w, c, min(c + step, n)) for c in range(0, n, step)]
        return jnp.concatenate(
            [map_rows(functools.partial(kernel, wb), *rows, block=1) for wb in blocks], axis=1
        )
    block = max(1, TEMP_ELEMENTS // per_row)
    return map_rows(functools.partial(kernel, w), *rows, block=block)


def _columns(w: Weight, start: int, stop: int) -> Weight:
    """Weight rows [start, stop) (output columns of MATMUL)."""
    if "w" in w:
        return {"w": w["w"][start:stop]}
    return {key: value[..., start:stop] for key, value in w.items()}


def map_rows(fn: Callable[..., jax.Array], *arrays: jax.Array, block: int) -> jax.Array:
    """``fn(*arrays)`` for a row-independent ``fn`` of arrays with a common first (row) axis,
    run ``block`` rows at a time when there are more (zero rows pad the last block; their
    results are dropped)."""
    t = arrays[0].shape[0]
    if t <= block:
        return fn(*arrays)
    n_blocks = math.ceil(t / block)
    pad = n_blocks * block - t
    blocks = tuple(
        jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(n_blocks, block, *a.shape[1:])
        for a in arrays
    )
    out = lax.map(lambda xs: fn(*xs), blocks)
    return out.reshape(n_blocks * block, *out.shape[2:])[:t]
