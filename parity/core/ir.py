"""The graph IR: an immutable, single-assignment listing of nodes.

Grammar::

    graph  := node* outputs
    node   := %id = OP dtype[shape] (%src, ...) {arg}
    src    := the id of an EARLIER node (ids are positions in ``Graph.nodes``)

Every node is a frozen, hashable ``Node(op, dtype, shape, src, arg)``: ``src`` is a tuple of node
ids, ``arg`` the op's static arguments (a scalar, a string or a frozen ``*Arg`` below). Leaves
(INPUT, WEIGHT, STATE) name the value they stand for and come first, at the head of the graph:
nothing is fed into the middle of a graph, so a whole forward pass can run as one split.
Activations are 2-D ``(n_tokens, width)`` float32 (or Q8A, the same rows quantized); ids and
positions are 1-D int32.

Fused ops are first-class: each is defined as an exact composition of the others (``FUSED``,
docs/numerics.md "Fused ops"), so a fused kernel gives the unfused oracle's bits. A backend's
``rewrite`` introduces them (``parity.core.fusion``); a rewritten graph records, per node, the
node of the graph it was rewritten from whose value it computes (``Graph.origin``).

``infer`` states each op's signature once; the builder uses it to type new nodes and ``verify``
uses it to re-check a whole graph. What each op computes, bit for bit, is docs/numerics.md and
its living definition ``parity.backends.cpu.ops``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from parity.core.dtypes import WEIGHT_TYPES, DType
from parity.errors import GraphError


class Op(enum.Enum):
    # leaves, at the graph head: values bound from outside the graph
    INPUT = enum.auto()  # a per-step host value (token ids, positions); arg: its name
    WEIGHT = enum.auto()  # a registered, read-only weight; arg: its name
    STATE = enum.auto()  # a persistent buffer the graph updates (a KV cache); arg: its name
    # data movement
    GET_ROWS = enum.auto()  # gather (and dequantize) weight rows by id: the embedding lookup
    SLICE_ROWS = enum.auto()  # rows [start, start + count); arg: SliceArg
    RESHAPE = enum.auto()  # the same values in row-major order as (rows, width); arg: that shape
    # elementwise (the second operand may be a row vector broadcast over rows)
    ADD = enum.auto()
    MUL = enum.auto()
    SILU = enum.auto()
    SWIGLU = enum.auto()  # silu(gate) * up
    GELU = enum.auto()  # the tanh form
    GEGLU = enum.auto()  # gelu(gate) * up
    SCALE = enum.auto()  # x * c; arg: c, a finite float32 constant
    # normalization
    RMS_NORM = enum.auto()  # arg: eps
    # matrix products: (x, weight[, bias]) -> x @ weight.T (+ bias); x is F32, or Q8A (already
    # quantized) when the weight is quantized
    MATMUL = enum.auto()
    QUANTIZE = enum.auto()  # F32 x -> Q8A: the activation quantization MATMUL does, done once
    # positions
    ROPE = enum.auto()  # (x, positions, cos, sin); arg: RopeArg
    # attention: KV_WRITE updates a cache in place; ATTENTION reads the updated caches
    KV_WRITE = enum.auto()  # (cache, rows, positions) -> the cache, rows written
    ATTENTION = enum.auto()  # (q, k_cache, v_cache, positions); arg: AttentionArg
    # reductions
    ARGMAX = enum.auto()  # per row, first index of the maximum
    # fused: exact compositions of the ops above (FUSED says which)
    RMS_NORM_MUL = enum.auto()  # (x, w); arg eps: MUL(RMS_NORM(x, eps), w)
    MATMUL_ADD = enum.auto()  # (x, weight[, bias], r): ADD(r, MATMUL(x, weight[, bias]))
    MATMUL_SWIGLU = enum.auto()  # (x, w_gate, w_up): SWIGLU(MATMUL(x, w_gate), MATMUL(x, w_up))

    @property
    def is_leaf(self) -> bool:
        return self in LEAVES


LEAVES = frozenset({Op.INPUT, Op.WEIGHT, Op.STATE})
# fused op -> the composition it stands for, as the explain plan and the docs name it
FUSED = {
    Op.RMS_NORM_MUL: "RMS_NORM + MUL",
    Op.MATMUL_ADD: "MATMUL + ADD",
    Op.MATMUL_SWIGLU: "MATMUL + MATMUL + SWIGLU",
}
# ops that multiply by weight matrices: x is source 0, the matrices are the sources MATRICES says
MATRICES = {Op.MATMUL: (1,), Op.MATMUL_ADD: (1,), Op.MATMUL_SWIGLU: (1, 2)}
MATMULS = frozenset(MATRICES)


def matrix_sources(node: Node) -> tuple[int, ...]:
    """Which of a matrix product's sources are its weight matrices (positions in ``src``)."""
    return MATRICES.get(node.op, ())


