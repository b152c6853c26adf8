"""The CPU oracle's elementwise, norm, rope and reduction ops: bitwise against scalar or
correctly rounded references where the contract allows it, stated bounds against float64."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity import quant
from parity.arch.rope import rope_tables
from parity.backends.cpu import ops
from parity.quant.synthetic import random_weight

F32 = np.float32
U = 2.0**-24  # unit roundoff of float32
WIDTHS = [1, 3, 576, 896]
EPS = float(F32(1e-5))  # the graph passes eps as the float32 value from the GGUF


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def with_specials(x: np.ndarray) -> np.ndarray:
    """Seeded values with zeros, -0.0, subnormals and large magnitudes mixed in."""
    x = x.copy()
    flat = x.reshape(-1)
    specials = np.array([0.0, -0.0, 1e-40, -3e-42, 1e30, -1e30, 1.0, -1.0], dtype=F32)
    flat[: min(flat.size, specials.size)] = specials[: flat.size]
    return x


# --- slice_rows, add, mul ----------------------------------------------------------------------


def test_slice_rows() -> None:
    x = rng().standard_normal((5, 3)).astype(F32)
    y = ops.slice_rows(x, 1, 3)
    assert np.array_equal(y, x[1:4]) and not np.shares_memory(x, y)
    for start, count in [(-1, 2), (4, 2), (0, 0)]:
        with pytest.raises(ValueError, match="slice_rows: rows"):
            ops.slice_rows(x, start, count)


@pytest.mark.parametrize("op, ref", [(ops.add, np.add), (ops.mul, np.multiply)])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("row_vector", [False, True])
def test_add_mul_are_correctly_rounded(op, ref, width: int, row_vector: bool) -> None:
    # float64 holds the exact sum/product of two float32s closely enough that rounding it to
    # float32 gives the correctly rounded result (53 >= 2 * 24 + 2), so this is bitwise
    a = with_specials(rng(1).standard_normal((4, width)).astype(F32) * 10)
    b = rng(2).standard_normal(width if row_vector else (4, width)).astype(F32)
    with np.errstate(over="ignore"):
        want = ref(a.astype(np.float64), b.astype(np.float64)).astype(F32)
    assert op(a, b).tobytes() == want.tobytes()


def test_add_mul_reject_bad_operands() -> None:
    a = np.zeros((2, 4), F32)
    with pytest.raises(ValueError, match=r"add: b must be float32 \[2, 4\] or a row vector \[4\]"):
        ops.add(a, np.zeros((4, 2), F32))
    with pytest.raises(ValueError, match="mul: b must be float32"):
        ops.mul(a, np.zeros(4, np.float64))
    with pytest.raises(ValueError, match=r"add: a must be a float32 \(n_tokens, width\)"):
        ops.add(np.zeros(4, F32), np.zeros(4, F32))


# --- silu, swiglu ------------------------------------------------------------------------------


def silu64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("width", WIDTHS)
def test_silu_within_3_ulp_of_float64(width: int) -> None:
    # exp is within 1.25 ulp; 1 + e (no cancellation) and the division add 0.5 ulp each
    x = with_specials(rng(3).uniform(-30, 30, (5, width)).astype(F32))
    got = ops.silu(x).astype(np.float64)
    want = silu64(x)
    assert np.all(np.abs(got - want) <= np.maximum(3 * U * np.abs(want), 2.0**-149))


def test_silu_large_magnitudes_and_specials() -> None:
    x = np.array([[-100.0, -88.0, -1e30, 100.0, 1e30, np.inf, -np.inf, 0.0, -0.0]], dtype=F32)
    y = ops.silu(x)
    # x <= -89: exp(-x) overflows to inf and x / inf = -0.0; large x: exp(-x) = 0, x / 1 = x
    assert y[0, [0, 2]].tobytes() == np.array([-0.0, -0.0], F32).tobytes()
    assert y[0, 1] < 0 and y[0, 1] > -1e-36
    assert np.array_equal(y[0, 3:6], x[0, 3:6])
    assert np.isnan(y[0, 6])  # -inf / inf, as documented
    assert y[0, 7:].tobytes() == np.array([0.0, -0.0], F32).tobytes()


def test_swiglu_is_silu_times_up() -> None:
    gate = with_specials(rng(4).uniform(-10, 10, (3, 896)).astype(F32))
    up = rng(5).standard_normal((3, 896)).astype(F32)
    assert ops.swiglu(gate, up).tobytes() == (ops.silu(gate) * up).tobytes()
    with pytest.raises(ValueError, match=r"swiglu: gate \[3, 896\] and up \[3, 4\] must match"):
        ops.swiglu(gate, up[:, :4])


def test_geglu_is_gelu_times_up_and_scale_is_one_product() -> None:
    gate = with_specials(rng(6).uniform(-12, 12, (3, 2048)).astype(F32))
    up = rng(7).standard_normal((3, 2048)).astype(F32)
    assert ops.geglu(gate, up).tobytes() == (ops.gelu(gate) * up).tobytes()
    with pytest.raises(ValueError, match=r"geglu: gate \[3, 2048\] and up \[3, 4\] must match"):
        ops.geglu(gate, up[:, :4])
    c = float(F32(np.sqrt(640.0)))
    assert ops.scale(up, c).tobytes() == (up * F32(c)).tobytes()
    with pytest.raises(ValueError, match="not a finite float32 value"):
        ops.scale(up, 0.1)


# --- rms_norm ----------------------------------------------------------------------------------


def tree(values: list[np.float32]) -> np.float32:
    """A plain recursive pairwise sum over a power-of-two padded list (independent of numerics)."""
    n = 1
    while n < len(values):
        n *= 2
    vals = list(values) + [F32(0.0)] * (n - len(values))
    while len(vals) > 1:
        vals = [F32(vals[i] + vals[i + 1]) for i in range(0, len(vals), 2)]
    return vals[0]


def rms_norm_scalar(x: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x)
    for t, row in enumerate(x):
        ss = tree([F32(v * v) for v in row])
        mean = F32(ss / F32(len(row)))
        r = F32(np.sqrt(F32(mean + F32(eps))))
        scale = F32(F32(1.0) / r)
        out[t] = [F32(v * scale) for v in row]
    return out


@pytest.mark.parametrize("width", [1, 3, 5, 64, 576])
def test_rms_norm_matches_scalar_loop_bitwise(width: int) -> None:
    x = with_specials(rng(6).standard_normal((3, width)).astype(F32))
    x[1] *= F32(1e-3)
    with np.errstate(over="ignore", invalid="ignore"):
        want = rms_norm_scalar(x, EPS)
    assert ops.rms_norm(x, EPS).tobytes() == want.tobytes()


@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_within_10_ulp_of_float64(width: int) -> None:
    # squares 0.5u; a tree of positive terms log2(width) <= 10 levels, 1u each; mean, +eps 1u;
    # sqrt halves that and adds 0.5u; 1/r and the final product 0.5u each: < 10u relative
    x = rng(7).standard_normal((6, width)) * np.array([[1e-3], [1], [30], [1e3], [1e6], [1]])
    x = x.astype(F32)
    x64 = x.astype(np.float64)
    eps = float(F32(1e-6))
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps)
    got = ops.rms_norm(x, eps).astype(np.float64)
    assert np.all(np.abs(got - want) <= 10 * U * np.abs(want))


def test_rms_norm_special_rows() -> None:
    eps = EPS
    x = np.zeros((5, 8), dtype=F32)
    x[1] = -0.0
    x[2] = 3.0  # all equal: ss = 72 exactly
    x[3] = 1e-40  # subnormal squares underflow to 0, so the row is scaled by 1/sqrt(eps)
    x[4] = 1e30  # squares overflow: ss = inf, scale = 0, the row comes out as zeros
    y = ops.rms_norm(x, eps)
    assert y[0].tobytes() == np.zeros(8, F32).tobytes()
    assert y[1].tobytes() == np.full(8, -0.0, F32).tobytes()
    assert np.all(y[2] == y[2, 0]) and abs(float(y[2, 0]) - 1.0) < 1e-5
    assert np.all(y[3] == F32(F32(1e-40) * F32(F32(1) / F32(np.sqrt(F32(eps))))))
    assert np.all(y[4] == 0.0)


def test_rms_norm_is_batch_invariant() -> None:
    x = rng(8).standard_normal((7, 576)).astype(F32)
    batch = ops.rms_norm(x, EPS)
    for t in range(7):
        assert ops.rms_norm(x[t : t + 1], EPS).tobytes() == batch[t : t + 1].tobytes()


def test_rms_norm_rejects_inexact_eps() -> None:
    x = np.ones((1, 4), F32)
    with pytest.raises(ValueError, match="rms_norm: eps must be positive and exact in float32"):
        ops.rms_norm(x, 0.1)
    with pytest.raises(ValueError, match="rms_norm: x must be a float32"):
        ops.rms_norm(x.astype(np.float64), float(F32(1e-5)))


# --- rope --------------------------------------------------------------------------------------


def rotate64(x, positions, *, n_head, head_dim, n_rot, mode, base) -> np.ndarray:
    """Independent float64 RoPE: pairs as complex numbers times e^(i p theta_i)."""
    half = n_rot // 2
    theta = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # (half,)
    rot = np.exp(1j * positions[:, None, None].astype(np.float64) * theta)  # (T, 1, half)
    xh = x.astype(np.float64).reshape(len(x), n_head, head_dim).copy()
    if mode == "normal":
        z = (xh[..., 0:n_rot:2] + 1j * xh[..., 1:n_rot:2]) * rot
        xh[..., 0:n_rot:2], xh[..., 1:n_rot:2] = z.real, z.imag
    else:
        z = (xh[..., :half] + 1j * xh[..., half:n_rot]) * rot
        xh[..., :half], xh[..., half:n_rot] = z.real, z.imag
    return xh.reshape(x.shape)


ROPE_CASES = [  # (n_head, head_dim, n_rot)
    (9, 64, 64),
    (14, 64, 64),
    (2, 64, 32),  # partial rotary
    (1, 8, 2),
]


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_head, head_dim, n_rot", ROPE_CASES)
def test_rope_against_float64_rotation(mode: str, n_head: int, head_dim: int, n_rot: int) -> None:
    # per output: two products and one add/sub at 0.5u each, plus the tables' 0.5u rounding:
    # |err| <= 3u * (|x0| + |x1|) against the exact rotation
    base, n_ctx = 10000.0, 600
    cos, sin = rope_tables(n_ctx, n_rot, base)
    x = rng(9).standard_normal((6, n_head * head_dim)).astype(F32)
    positions = np.array([0, 1, 17, 255, 256, 599], dtype=np.int32)
    got = ops.rope(x, positions, cos, sin, n_head=n_head, head_dim=head_dim, n_rot=n_rot, mode=mode)
    want = rotate64(
        x, positions, n_head=n_head, head_dim=head_dim, n_rot=n_rot, mode=mode, base=base
    )
    xh = np.abs(x.astype(np.float64)).reshape(6, n_head, head_dim)
    half = n_rot // 2
    if mode == "normal":
        pair = np.repeat(xh[..., 0:n_rot:2] + xh[..., 1:n_rot:2], 2, axis=-1)
    else:
        pair = np.tile(xh[..., :half] + xh[..., half:n_rot], 2)
    bound = 3 * U * pair.reshape(6, n_head, n_rot)
    err = np.abs(got.astype(np.float64) - want).reshape(6, n_head, head_dim)
    assert np.all(err[..., :n_rot] <= bound)
    # dims past n_rot pass through bit for bit
    gh, xh32 = got.reshape(6, n_head, head_dim), x.reshape(6, n_head, head_dim)
    assert gh[..., n_rot:].tobytes() == xh32[..., n_rot:].tobytes()


def test_rope_modes_pair_different_dims() -> None:
    cos, sin = rope_tables(4, 4, 10000.0)
    x = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=F32)
    p = np.array([1], dtype=np.int32)
    normal = ops.rope(x, p, cos, sin, n_head=1, head_dim=4, n_rot=4, mode="normal")
    neox = ops.rope(x, p, cos, sin, n_head=1, head_dim=4, n_rot=4, mode="neox")
    c, s = cos[1], sin[1]
    assert normal[0, 0] == F32(F32(1 * c[0]) - F32(2 * s[0]))  # pair (0, 1), column 0
    assert normal[0, 3] == F32(F32(3 * s[1]) + F32(4 * c[1]))  # pair (2, 3), column 1
    assert neox[0, 0] == F32(F32(1 * c[0]) - F32(3 * s[0]))  # pair (0, 2), column 0
    assert neox[0, 3] == F32(F32(2 * s[1]) + F32(4 * c[1]))  # pair (1, 3), column 1


def test_rope_position_zero_is_identity_and_batch_invariant() -> None:
    cos, sin = rope_tables(300, 64, 10000.0)
    x = rng(10).standard_normal((5, 14 * 64)).astype(F32)
    p = np.array([0, 3, 255, 256, 299], dtype=np.int32)
    kw = {"n_head": 14, "head_dim": 64, "n_rot": 64, "mode": "neox"}
    y = ops.rope(x, p, cos, sin, **kw)
    assert np.array_equal(y[0], x[0])
    for t in range(5):
        assert ops.rope(x[t : t + 1], p[t : t + 1], cos, sin, **kw).tobytes() == y[t].tobytes()


def test_rope_errors() -> None:
    cos, sin = rope_tables(16, 8, 10000.0)
    x = np.zeros((2, 16), F32)
    kw = {"n_head": 2, "head_dim": 8, "n_rot": 8, "mode": "normal"}
    with pytest.raises(
        ValueError, match=r"rope: position 16 is outside the rope tables' rows 0..15"
    ):
        ops.rope(x, np.array([0, 16], np.int32), cos, sin, **kw)
    with pytest.raises(ValueError, match="rope: position -1 is outside"):
        ops.rope(x, np.array([-1, 0], np.int32), cos, sin, **kw)
    with pytest.raises(ValueError, match=r"rope: positions must be int32\[2\]"):
        ops.rope(x, np.array([0, 1]), cos, sin, **kw)
    with pytest.raises(ValueError, match="rope: mode must be one of"):
        ops.rope(x, np.array([0, 1], np.int32), cos, sin, **{**kw, "mode": "glm"})
    with pytest.raises(ValueError, match="rope: x width 16 != n_head"):
        ops.rope(x, np.array([0, 1], np.int32), cos, sin, **{**kw, "n_head": 3})
    with pytest.raises(ValueError, match="rope: n_rot must be even"):
        ops.rope(x, np.array([0, 1], np.int32), cos, sin, **{**kw, "n_rot": 7})
    with pytest.raises(ValueError, match=r"rope: cos must be a float32 \(n_ctx, 4\) table"):
        ops.rope(x, np.array([0, 1], np.int32), cos[:, :2], sin, **kw)


def test_rope_tables() -> None:
    cos, sin = rope_tables(600, 64, 1_000_000.0)
    assert cos.shape == sin.shape == (600, 32) and cos.dtype == sin.dtype == F32
    assert np.all(cos[0] == 1.0) and np.all(sin[0] == 0.0)
    # float64 angle, rounded to float32 once: within half a float32 ulp of Python's math
    for p, i in [(1, 0), (599, 1), (300, 31), (257, 16)]:
        angle = p * (1_000_000.0 ** (-(2 * i) / 64))
        for table, fn in ((cos, math.cos), (sin, math.sin)):
            half_ulp = 0.5 * abs(float(np.spacing(table[p, i])))
            assert abs(float(table[p, i]) - fn(angle)) <= half_ulp * 1.01
    with pytest.raises(ValueError, match="rope_tables needs"):
        rope_tables(10, 7, 10000.0)


# --- argmax ------------------------------------------------------------------------------------


def test_argmax_first_index_on_ties_and_nan_wins() -> None:
    x = np.array(
        [
            [1.0, 3.0, 3.0, 2.0],
            [-0.0, 0.0, -1.0, -2.0],  # -0.0 == 0.0: the first wins
            [1.0, np.nan, 5.0, np.nan],  # the first NaN beats every number
            [-np.inf, -np.inf, -np.inf, -np.inf],
        ],
        dtype=F32,
    )
    got = ops.argmax(x)
    assert got.dtype == np.int32 and got.tolist() == [1, 0, 1, 0]
    big = rng(11).standard_normal((3, 49152)).astype(F32)
    assert ops.argmax(big).tolist() == [int(np.argmax(r)) for r in big]
    with pytest.raises(ValueError, match="argmax: rows must have at least one element"):
        ops.argmax(np.zeros((2, 0), F32))


# --- matmul (the product itself is parity.quant's, tested there) -------------------------------


@pytest.mark.parametrize("dtype", ["Q8_0", "F32"])
def test_matmul_adds_bias_with_add(dtype: str) -> None:
    shape = (24, 64)
    w = quant.prepare_weight(dtype, random_weight(dtype, shape, rng(12)), shape)
    x = rng(13).standard_normal((3, 64)).astype(F32)
    bias = rng(14).standard_normal(24).astype(F32)
    y = quant.matmul(x, w)
    assert ops.matmul(x, w).tobytes() == y.tobytes()
    assert ops.matmul(x, w, bias).tobytes() == ops.add(y, bias).tobytes()
    with pytest.raises(ValueError, match="add: b must be float32"):
        ops.matmul(x, w, bias[:5])


# --- exp's in-range fast path ------------------------------------------------------------------


def test_exp_in_range_path_matches_special_value_path_bitwise() -> None:
    # numerics.exp skips the clamp and the special-value selection when every x is inside
    # [EXP_LO, EXP_HI]; one out-of-range value sends the same array down the full path, which
    # tests/test_numerics.py checks against the step-by-step listing
    from parity.numerics import EXP_HI, EXP_LO, exp

    x = np.concatenate(
        [
            rng(5).uniform(-104.0, 88.72, 20000).astype(F32),
            -np.abs(rng(6).standard_normal(1000).astype(F32)) * 30,  # attention's s - m
            np.array([0.0, -0.0, 1e-45, -1e-45, EXP_HI, EXP_LO, -103.97], dtype=F32),
        ]
    )
    for extra in (np.inf, -np.inf, np.nan, 100.0, -200.0):
        full = exp(np.append(x, F32(extra)))[:-1]
        assert exp(x).tobytes() == full.tobytes()
    assert exp(x.reshape(-1, 7)).tobytes() == exp(x).tobytes()
