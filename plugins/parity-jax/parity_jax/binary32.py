"""The contract's binary32 arithmetic in jax, on a float64 carrier that XLA cannot bend.

Plain float32 jax is not the contract on XLA:CPU, which runs every computation with the x86
FTZ and DAZ bits set (subnormal operands read as zero, subnormal results become zero; no flag
or option turns this off), lets LLVM contract ``a * b + c`` into an FMA, and simplifies
``x + 0.0`` to ``x`` (so ``-0.0`` stays ``-0.0``). The carrier sidesteps all three:

- A value is a float64 array holding a binary32 value exactly. Every binary32 value, subnormals
  included, is a normal float64, and so is every exact sum, product, quotient or square root of
  two of them (magnitudes >= 2^-298), so FTZ and DAZ never meet a carrier value.
- Each fl() of the contract is the float64 operation, then ``rnd`` to the nearest binary32
  value. float64 carries 53 >= 2 * 24 + 2 bits, so rounding to float64 first and to binary32
  second gives the correctly rounded binary32 result of +, -, *, / and sqrt (double rounding
  is innocuous at that width). Results in the subnormal range are rounded on binary32's
  subnormal grid, as IEEE does, by float64 work that never forms a float32 subnormal.
- Products of binary32 values are exact in float64, and ``rnd`` stands between each product
  and the add that reads it, so an FMA that LLVM may form changes no bit.
- XLA turns ``a / b`` with a broadcast ``b`` into ``a * (1 / b)``; in float64 that is within
  2^-52 relative of the quotient, while a binary32 quotient of binary32 operands is at least
  2^-49 relative away from every rounding boundary it does not sit on, so ``rnd`` still gives
  the correctly rounded quotient.
- ``fl(x + 0.0)`` (the contract's padding adds) is written as a select, which no simplifier
  removes.

``widen`` and ``narrow`` move float32 arrays in and out through their bits. Integer values
(ids, positions) stay int32. Everything here must run inside ``float64_enabled()``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F64 = jnp.float64
F32 = jnp.float32
SMALLEST_NORMAL = 2.0**-126  # binary32's smallest normal; below it values lie on a 2^-149 grid
SUBNORMAL_STEP = 2.0**-149


def float64_enabled() -> AbstractContextManager[object]:
    """jax's x64 mode for the code inside (carriers are float64), leaving the global setting
    alone: ``jax.enable_x64``, or ``jax.experimental.enable_x64`` in older jax."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def widen(x: jax.Array) -> jax.Array:
    """float32 -> carrier, exactly; subnormal operands are rebuilt from their bits (a float32
    conversion would read them as zero under DAZ)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    tiny = (bits & 0x7FFFFFFF) < 0x00800000  # zero or subnormal
    mag = (bits & 0x007FFFFF).astype(F64) * SUBNORMAL_STEP
    return jnp.where(tiny, jnp.where(bits < 0, -mag, mag), x.astype(F64))


def narrow(v: jax.Array) -> jax.Array:
    """carrier -> float32 (the values are binary32 already); subnormals are written as bits."""
    tiny = jnp.abs(v) < SMALLEST_NORMAL
    steps = (jnp.abs(v) * (1 / SUBNORMAL_STEP)).astype(jnp.int32)  # exact: on the grid
    bits = jnp.where(jnp.signbit(v), steps | jnp.int32(-(2**31)), steps)
    return jnp.where(tiny, lax.bitcast_convert_type(bits, F32), v.astype(F32))


def rnd(v: jax.Array) -> jax.Array:
    """The binary32 value nearest to float64 ``v`` (ties to even), overflow to +-inf,
    subnormal results on the 2^-149 grid; still as a carrier."""
    subnormal = jnp.rint(v * (1 / SUBNORMAL_STEP)) * SUBNORMAL_STEP
    normal = lax.reduce_precision(v, exponent_bits=8, mantissa_bits=23)  # flushes subnormals
    return jnp.where(jnp.abs(v) < SMALLEST_NORMAL, subnormal, normal)


def add(a: jax.Array, b: jax.Array | float) -> jax.Array:
    return rnd(a + b)


def sub(a: jax.Array, b: jax.Array | float) -> jax.Array:
    return rnd(a - b)


def mul(a: jax.Array, b: jax.Array | float) -> jax.Array:
    return rnd(a * b)


def div(a: jax.Array | float, b: jax.Array) -> jax.Array:
    return rnd(a / b)


def sqrt(a: jax.Array) -> jax.Array:
    return rnd(jnp.sqrt(a))


def plus_zero(x: jax.Array) -> jax.Array:
    """fl(x + (+0.0)): -0.0 becomes +0.0, everything else (NaN included) is unchanged."""
    return jnp.where(x == 0, 0.0, x)


def tree_sum(a: jax.Array, axis: int = 0) -> jax.Array:
    """The contract's TREE along ``axis``: pad with +0.0 to a power of two, add adjacent pairs
    level by level. An odd level's last value meets its padded partner as fl(x + 0.0), which is
    the padded tree without forming the padding."""
    a = jnp.moveaxis(a, axis, 0)
    if a.shape[0] == 0:
        return jnp.zeros(a.shape[1:], F64)
    while a.shape[0] > 1:
        half, odd = divmod(a.shape[0], 2)
        pairs = a[: 2 * half].reshape(half, 2, *a.shape[1:])
        level = add(pairs[:, 0], pairs[:, 1])
        if odd:
            level = jnp.concatenate([level, plus_zero(a[-1:])])
        a = level
    return a[0]


# --- exp: docs/numerics.md "exp", the constants of parity.numerics, one fl() per line ----------


def _f32(hex_value: str) -> float:
    return float(np.float32(float.fromhex(hex_value)))


LOG2E = _f32("0x1.715476p+0")
LN2_HI = _f32("0x1.62e400p-1")
LN2_LO = _f32("0x1.7f7d1cp-20")
EXP_HI = _f32("0x1.62e42ep+6")
EXP_LO = _f32("-0x1.a00000p+6")
EXP_POLY = tuple(
    _f32(h)
    for h in (
        "0x1.a01a02p-13",
        "0x1.6c16c2p-10",
        "0x1.111112p-7",
        "0x1.555556p-5",
        "0x1.555556p-3",
        "0x1.000000p-1",
        "0x1.000000p+0",
        "0x1.000000p+0",
    )
)


def pow2(k: jax.Array) -> jax.Array:
    """2**k for int32 k in [-75, 64], exact, built from float64 exponent bits."""
    return lax.bitcast_convert_type((k.astype(jnp.int64) + 1023) << 52, F64)


def exp(x: jax.Array) -> jax.Array:
    """The project's exp (parity.numerics.exp), elementwise on a carrier."""
    nan = jnp.isnan(x)
    xc = jnp.where(nan, 0.0, jnp.minimum(jnp.maximum(x, EXP_LO), EXP_HI))
    kf = jnp.rint(mul(xc, LOG2E))  # round half to even; kf in [-150, 128]
    r = sub(xc, mul(kf, LN2_HI))
    r = sub(r, mul(kf, LN2_LO))
    p = mul(r, EXP_POLY[0])
    p = add(p, EXP_POLY[1])
    for c in EXP_POLY[2:]:
        p = add(mul(p, r), c)
    k = kf.astype(jnp.int32)
    k1 = k >> 1  # floor(k / 2)
    y = mul(mul(p, pow2(k1)), pow2(k - k1))
    y = jnp.where(x > EXP_HI, jnp.inf, y)
    y = jnp.where(x < EXP_LO, 0.0, y)
    return jnp.where(nan, x, y)