@attrs.frozen
class SliceArg:
    start: int
    count: int


@attrs.frozen
class RopeArg:
    n_head: int
    head_dim: int
    n_rot: int  # dims rotated per head; the rest pass through
    mode: str  # "normal": pairs (2i, 2i+1); "neox": pairs (i, i + n_rot/2)


@attrs.frozen
class AttentionArg:
    n_head: int
    n_head_kv: int
    head_dim: int
    scale: float  # exactly representable in float32
    window: int = 0  # > 0: a token at p reads positions p - window + 1 .. p (sliding window)
    # > 0: every token's position is below this (GraphParams.reach, which the caller keeps), so
    # a backend may size its launches to it; the values are the same either way
    reach: int = 0


@attrs.frozen(cache_hash=True)
class Node:
    op: Op
    dtype: DType
    shape: tuple[int, ...]
    src: tuple[int, ...] = ()
    arg: Any = None

    @property
    def name(self) -> str | None:
        """The bound name of a leaf (None for computed nodes)."""
        return self.arg if self.op.is_leaf else None


@attrs.frozen(cache_hash=True)
class Graph:
    """Nodes in topological order (a node's id is its index) and the ids of its outputs.

    ``origin`` is set on a rewritten graph (``Backend.rewrite``): per node, the id in the graph
    it was rewritten from of the node whose value it computes (a fused node: the root of the
    composition it replaces), or -1 for a node that graph has no value for (a QUANTIZE).
    """

    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]
    origin: tuple[int, ...] | None = None

    def original(self, node: int) -> int:
        """The id in the original graph of the value ``node`` computes (-1: none)."""
        return node if self.origin is None else self.origin[node]

    def rewritten(self) -> dict[int, int]:
        """Original node id -> the id here of the node computing its value."""
        if self.origin is None:
            return {i: i for i in range(len(self.nodes))}
        return {o: i for i, o in enumerate(self.origin) if o >= 0}

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def leaves(self, op: Op) -> dict[str, int]:
        """Name -> node id of the leaves of one kind (INPUT, WEIGHT or STATE)."""
        return {n.arg: i for i, n in enumerate(self.nodes) if n.op is op}

    def consumers(self) -> list[list[int]]:
        """For every node id, the ids of the nodes that read it."""
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for s in node.src:
                users[s].append(i)
        return users


def _need(ok: bool, op: Op, what: str) -> None:
    if not ok:
        raise GraphError(f"{op.name}: {what}")


def _rows(op: Op, n: Node, what: str) -> None:
    _need(n.dtype is DType.F32 and len(n.shape) == 2, op, f"{what} must be f32 (rows, width)")


def _positions(op: Op, n: Node, rows: int) -> None:
    _need(n.dtype is DType.I32 and n.shape == (rows,), op, f"positions must be i32[{rows}]")


def _exact_constant(arg: Any) -> bool:
    return isinstance(arg, float) and math.isfinite(arg) and float(np.float32(arg)) == arg


def _exact_eps(arg: Any) -> bool:
    return isinstance(arg, float) and arg > 0 and float(np.float32(arg)) == arg


