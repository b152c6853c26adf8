"""A conformance case: a small graph with everything needed to run it anywhere, and its file.

A case holds a graph, its INPUT values, its weights (packed bytes, as a GGUF stores them) and
the starting contents of its STATE buffers (KV caches). The op suite builds cases in memory;
``parity compare`` saves the first node that broke its tier as a case file (``.npz``: the
graph as JSON, every array under ``input/``, ``state/`` or ``weight/``), which the kit replays
with ``parity conformance NAME --case FILE`` or ``pytest --parity-backend NAME --parity-case
FILE``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from parity.core.builder import GraphBuilder, Ref
from parity.core.dtypes import DType, host_layout
from parity.core.ir import AttentionArg, Graph, Node, Op, RopeArg, SliceArg, verify
from parity.core.tiers import packed_type
from parity.core.weights import WeightData
from parity.errors import ParityError

FORMAT = "parity-case/1"
_ARG_TYPES = {cls.__name__: cls for cls in (SliceArg, RopeArg, AttentionArg)}


class CaseFileError(ParityError):
    """A case file that cannot be read: missing, not a case, or damaged."""


@attrs.frozen
class Case:
    id: str
    graph: Graph
    inputs: Mapping[str, np.ndarray] = attrs.field(eq=False, repr=False)
    weights: Mapping[str, WeightData] = attrs.field(eq=False, repr=False)
    states: Mapping[str, np.ndarray] = attrs.field(factory=dict, eq=False, repr=False)
    note: str = ""  # where the case came from (e.g. the compare run that saved it)
    rewrite: bool = False  # run it as the backend rewrites it (a case of a fusion)

    def __attrs_post_init__(self) -> None:
        """Every leaf of the graph has a value of its declared type and shape (a state may be
        left out: it starts at zero), and nothing else is given."""
        given = {Op.INPUT: self.inputs, Op.STATE: self.states, Op.WEIGHT: self.weights}
        for op, values in given.items():
            leaves = {n.arg: n for n in self.graph if n.op is op}
            unknown = sorted(set(values) - set(leaves))
            missing = sorted(set(leaves) - set(values)) if op is not Op.STATE else []
            if unknown or missing:
                raise ValueError(
                    f"case {self.id!r}: {op.name.lower()} values do not match the graph "
                    f"(missing {missing or 'none'}, unknown {unknown or 'none'})"
                )
            for name, value in values.items():
                node = leaves[name]
                if isinstance(value, WeightData):
                    have = f"{value.dtype.name}{list(value.shape)}"
                    ok = (value.dtype, value.shape) == (node.dtype, node.shape)
                else:
                    have = f"{np.asarray(value).dtype}{list(np.shape(value))}"
                    ok = (np.asarray(value).dtype, np.shape(value)) == host_layout(
                        node.dtype, node.shape
                    )
                if not ok:
                    raise ValueError(
                        f"case {self.id!r}: {op.name.lower()} {name!r} is {have}, the graph "
                        f"declares {node.dtype.name}{list(node.shape)}"
                    )

    @property
    def subject(self) -> Node:
        """The node the case is about: its first output."""
        return self.graph.nodes[self.graph.outputs[0]]

    @property
    def weight_type(self) -> DType | None:
        """The type of the subject's packed weight (MATMUL, GET_ROWS), if it has one."""
        return packed_type(self.subject, [self.graph.nodes[s] for s in self.subject.src])


def node_case(
    graph: Graph,
    node_id: int,
    values: Mapping[int, np.ndarray],
    inputs: Mapping[str, np.ndarray],
    weights: Mapping[str, WeightData],
    states: Mapping[str, np.ndarray],
    case_id: str,
    note: str = "",
) -> Case:
    """One node of a graph as a standalone case. A computed source with a value in ``values``
    (the reference's) becomes an INPUT holding it; one without (a QUANTIZE a rewrite put in)
    is computed in the case from its own sources, and so is a KV_WRITE (ATTENTION reads caches
    only through one), on the cache as it was before the step. Leaves keep kind and value."""
    b = GraphBuilder()
    case_inputs: dict[str, np.ndarray] = {}
    case_weights: dict[str, WeightData] = {}
    case_states: dict[str, np.ndarray] = {}

    def operand(s: int) -> Ref:
        src = graph.nodes[s]
        if src.op is Op.WEIGHT:
            case_weights[src.arg] = weights[src.arg]
            return b.weight(src.arg, src.dtype, src.shape)
        if src.op is Op.STATE:
            case_states[src.arg] = states[src.arg]
            return b.state(src.arg, src.shape, src.dtype)
        if src.op is Op.KV_WRITE or (src.op is not Op.INPUT and s not in values):
            return b.op(src.op, *(operand(t) for t in src.src), arg=src.arg)
        name = src.arg if src.op is Op.INPUT else f"{src.op.name.lower()}_{s}"
        case_inputs[name] = inputs[src.arg] if src.op is Op.INPUT else values[s]
        return b.input(name, src.dtype, src.shape)

    node = graph.nodes[node_id]
    out = b.op(node.op, *(operand(s) for s in node.src), arg=node.arg)
    return Case(case_id, b.build(out), case_inputs, case_weights, case_states, note)


