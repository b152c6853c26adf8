"""The op suite: seeded one-op cases for every op, every weight type, the real models' shapes.

Shapes come from the real models' layouts (``parity.arch.synthetic.twin_layout``): every
(weight type, rows, K) a real file multiplies by, for one token (decode) and seven (an odd
prefill), every head layout, both RoPE modes, attention across the 256-slot chunk boundary.
Weight rows are capped at ``MAX_ROWS``: rows are independent by the contract, and K (the
reduction a tree is shaped by) stays the real one. Values are seeded random with special values
planted: ±0, subnormals, ±1e30, an all-equal row, fp16 edge scales in every other weight block
(±0, subnormals, ±65504), ties and NaN for ARGMAX. KV caches start filled with ``SENTINEL`` (a
NaN): a backend that writes rows it should not, or reads cache slots a token may not see, shows
up as a difference.

Building a case makes its weights, so the suite lists ``CaseSpec``s and builds on demand.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

from parity import quant
from parity.arch.rope import rope_tables
from parity.arch.synthetic import REAL_SPECS, twin_layout
from parity.conformance.case import Case
from parity.core.builder import GraphBuilder, Ref
from parity.core.dtypes import Q8A_BLOCK, WEIGHT_TYPES, DType
from parity.core.ir import AttentionArg, Op, RopeArg, SliceArg
from parity.core.weights import WeightData
from parity.quant.synthetic import random_weight

F32, I32 = DType.F32, DType.I32
MAX_ROWS = 1024
SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-40, 1.17549435e-38, 1e30, -1e30, 1.0, -1.0, 0.5],
                   np.float32)  # fmt: skip
SENTINEL = np.array(0x7FC0DEAD, np.uint32).view(np.float32)  # a quiet NaN with a payload


@attrs.frozen
class CaseSpec:
    """One case of the suite, not built yet: ``build()`` makes its inputs and weights."""

    id: str
    op: str  # the op under test (the subject's)
    type: str  # the subject's weight type, or the activation type
    build: Callable[[], Case] = attrs.field(eq=False, repr=False)


def activations(rng: np.random.Generator, shape, special: bool = True, scale: float = 1.0,
                normed: bool = False):  # fmt: skip
    """Seeded normal values; with ``special``, SPECIAL planted first and, where there is more
    than one row, the last row constant (a single row, a decode step's, keeps its values: made
    constant, it was its first special value, 0.0, all along). ``normed``: the input of a block
    that a norm reads (or a product and a residual ADD before it), of one row: only the special
    values whose squares are finite, not +-1e30, with which the row's squares sum to +inf and the
    row norms to zeros, so that the block after the norm saw nothing but zeros (its products,
    attention, head norms). Rows past the first keep that case for every later kernel."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if special:
        flat = x.reshape(-1)
        one_row = x.ndim == 1 or x.shape[0] == 1
        planted = SPECIAL[np.abs(SPECIAL) < 1e19] if normed and one_row else SPECIAL
        flat[: planted.size] = planted[: flat.size]
        if x.ndim > 1 and x.shape[0] > 1:
            x[-1] = x[-1, 0]
    return x