def _matmul_operands(op: Op, x: Node, w: Node) -> None:
    _need(w.op is Op.WEIGHT and len(w.shape) == 2, op, "the matrix must be a 2-D weight")
    _need(w.dtype in WEIGHT_TYPES, op, f"{w.dtype.name} is not a weight type")
    if x.dtype is DType.Q8A:
        _need(w.dtype.is_quantized, op, f"Q8A x needs a quantized weight, not {w.dtype.name}")
        _need(len(x.shape) == 2, op, "x must be (rows, width)")
    else:
        _rows(op, x, "x")
    _need(x.shape[1] == w.shape[1], op, f"x width {x.shape[1]} != weight cols {w.shape[1]}")
    _need(w.shape[1] % w.dtype.block_size == 0, op, "weight cols must fill whole blocks")


# sources each op takes (MATMUL: 2 or 3, with a bias)
ARITY = {
    Op.GET_ROWS: 2,
    Op.SLICE_ROWS: 1,
    Op.RESHAPE: 1,
    Op.ADD: 2,
    Op.MUL: 2,
    Op.SILU: 1,
    Op.SWIGLU: 2,
    Op.GELU: 1,
    Op.GEGLU: 2,
    Op.SCALE: 1,
    Op.RMS_NORM: 1,
    Op.ROPE: 4,
    Op.KV_WRITE: 3,
    Op.ATTENTION: 4,
    Op.ARGMAX: 1,
    Op.QUANTIZE: 1,
    Op.RMS_NORM_MUL: 2,
    Op.MATMUL_SWIGLU: 3,
}
# ops whose source count varies: (fewest, most), the optional source being a bias
VARIADIC = {Op.MATMUL: (2, 3), Op.MATMUL_ADD: (3, 4)}


