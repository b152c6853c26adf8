"""The cpu backend's compiled (numba) kernels give the numpy definition's bits, op by op.

Every weight type at the real models' widths, T = 1 and T > 1, special activations (zeros,
-0.0, ties, subnormals, huge values, NaN, Inf), the edge fp16 scales of
``parity.quant.synthetic``, random bytes (NaN / Inf scale fields), serial and parallel row
splits. NaN payloads are not part of the contract: NaN positions are compared instead.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity import quant
from parity.arch.rope import rope_tables
from parity.backends.cpu import ops
from parity.backends.cpu.jit import ops as jit_ops
from parity.core.dtypes import DType
from parity.core.ir import AttentionArg, RopeArg
from parity.core.weights import WeightData
from parity.quant.synthetic import random_weight

F32 = np.float32
QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
FLOAT = ["F32", "F16", "BF16"]
# (N, K): the real models' widths (K-quants need K a multiple of 256), odd row counts
# weights: random quants and scales, every other block's scales from EDGE_FP16, or random bytes
# (float weights have no scale fields)
CASES = [(d, k) for d in QUANT for k in ("random", "edge", "bytes")] + [
    (d, k) for d in FLOAT for k in ("random", "edge")
]
SHAPES = {32: [(37, 576), (5, 896), (33, 1536), (3, 4864)], 256: [(9, 4864), (7, 1536), (3, 256)]}


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def special_x(rng: np.random.Generator, t: int, k: int) -> np.ndarray:
    """Random rows; the first rows carry special values, block by block."""
    x = rng.standard_normal((t, k)).astype(F32)
    specials = [
        np.zeros(32, F32),
        np.full(32, -0.0, F32),
        np.full(32, 2.5, F32),  # all equal: q = 127
        np.concatenate([[127.0], np.arange(31) - 15.5]).astype(F32) / F32(4),  # ties
        np.full(32, 1e-40, F32),  # subnormal: d rounds to 0
        rng.standard_normal(32).astype(F32) * F32(3e37),
        np.where(np.arange(32) == 5, F32(np.nan), F32(1)),
        np.where(np.arange(32) == 7, F32(-np.inf), F32(1)),
    ]
    flat = x[: min(t, 2)].reshape(-1)
    for i, block in enumerate(specials):
        if 32 * i + 32 <= flat.size:
            flat[32 * i : 32 * i + 32] = block
    return x


def weight(dtype: str, shape: tuple[int, int], rng: np.random.Generator, kind: str) -> WeightData:
    d = DType[dtype]
    if kind == "bytes":  # every byte random: scale fields may be NaN or Inf
        data = rng.integers(0, 256, d.nbytes(shape[0] * shape[1]), dtype=np.uint8)
    else:
        data = random_weight(d, shape, rng, edge=kind == "edge")
    return WeightData("w", d, shape, data)


def matmul_both(x: np.ndarray, w: WeightData) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(all="ignore"):
        want = quant.matmul(x, quant.prepare_weight(w.dtype, w.raw(), w.shape))
        got = jit_ops.matmul_op(x, jit_ops.pack_weight(w))
    return got, want


@pytest.mark.parametrize("dtype,kind", CASES)
def test_matmul_matches_numpy(dtype: str, kind: str) -> None:
    rng = np.random.default_rng(sum(map(ord, dtype + kind)))
    for n, k in SHAPES[DType[dtype].block_size if dtype in QUANT else 32]:
        w = weight(dtype, (n, k), rng, kind)
        for t in (1, 3):
            got, want = matmul_both(special_x(rng, t, k), w)
            same_bits(got, want)


@pytest.mark.parametrize("dtype", QUANT + FLOAT)
def test_matmul_parallel_split_and_batch_match_numpy(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many rows and tokens (past TOKEN_TILE): row ranges on all threads, token tiles."""
    rng = np.random.default_rng(7)
    k = 512 if dtype in ("Q4_K", "Q6_K") else 576
    w = weight(dtype, (301, k), rng, "edge")
    x = special_x(rng, 70, k)
    got, want = matmul_both(x, w)
    same_bits(got, want)
    monkeypatch.setattr(jit_ops, "PARALLEL_WORK", 1 << 62)  # one serial range
    same_bits(matmul_both(x, w)[0], want)
    same_bits(jit_ops.matmul_op(x[5:6], jit_ops.pack_weight(w)), want[5:6])