class _Builder:
    """A GraphBuilder that records the values of the leaves it declares."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.b = GraphBuilder()
        self.inputs: dict[str, np.ndarray] = {}
        self.weights: dict[str, WeightData] = {}
        self.states: dict[str, np.ndarray] = {}

    def input(self, name: str, value: np.ndarray) -> Ref:
        self.inputs[name] = value
        if value.dtype == Q8A_BLOCK:  # quantized activations: (T, K/32) blocks of (T, K)
            return self.b.input(name, DType.Q8A, (value.shape[0], value.shape[1] * 32))
        return self.b.input(name, I32 if value.dtype == np.int32 else F32, value.shape)

    def quantized(self, name: str, t: int, k: int) -> Ref:
        """An INPUT of quantized activations: seeded ones (special values planted) as the
        oracle quantizes them."""
        q = quant.quantize_activations(activations(self.rng, (t, k)))
        blocks = np.empty((t, k // 32), Q8A_BLOCK)
        blocks["q"], blocks["d"], blocks["s"] = q.q.reshape(t, k // 32, 32), q.d, q.s
        return self.input(name, blocks)

    def weight(
        self, name: str, dtype: DType, shape: tuple[int, ...], data=None, edge: bool = True
    ) -> Ref:
        """A seeded weight; with ``edge``, quantized blocks of the edge scales planted."""
        if data is None:
            data = random_weight(dtype, shape, self.rng, edge=edge)
        self.weights[name] = WeightData(name, dtype, shape, data)
        return self.b.weight(name, dtype, shape)

    def state(self, name: str, value: np.ndarray) -> Ref:
        self.states[name] = value
        return self.b.state(name, value.shape)

    def op(self, op: Op, *srcs: Ref, arg: object = None) -> Ref:
        return self.b.op(op, *srcs, arg=arg)  # (so a case reads g.op(...) like a graph)


def _spec(
    id: str,
    op: Op,
    type: DType,
    make: Callable[[_Builder], Ref | tuple[Ref, ...]],
    seed: int = 0,
    rewrite: bool = False,
) -> CaseSpec:
    def build() -> Case:
        g = _Builder(seed)
        out = make(g)
        outs = out if isinstance(out, tuple) else (out,)
        return Case(id, g.b.build(*outs), g.inputs, g.weights, g.states, rewrite=rewrite)

    return CaseSpec(id, "FUSION" if rewrite else op.name, type.name, build)


def real_matmul_shapes() -> list[tuple[DType, int, int]]:
    """Every (weight type, rows, K) the real models multiply by, rows capped at MAX_ROWS."""
    shapes = set()
    for model in REAL_SPECS:
        for dtype, shape in twin_layout(model).values():
            if len(shape) == 2:
                shapes.add((dtype, min(shape[0], MAX_ROWS), shape[1]))
    return sorted(shapes, key=lambda s: (s[0].value, s[1], s[2]))


def _matmul(dtype: DType, n: int, k: int, t: int, bias: bool = False, special: bool = True):
    def make(g: _Builder) -> Ref:
        x = activations(g.rng, (t, k), special=special)
        srcs = [g.input("x", x), g.weight("w", dtype, (n, k), edge=special)]
        if bias:
            srcs.append(g.weight("bias", F32, (n,)))
        return g.op(Op.MATMUL, *srcs)

    return make


def _get_rows(dtype: DType, n: int, k: int):
    def make(g: _Builder) -> Ref:
        ids = np.array([0, n - 1, 7, 7, n // 2], np.int32)
        return g.op(Op.GET_ROWS, g.weight("emb", dtype, (n, k)), g.input("ids", ids))

    return make


def _elementwise(op: Op, width: int, row: bool):
    def make(g: _Builder) -> Ref:
        a = g.input("a", activations(g.rng, (4, width)))
        if row:
            return g.op(op, a, g.weight("v", F32, (width,)))
        return g.op(op, a, g.input("b", activations(g.rng, (4, width), scale=3)))

    return make


def _rope(n_head: int, head_dim: int, n_rot: int, mode: str, n_ctx: int, base: float):
    def make(g: _Builder) -> Ref:
        cos, sin = rope_tables(n_ctx, n_rot, base)
        pos = np.array([0, 1, 255, 256, n_ctx - 1], np.int32)
        return g.op(
            Op.ROPE,
            g.input("x", activations(g.rng, (pos.size, n_head * head_dim))),
            g.input("pos", pos),
            g.weight("cos", F32, cos.shape, cos),
            g.weight("sin", F32, sin.shape, sin),
            arg=RopeArg(n_head, head_dim, n_rot, mode),
        )

    return make


def _attention(
    n_head: int,
    n_kv: int,
    head_dim: int,
    start: int,
    t: int,
    n_ctx: int,
    window: int = 0,
    special: bool = True,
    rope: tuple[str, int] | None = None,
    reach: int = 0,
):
    """Tokens at positions start..start+t-1 attend over a cache whose earlier rows hold
    history and whose later rows hold SENTINEL; with a sliding ``window``, so do the rows
    before the first one any of the tokens reads. ``special``: values hold SPECIAL too.
    ``rope`` (mode, n_rot): the new k and q rotated first, as a decoder's layer does (a
    backend may launch the ROPEs and KV_WRITEs as one). ``reach``: AttentionArg's (a shallow
    decode step's promise that every position is below it)."""

    def make(g: _Builder) -> Ref:
        width = n_kv * head_dim
        unread = max(0, start - window + 1) if window else 0  # rows below are never read
        caches = []
        for name in ("k", "v"):
            cache = np.full((n_ctx, width), SENTINEL, np.float32)
            if start:
                cache[:start] = activations(g.rng, (start, width), special=special and name == "v")
            else:
                cache[:start] = 0
            cache[:unread] = SENTINEL
            caches.append(g.state(name, cache))
        pos = g.input("pos", np.arange(start, start + t, dtype=np.int32))
        k = g.input("k_new", activations(g.rng, (t, width), special=False))
        v = g.input("v_new", activations(g.rng, (t, width), special=special))
        if rope:
            mode, n_rot = rope
            tables = zip(("cos", "sin"), rope_tables(n_ctx, n_rot, 10000.0), strict=True)
            cos, sin = (g.weight(n, F32, a.shape, a) for n, a in tables)
            k = g.op(Op.ROPE, k, pos, cos, sin, arg=RopeArg(n_kv, head_dim, n_rot, mode))
        kc = g.op(Op.KV_WRITE, caches[0], k, pos)
        vc = g.op(Op.KV_WRITE, caches[1], v, pos)
        q = g.input("q", activations(g.rng, (t, n_head * head_dim), special=False))
        if rope:
            q = g.op(Op.ROPE, q, pos, cos, sin, arg=RopeArg(n_head, head_dim, n_rot, mode))
        scale = float(np.float32(1 / np.sqrt(head_dim)))
        arg = AttentionArg(n_head, n_kv, head_dim, scale, window, reach)
        return g.op(Op.ATTENTION, q, kc, vc, pos, arg=arg)

    return make


def _argmax(width: int):
    def make(g: _Builder) -> Ref:
        x = activations(g.rng, (6, width), special=False)
        x[1, [10, 20, width - 1]] = 1e9  # a tie (across blocks of a row too): the first index wins
        x[2, [30, width - 5]] = np.nan  # NaN is above every number; the first NaN wins
        x[3] = -np.inf
        x[4] = -1.0
        x[4, [width - 3, width - 2]] = (-0.0, 0.0)  # -0 and +0 tie: the first index wins
        x[5, 3] = 1e9
        x[5, width - 1] = np.nan
        return g.op(Op.ARGMAX, g.input("x", x))

    return make


def _quantize(t: int, k: int):
    def make(g: _Builder) -> Ref:
        x = activations(g.rng, (t, k))
        x[0, 32:64] = 0.0  # an all-zero block: d = 0
        x[0, 64:96] = 1e-42  # a subnormal block: d rounds to 0
        if t > 1:
            x[1, 0:32] = np.tile(np.float32([0.5, -0.5]), 16)  # all equal magnitude: q = +-127
            x[1, 40] = np.nan
            x[1, 70] = np.inf
        return g.op(Op.QUANTIZE, g.input("x", x))

    return make