def infer(op: Op, srcs: Sequence[Node], arg: Any) -> tuple[DType, tuple[int, ...]]:
    """The (dtype, shape) of ``op`` applied to ``srcs``; GraphError if the signature is wrong."""
    _need(not op.is_leaf, op, "leaves have no sources; use the builder's leaf methods")
    if op in VARIADIC:
        lo, hi = VARIADIC[op]
        form = "(x, weight[, bias])" if op is Op.MATMUL else "(x, weight[, bias], residual)"
        _need(lo <= len(srcs) <= hi, op, f"takes {form}, got {len(srcs)} sources")
    else:
        _need(len(srcs) == ARITY[op], op, f"takes {ARITY[op]} sources, got {len(srcs)}")

    if op is Op.GET_ROWS:
        w, ids = srcs
        _need(w.op is Op.WEIGHT and len(w.shape) == 2, op, "source 0 must be a 2-D weight")
        _need(ids.dtype is DType.I32 and len(ids.shape) == 1, op, "ids must be i32[n]")
        return DType.F32, (ids.shape[0], w.shape[1])
    if op is Op.SLICE_ROWS:
        (x,) = srcs
        _need(isinstance(arg, SliceArg), op, "arg must be a SliceArg")
        _need(len(x.shape) >= 1, op, "source must have rows")
        end = arg.start + arg.count
        _need(
            arg.start >= 0 and arg.count >= 1 and end <= x.shape[0],
            op,
            f"rows [{arg.start}, {end}) outside 0..{x.shape[0]}",
        )
        return x.dtype, (arg.count, *x.shape[1:])
    if op is Op.RESHAPE:
        (x,) = srcs
        _rows(op, x, "source")
        ok = (
            isinstance(arg, tuple)
            and len(arg) == 2
            and all(isinstance(d, int) and d >= 1 for d in arg)
        )
        _need(ok, op, "arg must be the new shape, (rows, width) of positive ints")
        _need(
            arg[0] * arg[1] == x.shape[0] * x.shape[1],
            op,
            f"{x.shape} cannot be viewed as {arg}: the element counts differ",
        )
        return DType.F32, arg
    if op in (Op.ADD, Op.MUL, Op.SWIGLU, Op.GEGLU):
        a, b = srcs
        _rows(op, a, "source 0")
        _need(b.dtype is DType.F32, op, "source 1 must be f32")
        if op in (Op.SWIGLU, Op.GEGLU):
            _need(b.shape == a.shape, op, f"gate {a.shape} and up {b.shape} differ")
        else:
            _need(
                b.shape in (a.shape, a.shape[1:]),
                op,
                f"source 1 {b.shape} must be {a.shape} or a row vector {a.shape[1:]}",
            )
        return DType.F32, a.shape
    if op in (Op.SILU, Op.GELU, Op.SCALE, Op.RMS_NORM):
        (x,) = srcs
        _rows(op, x, "source")
        if op is Op.SCALE:
            _need(_exact_constant(arg), op, "arg must be a finite float that float32 holds exactly")
        if op is Op.RMS_NORM:
            _need(
                _exact_eps(arg),
                op,
                "arg must be eps, a positive float exactly representable in float32",
            )
        return DType.F32, x.shape
    if op in MATMULS:
        x = srcs[0]
        weights = [srcs[k] for k in MATRICES[op]]
        for w in weights:
            _matmul_operands(op, x, w)
        n = weights[0].shape[0]
        if op is Op.MATMUL_SWIGLU:
            _need(weights[1].shape == weights[0].shape, op, "gate and up weights differ in shape")
            return DType.F32, (x.shape[0], n)
        rest = srcs[2:]
        if op is Op.MATMUL_ADD:
            r = rest[-1]
            _need(
                r.dtype is DType.F32 and r.shape == (x.shape[0], n),
                op,
                f"the residual must be f32[{x.shape[0]}, {n}]",
            )
            rest = rest[:-1]
        if rest:
            _need(
                rest[0].dtype is DType.F32 and rest[0].shape == (n,), op, f"bias must be f32[{n}]"
            )
        return DType.F32, (x.shape[0], n)
    if op is Op.QUANTIZE:
        (x,) = srcs
        _rows(op, x, "source")
        _need(x.shape[1] % 32 == 0, op, "rows must fill whole 32-element blocks")
        return DType.Q8A, x.shape
    if op is Op.RMS_NORM_MUL:
        x, w = srcs
        _rows(op, x, "x")
        _need(
            _exact_eps(arg),
            op,
            "arg must be eps, a positive float exactly representable in float32",
        )
        _need(w.dtype is DType.F32 and w.shape == x.shape[1:], op, f"w must be f32[{x.shape[1]}]")
        return DType.F32, x.shape
    if op is Op.ROPE:
        x, pos, cos, sin = srcs
        _rows(op, x, "x")
        _need(isinstance(arg, RopeArg), op, "arg must be a RopeArg")
        _need(arg.mode in ("normal", "neox"), op, f"unknown mode {arg.mode!r}")
        _need(x.shape[1] == arg.n_head * arg.head_dim, op, "x width != n_head * head_dim")
        _need(
            0 < arg.n_rot <= arg.head_dim and arg.n_rot % 2 == 0,
            op,
            "n_rot must be even and in (0, head_dim]",
        )
        _positions(op, pos, x.shape[0])
        for t in (cos, sin):
            _need(
                t.dtype is DType.F32 and len(t.shape) == 2 and t.shape[1] == arg.n_rot // 2,
                op,
                f"tables must be f32 (n_ctx, {arg.n_rot // 2})",
            )
        return DType.F32, x.shape
    if op is Op.KV_WRITE:
        cache, rows, pos = srcs
        _need(cache.op is Op.STATE, op, "source 0 must be a STATE (the cache)")
        _rows(op, rows, "rows")
        _need(cache.shape[1:] == rows.shape[1:], op, "rows width != cache width")
        _positions(op, pos, rows.shape[0])
        return cache.dtype, cache.shape
    if op is Op.ATTENTION:
        q, k, v, pos = srcs
        _rows(op, q, "q")
        _need(isinstance(arg, AttentionArg), op, "arg must be an AttentionArg")
        _need(k.op is Op.KV_WRITE and v.op is Op.KV_WRITE, op, "k and v must be KV_WRITE results")
        _need(
            arg.n_head_kv >= 1 and arg.n_head % arg.n_head_kv == 0,
            op,
            "n_head must be a multiple of n_head_kv >= 1",
        )
        _need(
            float(np.float32(arg.scale)) == arg.scale,
            op,
            "scale must be exactly representable in float32",
        )
        _need(q.shape[1] == arg.n_head * arg.head_dim, op, "q width != n_head * head_dim")
        _need(
            isinstance(arg.window, int) and arg.window >= 0,
            op,
            "window must be an int >= 0 (0: every position up to the token's own)",
        )
        kv_width = arg.n_head_kv * arg.head_dim
        _need(
            k.shape[1] == kv_width and v.shape == k.shape, op, f"caches must be (n_ctx, {kv_width})"
        )
        _positions(op, pos, q.shape[0])
        return DType.F32, q.shape
    if op is Op.ARGMAX:
        (x,) = srcs
        _rows(op, x, "source")
        return DType.I32, (x.shape[0],)
    raise GraphError(f"no signature for {op.name}")


