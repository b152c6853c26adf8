"""Exact integer sums of GGUF blocks against int8 activations, written as LLVM vector code.

MATMUL's ``isum_s = sum_j qw[s, j] * q[s * L + j]`` (docs/numerics.md) is the only place where
the oracle's order of operations does not matter: every product and partial sum is an integer,
|isum| <= 32 * 128 * 127 < 2^31, so int32 arithmetic is exact in any order. numba disables
LLVM's SLP vectorizer and fully unrolls fixed 16/32-element loops, so plain numba code would
do these one element at a time; the intrinsics here emit the vector IR directly, and only
integer operations: loads, and/or/shift (unpacking quants exactly as ``parity.quant.blocks``
does), sign/zero extension, multiply, add.

``isums<g>_<type>(blocks, blocks_at, x, x_at, out, out_at, stride)`` reads g whole blocks at
byte ``blocks_at`` of the uint8 array ``blocks`` and their activations at byte ``x_at`` of the
int8 array ``x`` (the blocks' elements in order), and stores the isums of their sub-blocks
(int32, in order) ``stride`` bytes apart from byte ``out_at`` of ``out``. The partial sums of
all those sub-blocks are reduced together, by one transpose.
Operands are arrays with byte offsets (the arrays, not raw addresses, so that numba keeps them
alive for the call); the caller keeps every access in bounds.

``tree<w>(addr)`` is the contract's TREE of w = 2^j float32 values (no padding): j levels of
adjacent-pair float adds, each level one vector add of the even and the odd lanes, so the same
IEEE additions in the same pairs as ``parity.numerics.tree_sum``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from parity.core.dtypes import DType

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()

# a block's sub-blocks: (weights <L x i8>, signed, element offset of the sub-block in the block)
SubBlock = tuple[ir.Value, bool, int]


def _address(
    context: Any, builder: ir.IRBuilder, sig: Any, args: list, array: int, offset: int
) -> ir.Value:
    """The address of ``args[array]``'s data plus the byte offset ``args[offset]``, as i64."""
    data = context.make_array(sig.args[array])(context, builder, args[array]).data
    off = context.cast(builder, args[offset], sig.args[offset], types.int64)
    return builder.add(builder.ptrtoint(data, I64), off)


def _arrays_and_ints(arrays: tuple, ints: tuple) -> bool:
    """Typing check of an intrinsic's arguments."""
    return all(isinstance(a, types.Array) for a in arrays) and all(
        isinstance(i, types.Integer) for i in ints
    )


def _vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def _splat(elem: ir.IntType, value: int, n: int) -> ir.Constant:
    return ir.Constant(_vec(elem, n), [value] * n)


def _load(b: ir.IRBuilder, addr: ir.Value, offset: int, n: int) -> ir.Value:
    """n bytes at ``addr + offset`` as <n x i8> (no alignment assumed)."""
    ptr = b.inttoptr(b.add(addr, ir.Constant(I64, offset)), _vec(I8, n).as_pointer())
    return b.load(ptr, align=1)


def _shuffle(b: ir.IRBuilder, x: ir.Value, y: ir.Value, lanes: list[int]) -> ir.Value:
    return b.shuffle_vector(x, y, ir.Constant(_vec(I32, len(lanes)), lanes))


def _nibbles(b: ir.IRBuilder, qs: ir.Value) -> ir.Value:
    """<16 x i8> packed bytes -> <32 x i8>: low nibbles are elements 0..15, high 16..31."""
    lo = b.and_(qs, _splat(I8, 0x0F, 16))
    hi = b.lshr(qs, _splat(I8, 4, 16))
    return _shuffle(b, lo, hi, list(range(32)))


# --- the sub-block form of one block (docs/numerics.md, "Weights"), as integer vectors -------


def _q4_0(b: ir.IRBuilder, blk: ir.Value) -> list[SubBlock]:
    """18 bytes: d, qs[16]. qw = nibble - 8."""
    return [(b.sub(_nibbles(b, _load(b, blk, 2, 16)), _splat(I8, 8, 32)), True, 0)]


def _q4_1(b: ir.IRBuilder, blk: ir.Value) -> list[SubBlock]:
    """20 bytes: d, m, qs[16]. qw = nibble (0..15)."""
    return [(_nibbles(b, _load(b, blk, 4, 16)), False, 0)]


