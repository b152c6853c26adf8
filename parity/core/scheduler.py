"""Assign every node to a backend, cut the graph into splits, and say why.

Backends are tried in priority order (the chosen backend first, ``cpu`` last); a node goes to
the first whose ``supports_op`` accepts it. The scheduler never branches on backend names.
Anything that is not the first choice is a fallback, which ``strict`` turns into an error.

Under ``numerics = "exact"`` a backend gets a node only if it computes it exactly
(``op_numerics``); under ``"fast"`` any supporting backend will do.

A split is a maximal run of consecutive computed nodes on one backend. Leaves belong to no
split: INPUTs are uploaded to each backend that reads them, WEIGHTs are registered on each
backend that reads them, and a STATE lives on the backend of its one KV_WRITE, which runs
where the cache's readers run whenever that backend supports it (so a cache never crosses
backends every step).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

import attrs

from parity.core.backend import Backend, Split
from parity.core.ir import FUSED, Graph, Node, Op
from parity.core.tiers import manifest_of
from parity.errors import GraphError, SchedulingError

HOST = "host"  # where INPUT leaves start


@attrs.frozen
class Placement:
    backend: str
    reason: str
    fallback: bool = False
    numerics: str = "exact"  # how the backend computes this node


@attrs.frozen
class Copy:
    """Before split ``split`` runs, node ``node``'s value moves from ``src`` to ``dst``."""

    split: int
    node: int
    src: str
    dst: str


@attrs.frozen
class Plan:
    graph: Graph = attrs.field(repr=False)
    placements: tuple[Placement | None, ...]  # per node; None for WEIGHT/INPUT leaves
    splits: tuple[Split, ...]
    copies: tuple[Copy, ...]

    @property
    def fallbacks(self) -> list[int]:
        return [i for i, p in enumerate(self.placements) if p is not None and p.fallback]

    def backend_of(self, node: int) -> str | None:
        p = self.placements[node]
        return p.backend if p is not None else None

    def summary(self) -> dict:
        ops = Counter(
            (self.graph.nodes[i].op.name, p.backend)
            for i, p in enumerate(self.placements)
            if p is not None and not self.graph.nodes[i].op.is_leaf
        )
        return {
            "nodes": len(self.graph.nodes),
            "splits": len(self.splits),
            "copies": sum(1 for c in self.copies if c.src != HOST),
            "fallbacks": len(self.fallbacks),
            "ops": [{"op": op, "backend": b, "count": n} for (op, b), n in sorted(ops.items())],
            "fusions": self.fusions(),
        }

    def fusions(self) -> list[dict]:
        """What the rewrite put in: per fused op, how many and what each stands for; per shared
        quantization, how many matrix products read one QUANTIZE."""
        if self.graph.origin is None:
            return []
        counts = Counter(n.op for n in self.graph.nodes if n.op in FUSED or n.op is Op.QUANTIZE)
        found = [
            {"op": op.name, "count": n, "replaces": FUSED[op]}
            for op, n in sorted(counts.items(), key=lambda item: item[0].name)
            if op in FUSED
        ]
        if counts[Op.QUANTIZE]:
            users = self.graph.consumers()
            readers = sum(
                len(users[i]) for i, n in enumerate(self.graph.nodes) if n.op is Op.QUANTIZE
            )
            found.append(
                {
                    "op": "QUANTIZE",
                    "count": counts[Op.QUANTIZE],
                    "replaces": f"the activation quantization of {readers} matrix products",
                }
            )
        return found

    def explain(self, verbose: bool = False) -> str:
        """A readable plan: per op kind where it runs, every fallback with its reason, the
        splits; ``verbose`` lists every node."""
        s = self.summary()
        lines = [
            f"{s['nodes']} nodes, {s['splits']} split(s), {s['copies']} cross-backend "
            f"copies, {s['fallbacks']} fallback(s)"
        ]
        lines += [f"  {o['op']:<14} x{o['count']:<4} -> {o['backend']}" for o in s["ops"]]
        if s["fusions"]:
            lines.append("  fusions (the first backend's rewrite):")
            lines += [
                f"    {f['op']:<14} x{f['count']:<4} for {f['replaces']}" for f in s["fusions"]
            ]
        for i in self.fallbacks:
            n, p = self.graph.nodes[i], self.placements[i]
            lines.append(f"  fallback %{i} {n.op.name} -> {p.backend}: {p.reason}")
        for sp in self.splits:
            lines.append(
                f"  split {sp.index} on {sp.backend}: nodes %{sp.nodes[0]}..%{sp.nodes[-1]} "
                f"({len(sp.nodes)}), {len(sp.inputs)} inputs, {len(sp.outputs)} outputs"
            )
        if verbose:
            for i, (n, p) in enumerate(zip(self.graph.nodes, self.placements, strict=True)):
                where = p.backend if p else "(registered where read)"
                why = f"  # {p.reason}" if p else ""
                lines.append(f"  %{i:<4} {n.op.name:<14} -> {where}{why}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                **self.summary(),
                "placements": [
                    None
                    if p is None
                    else {"backend": p.backend, "reason": p.reason, "fallback": p.fallback}
                    for p in self.placements
                ],
            }
        )