# -- graphs as JSON --------------------------------------------------------------------------


def _arg_to_json(arg: Any) -> Any:
    if attrs.has(type(arg)):
        return {"type": type(arg).__name__, **attrs.asdict(arg)}
    # None, a float (RMS_NORM eps; JSON keeps float64 exactly), a leaf's name or a RESHAPE's
    # shape (a list in JSON)
    return arg


def _arg_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        fields = dict(value)
        cls = _ARG_TYPES[fields.pop("type")]
        return cls(**fields)
    if isinstance(value, list):  # a RESHAPE's shape
        return tuple(value)
    return value


def graph_to_json(graph: Graph) -> dict:
    return {
        "nodes": [
            {
                "op": n.op.name,
                "dtype": n.dtype.name,
                "shape": list(n.shape),
                "src": list(n.src),
                "arg": _arg_to_json(n.arg),
            }
            for n in graph.nodes
        ],
        "outputs": list(graph.outputs),
    }


def graph_from_json(data: dict) -> Graph:
    nodes = tuple(
        Node(
            Op[n["op"]],
            DType[n["dtype"]],
            tuple(n["shape"]),
            tuple(n["src"]),
            _arg_from_json(n["arg"]),
        )
        for n in data["nodes"]
    )
    graph = Graph(nodes, tuple(data["outputs"]))
    verify(graph)
    return graph


# -- files -----------------------------------------------------------------------------------


def save_case(case: Case, path: str | Path) -> Path:
    """Write ``case`` to ``path`` (``.npz``); returns the path written."""
    path = Path(path)
    meta = {
        "format": FORMAT,
        "id": case.id,
        "note": case.note,
        "rewrite": case.rewrite,
        "graph": graph_to_json(case.graph),
        "weights": {
            name: {"dtype": w.dtype.name, "shape": list(w.shape)}
            for name, w in case.weights.items()
        },
    }
    arrays = {"meta": np.array(json.dumps(meta))}
    arrays.update({f"input/{k}": np.asarray(v) for k, v in case.inputs.items()})
    arrays.update({f"state/{k}": np.asarray(v) for k, v in case.states.items()})
    arrays.update({f"weight/{k}": w.raw() for k, w in case.weights.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.savez_compressed(f, **arrays)
    return path


def load_case(path: str | Path) -> Case:
    """Read a case file; a CaseFileError says what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise CaseFileError(f"no case file at {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        meta = json.loads(str(arrays.pop("meta")))
        found = meta.get("format") if isinstance(meta, dict) else None
        if found != FORMAT:
            raise CaseFileError(
                f"{path} is not a parity case file (format {found!r}, want {FORMAT})"
            )
        weights = {
            name: WeightData(name, DType[w["dtype"]], tuple(w["shape"]), arrays[f"weight/{name}"])
            for name, w in meta["weights"].items()
        }
        return Case(
            str(meta["id"]),
            graph_from_json(meta["graph"]),
            inputs=_strip(arrays, "input/"),
            weights=weights,
            states=_strip(arrays, "state/"),
            note=str(meta.get("note", "")),
            rewrite=bool(meta.get("rewrite", False)),
        )
    except CaseFileError:
        raise
    except Exception as e:  # any damage: one line naming the file, never a traceback
        raise CaseFileError(
            f"{path} is not a readable parity case file ({type(e).__name__}: {e}); "
            "save it again with `parity compare`"
        ) from None


def _strip(arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)}
