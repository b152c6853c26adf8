"""Fusion passes: a graph rewritten so that fused ops (``ir.FUSED``) stand in for the compositions
they are defined as, and matrix products that read one x share one activation quantization.

A backend's ``rewrite`` calls ``fuse(graph, accept=...)``: ``accept(node, srcs)`` says whether
the backend runs a candidate node (usually ``supports_op``), so a backend only ever gets fused
nodes it has kernels for. A pass never fuses away a value something else needs (a graph output,
or a node with another consumer), and every fused op is an exact composition
(docs/numerics.md, "Fused ops"), so the rewritten graph computes the original's bits. The result
records each node's origin (``Graph.origin``), which is how the runtime, the conformance kit and
``parity compare`` find the original nodes that still exist.

The passes, in the order they run:

- ``gate_up``: ``SWIGLU(MATMUL(x, w_gate), MATMUL(x, w_up))`` -> ``MATMUL_SWIGLU(x, w_gate, w_up)``
- ``norm_mul``: ``MUL(RMS_NORM(x), w)`` (w a row vector) -> ``RMS_NORM_MUL(x, w)``
- ``matmul_add``: ``ADD(r, MATMUL(x, w[, b]))`` -> ``MATMUL_ADD(x, w[, b], r)``
- ``share_quantization``: x read by ``share_min`` or more matrix products with quantized
  weights -> one ``QUANTIZE(x)`` that they all read
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from parity.core.dtypes import DType
from parity.core.ir import MATMULS, Graph, Node, Op, infer, matrix_sources, verify

PASSES = ("gate_up", "norm_mul", "matmul_add", "share_quantization")
Accept = Callable[[Node, Sequence[Node]], bool]


@attrs.frozen
class New:
    """A node a pass inserts (it has no origin): ``index`` into the edit's new nodes."""

    index: int


Ref = int | New


@attrs.define
class _Edit:
    """Changes to one graph, applied all at once by ``build``. Every node put in is typed when
    it is made (``typed``), so a candidate's sources are looked up, never re-inferred."""

    graph: Graph
    replace: dict[int, tuple[Op, tuple[Ref, ...], Any]] = attrs.Factory(dict)
    dead: set[int] = attrs.Factory(set)
    new: list[tuple[Op, tuple[Ref, ...], Any]] = attrs.Factory(list)
    before: dict[int, list[int]] = attrs.Factory(dict)  # node id -> new nodes placed before it
    typed: dict[Ref, Node] = attrs.Factory(dict)  # replacements and new nodes, typed

    def candidate(self, op: Op, srcs: Sequence[Ref], arg: Any = None) -> tuple[Node, list[Node]]:
        """The node ``op(srcs)`` would be, typed, and its source nodes (for ``accept``)."""
        nodes = [self.typed[s] if s in self.typed else self.graph.nodes[s] for s in srcs]
        dtype, shape = infer(op, nodes, arg)
        return Node(op, dtype, shape, (), arg), nodes

    def put(self, at: int, op: Op, srcs: tuple[Ref, ...], arg: Any, node: Node) -> None:
        """Node ``at`` becomes ``op(srcs)`` (typed as ``node``)."""
        self.replace[at] = (op, srcs, arg)
        self.typed[at] = node

    def add(self, op: Op, srcs: tuple[Ref, ...], node: Node) -> New:
        """A new node ``op(srcs)`` (typed as ``node``); ``place`` says where it goes."""
        ref = New(len(self.new))
        self.new.append((op, srcs, None))
        self.typed[ref] = node
        return ref

    def drop(self, ref: New) -> None:
        """Take back the last node ``add`` made."""
        self.new.pop()
        del self.typed[ref]

    def build(self) -> Graph:
        """The edited graph, its origin composed with the input graph's (not verified)."""
        ids: dict[Ref, int] = {}
        nodes: list[Node] = []
        origin: list[int] = []

        def emit(ref: Ref, node: Node, srcs: Sequence[Ref], orig: int) -> None:
            ids[ref] = len(nodes)
            nodes.append(attrs.evolve(node, src=tuple(ids[s] for s in srcs)))
            origin.append(orig)

        for i, node in enumerate(self.graph.nodes):
            for k in self.before.get(i, ()):
                ref = New(k)
                emit(ref, self.typed[ref], self.new[k][1], -1)
            if i in self.dead:
                continue
            if i in self.replace:
                emit(i, self.typed[i], self.replace[i][1], self.graph.original(i))
            else:  # the same value as before: only its sources' ids move
                emit(i, node, node.src, self.graph.original(i))
        return Graph(tuple(nodes), tuple(ids[o] for o in self.graph.outputs), tuple(origin))


