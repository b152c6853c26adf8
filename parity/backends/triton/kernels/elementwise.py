"""Elementwise ops in ``exact`` numerics (docs/numerics.md): every float operation below is one
correctly rounded binary32 operation in the order written. Launched with
``enable_fp_fusion=False`` (no ``a * b + c`` contracted to an FMA); divisions are
``tl.math.div_rn``. Only ``*``, ``+``, ``-``, ``div_rn``, comparisons, selects and integer bit
work are used, which keep subnormals on the GPU and in Triton's interpreter alike; no libdevice
call (some flush subnormals), so rounding to an integer is the 1.5 * 2^23 trick, which rounds
half to even as ``rintf`` does for the |t| <= 151 that reach it.

One program handles ``BLOCK`` consecutive elements of a flat, contiguous array.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from parity.backends.triton.kernels.pdl import after_previous

BLOCK = 1024


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


LOG2E = tl.constexpr(_f32(0x3FB8AA3B))  # 0x1.715476p+0
LN2_HI = tl.constexpr(_f32(0x3F317200))  # 0x1.62e400p-1
LN2_LO = tl.constexpr(_f32(0x35BFBE8E))  # 0x1.7f7d1cp-20
EXP_HI = tl.constexpr(_f32(0x42B17217))  # 0x1.62e42ep+6
EXP_LO = tl.constexpr(-104.0)
ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23: fl(fl(t + R) - R) = rint(t) for |t| < 2^22
C7 = tl.constexpr(_f32(0x39500D01))  # 0x1.a01a02p-13
C6 = tl.constexpr(_f32(0x3AB60B61))  # 0x1.6c16c2p-10
C5 = tl.constexpr(_f32(0x3C088889))  # 0x1.111112p-7
C4 = tl.constexpr(_f32(0x3D2AAAAB))  # 0x1.555556p-5
C3 = tl.constexpr(_f32(0x3E2AAAAB))  # 0x1.555556p-3
GELU_A = tl.constexpr(_f32(0x3D372713))  # 0.044715
GELU_S = tl.constexpr(_f32(0x3F4C422A))  # sqrt(2 / pi)


@triton.jit
def p_exp(x):
    """The project's exp, line for line (docs/numerics.md, "exp")."""
    nan = x != x
    xc = tl.where(nan, 0.0, tl.minimum(tl.maximum(x, EXP_LO), EXP_HI))
    t = xc * LOG2E
    kf = (t + ROUNDER) - ROUNDER
    a = kf * LN2_HI
    r = xc - a
    b = kf * LN2_LO
    r = r - b
    p = C7 * r + C6
    p = p * r + C5
    p = p * r + C4
    p = p * r + C3
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    k = kf.to(tl.int32)
    k1 = k >> 1  # arithmetic: floor(k / 2)
    k2 = k - k1
    s1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((k2 + 127) << 23).to(tl.float32, bitcast=True)
    y = (p * s1) * s2
    y = tl.where(x < EXP_LO, 0.0, y)
    y = tl.where(x > EXP_HI, float("inf"), y)
    return tl.where(nan, x, y)


@triton.jit
def p_silu(x):
    e = p_exp(-x)
    return tl.math.div_rn(x, 1.0 + e)


@triton.jit
def p_gelu(x):
    """GELU's tanh form as the two-sided logistic it equals (docs/numerics.md, "GELU")."""
    c = GELU_A * (x * x) + 1.0
    u = GELU_S * (x * c)
    v = u * -2.0
    right = v > 0.0  # x < 0: the exp of -v, at most 1 (NaN: the left side)
    e = p_exp(tl.where(right, -v, v))
    num = tl.where(right, x * e, x)
    return tl.math.div_rn(num, e + 1.0)


@triton.jit
def binary_f32(out, a, b, n, width, OP: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
               PDL: tl.constexpr):  # fmt: skip
    """out = fl(a OP b); with ROW, b is a (width,) row vector over every row of a."""
    after_previous(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(a + i, mask=m)
    y = tl.load(b + (i % width if ROW else i), mask=m)
    r = x + y if OP == 0 else x * y
    tl.store(out + i, r, mask=m)


@triton.jit
def unary_f32(out, x, n, OP: tl.constexpr, BLOCK: tl.constexpr,
              PDL: tl.constexpr):  # fmt: skip
    """out = silu(x) (OP 0) or gelu(x) (OP 1)."""
    after_previous(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x + i, mask=m)
    r = p_silu(v) if OP == 0 else p_gelu(v)
    tl.store(out + i, r, mask=m)


@triton.jit
def glu_f32(out, gate, up, n, OP: tl.constexpr, BLOCK: tl.constexpr,
            PDL: tl.constexpr):  # fmt: skip
    """out = fl(silu(gate) * up) (OP 0, SWIGLU) or fl(gelu(gate) * up) (OP 1, GEGLU)."""
    after_previous(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(gate + i, mask=m)
    u = tl.load(up + i, mask=m)
    a = p_silu(g) if OP == 0 else p_gelu(g)
    tl.store(out + i, a * u, mask=m)


@triton.jit
def scale_f32(out, x, n, c, BLOCK: tl.constexpr,
              PDL: tl.constexpr):  # fmt: skip
    """out = fl(x * c), c a float32 constant."""
    after_previous(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, tl.load(x + i, mask=m) * c, mask=m)
