"""Human-readable graph dumps: a text listing and Graphviz DOT, optionally coloured by plan."""

from __future__ import annotations

import attrs

from parity.core.ir import Graph, Node
from parity.core.scheduler import Plan

_COLOURS = ("lightblue", "palegreen", "lightsalmon", "khaki", "plum", "lightgrey")


def _arg(node: Node) -> str:
    if node.arg is None:
        return ""
    if node.op.is_leaf:
        return f" {node.arg!r}"
    if attrs.has(type(node.arg)):
        fields = ", ".join(f"{k}={v!r}" for k, v in attrs.asdict(node.arg).items())
        return f" {{{fields}}}"
    return f" {{{node.arg!r}}}"


def format_node(i: int, node: Node) -> str:
    srcs = ", ".join(f"%{s}" for s in node.src)
    return f"%{i} = {node.op.name} {node.dtype.name}{list(node.shape)} ({srcs}){_arg(node)}"


def format_graph(graph: Graph, plan: Plan | None = None) -> str:
    """One line per node, ``%id = OP dtype[shape] (%src, ...) {arg}  @backend``."""
    lines = []
    for i, node in enumerate(graph.nodes):
        line = format_node(i, node)
        where = plan.backend_of(i) if plan is not None else None
        lines.append(f"{line}  @{where}" if where else line)
    lines.append(f"outputs: {', '.join(f'%{o}' for o in graph.outputs)}")
    return "\n".join(lines)


def to_dot(graph: Graph, plan: Plan | None = None) -> str:
    """Graphviz DOT; with a plan, nodes are filled by backend. Render: ``dot -Tsvg``."""
    colour: dict[str, str] = {}
    lines = ["digraph parity {", "  node [shape=box, style=filled, fontname=monospace];"]
    for i, node in enumerate(graph.nodes):
        label = f"%{i} {node.op.name}\\n{node.dtype.name}{list(node.shape)}"
        if node.op.is_leaf:
            label += f"\\n{node.arg}"
        where = plan.backend_of(i) if plan is not None else None
        fill = "white"
        if where:
            fill = colour.setdefault(where, _COLOURS[len(colour) % len(_COLOURS)])
            label += f"\\n@{where}"
        lines.append(f'  n{i} [label="{label}", fillcolor="{fill}"];')
        lines += [f"  n{s} -> n{i};" for s in node.src]
    lines += [f"  n{o} [peripheries=2];" for o in graph.outputs]
    lines.append("}")
    return "\n".join(lines)