def accepts(backend: Backend, node: Node, srcs: Sequence[Node]) -> bool:
    """Would the scheduler give ``node`` to ``backend`` (supported, in the backend's numerics)?
    What a rewrite's ``accept`` should ask of a fused node it is about to put in."""
    return _accepts(backend, node, list(srcs))[0] is not None


def _accepts(b: Backend, node: Node, srcs: list[Node]) -> tuple[str | None, str]:
    """(the numerics b would use, or None if it cannot take the node; why not)."""
    if not b.supports_op(node, srcs):
        return None, b.why_unsupported(node, srcs)
    mode = b.op_numerics(node, srcs)
    if not manifest_of(b).tier_of(node, srcs).exact:
        mode = "fast"  # a declared bound is fast numerics, whatever op_numerics says
    if mode != "exact" and b.numerics == "exact":
        return None, f"{b.name} computes {node.op.name} only in {mode} numerics"
    return mode, ""


def place(graph: Graph, backends: Sequence[Backend]) -> list[Placement | None]:
    """Choose a backend for every computed node and STATE leaf."""
    if not backends:
        raise SchedulingError("no backends to schedule on; pass at least the cpu backend")
    placements: list[Placement | None] = [None] * len(graph.nodes)
    first = backends[0].name
    for i, node in enumerate(graph.nodes):
        if node.op.is_leaf:
            continue
        srcs = [graph.nodes[s] for s in node.src]
        refusals = []
        for b in backends:
            mode, why_not = _accepts(b, node, srcs)
            if mode is not None:
                fallback = b.name != first
                why = "; ".join(refusals) if fallback else f"{b.name} supports it"
                placements[i] = Placement(b.name, why, fallback, mode)
                break
            refusals.append(why_not)
        else:
            raise SchedulingError(
                f"no backend can run %{i} {node.op.name}: {'; '.join(refusals)}. "
                "Install or enable a backend that supports it"
            )
    users = graph.consumers()
    by_name = {b.name: b for b in backends}
    for i, node in enumerate(graph.nodes):
        if node.op is not Op.KV_WRITE:
            continue
        readers = {placements[u].backend for u in users[i]}
        here = placements[i].backend
        if len(readers) == 1 and here not in readers:
            (there,) = readers
            srcs = [graph.nodes[s] for s in node.src]
            mode, _ = _accepts(by_name[there], node, srcs)
            if mode is not None:
                placements[i] = Placement(
                    there, f"with its readers, so the cache stays on {there}",
                    there != first, mode,
                )  # fmt: skip
    for s in graph.leaves(Op.STATE).values():
        (writer,) = users[s]  # verify() guarantees one KV_WRITE per STATE
        p = placements[writer]
        placements[s] = Placement(p.backend, f"state of %{writer}, which runs on {p.backend}")
    return placements


def schedule(
    graph: Graph,
    backends: Sequence[Backend],
    *,
    strict: bool = False,
    expose: Sequence[int] = (),
) -> Plan:
    """Plan ``graph`` over ``backends`` (priority order). ``expose`` lists extra node ids whose
    values must be read back (the oracle comparison exposes every node)."""
    for i in expose:
        if not (0 <= i < len(graph.nodes)) or graph.nodes[i].op.is_leaf:
            raise GraphError(f"cannot expose %{i}: only computed nodes have values to read back")
    placements = place(graph, backends)
    fallbacks = [i for i, p in enumerate(placements) if p is not None and p.fallback]
    if strict and fallbacks:
        detail = "; ".join(
            f"%{i} {graph.nodes[i].op.name} -> {placements[i].backend} ({placements[i].reason})"
            for i in fallbacks[:8]
        )
        more = f" and {len(fallbacks) - 8} more" if len(fallbacks) > 8 else ""
        raise SchedulingError(
            f"strict mode: {len(fallbacks)} node(s) cannot run on {backends[0].name}: "
            f"{detail}{more}. Turn strict off to allow the fallback."
        )

    # maximal runs of consecutive computed nodes on one backend
    runs: list[tuple[str, list[int]]] = []
    for i, node in enumerate(graph.nodes):
        if node.op.is_leaf:
            continue
        b = placements[i].backend
        if runs and runs[-1][0] == b:
            runs[-1][1].append(i)
        else:
            runs.append((b, [i]))

    users = graph.consumers()
    split_of = {i: k for k, (_, ids) in enumerate(runs) for i in ids}
    needed_outside = set(graph.outputs) | set(expose)
    splits, copies = [], []
    location: dict[int, set[str]] = {}  # node -> backends holding its value so far
    for k, (b, ids) in enumerate(runs):
        members = set(ids)
        inputs = sorted({s for i in ids for s in graph.nodes[i].src if s not in members})
        outputs = [
            i for i in ids if i in needed_outside or any(split_of.get(u, k) != k for u in users[i])
        ]
        for s in inputs:
            op = graph.nodes[s].op
            if op is Op.WEIGHT:
                continue
            if op is Op.INPUT:
                held = location.setdefault(s, {HOST})
                src = HOST
            else:  # a STATE, or a value computed by an earlier split
                held = location.setdefault(s, {placements[s].backend})
                src = placements[s].backend
            if b not in held:
                copies.append(Copy(k, s, src, b))
                held.add(b)
        for i in outputs:
            location[i] = {b}
        splits.append(Split(k, b, graph, tuple(ids), tuple(inputs), tuple(outputs)))
    return Plan(graph, tuple(placements), tuple(splits), tuple(copies))
