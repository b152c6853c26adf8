"""Build graphs: a small builder that types nodes as they are added and puts leaves at the head,
and a cache of built graphs keyed by what they were built from."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import attrs

from parity.core.dtypes import DType
from parity.core.ir import Graph, Node, Op, infer, verify


@attrs.frozen
class Ref:
    """A handle to a node under construction (its final id is known only at ``build``)."""

    leaf: bool
    index: int


class GraphBuilder:
    """Add nodes in program order; ``build`` lays out leaves first, then computed nodes.

    Declaring the same leaf twice returns the same handle, so a tied weight used by two
    nodes is one WEIGHT leaf.
    """

    def __init__(self) -> None:
        self._leaves: list[Node] = []
        self._leaf_index: dict[tuple[Op, str], int] = {}
        self._body: list[Node] = []  # sources are Refs until build()

    def _node(self, ref: Ref) -> Node:
        return self._leaves[ref.index] if ref.leaf else self._body[ref.index]

    def _leaf(self, op: Op, name: str, dtype: DType, shape: tuple[int, ...]) -> Ref:
        key = (op, name)
        if key in self._leaf_index:
            node = self._leaves[self._leaf_index[key]]
            if (node.dtype, node.shape) != (dtype, shape):
                raise ValueError(f"{op.name} {name!r} redeclared with another type or shape")
            return Ref(True, self._leaf_index[key])
        self._leaf_index[key] = len(self._leaves)
        self._leaves.append(Node(op, dtype, tuple(shape), (), name))
        return Ref(True, len(self._leaves) - 1)

    def input(self, name: str, dtype: DType, shape: tuple[int, ...]) -> Ref:
        return self._leaf(Op.INPUT, name, dtype, shape)

    def weight(self, name: str, dtype: DType, shape: tuple[int, ...]) -> Ref:
        return self._leaf(Op.WEIGHT, name, dtype, shape)

    def state(self, name: str, shape: tuple[int, ...], dtype: DType = DType.F32) -> Ref:
        return self._leaf(Op.STATE, name, dtype, shape)

    def op(self, op: Op, *srcs: Ref, arg: Any = None) -> Ref:
        """Add a computed node; its dtype and shape come from ``ir.infer``."""
        dtype, shape = infer(op, [self._node(s) for s in srcs], arg)
        self._body.append(Node(op, dtype, shape, srcs, arg))
        return Ref(False, len(self._body) - 1)

    def build(self, *outputs: Ref) -> Graph:
        n_leaves = len(self._leaves)

        def ident(ref: Ref) -> int:
            return ref.index if ref.leaf else n_leaves + ref.index

        body = tuple(attrs.evolve(n, src=tuple(ident(s) for s in n.src)) for n in self._body)
        graph = Graph(nodes=(*self._leaves, *body), outputs=tuple(ident(o) for o in outputs))
        verify(graph)
        return graph


class GraphCache:
    """Built graphs by key (e.g. ``(model spec, GraphParams)``), least recently used evicted.

    A rebuild is structural work only: graphs name weights, they never hold them.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._graphs: OrderedDict[Hashable, Graph] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, build: Callable[[], Graph]) -> Graph:
        if key in self._graphs:
            self.hits += 1
            self._graphs.move_to_end(key)
            return self._graphs[key]
        self.misses += 1
        graph = self._graphs[key] = build()
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        return graph