def fuse(
    graph: Graph,
    *,
    accept: Accept,
    passes: Sequence[str] = PASSES,
    share_min: int = 2,
) -> Graph:
    """``graph`` with the named passes applied, in PASSES order, each candidate node kept only
    where ``accept`` takes it. ``share_min``: matrix products that must read one x before it is
    quantized once for them (1 quantizes every quantized product's x in a node of its own)."""
    unknown = sorted(set(passes) - set(PASSES))
    if unknown:
        raise ValueError(f"unknown fusion pass(es) {unknown}; the passes are {list(PASSES)}")
    changed = False
    for name in PASSES:
        if name in passes:
            edit = _Edit(graph)
            _PASSES[name](edit, graph.consumers(), set(graph.outputs), accept, share_min)
            if edit.replace or edit.new:
                graph, changed = edit.build(), True
    if changed:
        verify(graph)
    return graph


def _only_user(users: list[list[int]], outputs: set[int], node: int, user: int) -> bool:
    """Is ``user`` the one consumer of ``node``, whose value nothing else needs?"""
    return users[node] == [user] and node not in outputs


def _gate_up(
    edit: _Edit, users: list[list[int]], outputs: set[int], accept: Accept, _: int
) -> None:
    nodes = edit.graph.nodes
    for i, node in enumerate(nodes):
        if node.op is not Op.SWIGLU:
            continue
        g, u = (nodes[s] for s in node.src)
        if not (g.op is Op.MATMUL is u.op and len(g.src) == 2 == len(u.src)):
            continue  # biased projections stay as they are
        if g.src[0] != u.src[0] or node.src[0] == node.src[1]:
            continue
        if not all(_only_user(users, outputs, s, i) for s in node.src):
            continue
        srcs = (g.src[0], g.src[1], u.src[1])
        fused, sources = edit.candidate(Op.MATMUL_SWIGLU, srcs)
        if accept(fused, sources):
            edit.put(i, Op.MATMUL_SWIGLU, srcs, None, fused)
            edit.dead.update(node.src)


def _norm_mul(
    edit: _Edit, users: list[list[int]], outputs: set[int], accept: Accept, _: int
) -> None:
    nodes = edit.graph.nodes
    for i, node in enumerate(nodes):
        if node.op is not Op.MUL:
            continue
        a, w = node.src
        norm = nodes[a]
        if norm.op is not Op.RMS_NORM or nodes[w].shape != norm.shape[1:]:
            continue
        if not _only_user(users, outputs, a, i):
            continue
        srcs = (norm.src[0], w)
        fused, sources = edit.candidate(Op.RMS_NORM_MUL, srcs, norm.arg)
        if accept(fused, sources):
            edit.put(i, Op.RMS_NORM_MUL, srcs, norm.arg, fused)
            edit.dead.add(a)


def _matmul_add(
    edit: _Edit, users: list[list[int]], outputs: set[int], accept: Accept, _: int
) -> None:
    nodes = edit.graph.nodes
    for i, node in enumerate(nodes):
        if node.op is not Op.ADD or nodes[node.src[0]].shape != nodes[node.src[1]].shape:
            continue
        for m, r in (node.src[::-1], node.src):  # the product second first, as decoders write it
            product = nodes[m]
            if product.op is not Op.MATMUL or m == r or not _only_user(users, outputs, m, i):
                continue
            srcs = (*product.src, r)
            fused, sources = edit.candidate(Op.MATMUL_ADD, srcs)
            if accept(fused, sources):
                edit.put(i, Op.MATMUL_ADD, srcs, None, fused)
                edit.dead.add(m)
                break


def _share_quantization(
    edit: _Edit, users: list[list[int]], outputs: set[int], accept: Accept, share_min: int
) -> None:
    nodes = edit.graph.nodes
    for x, node in enumerate(nodes):
        if node.dtype is not DType.F32 or len(node.shape) != 2 or node.shape[1] % 32:
            continue
        readers = [
            u
            for u in dict.fromkeys(users[x])
            if nodes[u].op in MATMULS
            and nodes[u].src[0] == x
            and x not in nodes[u].src[1:]
            and all(nodes[nodes[u].src[k]].dtype.is_quantized for k in matrix_sources(nodes[u]))
        ]
        if len(readers) < share_min:
            continue
        q_node, q_srcs = edit.candidate(Op.QUANTIZE, (x,))
        if not accept(q_node, q_srcs):
            continue
        quantized = edit.add(Op.QUANTIZE, (x,), q_node)
        taken = []
        for u in readers:
            srcs = (quantized, *nodes[u].src[1:])
            reader, sources = edit.candidate(nodes[u].op, srcs, nodes[u].arg)
            if accept(reader, sources):
                taken.append((u, srcs, reader))
        if len(taken) < share_min:
            edit.drop(quantized)
            continue
        edit.before.setdefault(taken[0][0], []).append(quantized.index)
        for u, srcs, reader in taken:
            edit.put(u, nodes[u].op, srcs, nodes[u].arg, reader)


_PASSES: Mapping[str, Callable[..., None]] = {
    "gate_up": _gate_up,
    "norm_mul": _norm_mul,
    "matmul_add": _matmul_add,
    "share_quantization": _share_quantization,
}