def _matmul_q8(dtype: DType, n: int, k: int, t: int):
    def make(g: _Builder) -> Ref:
        return g.op(Op.MATMUL, g.quantized("xq", t, k), g.weight("w", dtype, (n, k)))

    return make


def _rms_norm_mul(width: int, eps: float, rows: int = 5):
    def make(g: _Builder) -> Ref:
        x = g.input("x", activations(g.rng, (rows, width)))
        return g.op(Op.RMS_NORM_MUL, x, g.weight("w", F32, (width,)), arg=eps)

    return make


def _matmul_add(dtype: DType, n: int, k: int, t: int, bias: bool = False, special: bool = True):
    def make(g: _Builder) -> Ref:
        x = activations(g.rng, (t, k), special=special)
        srcs = [g.input("x", x), g.weight("w", dtype, (n, k), edge=special)]
        if bias:
            srcs.append(g.weight("bias", F32, (n,)))
        residual = activations(g.rng, (t, n), special=special, scale=3)
        return g.op(Op.MATMUL_ADD, *srcs, g.input("r", residual))

    return make


def _matmul_swiglu(
    dtype: DType,
    n: int,
    k: int,
    t: int,
    quantized: bool = False,
    up: DType | None = None,
    special: bool = True,
):
    def make(g: _Builder) -> Ref:
        if quantized:
            x = g.quantized("xq", t, k)
        else:
            x = g.input("x", activations(g.rng, (t, k), special=special))
        gate_w = g.weight("gate", dtype, (n, k), edge=special)
        up_w = g.weight("up", up or dtype, (n, k), edge=special)
        return g.op(Op.MATMUL_SWIGLU, x, gate_w, up_w)

    return make


def _unfused_ffn(dtype: DType, e: int, f: int, t: int, eps: float, special: bool = True):
    """A decoder's FFN block as the graph builder writes it: every fusion has a place here
    (the norm and its weight, gate and up with their SWIGLU, down and the residual ADD)."""

    def make(g: _Builder) -> Ref:
        x = g.input("x", activations(g.rng, (t, e), special=special, normed=True))
        h = g.op(Op.MUL, g.op(Op.RMS_NORM, x, arg=eps), g.weight("norm", F32, (e,)))
        gate = g.op(Op.MATMUL, h, g.weight("gate", dtype, (f, e), edge=special))
        up = g.op(Op.MATMUL, h, g.weight("up", dtype, (f, e), edge=special))
        down_w = g.weight("down", dtype, (e, f), edge=special)
        down = g.op(Op.MATMUL, g.op(Op.SWIGLU, gate, up), down_w)
        return g.op(Op.ADD, x, down)

    return make


def _unfused_product_norm(dtype: DType, e: int, k: int, t: int, eps: float, chained: bool):
    """A product, the residual ADD and the norm before the next product, as a decoder writes
    them (o or down, then the next block's norm), its output read by that product; with
    ``chained``, Gemma 3's: the product normed first, that norm added to the residual."""

    def make(g: _Builder) -> tuple[Ref, ...]:
        x = g.input("x", activations(g.rng, (t, k), normed=True))
        r = g.input("r", activations(g.rng, (t, e), scale=3, normed=True))
        p = g.op(Op.MATMUL, x, g.weight("w", dtype, (e, k)))
        if chained:
            p = g.op(Op.MUL, g.op(Op.RMS_NORM, p, arg=eps), g.weight("post", F32, (e,)))
        h = g.op(Op.ADD, r, p)
        n = g.op(Op.MUL, g.op(Op.RMS_NORM, h, arg=eps), g.weight("norm", F32, (e,)))
        return h, n, g.op(Op.MATMUL, n, g.weight("next", dtype, (48, e)))

    return make


def _unfused_geglu(dtype: DType, e: int, f: int, t: int):
    """Gemma 3's FFN products as a decoder writes them: gate and up of one x, their GEGLU,
    read by the down product."""

    def make(g: _Builder) -> tuple[Ref, ...]:
        x = g.input("x", activations(g.rng, (t, e)))
        gate = g.op(Op.MATMUL, x, g.weight("gate", dtype, (f, e)))
        up = g.op(Op.MATMUL, x, g.weight("up", dtype, (f, e)))
        act = g.op(Op.GEGLU, gate, up)
        return gate, up, act, g.op(Op.MATMUL, act, g.weight("down", dtype, (e, f)))

    return make


def _unfused_qkv(dtype: DType, e: int, q: int, kv: int, t: int, v_dtype: DType | None = None,
                 bias: bool = False):  # fmt: skip
    """Three products of one x (q, k, v): one activation quantization can serve all three (v
    of ``v_dtype`` when given; with ``bias``, each with its bias, Qwen2's)."""

    def make(g: _Builder) -> tuple[Ref, ...]:
        x = g.input("x", activations(g.rng, (t, e)))
        out = []
        for n, rows, wtype in (("q", q, dtype), ("k", kv, dtype), ("v", kv, v_dtype or dtype)):
            srcs = [x, g.weight(n, wtype, (rows, e))]
            if bias:
                srcs.append(g.weight(f"{n}_bias", F32, (rows,)))
            out.append(g.op(Op.MATMUL, *srcs))
        return tuple(out)

    return make


def _head_argmax(dtype: DType, n: int, k: int, special: bool):
    """Greedy decoding's end: the output head's one row of logits, then its ARGMAX (a GPU
    backend may take the ARGMAX in the product's launch)."""

    def make(g: _Builder) -> Ref:
        x = g.input("x", activations(g.rng, (1, k), special=special))
        return g.op(Op.ARGMAX, g.op(Op.MATMUL, x, g.weight("w", dtype, (n, k))))

    return make


