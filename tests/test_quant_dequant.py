"""Weight dequantization and GET_ROWS: bit-exact against gguf.quants.dequantize."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from parity.core.dtypes import DType
from parity.quant import PreparedWeight, dequantize, get_rows, prepare_weight
from parity.quant.blocks import SUB_BLOCK, SUPPORTED_TYPES, unpack
from parity.quant.synthetic import random_weight

F32 = np.float32
ALL = [t.name for t in SUPPORTED_TYPES]
QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
QW_RANGE = {
    "Q4_0": (-8, 7),
    "Q4_1": (0, 15),
    "Q5_0": (-16, 15),
    "Q8_0": (-128, 127),
    "Q4_K": (0, 15),
    "Q6_K": (-32, 31),
}


def gguf_dequantize(dtype: DType, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(*shape[:-1], dtype.nbytes(shape[-1]))
    out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(dtype.value))
    return np.asarray(out, F32).reshape(shape)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, F32).view(np.uint32)


@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge-scales"])
@pytest.mark.parametrize("name", ALL)
def test_dequantize_matches_gguf(name: str, edge: bool) -> None:
    dtype = DType[name]
    rng = np.random.default_rng(sum(map(ord, name)) + edge)
    shape = (6, 512)
    raw = random_weight(dtype, shape, rng, edge=edge)
    got = dequantize(dtype, raw, shape)
    assert got.dtype == F32 and got.shape == shape
    np.testing.assert_array_equal(bits(got), bits(gguf_dequantize(dtype, raw, shape)))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # gguf's own NaN arithmetic
@pytest.mark.parametrize("name", [*QUANT, "F16", "BF16"])
def test_dequantize_all_byte_patterns_match_gguf(name: str) -> None:
    # raw random bytes: scale fields may be NaN/inf too; bits still agree with gguf
    dtype = DType[name]
    rng = np.random.default_rng(7)
    shape = (4, 1024)
    raw = rng.integers(0, 256, dtype.nbytes(4 * 1024), dtype=np.uint8)
    got = dequantize(dtype, raw, shape)
    np.testing.assert_array_equal(bits(got), bits(gguf_dequantize(dtype, raw, shape)))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", "BF16"])
def test_dequantize_of_gguf_quantize(name: str) -> None:
    dtype = DType[name]
    rng = np.random.default_rng(3)
    data = rng.standard_normal((8, 256)).astype(F32)
    data[0, :32] = 0.0  # an all-zero block: d = 0
    data[1, :32] = 1.5  # an all-equal block
    raw = np.asarray(gguf.quants.quantize(data, gguf.GGMLQuantizationType(dtype.value)))
    got = dequantize(dtype, raw.view(np.uint8), data.shape)
    np.testing.assert_array_equal(bits(got), bits(gguf_dequantize(dtype, raw, data.shape)))


@pytest.mark.parametrize("name", QUANT)
def test_sub_block_form_reproduces_gguf(name: str) -> None:
    """The contract's identity: w = fl(a*qw), fl(fl(a*qw) + m) (Q4_1), fl(fl(a*qw) - m) (Q4_K)."""
    dtype = DType[name]
    rng = np.random.default_rng(11)
    shape = (3, 512)
    raw = random_weight(dtype, shape, rng, edge=True)
    sub = unpack(dtype, raw, shape)
    n_sub = shape[1] // SUB_BLOCK[dtype]
    assert sub.qw.shape == (3, n_sub, SUB_BLOCK[dtype]) and sub.qw.dtype == np.int8
    assert sub.a.shape == (3, n_sub) and sub.a.dtype == F32
    lo, hi = QW_RANGE[name]
    assert lo <= sub.qw.min() and sub.qw.max() <= hi
    w = sub.a[..., None] * sub.qw.astype(F32)
    if name == "Q4_1":
        w = w + sub.m[..., None]
    elif name == "Q4_K":
        w = w - sub.m[..., None]
    else:
        assert sub.m is None
    np.testing.assert_array_equal(bits(w.reshape(shape)), bits(gguf_dequantize(dtype, raw, shape)))