def test_matmul_bias_and_empty_batch() -> None:
    rng = np.random.default_rng(3)
    w = weight("Q5_0", (64, 896), rng, "random")
    x = special_x(rng, 3, 896)
    bias = rng.standard_normal(64).astype(F32)
    want = ops.matmul(x, quant.prepare_weight(w.dtype, w.raw(), w.shape), bias)
    same_bits(jit_ops.matmul_op(x, jit_ops.pack_weight(w), bias), want)
    assert jit_ops.matmul_op(np.zeros((0, 896), F32), jit_ops.pack_weight(w)).shape == (0, 64)
    with pytest.raises(ValueError, match=r"float32 x of shape \(T, 896\) for a Q5_0 weight"):
        jit_ops.matmul_op(np.zeros((2, 64), F32), jit_ops.pack_weight(w))


def test_activation_quantization_matches_numpy() -> None:
    rng = np.random.default_rng(5)
    x = special_x(rng, 300, 4864)  # parallel rows
    x[2] = rng.standard_normal(4864).astype(F32) * F32(10.0) ** rng.integers(-40, 38, 4864)
    x[3, :8] = [0.49999997, 0.5, 0.50000006, -0.49999997, -0.5, 1.5, -2.5, 127]
    want = quant.quantize_activations(x)
    for rows in (x, x[:1], x[2:5]):
        q, d, s = jit_ops.quantize(rows)
        ref = quant.quantize_activations(rows)
        np.testing.assert_array_equal(q, ref.q)
        same_bits(d, ref.d)
        same_bits(s, ref.s)
    assert jit_ops.quantize(x)[0].tobytes() == want.q.tobytes()


@pytest.mark.parametrize("dtype,kind", CASES)
def test_get_rows_matches_numpy(dtype: str, kind: str) -> None:
    rng = np.random.default_rng(11)
    k = 512 if dtype in ("Q4_K", "Q6_K") else 896
    w = weight(dtype, (41, k), rng, kind)
    ids = np.array([0, 40, 7, 7, 13], np.int32)
    want = quant.get_rows((w.dtype, w.raw(), w.shape), ids)
    same_bits(jit_ops.get_rows_op(jit_ops.pack_weight(w), ids), want)
    with pytest.raises(IndexError, match="id 41 is out of range"):
        jit_ops.get_rows_op(jit_ops.pack_weight(w), np.array([41]))


def elementwise_x(rng: np.random.Generator, t: int, width: int, scale: float = 1.0) -> np.ndarray:
    x = (rng.standard_normal((t, width)) * scale).astype(F32)
    flat = x.reshape(-1)
    special = [0.0, -0.0, 1e-45, -1e-40, 1e30, -1e30, np.inf, -np.inf, np.nan, -89, -104, 17, 88.8]
    flat[: len(special)] = special[: flat.size]
    x[-1] = x[-1, 0]  # an all-equal row
    return x


@pytest.mark.parametrize("t", [1, 40])
def test_silu_swiglu_match_numpy(t: int) -> None:
    rng = np.random.default_rng(t)
    g, u = elementwise_x(rng, t, 1536, 8.0), elementwise_x(rng, t, 1536)
    with np.errstate(all="ignore"):
        same_bits(jit_ops.silu_op(g), ops.silu(g))
        same_bits(jit_ops.swiglu_op(g, u), ops.swiglu(g, u))
    with pytest.raises(ValueError, match="must match"):
        jit_ops.swiglu_op(g, u[:, :32])


@pytest.mark.parametrize("width", [576, 896, 64, 5])
@pytest.mark.parametrize("t", [1, 50])
def test_rms_norm_matches_numpy(width: int, t: int) -> None:
    rng = np.random.default_rng(width + t)
    x = elementwise_x(rng, t, width)
    eps = float(F32(1e-5))
    with np.errstate(all="ignore"):
        x[0] *= F32(1e20)  # squares overflow
        if t > 1:
            x[1] *= F32(1e-25)  # squares underflow
        same_bits(jit_ops.rms_norm_op(x, eps), ops.rms_norm(x, eps))
    with pytest.raises(ValueError, match="eps must be positive"):
        jit_ops.rms_norm_op(x, 0.1)


