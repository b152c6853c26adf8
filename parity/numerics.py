"""The contract's arithmetic primitives, shared by every oracle op (docs/numerics.md).

Only correctly rounded float32 add, sub, mul, div and sqrt appear here, in an order fixed by
the data's shape. numpy never contracts ``a * b + c`` into an FMA, so writing the operations
one per line is writing the contract.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def tree_sum(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """Sum float32 values along ``axis`` by the contract's fixed tree.

    The n values are padded with +0.0 to the next power of two, then adjacent pairs are added
    level by level: ``(a0 + a1) + (a2 + a3)``, ... This is the order a GPU gets from a warp
    butterfly with offsets 1, 2, 4, ...; it depends on n only, never on the hardware.
    """
    a = np.moveaxis(np.asarray(a, dtype=F32), axis, -1)
    n = a.shape[-1]
    if n == 0:
        return np.zeros(a.shape[:-1], dtype=F32)
    width = next_pow2(n)
    if width != n:
        padded = np.zeros((*a.shape[:-1], width), dtype=F32)
        padded[..., :n] = a
        a = padded
    while a.shape[-1] > 1:
        a = a[..., 0::2] + a[..., 1::2]
    return a[..., 0]


# --- exp: the contract's float32 exponential, from add/sub/mul and exact bit work only -------

LOG2E = F32(float.fromhex("0x1.715476p+0"))  # 1/ln 2 rounded to f32
# ln 2 = LN2_HI + LN2_LO; LN2_HI has 15 significant bits, so k * LN2_HI is exact for |k| < 2^9
LN2_HI = F32(float.fromhex("0x1.62e400p-1"))
LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
# Taylor coefficients 1/n!, n = 7 down to 0, rounded to f32; Horner order is this order
EXP_POLY = tuple(
    F32(float.fromhex(h))
    for h in (
        "0x1.a01a02p-13",  # 1/5040
        "0x1.6c16c2p-10",  # 1/720
        "0x1.111112p-7",  # 1/120
        "0x1.555556p-5",  # 1/24
        "0x1.555556p-3",  # 1/6
        "0x1.000000p-1",  # 1/2
        "0x1.000000p+0",  # 1
        "0x1.000000p+0",  # 1
    )
)
# the largest f32 whose exp rounds to a finite f32; anything above gives +inf
EXP_HI = F32(float.fromhex("0x1.62e42ep+6"))  # 88.72283172607422
# below this exp rounds to +0 (exp(-104) < 2^-150, half the smallest subnormal)
EXP_LO = F32(float.fromhex("-0x1.a00000p+6"))  # -104.0


def pow2(n: np.ndarray) -> np.ndarray:
    """2**n as float32, built from the exponent bits; n must be int32 in [-126, 127]."""
    return ((np.asarray(n, dtype=np.int32) + 127) << 23).astype(np.uint32).view(F32)


def exp(x: np.ndarray) -> np.ndarray:
    """The contract's float32 exp, elementwise, any shape (docs/numerics.md, "exp").

    exp(-inf) = +0, exp(+inf) = +inf, NaN -> the same NaN, x > EXP_HI -> +inf,
    x < EXP_LO -> +0; subnormal results are rounded once, correctly, from the polynomial.

    Every line below is the listing's fl() in its order; the in-place forms (``r -= ...``)
    only reuse buffers. When every x is inside [EXP_LO, EXP_HI] (the common case; a NaN fails
    both comparisons) the clamp and the special-value selection are the identity and are
    skipped.
    """
    x = np.asarray(x, dtype=F32)
    if x.ndim == 0:
        return exp(x.reshape(1)).reshape(())
    plain = x.size == 0 or bool(x.min() >= EXP_LO and x.max() <= EXP_HI)
    # compute on x clamped to [EXP_LO, EXP_HI] (0 for NaN); special results are selected at the end
    xc = x if plain else np.where(np.isnan(x), F32(0), np.minimum(np.maximum(x, EXP_LO), EXP_HI))
    kf = np.rint(xc * LOG2E)  # round half to even; kf in [-150, 128]
    r = xc - kf * LN2_HI
    r -= kf * LN2_LO  # |r| <= ~0.3466
    p = r * EXP_POLY[0]  # Horner from C7: p = fl(C7 * r), then fl(p + C6), fl(p * r), ...
    p += EXP_POLY[1]
    for c in EXP_POLY[2:]:
        p *= r
        p += c
    # scale by 2^k in two exact power-of-two steps: the first is always exact (normal result),
    # the second rounds once, and only when the result is subnormal
    k1 = kf.astype(np.int32)
    k2 = k1.copy()
    k1 >>= 1  # floor(k / 2), in [-75, 64]
    k2 -= k1  # k - k1, in [-75, 64]
    p *= _pow2_inplace(k1)
    p *= _pow2_inplace(k2)
    if plain:
        return p
    y = np.where(x > EXP_HI, F32(np.inf), p)
    y = np.where(x < EXP_LO, F32(0), y)
    return np.where(np.isnan(x), x, y)


def _pow2_inplace(n: np.ndarray) -> np.ndarray:
    """``pow2(n)`` for an int32 array n in [-126, 127], reusing n's buffer (n is consumed).

    The biased exponent n + 127 is in [1, 254], so ``(n + 127) << 23`` is a positive int32 and
    its bits are those of the float32 2**n.
    """
    n += 127
    n <<= 23
    return n.view(F32)


def tree_sum_leading(a: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """``tree_sum(a, axis=0)`` bit for bit, without the padded copy: the fast form the matmul
    and attention kernels use.

    An odd level's last value is added to +0.0 (its padded partner), so -0.0 becomes +0.0
    exactly as in the padded tree. Levels ping-pong between two buffers: ``scratch`` (flat,
    >= half of ``a``'s size) and ``a`` itself (then contiguous, and clobbered), or, without
    ``scratch``, two buffers allocated once per call.
    """
    n, rest = a.shape[0], a.shape[1:]
    if n == 0:
        return np.zeros(rest, dtype=F32)
    if scratch is not None:
        targets = (scratch, a.reshape(-1))
    else:
        size = math.prod(rest)
        targets = (np.empty((n + 1) // 2 * size, F32), np.empty((n + 3) // 4 * size, F32))
    level = 0
    while a.shape[0] > 1:
        half, odd = divmod(a.shape[0], 2)
        shape = (half + odd, *rest)
        out = targets[level % 2][: math.prod(shape)].reshape(shape)
        np.add(a[0 : 2 * half : 2], a[1 : 2 * half : 2], out=out[:half])
        if odd:
            np.add(a[-1], F32(0), out=out[half])
        a = out
        level += 1
    return a[0]


# --- tanh and GELU (tanh form) ------------------------------------------------------------------

# tanh's odd Taylor coefficients from u^11 down to u^3, float32 of the float64 values:
# -1382/155925, 62/2835, -17/315, 2/15, -1/3
TANH_POLY = tuple(F32(c) for c in (-1382 / 155925, 62 / 2835, -17 / 315, 2 / 15, -1 / 3))
TANH_SMALL = F32(0.25)  # below, the polynomial; at and above, the exp form
GELU_A = F32(0.044715)  # GELU's cubic coefficient (float32 of 0.044715)
GELU_S = F32(math.sqrt(2 / math.pi))  # sqrt(2 / pi), float64 rounded once: 0x1.988454p-1


def tanh(x: np.ndarray) -> np.ndarray:
    """The contract's float32 tanh, elementwise (docs/numerics.md, "tanh"): odd, from u = |x|:

    u < 0.25:  p = fl(u * u), q = Horner(TANH_POLY, p), t = fl(u + fl(fl(u * p) * q))
    u >= 0.25: e = exp(fl(u * -2)), t = fl(fl(1 - e) / fl(1 + e))

    and the result is t with x's sign. tanh(+-0) = +-0, tanh(+-inf) = +-1, NaN stays NaN.
    """
    x = np.asarray(x, dtype=F32)
    u = np.abs(x)
    with np.errstate(over="ignore", invalid="ignore"):
        e = exp(u * F32(-2))
        big = (F32(1) - e) / (F32(1) + e)
        p = u * u
        q = TANH_POLY[0] * p
        q += TANH_POLY[1]
        for c in TANH_POLY[2:]:
            q *= p
            q += c
        small = u + (u * p) * q
    return np.copysign(np.where(u < TANH_SMALL, small, big), x)


def gelu(x: np.ndarray) -> np.ndarray:
    """The contract's GELU, tanh form (docs/numerics.md, "GELU, GEGLU"), written as the logistic
    it equals, x * 0.5 * (1 + tanh(u)) = x / (1 + exp(-2u)), in its two-sided form so that
    nothing cancels (tanh(u) near -1) and nothing overflows (exp(-2u) for u < -44):

    u = fl(S * fl(x * fl(1 + fl(A * fl(x * x))))), v = fl(u * -2)
    v <= 0 or NaN: gelu = fl(x / fl(1 + exp(v)))
    v > 0:         e = exp(fl(-v)), gelu = fl(fl(x * e) / fl(1 + e))

    gelu(-inf) is NaN (-inf * 0), as silu(-inf) is; gelu(+inf) = +inf; gelu(-0) = -0.
    """
    x = np.asarray(x, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        c = GELU_A * (x * x)
        c += F32(1)
        u = GELU_S * (x * c)
        v = u * F32(-2)
        right = v > 0  # x < 0: the exp of -v, at most 1
        e = exp(np.where(right, -v, v))
        num = np.where(right, x * e, x)
        e += F32(1)
        return num / e