def _unfused_attention_out(
    dtype: DType, n_head: int, n_kv: int, head_dim: int, start: int, t: int, n_ctx: int
):
    """Attention, then the output projection and the residual ADD, as a decoder writes them:
    a backend's rewrite may quantize the attention for the product in the same launch."""
    attend = _attention(n_head, n_kv, head_dim, start, t, n_ctx, special=False)

    def make(g: _Builder) -> Ref:
        e = n_head * head_dim
        a = attend(g)
        x = g.input("x", activations(g.rng, (t, e), special=False))
        return g.op(Op.ADD, x, g.op(Op.MATMUL, a, g.weight("o", dtype, (e, e))))

    return make


def _unfused_attention_block(
    dtype: DType, e: int, heads: tuple[int, int, int], mode: str, bias: bool, start: int,
    t: int, n_ctx: int, eps: float, head_norms: bool = False,
):  # fmt: skip
    """A decoder's attention block up to the attention as the graph builder writes it: the norm
    and its weight, q/k/v (with biases), the ROPEs of q and k (with ``head_norms``, Gemma 3's
    norm of each head of q and k before them: RESHAPE to heads, the norm and its weight,
    RESHAPE back), the cache writes of k and v, then attention over caches with history. A
    backend may launch the products with their ROPEs and cache writes (and head norms)."""
    n_head, n_kv, head_dim = heads

    def make(g: _Builder) -> Ref:
        x = g.input("x", activations(g.rng, (t, e), normed=True))
        h = g.op(Op.MUL, g.op(Op.RMS_NORM, x, arg=eps), g.weight("norm", F32, (e,)))

        def project(name: str, rows: int) -> Ref:
            w = [g.weight(name, dtype, (rows, e))]
            if bias:
                w.append(g.weight(f"{name}.bias", F32, (rows,)))
            return g.op(Op.MATMUL, h, *w)

        q = project("q", n_head * head_dim)
        k = project("k", n_kv * head_dim)
        v = project("v", n_kv * head_dim)
        if head_norms:

            def norm_heads(x: Ref, name: str, n: int) -> Ref:
                w = g.weight(f"{name}.norm", F32, (head_dim,))
                rows = g.op(Op.RESHAPE, x, arg=(t * n, head_dim))
                normed = g.op(Op.MUL, g.op(Op.RMS_NORM, rows, arg=eps), w)
                return g.op(Op.RESHAPE, normed, arg=(t, n * head_dim))

            q, k = norm_heads(q, "q", n_head), norm_heads(k, "k", n_kv)
        caches = []
        for name in ("k", "v"):
            cache = np.full((n_ctx, n_kv * head_dim), SENTINEL, np.float32)
            cache[:start] = activations(g.rng, (start, n_kv * head_dim), special=False)
            caches.append(g.state(name, cache))
        pos = g.input("pos", np.arange(start, start + t, dtype=np.int32))
        tables = zip(("cos", "sin"), rope_tables(n_ctx, head_dim, 10000.0), strict=True)
        cos, sin = (g.weight(n, F32, a.shape, a) for n, a in tables)
        q = g.op(Op.ROPE, q, pos, cos, sin, arg=RopeArg(n_head, head_dim, head_dim, mode))
        k = g.op(Op.ROPE, k, pos, cos, sin, arg=RopeArg(n_kv, head_dim, head_dim, mode))
        kc = g.op(Op.KV_WRITE, caches[0], k, pos)
        vc = g.op(Op.KV_WRITE, caches[1], v, pos)
        scale = float(np.float32(1 / np.sqrt(head_dim)))
        return g.op(Op.ATTENTION, q, kc, vc, pos, arg=AttentionArg(n_head, n_kv, head_dim, scale))

    return make