def _q5_0(b: ir.IRBuilder, blk: ir.Value) -> list[SubBlock]:
    """22 bytes: d, qh (uint32 LE), qs[16]. qw = (nibble | bit j of qh << 4) - 16."""
    qh_ptr = b.inttoptr(b.add(blk, ir.Constant(I64, 2)), I32.as_pointer())
    qh = b.load(qh_ptr, align=1)
    splat = b.shuffle_vector(
        b.insert_element(ir.Constant(_vec(I32, 1), ir.Undefined), qh, ir.Constant(I32, 0)),
        ir.Constant(_vec(I32, 1), ir.Undefined),
        ir.Constant(_vec(I32, 32), [0] * 32),
    )
    bits = b.and_(b.lshr(splat, ir.Constant(_vec(I32, 32), list(range(32)))), _splat(I32, 1, 32))
    high = b.shl(b.trunc(bits, _vec(I8, 32)), _splat(I8, 4, 32))
    qw = b.sub(b.or_(_nibbles(b, _load(b, blk, 6, 16)), high), _splat(I8, 16, 32))
    return [(qw, True, 0)]


def _q8_0(b: ir.IRBuilder, blk: ir.Value) -> list[SubBlock]:
    """34 bytes: d, qs int8[32]. qw = qs."""
    return [(_load(b, blk, 2, 32), True, 0)]


def _q4_k(b: ir.IRBuilder, blk: ir.Value) -> list[SubBlock]:
    """144 bytes: d, dmin, scales[12], qs[128]. Sub-block 2c is the low nibbles of qs[32c:32c+32],
    sub-block 2c + 1 their high nibbles; qw = nibble (0..15)."""
    subs = []
    for c in range(4):
        qs = _load(b, blk, 16 + 32 * c, 32)
        subs.append((b.and_(qs, _splat(I8, 0x0F, 32)), False, 64 * c))
        subs.append((b.lshr(qs, _splat(I8, 4, 32)), False, 64 * c + 32))
    return subs


