"""Nodes of a split as a jax program: a hashable structure (the compile cache's key) and the
function that runs it.

A program takes its weights (device forms), its value inputs and its states (KV caches) and
returns its outputs and the states' new contents. It knows no node ids or weight names, only
structure, so equal structures (every decode step, or every layer's matmul under
``jit = "op"``) share one compiled function. ``lower`` turns graph nodes into a program plus
the ``Binding`` that says which nodes and weights feed it.

Float values cross the program's boundary as float32 arrays (a Q8A value as a ``quant.Q8``
whose scales are float32); inside, a value is a carrier (``binary32``) except where the
contract works on float32 storage: the KV caches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import attrs
import jax

from parity.backends.cpu.backend import PACKED_OPERANDS
from parity.core.dtypes import DType
from parity.core.ir import Graph, Op
from parity_jax.binary32 import narrow, widen
from parity_jax.ops import KERNELS, DeviceWeight
from parity_jax.quant import Q8

# float operands an op reads as float32 storage rather than as carriers
STORAGE_OPERANDS = frozenset({(Op.KV_WRITE, 0), (Op.ATTENTION, 1), (Op.ATTENTION, 2)})
# ops whose float results are float32 storage (a cache with rows written)
STORAGE_RESULTS = frozenset({Op.KV_WRITE})


@attrs.frozen
class Ref:
    """A program value: ``table`` is "weight", "value", "state" or "step", ``index`` its slot."""

    table: str
    index: int


@attrs.frozen
class Step:
    op: Op
    arg: Any
    srcs: tuple[Ref, ...]


@attrs.frozen(cache_hash=True)
class Program:
    """``weight_types`` per weight slot; ``value_types`` per value input; ``outputs``: steps whose
    values leave; ``writes``: per state slot, the KV_WRITE step that updates it."""

    weight_types: tuple[DType, ...]
    value_types: tuple[DType, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    writes: tuple[int, ...]


@attrs.frozen
class Binding:
    """The graph side of a program: weight names and node ids for its slots and results."""

    weights: tuple[str, ...]
    values: tuple[int, ...]
    states: tuple[int, ...]
    outputs: tuple[int, ...]
    writes: tuple[int, ...]  # KV_WRITE node ids, one per state slot


def lower(graph: Graph, nodes: Sequence[int], leaving: Collection[int]) -> tuple[Program, Binding]:
    """The program computing ``nodes`` (in order); the values of ``leaving`` are returned
    (a KV_WRITE's value is its state, returned as the state's new contents)."""
    slots: dict[str, dict[int, int]] = {"weight": {}, "value": {}, "state": {}}
    local: dict[int, int] = {}
    steps = []
    for i in nodes:
        srcs = []
        for s in graph.nodes[i].src:
            if s in local:
                srcs.append(Ref("step", local[s]))
                continue
            name = _table_name(graph.nodes[s].op)
            srcs.append(Ref(name, slots[name].setdefault(s, len(slots[name]))))
        node = graph.nodes[i]
        local[i] = len(steps)
        steps.append(Step(node.op, node.arg, tuple(srcs)))
    states = tuple(slots["state"])
    writer = {graph.nodes[i].src[0]: i for i in nodes if graph.nodes[i].op is Op.KV_WRITE}
    outputs = tuple(i for i in nodes if i in leaving and graph.nodes[i].op is not Op.KV_WRITE)
    program = Program(
        weight_types=tuple(graph.nodes[s].dtype for s in slots["weight"]),
        value_types=tuple(graph.nodes[s].dtype for s in slots["value"]),
        steps=tuple(steps),
        outputs=tuple(local[i] for i in outputs),
        writes=tuple(local[writer[s]] for s in states),
    )
    binding = Binding(
        weights=tuple(graph.nodes[s].arg for s in slots["weight"]),
        values=tuple(slots["value"]),
        states=states,
        outputs=outputs,
        writes=tuple(writer[s] for s in states),
    )
    return program, binding


def _table_name(op: Op) -> str:
    return "weight" if op is Op.WEIGHT else "state" if op is Op.STATE else "value"


def run(
    program: Program,
    weights: tuple[dict[str, jax.Array], ...],
    values: tuple[jax.Array, ...],
    states: tuple[jax.Array, ...],
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Trace ``program``: (outputs as float32/int32 arrays, the states' new contents)."""
    # every value with whether it is float32 storage (True) or a carrier / int array (False)
    stored = (DType.F32, DType.Q8A)
    inputs = {
        "value": [(v, t in stored) for v, t in zip(values, program.value_types, strict=True)],
        "state": [(s, True) for s in states],
    }
    results: list[tuple[jax.Array, bool]] = []

    def operand(ref: Ref, op: Op, k: int) -> Any:
        if ref.table == "weight":
            arrays = weights[ref.index]
            if (op, k) in PACKED_OPERANDS:
                return DeviceWeight(program.weight_types[ref.index], arrays)
            return arrays["w"]  # a float weight read as values (norm, bias, rope table)
        value, storage = results[ref.index] if ref.table == "step" else inputs[ref.table][ref.index]
        wanted = (op, k) in STORAGE_OPERANDS
        if storage == wanted:
            return value
        return _floats(narrow if wanted else widen, value)

    for step in program.steps:
        args = [operand(ref, step.op, k) for k, ref in enumerate(step.srcs)]
        value = kernel(step.op, step.arg)(*args)
        results.append((value, step.op in STORAGE_RESULTS))
    outputs = tuple(
        value if storage else _floats(narrow, value)
        for value, storage in (results[i] for i in program.outputs)
    )
    return outputs, tuple(results[i][0] for i in program.writes)


def _floats(convert: Callable[[jax.Array], jax.Array], value: Any) -> Any:
    """``value`` with ``convert`` (``widen`` or ``narrow``) applied to its float arrays: the
    array itself, or a Q8's scales; int32 values (ids, positions, ARGMAX) pass."""
    if isinstance(value, Q8):
        return Q8(value.q, convert(value.d), convert(value.s))
    return value if value.dtype == jax.numpy.int32 else convert(value)


@functools.lru_cache(maxsize=512)
def kernel(op: Op, arg: Any) -> Callable[..., jax.Array]:
    """An op's kernel jitted on its own: traced once per argument and operand shapes however
    often a program uses it (30 layers trace one), and XLA inlines it into the program."""
    return jax.jit(functools.partial(KERNELS[op], arg=arg))


@functools.lru_cache(maxsize=512)
def compiled(program: Program) -> Callable[..., Any]:
    """The jitted function of a program, one per distinct structure; states are donated so a
    KV_WRITE updates the cache where it lies."""
    return jax.jit(functools.partial(run, program), donate_argnums=2)