def op_suite() -> list[CaseSpec]:
    """The whole suite, in a fixed order (ids are stable across runs and machines)."""
    specs: list[CaseSpec] = []
    for dtype in WEIGHT_TYPES:  # every type, small: the block formats themselves
        specs.append(_spec(f"get_rows-{dtype.name}", Op.GET_ROWS, dtype, _get_rows(dtype, 40, 256)))
        for t, k in ((1, 256), (5, 512)):
            specs.append(
                _spec(
                    f"matmul-{dtype.name}-48x{k}-t{t}", Op.MATMUL, dtype, _matmul(dtype, 48, k, t)
                )
            )
    for dtype, n, k in real_matmul_shapes():  # the real models' products
        for t in (1, 7):
            name = f"matmul-{dtype.name}-{n}x{k}-t{t}"
            specs.append(_spec(name, Op.MATMUL, dtype, _matmul(dtype, n, k, t), seed=n + k + t))
    # one token through many short rows (an output head's shape): a GPU backend may give each
    # of a few warps a multiprocessor many rows; row counts that no grid divides, and one past
    # a big GPU's threshold for that path (Gemma 3's head has 262,144 rows of 640)
    for dtype in (t for t in WEIGHT_TYPES if t.is_quantized):
        name = f"matmul-wide-{dtype.name}-2051x256-t1"
        specs.append(_spec(name, Op.MATMUL, dtype, _matmul(dtype, 2051, 256, 1), seed=2051))
    specs.append(_spec("matmul-head-Q8_0-40009x640-t1", Op.MATMUL, DType.Q8_0,
                       _matmul(DType.Q8_0, 40009, 640, 1), seed=40009))  # fmt: skip
    specs.append(_spec("matmul-wide-bias-Q5_0-2051x256-t1", Op.MATMUL, DType.Q5_0,
                       _matmul(DType.Q5_0, 2051, 256, 1, bias=True), seed=2052))  # fmt: skip
    specs.append(_spec("matmul_add-wide-bias-Q6_K-2051x256-t1", Op.MATMUL_ADD, DType.Q6_K,
                       _matmul_add(DType.Q6_K, 2051, 256, 1, bias=True), seed=2053))  # fmt: skip
    # more tokens than a GEMV takes (a backend's GEMM path): tiles cut short by rows and tokens,
    # rows whose last 256-element stage is partial (K = 896), rows of only 4 blocks (K = 128)
    for dtype in WEIGHT_TYPES:
        name = f"matmul-{dtype.name}-72x1024-t37"
        specs.append(_spec(name, Op.MATMUL, dtype, _matmul(dtype, 72, 1024, 37), seed=37))
    for dtype in (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q8_0):
        name = f"matmul-{dtype.name}-40x896-t33"
        specs.append(_spec(name, Op.MATMUL, dtype, _matmul(dtype, 40, 896, 33), seed=33))
    specs.append(
        _spec("matmul-Q4_0-48x128-t37", Op.MATMUL, DType.Q4_0, _matmul(DType.Q4_0, 48, 128, 37))
    )
    # plain values only (no SPECIAL, no edge weight scales), over two 64-token tiles: a bounded
    # tier's NMSE then measures the ordinary elements, which planted values 10^30 times larger
    # (or weight blocks of scale 65,504) would swamp
    for dtype in WEIGHT_TYPES:
        name = f"matmul-plain-{dtype.name}-64x512-t70"
        specs.append(
            _spec(name, Op.MATMUL, dtype, _matmul(dtype, 64, 512, 70, special=False), seed=70)
        )
    # ... and of the products with a bias, a residual, both, and gate/up with their SWIGLU
    for name, op, dtype, make, more in (
        ("matmul-plain-bias", Op.MATMUL, DType.Q8_0, _matmul, {"bias": True}),
        ("matmul_add-plain", Op.MATMUL_ADD, DType.Q4_K, _matmul_add, {}),
        ("matmul_add-plain-bias", Op.MATMUL_ADD, DType.Q5_0, _matmul_add, {"bias": True}),
        ("matmul_swiglu-plain", Op.MATMUL_SWIGLU, DType.Q4_1, _matmul_swiglu, {}),
    ):
        specs.append(_spec(f"{name}-{dtype.name}-64x512-t40", op, dtype,
                           make(dtype, 64, 512, 40, special=False, **more), seed=40))  # fmt: skip
    specs.append(
        _spec("matmul-Q5_0-bias-128x896-t3", Op.MATMUL, DType.Q5_0,
              _matmul(DType.Q5_0, 128, 896, 3, bias=True))
    )  # fmt: skip
    # a prefill's product with a bias, rows not a multiple of a GEMM tile's 32
    specs.append(
        _spec("matmul-Q5_0-bias-40x256-t12", Op.MATMUL, DType.Q5_0,
              _matmul(DType.Q5_0, 40, 256, 12, bias=True))
    )  # fmt: skip
    for dtype, k in ((DType.Q8_0, 576), (DType.Q5_0, 896), (DType.Q8_0, 896)):
        specs.append(
            _spec(f"get_rows-{dtype.name}-4099x{k}", Op.GET_ROWS, dtype, _get_rows(dtype, 4099, k))
        )

    def slice_rows(g: _Builder) -> Ref:
        return g.op(Op.SLICE_ROWS, g.input("x", activations(g.rng, (6, 576))), arg=SliceArg(2, 3))

    specs.append(_spec("slice_rows", Op.SLICE_ROWS, F32, slice_rows))

    def reshape(g: _Builder) -> Ref:  # Gemma 3's q as (tokens * heads, head_dim)
        return g.op(Op.RESHAPE, g.input("x", activations(g.rng, (3, 1024))), arg=(12, 256))

    specs.append(_spec("reshape", Op.RESHAPE, F32, reshape))
    for width in (576, 4864):
        for op in (Op.ADD, Op.MUL, Op.SWIGLU):
            specs.append(
                _spec(f"{op.name.lower()}-{width}", op, F32, _elementwise(op, width, False))
            )
        for op in (Op.ADD, Op.MUL):
            specs.append(
                _spec(f"{op.name.lower()}-row-{width}", op, F32, _elementwise(op, width, True))
            )

    def silu(g: _Builder) -> Ref:
        return g.op(Op.SILU, g.input("x", activations(g.rng, (3, 1536), scale=30)))

    specs.append(_spec("silu-1536", Op.SILU, F32, silu))

    def gelu(g: _Builder) -> Ref:
        x = activations(g.rng, (3, 2048), scale=12)  # through x < -9, where exp(-2u) overflows
        x[0, 10:14] = (np.inf, -np.inf, np.nan, -9.4393206)
        return g.op(Op.GELU, g.input("x", x))

    def geglu(g: _Builder) -> Ref:
        gate = g.input("gate", activations(g.rng, (3, 2048), scale=12))
        return g.op(Op.GEGLU, gate, g.input("up", activations(g.rng, (3, 2048), scale=3)))

    def scale(g: _Builder) -> Ref:  # Gemma's embedding scale, sqrt(640) rounded once
        x = g.input("x", activations(g.rng, (3, 640), scale=1e37))  # overflow to inf too
        return g.op(Op.SCALE, x, arg=float(np.float32(np.sqrt(640.0))))

    specs.append(_spec("gelu-2048", Op.GELU, F32, gelu))
    specs.append(_spec("geglu-2048", Op.GEGLU, F32, geglu))
    specs.append(_spec("scale-640", Op.SCALE, F32, scale))
    for spec in REAL_SPECS.values():

        def rms_norm(g: _Builder, spec=spec) -> Ref:
            x = g.input("x", activations(g.rng, (5, spec.n_embd)))
            return g.op(Op.RMS_NORM, x, arg=spec.rms_eps)

        specs.append(_spec(f"rms_norm-{spec.n_embd}", Op.RMS_NORM, F32, rms_norm))
        mode = "normal" if spec.arch == "llama" else "neox"
        for n_head in (spec.n_head, spec.n_head_kv):
            specs.append(
                _spec(
                    f"rope-{mode}-{n_head}x{spec.head_dim}",
                    Op.ROPE,
                    F32,
                    _rope(n_head, spec.head_dim, spec.head_dim, mode, 4096, spec.rope_base),
                )
            )
        # prefill, decode, and decode deep in caches of 17 and 34 chunks (flash decoding)
        for start, t, n_ctx in ((0, 300, 640), (300, 1, 640), (511, 2, 640), (4000, 1, 4352),
                                (8600, 1, 8704)):  # fmt: skip
            heads = f"{spec.n_head}x{spec.n_head_kv}x{spec.head_dim}"
            specs.append(
                _spec(
                    f"attention-{heads}-p{start}-t{t}",
                    Op.ATTENTION,
                    F32,
                    _attention(spec.n_head, spec.n_head_kv, spec.head_dim, start, t, n_ctx),
                )
            )
    # sliding windows (Gemma 3's local layers: 4 heads, 1 kv head, 256 dims, window 512):
    # windows inside one chunk, across chunk edges, starting on one, of one position; a
    # prefill without GQA and a window over more chunks than a GPU reads in one launch
    for heads, start, t, n_ctx, window in (
        ((4, 1, 256), 0, 300, 640, 100),
        ((4, 1, 256), 1000, 2, 1280, 512),
        ((4, 1, 256), 767, 1, 1024, 512),
        ((9, 3, 64), 250, 20, 512, 7),
        ((9, 3, 64), 100, 12, 256, 5),  # (a prefill whose slots fit one tile of 32)
        ((9, 3, 64), 5, 3, 64, 1),
        ((4, 4, 64), 600, 8, 1024, 100),
        ((2, 1, 64), 9500, 1, 10240, 9000),
    ):
        name = "x".join(map(str, heads))
        specs.append(
            _spec(
                f"attention-window{window}-{name}-p{start}-t{t}",
                Op.ATTENTION,
                F32,
                _attention(*heads, start, t, n_ctx, window),
            )
        )
    # Gemma 3's heads of 256, decode in a chunk filled to the middle of a batch of V rows
    specs.append(_spec("attention-4x1x256-p100-t2", Op.ATTENTION, F32,
                       _attention(4, 1, 256, 100, 2, 640)))  # fmt: skip
    # a shallow decode step's attention (GraphParams.reach: every position below 512) in a
    # cache of 17 chunks: the three models' heads, one chunk and two, Gemma 3's window
    for heads, start, window in (((9, 3, 64), 300, 0), ((14, 2, 64), 100, 0),
                                 ((4, 1, 256), 511, 0), ((4, 1, 256), 400, 100)):  # fmt: skip
        name = "x".join(map(str, heads))
        specs.append(_spec(f"attention-reach512-window{window}-{name}-p{start}-t1", Op.ATTENTION,
                           F32, _attention(*heads, start, 1, 4352, window, reach=512)))  # fmt: skip
    # heads of 128 (no model here has them): decode over 3 chunks (one launch on a GPU) and 17
    # (the scores through scratch)
    for start, t, n_ctx in ((511, 2, 640), (4000, 1, 4352)):
        specs.append(
            _spec(
                f"attention-8x2x128-p{start}-t{t}",
                Op.ATTENTION,
                F32,
                _attention(8, 2, 128, start, t, n_ctx),
            )
        )
    # plain values only (as the plain products): a prefill continuing a history, GQA, and a
    # windowed one with heads of 256
    for heads, start, t, n_ctx, window in (((9, 3, 64), 100, 100, 256, 0),
                                           ((4, 1, 256), 200, 40, 512, 64)):  # fmt: skip
        name = "x".join(map(str, heads))
        specs.append(
            _spec(
                f"attention-plain-window{window}-{name}-p{start}-t{t}",
                Op.ATTENTION,
                F32,
                _attention(*heads, start, t, n_ctx, window, special=False),
            )
        )
    specs.append(_spec("rope-neox-partial-9x64-rot32", Op.ROPE, F32,
                       _rope(9, 64, 32, "neox", 512, 10000.0)))  # fmt: skip
    # a layer's ROPEs, KV_WRITEs and ATTENTION as a decoder writes them: both modes, GQA,
    # a partial rotation with heads of 256
    for heads, mode, n_rot, start, t in (((9, 3, 64), "normal", 64, 40, 1),
                                          ((14, 2, 64), "neox", 64, 40, 7),
                                          ((4, 1, 256), "neox", 128, 300, 2)):  # fmt: skip
        name = "x".join(map(str, heads))
        specs.append(
            _spec(
                f"attention-rope-{mode}{n_rot}-{name}-p{start}-t{t}",
                Op.ATTENTION,
                F32,
                _attention(*heads, start, t, 512, rope=(mode, n_rot)),
            )
        )
    for width in (1000, 49152, 151936):  # (the last: Qwen2.5's vocabulary)
        specs.append(_spec(f"argmax-{width}", Op.ARGMAX, F32, _argmax(width)))
    specs += fused_suite()
    return specs