# the element types each kind of leaf may have
LEAF_TYPES = {
    Op.INPUT: (DType.F32, DType.I32, DType.Q8A),
    Op.WEIGHT: WEIGHT_TYPES,
    Op.STATE: (DType.F32,),
}


def verify(graph: Graph) -> None:
    """Check single assignment, topological order, leaves at the head, every node's type and
    shape, unique leaf names, and outputs that are distinct computed nodes; raise GraphError
    naming the first bad node."""
    seen: dict[tuple[Op, str], int] = {}
    head = True
    for i, node in enumerate(graph.nodes):
        if not isinstance(node, Node) or not isinstance(node.op, Op):
            raise GraphError(f"node %{i}: not a Node, got {type(node).__name__}")
        where = f"node %{i} ({node.op.name})"
        if not all(isinstance(d, int) and d >= 1 for d in node.shape):
            raise GraphError(f"{where}: shape {node.shape} must be positive integers")
        if node.op.is_leaf:
            if not head:
                raise GraphError(f"{where}: leaves must precede computed nodes (graph head)")
            if node.src or not isinstance(node.arg, str) or not node.arg:
                raise GraphError(f"{where}: a leaf has no sources and a non-empty name")
            if node.dtype not in LEAF_TYPES[node.op]:
                raise GraphError(f"{where}: cannot be {node.dtype.name}")
            if (node.op, node.arg) in seen:
                raise GraphError(f"{where}: {node.op.name} {node.arg!r} declared twice")
            seen[node.op, node.arg] = i
            continue
        head = False
        for s in node.src:
            if not 0 <= s < i:
                raise GraphError(f"{where}: source %{s} is not an earlier node")
        try:
            dtype, shape = infer(node.op, [graph.nodes[s] for s in node.src], node.arg)
        except GraphError as e:
            raise GraphError(f"{where}: {e}") from None
        if (dtype, shape) != (node.dtype, node.shape):
            raise GraphError(
                f"{where}: declared {node.dtype.name}{list(node.shape)}, "
                f"its sources give {dtype.name}{list(shape)}"
            )
    if graph.origin is not None:
        if len(graph.origin) != len(graph.nodes):
            raise GraphError(f"origin lists {len(graph.origin)} nodes, the graph has {len(graph)}")
        known = [o for o in graph.origin if o >= 0]
        if len(set(known)) != len(known) or any(o < -1 for o in graph.origin):
            raise GraphError("origin must name each original node at most once (or -1)")
    users = graph.consumers()
    for s in graph.leaves(Op.STATE).values():
        if [graph.nodes[u].op for u in users[s]] != [Op.KV_WRITE]:
            raise GraphError(f"node %{s}: a STATE must be read by exactly one KV_WRITE")
    if not graph.outputs:
        raise GraphError("graph has no outputs")
    if len(set(graph.outputs)) != len(graph.outputs):
        raise GraphError(f"outputs {list(graph.outputs)} name a node twice")
    for o in graph.outputs:
        if not 0 <= o < len(graph.nodes):
            raise GraphError(f"output %{o} is not a node")
        if graph.nodes[o].op.is_leaf:
            raise GraphError(f"output %{o} is a leaf; outputs are computed nodes")