def test_q4_k_scale_unpacking_matches_ggml_scalar_code() -> None:
    rng = np.random.default_rng(5)
    raw = random_weight(DType.Q4_K, (1, 256 * 4), rng)
    blocks = raw.reshape(4, 144)
    sub = unpack(DType.Q4_K, raw, (1, 1024))
    for b, blk in enumerate(blocks):
        d = F32(blk[0:2].view(np.float16)[0])
        dmin = F32(blk[2:4].view(np.float16)[0])
        q = [int(v) for v in blk[4:16]]
        for j in range(8):  # ggml get_scale_min_k4
            if j < 4:
                sc, mn = q[j] & 63, q[j + 4] & 63
            else:
                sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)
                mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
            assert sub.a[0, 8 * b + j] == d * F32(sc)
            assert sub.m[0, 8 * b + j] == dmin * F32(mn)


def test_dequantize_shapes_views_and_memmap(tmp_path) -> None:
    rng = np.random.default_rng(1)
    raw = random_weight(DType.Q8_0, (2, 3, 64), rng)
    ref = gguf_dequantize(DType.Q8_0, raw, (6, 64)).reshape(2, 3, 64)
    np.testing.assert_array_equal(bits(dequantize("q8_0", raw, (2, 3, 64))), bits(ref))
    np.testing.assert_array_equal(
        bits(dequantize(8, raw.reshape(6, -1), (6, 64))), bits(ref.reshape(6, 64))
    )
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    np.testing.assert_array_equal(bits(dequantize(DType.Q8_0, mm, (2, 3, 64))), bits(ref))
    f16 = rng.standard_normal((4, 8)).astype(np.float16)  # typed raw arrays are read as bytes
    np.testing.assert_array_equal(dequantize("F16", f16, (4, 8)), f16.astype(F32))


def test_dequantize_errors() -> None:
    raw = np.zeros(DType.Q4_0.nbytes(64), np.uint8)
    with pytest.raises(ValueError, match=r"Q4_0 tensor of shape \(2, 32\) needs 36 bytes, got 34"):
        dequantize("Q4_0", raw[:-2], (2, 32))
    with pytest.raises(ValueError, match=r"needs 36 bytes, got 38"):
        dequantize("Q4_0", np.zeros(38, np.uint8), (2, 32))
    with pytest.raises(ValueError, match=r"last .* dim 48 is not a multiple of the block size 32"):
        dequantize("Q4_0", raw, (1, 48))
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        dequantize("Q6_K", raw, (1, 128))
    with pytest.raises(ValueError, match="no dequantization for tensor type I32; supported: F32"):
        dequantize("I32", raw, (9,))
    with pytest.raises(ValueError, match="unsupported tensor type 'Q5_1'"):
        dequantize("Q5_1", raw, (2, 32))
    with pytest.raises(ValueError, match="unsupported tensor type 7"):
        dequantize(7, raw, (2, 32))


@pytest.mark.parametrize("name", ALL)
def test_get_rows_matches_dequantize(name: str) -> None:
    dtype = DType[name]
    rng = np.random.default_rng(2)
    shape = (10, 256)
    raw = random_weight(dtype, shape, rng, edge=True)
    ids = np.array([3, 0, 9, 3, 7], np.int32)
    full = dequantize(dtype, raw, shape)
    np.testing.assert_array_equal(bits(get_rows((dtype, raw, shape), ids)), bits(full[ids]))
    prepared = prepare_weight(dtype, raw, shape)
    assert isinstance(prepared, PreparedWeight)
    np.testing.assert_array_equal(bits(get_rows(prepared, ids.astype(np.int64))), bits(full[ids]))
    assert get_rows(prepared, np.array([], np.int64)).shape == (0, 256)


def test_get_rows_errors() -> None:
    raw = np.zeros(DType.Q8_0.nbytes(4 * 32), np.uint8)
    with pytest.raises(IndexError, match="id 4 is out of range for a weight of 4 rows"):
        get_rows(("Q8_0", raw, (4, 32)), np.array([0, 4]))
    with pytest.raises(IndexError, match="id -1 is out of range"):
        get_rows(("Q8_0", raw, (4, 32)), np.array([-1]))
    with pytest.raises(ValueError, match="1-D integer id array"):
        get_rows(("Q8_0", raw, (4, 32)), np.array([[0]]))
    with pytest.raises(ValueError, match="1-D integer id array"):
        get_rows(("Q8_0", raw, (4, 32)), np.array([0.0]))
    with pytest.raises(ValueError, match="2-D weight"):
        get_rows(("Q8_0", raw, (128,)), np.array([0]))