def fused_suite() -> list[CaseSpec]:
    """The fused ops and what they stand on: QUANTIZE and products of quantized x at every
    quantized type, each fused op on every weight type and at real shapes, and the unfused
    patterns a backend's rewrite fuses (``rewrite``: run as the backend rewrites them)."""
    specs: list[CaseSpec] = []

    def add(id: str, op: Op, dtype: DType, make: Callable, seed: int = 0, **kw: bool) -> None:
        specs.append(_spec(id, op, dtype, make, seed=seed, **kw))

    smollm, qwen = REAL_SPECS["smollm2-135m"], REAL_SPECS["qwen2.5-coder-0.5b"]
    for k in (576, 896, 4864):
        for t in (1, 7):
            add(f"quantize-{k}-t{t}", Op.QUANTIZE, F32, _quantize(t, k))
    largest: dict[DType, tuple[int, int]] = {}  # each quantized type's longest real rows
    for dtype, n, k in real_matmul_shapes():
        if dtype.is_quantized and k >= largest.get(dtype, (0, 0))[1]:
            largest[dtype] = (n, k)
    for dtype in (t for t in WEIGHT_TYPES if t.is_quantized):
        for (n, k), t in ((largest.get(dtype, (48, 512)), 1), ((48, 512), 7)):
            name = f"matmul-q8x-{dtype.name}-{n}x{k}-t{t}"
            add(name, Op.MATMUL, dtype, _matmul_q8(dtype, n, k, t), seed=n + k + t)
    for spec in (smollm, qwen):
        width = spec.n_embd
        add(f"rms_norm_mul-{width}", Op.RMS_NORM_MUL, F32, _rms_norm_mul(width, spec.rms_eps))
    # a prefill's rows (a GPU backend may norm them a row a warp): the three models' widths, a
    # head's, and rows of 90 (runs of 4 slots, the last lane's half padding, rows not 16-byte
    # aligned), 320 (16 a lane, lanes past the row) and 16 (a slot a lane, half the lanes)
    for width, rows in ((576, 40), (896, 40), (640, 40), (256, 70), (90, 12), (320, 12),
                        (16, 12)):  # fmt: skip
        add(f"rms_norm_mul-{width}-t{rows}", Op.RMS_NORM_MUL, F32,
            _rms_norm_mul(width, smollm.rms_eps, rows))  # fmt: skip
    for dtype in WEIGHT_TYPES:
        for t in (1, 5):
            name = f"{dtype.name}-48x512-t{t}"
            add(f"matmul_add-{name}", Op.MATMUL_ADD, dtype, _matmul_add(dtype, 48, 512, t))
            add(f"matmul_swiglu-{name}", Op.MATMUL_SWIGLU, dtype, _matmul_swiglu(dtype, 48, 512, t))
    for dtype in (t for t in WEIGHT_TYPES if t.is_quantized):  # their GEMM path
        name = f"{dtype.name}-40x512-t35"
        add(f"matmul_add-{name}", Op.MATMUL_ADD, dtype, _matmul_add(dtype, 40, 512, 35))
        add(f"matmul_swiglu-{name}", Op.MATMUL_SWIGLU, dtype, _matmul_swiglu(dtype, 40, 512, 35))
    for gate, up in ((DType.Q8_0, DType.F16), (DType.F16, DType.Q4_K)):  # x quantized for one
        add(f"matmul_swiglu-mixed-{gate.name}-{up.name}-48x512-t3", Op.MATMUL_SWIGLU, gate,
            _matmul_swiglu(gate, 48, 512, 3, up=up))  # fmt: skip
    # long rows in few: a K of several of a GPU product's groups (2,048 elements), the last
    # one partial, with mins, with 16-element sub-blocks, in float
    add("matmul-q8x-Q4_K-48x4864-t1", Op.MATMUL, DType.Q4_K, _matmul_q8(DType.Q4_K, 48, 4864, 1))
    for dtype in (DType.Q6_K, DType.F16):
        add(f"matmul_add-{dtype.name}-48x4864-t1", Op.MATMUL_ADD, dtype,
            _matmul_add(dtype, 48, 4864, 1))  # fmt: skip
    # the real down projections with their residuals, and gate/up with their SWIGLU
    for dtype, n, k in (
        (DType.Q4_1, smollm.n_embd, smollm.n_ff),
        (DType.Q6_K, qwen.n_embd, qwen.n_ff),
    ):
        for t in (1, 7):
            add(
                f"matmul_add-{dtype.name}-{n}x{k}-t{t}",
                Op.MATMUL_ADD,
                dtype,
                _matmul_add(dtype, n, k, t),
                seed=t,
            )
    add(
        "matmul_add-Q5_0-bias-128x896-t3",
        Op.MATMUL_ADD,
        DType.Q5_0,
        _matmul_add(DType.Q5_0, 128, 896, 3, bias=True),
    )
    for dtype, n, k in (
        (DType.Q4_1, smollm.n_ff, smollm.n_embd),
        (DType.Q5_0, MAX_ROWS, qwen.n_embd),
    ):
        for t in (1, 7):
            name = f"{dtype.name}-{n}x{k}-t{t}"
            add(
                f"matmul_swiglu-{name}",
                Op.MATMUL_SWIGLU,
                dtype,
                _matmul_swiglu(dtype, n, k, t),
                seed=t,
            )
            add(
                f"matmul_swiglu-q8x-{name}",
                Op.MATMUL_SWIGLU,
                dtype,
                _matmul_swiglu(dtype, n, k, t, quantized=True),
                seed=t,
            )
    # whole patterns as a decoder writes them, for the backend's rewrite to fuse
    for spec, dtype in ((smollm, DType.Q4_1), (qwen, DType.Q5_0)):
        e, f = spec.n_embd, min(spec.n_ff, MAX_ROWS)
        q, kv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
        for t in (1, 7):
            add(
                f"fusion-ffn-{dtype.name}-{e}x{f}-t{t}",
                Op.ADD,
                dtype,
                _unfused_ffn(dtype, e, f, t, spec.rms_eps),
                rewrite=True,
            )
            add(
                f"fusion-qkv-{dtype.name}-{e}-t{t}",
                Op.MATMUL,
                dtype,
                _unfused_qkv(dtype, e, q, kv, t),
                rewrite=True,
            )
            heads = (spec.n_head, spec.n_head_kv, spec.head_dim)
            add(
                f"fusion-attention-out-{dtype.name}-{'x'.join(map(str, heads))}-p40-t{t}",
                Op.ADD,
                dtype,
                _unfused_attention_out(dtype, *heads, 40, t, 256),
                rewrite=True,
            )
            mode, bias = ("normal", False) if spec.arch == "llama" else ("neox", True)
            add(
                f"fusion-attention-block-{dtype.name}-{e}-{mode}{'-bias' * bias}-p40-t{t}",
                Op.ATTENTION,
                dtype,
                _unfused_attention_block(dtype, e, heads, mode, bias, 40, t, 256, spec.rms_eps),
                rewrite=True,
            )
    for special in (False, True):  # (special x: NaN and infinite logits, the first NaN wins)
        add(f"fusion-head-argmax{'-special' * special}-Q8_0-2051x256-t1", Op.ARGMAX, DType.Q8_0,
            _head_argmax(DType.Q8_0, 2051, 256, special), rewrite=True)  # fmt: skip
    # a norm wider than a norm block's threads (cuda's rms_norm_f32: runs of two squares a
    # thread), not a power of two, before the products of a decode step
    wide = _unfused_ffn(DType.Q4_K, 1536, 256, 1, qwen.rms_eps)
    add("fusion-ffn-Q4_K-1536x256-t1", Op.ADD, DType.Q4_K, wide, rewrite=True)
    # a prefill's FFN (a GPU backend's GEMM may quantize SWIGLU's output for down in its
    # epilogue; 40 tokens: a whole tile of 32 and 8 more)
    for dtype in (DType.Q5_0, DType.Q4_K):
        add(f"fusion-ffn-{dtype.name}-256x512-t40", Op.ADD, dtype,
            _unfused_ffn(dtype, 256, 512, 40, qwen.rms_eps), rewrite=True)  # fmt: skip
    # ... with plain values only (no SPECIAL, no edge weight scales): a bounded tier's NMSE of
    # the products, the GLU's quantized output and down then measures ordinary elements
    add("fusion-ffn-plain-Q5_0-256x512-t40", Op.ADD, DType.Q5_0,
        _unfused_ffn(DType.Q5_0, 256, 512, 40, qwen.rms_eps, special=False),
        rewrite=True)  # fmt: skip
    # a product, its residual and the next block's norm (a GPU backend may norm in the
    # product's last block), and Gemma 3's chain of norm, ADD and norm, 1,152 wide (Gemma 3
    # 1B's width: runs of 16 squares in a block of 128 threads)
    # (and prefills of 40 tokens: a GPU backend may norm their rows a warp each, 1,152 wide:
    # runs of 64 slots a lane; 64 wide: a Q8 block on 16 lanes, two values each)
    for dtype, e, k, t, chained in ((DType.Q4_1, 576, 1536, 1, False),
                                    (DType.Q5_0, 896, 896, 7, False),
                                    (DType.Q4_1, 576, 256, 40, False),
                                    (DType.Q4_1, 64, 256, 40, False),
                                    (DType.Q8_0, 1152, 640, 1, True),
                                    (DType.Q8_0, 1152, 640, 3, True),
                                    (DType.Q8_0, 1152, 256, 40, True)):  # fmt: skip
        kind = "chained-norm" if chained else "residual-norm"
        add(f"fusion-{kind}-{dtype.name}-{e}x{k}-t{t}", Op.ADD, dtype,
            _unfused_product_norm(dtype, e, k, t, smollm.rms_eps, chained),
            rewrite=True)  # fmt: skip
    # Gemma 3's attention block: heads of 256 normed before their ROPEs (a GPU backend may
    # norm and rotate them in the q/k/v launch)
    for t in (1, 3, 20):  # (20: a prefill's head norms, q's and k's in one launch)
        add(f"fusion-attention-block-Q8_0-640-neox-head-norms-p40-t{t}", Op.ATTENTION,
            DType.Q8_0, _unfused_attention_block(DType.Q8_0, 640, (4, 1, 256), "neox", False,
                                                 40, t, 256, smollm.rms_eps, head_norms=True),
            rewrite=True)  # fmt: skip
    # a prefill's q, k and v (a GPU backend may run them as one GEMM launch): SmolLM2's, and
    # v of another type than q and k with biases (Qwen2's, narrower)
    add("fusion-qkv-Q4_1-576-t40", Op.MATMUL, DType.Q4_1,
        _unfused_qkv(DType.Q4_1, 576, 576, 192, 40), rewrite=True)  # fmt: skip
    add("fusion-qkv-bias-Q5_0-Q8_0-256-t40", Op.MATMUL, DType.Q5_0,
        _unfused_qkv(DType.Q5_0, 256, 256, 64, 40, DType.Q8_0, bias=True),
        rewrite=True)  # fmt: skip
    # Gemma 3's gate, up and GEGLU before down (a GPU backend may run them as one product; 40
    # tokens: a prefill's)
    for t in (1, 3, 40):
        add(f"fusion-geglu-Q8_0-640x512-t{t}", Op.GEGLU, DType.Q8_0,
            _unfused_geglu(DType.Q8_0, 640, 512, t), rewrite=True)  # fmt: skip
    return specs
