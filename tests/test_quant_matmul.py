"""MATMUL: bit-exact against a loop reference of the contract, close to float64, batch invariant."""

from __future__ import annotations

import math

import numpy as np
import pytest

import parity.quant.gemm as quant_gemm
from parity.core.dtypes import DType
from parity.numerics import tree_sum, tree_sum_leading
from parity.quant import dequantize, matmul, prepare_weight, quantize_activations
from parity.quant.activation import quantize_rows
from parity.quant.blocks import SUB_BLOCK, SUPPORTED_TYPES, unpack
from parity.quant.synthetic import random_weight

F32 = np.float32
U = 2.0**-24  # unit roundoff of float32
ALL = [t.name for t in SUPPORTED_TYPES]
QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
FLOAT = ["F32", "F16", "BF16"]


def ref_tree(values: list[np.float32]) -> np.float32:
    """Pad with +0.0 to a power of two, add adjacent pairs level by level."""
    width = 1 << max(len(values) - 1, 0).bit_length()
    level = [F32(v) for v in values] + [F32(0.0)] * (width - len(values))
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def ref_matmul(x: np.ndarray, dtype: DType, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The contract with Python loops: integer sub-block dots, scalar float32 ops, the tree."""
    n, k = shape
    y = np.zeros((x.shape[0], n), F32)
    with np.errstate(all="ignore"):
        if dtype.name in FLOAT:
            w = dequantize(dtype, raw, shape)
            for t in range(x.shape[0]):
                for r in range(n):
                    y[t, r] = ref_tree([x[t, i] * w[r, i] for i in range(k)])
            return y
        sub = unpack(dtype, raw, shape)
        xq = quantize_activations(x)
        size = SUB_BLOCK[dtype]
        for t in range(x.shape[0]):
            qx = [int(v) for v in xq.q[t]]
            for r in range(n):
                terms = []
                for s in range(k // size):
                    b = s * size // 32  # the activation block this sub-block lies in
                    qw = sub.qw[r, s].tolist()
                    isum = sum(qw[j] * qx[s * size + j] for j in range(size))
                    term = (sub.a[r, s] * xq.d[t, b]) * F32(isum)
                    if dtype is DType.Q4_1:
                        term = term + sub.m[r, s] * xq.s[t, b]
                    elif dtype is DType.Q4_K:
                        term = term - sub.m[r, s] * xq.s[t, b]
                    terms.append(term)
                y[t, r] = ref_tree(terms)
    return y


def special_x(rng: np.random.Generator, t: int, k: int) -> np.ndarray:
    """Random rows with a zero row, a -0.0 row, tie values, subnormals and huge values."""
    x = rng.standard_normal((t, k)).astype(F32)
    x[1] = -0.0
    x[2, :32] = 0.0
    x[2, 32:64] = np.concatenate([[127.0], np.arange(31) - 15.5]).astype(F32) / F32(4)
    x[2, 64:96] = F32(1e-40)
    x[2, 96:128] = F32(-2.5)
    if t > 3:
        x[3, :32] = F32(3e38)
        x[3, 32:64] = -x[3, 32:64] * F32(1e30)
    return x


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == F32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge-scales"])
@pytest.mark.parametrize("name", ALL)
def test_matmul_matches_loop_reference(name: str, edge: bool) -> None:
    dtype = DType[name]
    rng = np.random.default_rng(100 + sum(map(ord, name)) + edge)
    shape = (5, 512)
    raw = random_weight(dtype, shape, rng, edge=edge)
    x = special_x(rng, 4, 512)
    got = matmul(x, prepare_weight(dtype, raw, shape))
    assert_same_bits(got, ref_matmul(x, dtype, raw, shape))


def vectorized_reference(
    x: np.ndarray, dtype: DType, raw: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    """The contract without BLAS: int64 dot products, numerics.tree_sum over the K-order terms."""
    k = shape[1]
    sub = unpack(dtype, raw, shape)
    xq = quantize_activations(x)
    size = SUB_BLOCK[dtype]
    qx = xq.q.reshape(x.shape[0], 1, k // size, size).astype(np.int64)
    isum = (qx * sub.qw[None].astype(np.int64)).sum(-1).astype(F32)  # (T, N, n_sub), exact
    blk = np.arange(k // size) * size // 32
    terms = (sub.a[None] * xq.d[:, None, blk]) * isum
    if sub.min_sign:
        terms = terms + sub.min_sign * (sub.m[None] * xq.s[:, None, blk])
    return tree_sum(terms, axis=-1)


@pytest.mark.parametrize(
    "name,shape",
    [("Q4_1", (96, 576)), ("Q8_0", (64, 896)), ("Q5_0", (80, 896)), ("Q4_K", (40, 4864)),
     ("Q6_K", (40, 4864)), ("Q4_0", (33, 1536))],
)  # fmt: skip
def test_matmul_matches_vectorized_reference_at_model_widths(
    name: str, shape: tuple[int, int]
) -> None:
    dtype = DType[name]
    rng = np.random.default_rng(7)
    raw = random_weight(dtype, shape, rng)
    x = rng.standard_normal((5, shape[1])).astype(F32)
    assert_same_bits(
        matmul(x, prepare_weight(dtype, raw, shape)), vectorized_reference(x, dtype, raw, shape)
    )


@pytest.mark.parametrize("name", QUANT)
def test_quantized_matmul_is_close_to_float64(name: str) -> None:
    """|y - x·Wᵀ| <= activation rounding (d/2 per element) + float rounding of every term."""
    dtype = DType[name]
    rng = np.random.default_rng(21)
    shape = (16, 1024)
    raw = random_weight(dtype, shape, rng)
    x = rng.standard_normal((3, 1024)).astype(F32)
    y = matmul(x, prepare_weight(dtype, raw, shape))
    w = dequantize(dtype, raw, shape).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    sub = unpack(dtype, raw, shape)
    mag = np.abs(sub.a[..., None] * sub.qw.astype(np.float64))  # |a qw| per element
    if sub.m is not None:
        mag = mag + np.abs(sub.m[..., None])
    mag = mag.reshape(shape)
    d_x = np.repeat(quantize_activations(x).d.astype(np.float64), 32, axis=1)  # (T, K)
    quant_err = 0.5 * d_x @ np.abs(w).T
    levels = math.ceil(math.log2(shape[1] // SUB_BLOCK[dtype])) + 4
    round_err = levels * U * ((np.abs(x) + d_x) @ mag.T)
    assert (np.abs(y - exact) <= quant_err + round_err).all()
    assert np.abs(y - exact).max() <= 0.05 * np.abs(exact).max()  # the bound is not vacuous


@pytest.mark.parametrize("name", FLOAT)
def test_float_matmul_is_close_to_float64(name: str) -> None:
    dtype = DType[name]
    rng = np.random.default_rng(22)
    shape = (24, 1000)
    raw = random_weight(dtype, shape, rng)
    x = rng.standard_normal((3, 1000)).astype(F32)
    y = matmul(x, prepare_weight(dtype, raw, shape))
    w = dequantize(dtype, raw, shape).astype(np.float64)
    bound = (math.ceil(math.log2(1000)) + 1) * U * (np.abs(x) @ np.abs(w).T)
    assert (np.abs(y - x.astype(np.float64) @ w.T) <= bound).all()


@pytest.mark.parametrize("name", ALL)
def test_batch_and_chunk_invariance(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dtype = DType[name]
    rng = np.random.default_rng(31)
    shape = (67, 512)
    w = prepare_weight(dtype, random_weight(dtype, shape, rng, edge=True), shape)
    x = special_x(rng, 7, 512)
    batch = matmul(x, w)
    for i in range(7):
        assert_same_bits(matmul(x[i : i + 1], w), batch[i : i + 1])
    monkeypatch.setattr(quant_gemm, "CHUNK_ELEMENTS", 300)  # many small (T, N) chunks
    assert_same_bits(matmul(x, w), batch)


@pytest.mark.parametrize("n", [*range(1, 19), 31, 33, 64])
def test_leading_tree_sum_equals_numerics_tree_sum(n: int) -> None:
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, 3, 5)).astype(F32) * F32(1e3)
    a[rng.random(a.shape) < 0.3] = -0.0  # -0.0 paired with the +0.0 padding must become +0.0
    a[:, 0, 0] = -0.0
    assert_same_bits(tree_sum_leading(a), tree_sum(a, axis=0))


def test_empty_batch_and_errors() -> None:
    rng = np.random.default_rng(4)
    w = prepare_weight("Q8_0", random_weight(DType.Q8_0, (8, 64), rng), (8, 64))
    assert matmul(np.zeros((0, 64), F32), w).shape == (0, 8)
    with pytest.raises(ValueError, match=r"float32 x of shape \(T, 64\) for a Q8_0 weight"):
        matmul(np.zeros((2, 32), F32), w)
    with pytest.raises(ValueError, match="got float64"):
        matmul(np.zeros((2, 64)), w)
    with pytest.raises(ValueError, match="2-D"):
        prepare_weight("Q8_0", random_weight(DType.Q8_0, (8, 64), rng), (512,))


@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge-scales"])
@pytest.mark.parametrize("name", QUANT)
def test_decode_path_matches_general_path(name: str, edge: bool) -> None:
    """The T = 1 fast path gives the chunked path's bits, row by row, at extreme isums too."""
    dtype = DType[name]
    rng = np.random.default_rng(40 + sum(map(ord, name)) + edge)
    shape = (37, 1024)
    w = prepare_weight(dtype, random_weight(dtype, shape, rng, edge=edge), shape)
    x = special_x(rng, 8, 1024)
    x[4] = F32(1.0)  # q = 127 everywhere: the largest positive isums
    x[5] = F32(-3.0)  # q = -127 everywhere
    x[6, ::2], x[6, 1::2] = F32(2.0), F32(-2.0)
    x[7] = np.where(rng.random(1024) < 0.5, F32(0.5), F32(-1.0))  # ties: q = +/-64, +/-127
    with np.errstate(all="ignore"):
        general = quant_gemm._matmul_quant(*quantize_rows(x), w)
        for t in range(x.shape[0]):
            row = quantize_rows(x[t : t + 1])
            assert_same_bits(quant_gemm._matvec_quant(*row, w), general[t : t + 1])
            assert_same_bits(matmul(x[t : t + 1], w), general[t : t + 1])


def test_decode_path_matches_loop_reference_for_every_type() -> None:
    for name in QUANT:
        dtype = DType[name]
        rng = np.random.default_rng(sum(map(ord, name)))
        shape = (3, 256)
        raw = random_weight(dtype, shape, rng, edge=True)
        x = special_x(rng, 4, 256)
        w = prepare_weight(dtype, raw, shape)
        want = ref_matmul(x, dtype, raw, shape)
        for t in range(4):
            assert_same_bits(matmul(x[t : t + 1], w), want[t : t + 1])


def quantize_transcription(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contract's activation quantization, step by step in float32 (no shortcuts)."""
    t, k = x.shape
    xb = x.reshape(t, k // 32, 32)
    with np.errstate(all="ignore"):
        d = np.max(np.abs(xb), axis=-1) / F32(127)
        v = xb / d[..., None]
        v = np.where(np.isnan(v) | (d == 0)[..., None], F32(0), v)
        a = np.abs(v)
        f = np.floor(a)
        r = np.copysign(f + (a - f >= F32(0.5)).astype(F32), v)  # ties away from zero
        q = np.clip(r, F32(-127), F32(127)).astype(np.int8)
        s = d * q.sum(axis=-1, dtype=np.int32).astype(F32)
    return q.reshape(t, k), d, s


def test_fast_activation_quantization_matches_transcription() -> None:
    rng = np.random.default_rng(5)
    x = special_x(rng, 6, 512)
    x[4] = rng.standard_normal(512).astype(F32) * F32(10.0) ** rng.integers(-40, 38, 512)
    # quotients just below / at / above the half: d = 1 for amax = 127
    x[5, :32] = np.array([127, 0.49999997, 0.5, 0.50000006, -0.49999997, -0.5, 1.5, -2.5] * 4, F32)
    x[5, 32:64] = np.nan
    x[5, 64] = np.inf
    got = quantize_activations(x)
    q, d, s = quantize_transcription(x)
    np.testing.assert_array_equal(got.q, q)
    assert_same_bits(got.d, d)
    np.testing.assert_array_equal(np.isnan(got.s), np.isnan(s))
    assert_same_bits(np.where(np.isnan(s), 0, got.s).astype(F32), np.where(np.isnan(s), 0, s))