def _q6_k(b: ir.IRBuilder, blk: ir.Value) -> list[SubBlock]:
    """210 bytes: ql[128], qh[64], scales[16], d. Element 128h + 32c + i has
    low = (ql[64h + 32(c % 2) + i] >> 4(c // 2)) & 15, high = (qh[32h + i] >> 2c) & 3,
    qw = (low | high << 4) - 32; sub-blocks of 16 elements."""
    subs = []
    for h in range(2):
        for c in range(4):
            for i0 in (0, 16):
                ql = _load(b, blk, 64 * h + 32 * (c % 2) + i0, 16)
                qh = _load(b, blk, 128 + 32 * h + i0, 16)
                low = b.and_(b.lshr(ql, _splat(I8, 4 * (c // 2), 16)), _splat(I8, 0x0F, 16))
                high = b.and_(b.lshr(qh, _splat(I8, 2 * c, 16)), _splat(I8, 3, 16))
                qw = b.sub(b.or_(low, b.shl(high, _splat(I8, 4, 16))), _splat(I8, 32, 16))
                subs.append((qw, True, 128 * h + 32 * c + i0))
    return subs


DECODERS: dict[DType, Callable[[ir.IRBuilder, ir.Value], list[SubBlock]]] = {
    DType.Q4_0: _q4_0,
    DType.Q4_1: _q4_1,
    DType.Q5_0: _q5_0,
    DType.Q8_0: _q8_0,
    DType.Q4_K: _q4_k,
    DType.Q6_K: _q6_k,
}


# --- exact integer sums ------------------------------------------------------------------------


def _partials(b: ir.IRBuilder, qw: ir.Value, signed: bool, x: ir.Value) -> ir.Value:
    """<L x i8> quants and activations -> <L/2 x i32>: their products, added in adjacent pairs
    (the shape of one x86 ``pmaddwd``)."""
    n = qw.type.count
    wide = _vec(I32, n)
    prod = b.mul((b.sext if signed else b.zext)(qw, wide), b.sext(x, wide))
    return b.add(
        _shuffle(b, prod, prod, list(range(0, n, 2))),
        _shuffle(b, prod, prod, list(range(1, n, 2))),
    )


def _sum_lanes(b: ir.IRBuilder, parts: list[ir.Value], seg: int) -> ir.Value:
    """Vectors whose runs of ``seg`` int32 lanes each belong to one sum -> a vector of all the
    sums, in order.

    Pairs of vectors are folded together (each keeps half of every run, the pair's halves
    added) until one vector is left, then it is folded on itself: a transpose that reduces
    many vectors with few shuffles. Integer adds, so the pairing is exact."""
    while len(parts) > 1:
        lanes = parts[0].type.count
        first, second = [], []
        for start in range(0, 2 * lanes, seg):
            first += range(start, start + seg // 2)
            second += range(start + seg // 2, start + seg)
        parts = [
            b.add(_shuffle(b, x, y, first), _shuffle(b, x, y, second))
            for x, y in zip(parts[0::2], parts[1::2], strict=True)
        ]
        seg //= 2
    v = parts[0]
    while seg > 1:
        lanes = v.type.count
        first = [i for s in range(0, lanes, seg) for i in range(s, s + seg // 2)]
        second = [i for s in range(0, lanes, seg) for i in range(s + seg // 2, s + seg)]
        v = b.add(_shuffle(b, v, v, first), _shuffle(b, v, v, second))
        seg //= 2
    return v


def _isums(dtype: DType, n_blocks: int) -> Callable:
    """An intrinsic: isums of ``n_blocks`` consecutive blocks of ``dtype`` (see module doc)."""
    decode, block_bytes, block_elems = DECODERS[dtype], dtype.block_bytes, dtype.block_size

    @intrinsic
    def isums(
        typingctx: Any,
        blocks: types.Type,
        blocks_at: types.Type,
        x: types.Type,
        x_at: types.Type,
        out: types.Type,
        out_at: types.Type,
        stride: types.Type,
    ):
        if not _arrays_and_ints((blocks, x, out), (blocks_at, x_at, out_at, stride)):
            return None
        sig = types.void(blocks, blocks_at, x, x_at, out, out_at, stride)

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
            blocks = _address(context, builder, signature, args, 0, 1)
            x = _address(context, builder, signature, args, 2, 3)
            out = _address(context, builder, signature, args, 4, 5)
            stride = context.cast(builder, args[6], signature.args[6], types.int64)
            parts = []
            for g in range(n_blocks):
                blk = builder.add(blocks, ir.Constant(I64, g * block_bytes))
                for qw, signed, at in decode(builder, blk):
                    xv = _load(builder, x, g * block_elems + at, qw.type.count)
                    parts.append(_partials(builder, qw, signed, xv))
            seg = parts[0].type.count  # L / 2 lanes per sub-block: 16, or 8 for Q6_K
            n_sums = len(parts)
            if seg == 8:  # two sub-blocks per 16-lane vector
                parts = [
                    _shuffle(builder, u, v, list(range(16)))
                    for u, v in zip(*[iter(parts)] * 2, strict=True)
                ]
            total = _sum_lanes(builder, parts, seg)
            for i in range(n_sums):  # sum i at out + i * stride
                at = builder.add(out, builder.mul(stride, ir.Constant(I64, i)))
                value = builder.extract_element(total, ir.Constant(I32, i))
                builder.store(value, builder.inttoptr(at, I32.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return isums


# a row's isums: runs of 4 blocks (one block per call for the K-quants, whose blocks hold 8
# or 16 sub-blocks), then single blocks for the rest
isums4_q4_0, isums1_q4_0 = _isums(DType.Q4_0, 4), _isums(DType.Q4_0, 1)
isums4_q4_1, isums1_q4_1 = _isums(DType.Q4_1, 4), _isums(DType.Q4_1, 1)
isums4_q5_0, isums1_q5_0 = _isums(DType.Q5_0, 4), _isums(DType.Q5_0, 1)
isums4_q8_0, isums1_q8_0 = _isums(DType.Q8_0, 4), _isums(DType.Q8_0, 1)
isums1_q4_k = _isums(DType.Q4_K, 1)
isums1_q6_k = _isums(DType.Q6_K, 1)


# --- the fixed reduction tree -----------------------------------------------------------------


def _tree(width: int) -> Callable:
    """An intrinsic ``f(buf, at)``: TREE of the ``width`` float32 values at byte ``at`` of ``buf``
    (width a power of 2)."""

    @intrinsic
    def tree(typingctx: Any, buf: types.Type, at: types.Type):
        if not _arrays_and_ints((buf,), (at,)):
            return None

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> ir.Value:
            addr = _address(context, builder, signature, args, 0, 1)
            v = builder.load(builder.inttoptr(addr, _vec(F32, width).as_pointer()), align=4)
            n = width
            while n > 1:  # level: s'[i] = fl(s[2i] + s[2i+1])
                even = _shuffle(builder, v, v, list(range(0, n, 2)))
                odd = _shuffle(builder, v, v, list(range(1, n, 2)))
                v = builder.fadd(even, odd)
                n //= 2
            return builder.extract_element(v, ir.Constant(I32, 0))

        return types.float32(buf, at), codegen

    return tree


tree2, tree4, tree8, tree16, tree32 = (_tree(w) for w in (2, 4, 8, 16, 32))


# --- 16 lanes of float work side by side (MATMUL's terms and tree, docs/numerics.md) ----------
#
# Loops of 16 would be unrolled to scalar code (see above); these emit <16 x float> IR: plain
# IEEE fmul / fadd / fsub lane by lane, no fast-math flags, so each lane is the scalar
# computation written in the docstring.

LANES = 16
F32V = ir.VectorType(F32, LANES)


def _lanes(b: ir.IRBuilder, addr: ir.Value, elem: ir.Type = F32) -> ir.Value:
    """LANES values of type ``elem`` at an address."""
    return b.load(b.inttoptr(addr, ir.VectorType(elem, LANES).as_pointer()), align=4)


def _splat_value(b: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """A scalar in all LANES lanes."""
    undef = ir.Constant(ir.VectorType(value.type, 1), ir.Undefined)
    one = b.insert_element(undef, value, ir.Constant(I32, 0))
    return b.shuffle_vector(one, undef, ir.Constant(_vec(I32, LANES), [0] * LANES))


def _terms(min_sign: int) -> Callable:
    """An intrinsic ``f(terms, at, isum, a, m, d, s, d_at)``: the MATMUL terms of 16 tokens,
    written at byte ``at`` of ``terms`` (float32). Lane i: fl(fl(a * d_i) * (float) isum_i),
    then fl(t + fl(m * s_i)) (min_sign 1) or fl(t - fl(m * s_i)) (min_sign -1); ``isum``
    (int32) is read at byte ``at``, ``d`` and ``s`` (float32) at byte ``d_at``; ``a``, ``m``
    (float32) are one sub-block's scale and min."""

    @intrinsic
    def terms(
        typingctx: Any,
        out: types.Type,
        at: types.Type,
        isum: types.Type,
        a: types.Type,
        m: types.Type,
        d: types.Type,
        s: types.Type,
        d_at: types.Type,
    ):
        if not _arrays_and_ints((out, isum, d, s), (at, d_at)) or (a, m) != (types.float32,) * 2:
            return None

        def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
            def lanes(i: int, at: int) -> ir.Value:
                return _address(context, builder, signature, args, i, at)

            a, m = _splat_value(builder, args[3]), _splat_value(builder, args[4])
            d, s = _lanes(builder, lanes(5, 7)), _lanes(builder, lanes(6, 7))
            term = builder.fmul(
                builder.fmul(a, d), builder.sitofp(_lanes(builder, lanes(2, 1), I32), F32V)
            )
            if min_sign > 0:
                term = builder.fadd(term, builder.fmul(m, s))
            elif min_sign < 0:
                term = builder.fsub(term, builder.fmul(m, s))
            builder.store(term, builder.inttoptr(lanes(0, 1), F32V.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(out, at, isum, a, m, d, s, d_at), codegen

    return terms


terms, terms_plus_m, terms_minus_m = (_terms(k) for k in (0, 1, -1))


@intrinsic
def add_lanes(
    typingctx: Any,
    dst: types.Type,
    at: types.Type,
    src: types.Type,
    x_at: types.Type,
    y_at: types.Type,
):
    """16 float32 at byte ``at`` of ``dst`` = fl(x_i + y_i), x and y the 16 float32 at bytes
    ``x_at`` and ``y_at`` of ``src``."""
    if not _arrays_and_ints((dst, src), (at, x_at, y_at)):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
        out = _address(context, builder, signature, args, 0, 1)
        x = _lanes(builder, _address(context, builder, signature, args, 2, 3))
        y = _lanes(builder, _address(context, builder, signature, args, 2, 4))
        builder.store(builder.fadd(x, y), builder.inttoptr(out, F32V.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(dst, at, src, x_at, y_at), codegen


@intrinsic
def load_u16(typingctx: Any, buf: types.Type, at: types.Type):
    """The little-endian uint16 at byte ``at`` of ``buf`` (no alignment assumed)."""
    if not _arrays_and_ints((buf,), (at,)):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> ir.Value:
        addr = _address(context, builder, signature, args, 0, 1)
        return builder.load(builder.inttoptr(addr, ir.IntType(16).as_pointer()), align=1)

    return types.uint16(buf, at), codegen


# --- bit casts ---------------------------------------------------------------------------------


@intrinsic
def bits_to_f32(typingctx: Any, bits: types.Type):
    """The float32 whose bit pattern is the int32/uint32 ``bits`` (a free reinterpretation)."""
    if not isinstance(bits, types.Integer) or bits.bitwidth != 32:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> ir.Value:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(bits), codegen