@pytest.mark.parametrize("mode,n_rot", [("normal", 64), ("neox", 64), ("neox", 32)])
@pytest.mark.parametrize("t", [1, 64])
def test_rope_matches_numpy(mode: str, n_rot: int, t: int) -> None:
    rng = np.random.default_rng(t + n_rot)
    cos, sin = rope_tables(512, n_rot, 10000.0)
    x = elementwise_x(rng, t, 14 * 64)
    pos = rng.permutation(512)[:t].astype(np.int32)
    arg = RopeArg(14, 64, n_rot, mode)
    kw = {"n_head": 14, "head_dim": 64, "n_rot": n_rot, "mode": mode}
    with np.errstate(all="ignore"):
        same_bits(jit_ops.rope_op(x, pos, cos, sin, arg=arg), ops.rope(x, pos, cos, sin, **kw))
    with pytest.raises(ValueError, match="position 512 is outside"):
        jit_ops.rope_op(x[:1], np.array([512], np.int32), cos, sin, arg=arg)


@pytest.mark.parametrize(
    "heads,kv,positions",
    [
        (9, 3, [0]),
        (9, 3, [50]),
        (14, 2, [255, 256, 257, 599]),
        (9, 3, list(range(0, 600, 7))),  # a prefill: parallel (token, head) ranges
        (4, 4, [3, 1, 2]),
    ],
)
def test_attention_matches_numpy(heads: int, kv: int, positions: list[int]) -> None:
    rng = np.random.default_rng(len(positions) + heads)
    pos = np.array(positions, np.int32)
    q = rng.standard_normal((len(pos), heads * 64)).astype(F32)
    k = rng.standard_normal((600, kv * 64)).astype(F32)
    v = rng.standard_normal((600, kv * 64)).astype(F32)
    k[700 % 600] = np.nan  # a row no token sees when every position < 100
    v[3, :5] = [-0.0, np.inf, -np.inf, 1e-45, 3e38]
    arg = AttentionArg(heads, kv, 64, 0.125)
    kw = {"n_head": heads, "n_head_kv": kv, "head_dim": 64, "scale": 0.125}
    with np.errstate(all="ignore"):
        want = ops.attention(q, k, v, pos, **kw)
        same_bits(jit_ops.attention_op(q, k, v, pos, arg=arg), want)


@pytest.mark.parametrize("window", [1, 7, 256, 300])
def test_attention_sliding_window_matches_numpy(window: int) -> None:
    rng = np.random.default_rng(window)
    pos = np.array([0, 9, 255, 256, 530, 599, 300], np.int32)
    q = rng.standard_normal((len(pos), 4 * 64)).astype(F32)
    k = rng.standard_normal((600, 2 * 64)).astype(F32)
    v = rng.standard_normal((600, 2 * 64)).astype(F32)
    v[520:560] = -0.0  # chunk numerators of -0.0 for some tokens
    arg = AttentionArg(4, 2, 64, 0.125, window)
    kw = {"n_head": 4, "n_head_kv": 2, "head_dim": 64, "scale": 0.125, "window": window}
    same_bits(jit_ops.attention_op(q, k, v, pos, arg=arg), ops.attention(q, k, v, pos, **kw))


def test_attention_signed_zero_chunks() -> None:
    """With every v = -0.0: p = 0 and 256 give +0.0, p = 255 gives -0.0 (the padding adds)."""
    rng = np.random.default_rng(2)
    pos = np.array([0, 255, 256], np.int32)
    q = rng.standard_normal((3, 4 * 64)).astype(F32)
    k = rng.standard_normal((300, 2 * 64)).astype(F32)
    v = np.full((300, 2 * 64), -0.0, F32)
    got = jit_ops.attention_op(q, k, v, pos, arg=AttentionArg(4, 2, 64, 0.125))
    same_bits(got, ops.attention(q, k, v, pos, n_head=4, n_head_kv=2, head_dim=64, scale=0.125))
    assert np.signbit(got[:, 0]).tolist() == [False, True, False]


def test_compiling_is_announced_once_and_timed(monkeypatch):
    """Every real compile (the first model's, or a quant type met later) is covered by the
    notice; nested and later compiles add to the time reported at exit."""
    import io

    import numba

    from parity.backends.cpu.jit import compile as jit_compile

    out = io.StringIO()
    notice = jit_compile._CompileNotice(out)
    numba.core.event.register("numba:compile", notice)
    try:

        @numba.njit(cache=False)
        def helper(x):
            return x + 1

        @numba.njit(cache=False)
        def outer(x):
            return helper(x) * 2

        assert outer(3) == 8 and outer(4) == 10 and helper(1.5) == 2.5
    finally:
        numba.core.event.unregister("numba:compile", notice)
    notice.report()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("parity: compiling cpu kernels")
    assert lines[1].startswith("parity: cpu kernels compiled in ") and notice.total > 0
