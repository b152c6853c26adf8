"""CpuBackend: runs every op on the host, into buffers bound once at prepare.

Three implementations of the same ops (``kernel_choice`` says how one is chosen), all giving
the same bits:

- ``definition``: the readable definition itself (``ops.py``, ``parity.quant``; weights
  unpacked into float32 planes by ``parity.quant.prepare_weight``). The oracle: what the
  conformance kit and ``parity compare`` hold every backend to. No rewrite.
- ``numpy``: the definition with the numpy kernels that are faster than it
  (``attention_tiled``), and the fusions that save work (one activation quantization for the
  matrix products that share an x).
- ``numba`` (the default): compiled kernels (``jit``) reading the packed GGUF bytes where they
  lie, never copied, and every fusion of ``parity.core.fusion``.

``prepare`` turns a split into a list of calls, each writing one value into a buffer planned
for it (``memory``): a split's outputs get buffers of their own, the rest live in an arena
shared by the backend's executables, so no value of a step is allocated by the step. (The
compiled kernels keep small scratch of their own, per call: a row's terms, and attention's
keys laid out head dimension first, which is a copy of the cache rows a token reads.) A node
is one call, or a few (``_expand``: a product of F32 x by a quantized weight quantizes x into a
temporary first; the fused ops are their compositions' kernels in a row).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from parity import quant
from parity.backends.cpu import attention_tiled, kernel_choice, memory, ops
from parity.backends.cpu.threads import ThreadGovernor
from parity.core.backend import Availability, Backend, Buffer, Device, Executable, Split
from parity.core.dtypes import DType
from parity.core.fusion import PASSES, fuse
from parity.core.ir import MATMULS, MATRICES, AttentionArg, Graph, Node, Op, RopeArg, matrix_sources
from parity.core.scheduler import accepts
from parity.core.weights import WeightData
from parity.errors import ConfigError
from parity.quant import Q8Activations


def _rope(
    x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, arg: RopeArg
) -> np.ndarray:
    return ops.rope(
        x, pos, cos, sin, n_head=arg.n_head, head_dim=arg.head_dim, n_rot=arg.n_rot, mode=arg.mode
    )


def _attention_args(arg: AttentionArg) -> dict[str, Any]:
    return dict(
        n_head=arg.n_head,
        n_head_kv=arg.n_head_kv,
        head_dim=arg.head_dim,
        scale=arg.scale,
        window=arg.window,
    )


def _matmul_add(x, w, *rest, arg=None):
    return ops.matmul_add(x, w, rest[-1], rest[0] if len(rest) == 2 else None)


# op -> f(*source values, arg=node.arg), the definition; WEIGHT sources arrive prepared
KERNELS: dict[Op, Callable[..., Any]] = {
    Op.GET_ROWS: lambda w, ids, arg: ops.get_rows(w, ids),
    Op.SLICE_ROWS: lambda x, arg: ops.slice_rows(x, arg.start, arg.count),
    Op.RESHAPE: lambda x, arg: ops.reshape(x, arg),
    Op.ADD: lambda a, b, arg: ops.add(a, b),
    Op.MUL: lambda a, b, arg: ops.mul(a, b),
    Op.SILU: lambda x, arg: ops.silu(x),
    Op.SWIGLU: lambda g, u, arg: ops.swiglu(g, u),
    Op.GELU: lambda x, arg: ops.gelu(x),
    Op.GEGLU: lambda g, u, arg: ops.geglu(g, u),
    Op.SCALE: lambda x, arg: ops.scale(x, arg),
    Op.RMS_NORM: lambda x, arg: ops.rms_norm(x, arg),
    Op.MATMUL: lambda x, w, b=None, arg=None: ops.matmul(x, w, b),
    Op.QUANTIZE: lambda x, arg: ops.quantize(x),
    Op.ROPE: _rope,
    Op.KV_WRITE: lambda cache, rows, pos, arg: ops.kv_write(cache, rows, pos),
    Op.ATTENTION: lambda q, k, v, pos, arg: ops.attention(q, k, v, pos, **_attention_args(arg)),
    Op.ARGMAX: lambda x, arg: ops.argmax(x),
    Op.RMS_NORM_MUL: lambda x, w, arg: ops.rms_norm_mul(x, w, arg),
    Op.MATMUL_ADD: _matmul_add,
    Op.MATMUL_SWIGLU: lambda x, wg, wu, arg: ops.matmul_swiglu(x, wg, wu),
}
# the numpy kernels faster than the definition, same signatures
NUMPY_KERNELS: dict[Op, Callable[..., Any]] = {
    Op.ATTENTION: lambda q, k, v, pos, arg: attention_tiled.attention_tiled(
        q, k, v, pos, **_attention_args(arg)
    ),
}
# the ops each fused op is made of: it runs fused only where this class runs their definitions
COMPONENTS = {
    Op.RMS_NORM_MUL: (Op.RMS_NORM, Op.MUL),
    Op.MATMUL_ADD: (Op.MATMUL, Op.ADD),
    Op.MATMUL_SWIGLU: (Op.MATMUL, Op.SWIGLU),
    Op.QUANTIZE: (Op.MATMUL,),
}
# fusion passes per kernel mode: the ones that make it faster (docs/perf.md)
FUSIONS = {"definition": (), "numpy": ("share_quantization",), "numba": PASSES}

# (op, source index) of the weights read in packed form: unpacked by parity.quant for the
# numpy kernels, raw GGUF bytes for the numba ones (a table's, and the products' matrices)
PACKED_OPERANDS = frozenset({(Op.GET_ROWS, 0)} | {(op, k) for op in MATMULS for k in MATRICES[op]})


@attrs.frozen
class _Form:
    """A weight operand, by the key of its working form."""

    name: str
    form: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.form)


@attrs.frozen
class Temp:
    """A temporary value of one node's calls (lives in the arena)."""

    node: int
    index: int
    dtype: DType
    shape: tuple[int, ...]


Value = int | Temp  # a graph node's value, or a temporary


@attrs.frozen
class Call:
    """One kernel call: ``fn(out, *sources, arg)`` (a writer), or ``fn(*sources, arg=arg)``
    whose result is stored into ``out`` (a definition, ``writer`` False)."""

    fn: Callable[..., Any]
    out: Value
    srcs: tuple[Value | _Form, ...]
    arg: Any
    writer: bool


class CpuExecutable(Executable):
    """A split as kernel calls on bound buffers, rebound when the arena moves."""

    def __init__(
        self,
        split: Split,
        inputs: Mapping[int, Buffer],
        outputs: Mapping[int, Buffer],
        calls: list[Call],
        values: dict[Value, Any],
        arena: list[tuple[Value, int]],
    ) -> None:
        super().__init__(split, inputs, outputs)
        self.calls = calls
        self.values = values  # inputs, outputs and weights: fixed
        self.arena = arena  # (value, offset) of the values that live in the arena
        self.generation = -1
        self.bound: tuple[Callable[[], None], ...] = ()


class CpuBackend(Backend):
    """The oracle. ``kernels="definition"|"numpy"|"numba"`` picks the implementation and
    ``threads`` the numba kernels' thread count (both also ``[backends.cpu]`` options;
    ``kernel_choice``). ``kernels`` (class attribute) maps each op to its definition; a subclass
    may replace entries, and those ops then run its functions in every mode (and no fused op
    containing them is formed)."""

    name = "cpu"
    numerics_modes = ("exact", "fast")  # exact satisfies fast
    kernels: Mapping[Op, Callable[..., Any]] = KERNELS

    def __init__(
        self, device: Device, *, kernels: str | None = None, threads: int | None = None, **kwargs
    ) -> None:
        super().__init__(device, **kwargs)
        unknown = sorted(set(self.options) - {"kernels", "threads"})
        if unknown:
            raise ConfigError(
                f"[backends.cpu] has unknown option(s) {', '.join(unknown)}; "
                "the cpu backend takes kernels and threads"
            )
        self.kernel_mode = kernel_choice.choose_mode(kernels, self.options, os.environ)
        self.threads, self.threads_fixed = kernel_choice.choose_threads(
            threads, self.options, self.kernel_mode, os.environ
        )
        self.ops = dict(self.kernels)
        self._native = frozenset(op for op, fn in self.ops.items() if fn is KERNELS.get(op))
        self._writers: Mapping[Op, Callable[..., None]] = {}
        self._set_threads: Callable[[int], None] | None = None
        if self.kernel_mode == "numpy":
            self.ops.update({op: fn for op, fn in NUMPY_KERNELS.items() if op in self._native})
        elif self.kernel_mode == "numba":
            import numba

            from parity.backends.cpu.jit import ops as jit_ops

            self._writers = {op: fn for op, fn in jit_ops.WRITERS.items() if op in self._native}
            self._set_threads = numba.set_num_threads
        self._governor = ThreadGovernor(self.threads, fixed=self.threads_fixed)
        self._forms: dict[tuple[str, str], Any] = {}
        self._arena = memory.Arena()

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    @classmethod
    def devices(cls) -> list[Device]:
        return [Device("cpu", 0, f"numpy/numba on {os.cpu_count()} cores")]

    @classmethod
    def score(cls, device: Device) -> int:
        return 0  # the oracle: always there, never the fast choice

    # -- graphs -------------------------------------------------------------------------------

    def supports_op(self, node: Node, srcs: Sequence[Node]) -> bool:
        return node.op in self.ops

    def rewrite(self, graph: Graph) -> Graph:
        passes = FUSIONS[self.kernel_mode]
        if not passes:
            return graph
        return fuse(graph, accept=self._fusable, passes=passes)

    def _fusable(self, node: Node, srcs: Sequence[Node]) -> bool:
        parts = COMPONENTS.get(node.op, (node.op,))
        return accepts(self, node, srcs) and all(p in self._native for p in parts)

    # -- weights --------------------------------------------------------------------------------

    def load_weight(self, weight: WeightData) -> None:
        pass  # zero-copy: the mapped bytes are read where they lie, in the form a kernel needs

    def register_weights(self, weights, *, splits=(), progress=None) -> None:
        super().register_weights(weights, splits=splits, progress=progress)
        for split in splits:  # the forms its nodes read, built now rather than at a first step
            nodes = split.graph.nodes
            for i in split.nodes:
                for k, s in enumerate(nodes[i].src):
                    if nodes[s].op is Op.WEIGHT and nodes[s].arg in self.weights:
                        self.weight(nodes[s].arg, self._form(nodes[i].op, k))

    def _form(self, op: Op, k: int) -> str:
        if (op, k) not in PACKED_OPERANDS:
            return "array"
        return "packed" if self._compiled(op) else "prepared"

    def _compiled(self, op: Op) -> bool:
        """Does ``op`` run as compiled writers (a fused op: all of its components)?"""
        return all(p in self._writers for p in COMPONENTS.get(op, (op,)))

    def weight(self, name: str, form: str) -> Any:
        """A registered weight in a kernel's working form, built on first use: ``packed``
        (zero-copy GGUF bytes, numba kernels), ``prepared`` (unpacked by parity.quant, numpy
        kernels) or ``array`` (float32 values: norm weights, biases, rope tables)."""
        key = (name, form)
        value = self._forms.get(key)
        if value is None:
            w = self.weights[name]
            if form == "packed":
                from parity.backends.cpu.jit.ops import pack_weight

                value = pack_weight(w)
            elif form == "prepared":
                value = quant.prepare_weight(w.dtype, w.raw(), w.shape)
            else:
                value = quant.dequantize(w.dtype, w.raw(), w.shape)
            self._forms[key] = value
        return value

    # -- buffers -------------------------------------------------------------------------------

    def alloc(self, dtype: DType, shape: tuple[int, ...]) -> Buffer:
        return memory.new_value(dtype, tuple(shape))

    def upload(self, buffer: Buffer, host: np.ndarray) -> None:
        if isinstance(buffer, Q8Activations):
            buffer.q[...] = host["q"].reshape(buffer.q.shape)
            buffer.d[...], buffer.s[...] = host["d"], host["s"]
        else:
            buffer[...] = host  # (np.copyto's keyword arguments cost an allocation per call)

    def download(self, buffer: Buffer, out: np.ndarray) -> None:
        if isinstance(buffer, Q8Activations):
            out["q"] = buffer.q.reshape(out["q"].shape)
            out["d"], out["s"] = buffer.d, buffer.s
        else:
            out[...] = buffer

    def copy_from(self, dst: Buffer, src: Buffer, source: Backend) -> bool:
        if isinstance(dst, Q8Activations) and isinstance(src, Q8Activations):
            for a, b in ((dst.q, src.q), (dst.d, src.d), (dst.s, src.s)):
                np.copyto(a, b, casting="no")
            return True
        if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):  # both in host memory
            dst[...] = src
            return True
        return False

    def zero(self, buffer: Buffer, dtype: DType, shape: tuple[int, ...]) -> None:
        for part in (buffer.q, buffer.d, buffer.s) if dtype is DType.Q8A else (buffer,):
            part.fill(0)

    def increment(self, buffer: Buffer, dtype: DType, shape: tuple[int, ...], by: int) -> None:
        if buffer.size == 1:  # a decode position (an int32 ufunc call allocates ~1 KiB)
            buffer[0] += by
        else:
            buffer += np.int32(by)

    # -- running ---------------------------------------------------------------------------------

    def prepare(self, split: Split, inputs: Mapping[int, Buffer]) -> CpuExecutable:
        graph = split.graph
        calls: list[Call] = []
        for i in split.nodes:
            calls += self._expand(graph, i)
        values: dict[Value, Any] = dict(inputs)
        outputs: dict[int, Buffer] = {}
        for i in split.outputs:
            node = graph.nodes[i]
            if node.op is Op.KV_WRITE:
                outputs[i] = values[i] = inputs[node.src[0]]  # the cache, written in place
            else:
                outputs[i] = values[i] = self.alloc(node.dtype, node.shape)
        # every other value's lifetime, in calls: written by one, read until its last reader
        first: dict[Value, int] = {}
        last: dict[Value, int] = {}
        for c, call in enumerate(calls):
            for s in call.srcs:
                if not isinstance(s, _Form):
                    last[s] = c
            first.setdefault(call.out, c)
            last.setdefault(call.out, c)
        local = [v for v in first if v not in values]
        for v in local:
            if isinstance(v, int) and graph.nodes[v].op is Op.KV_WRITE:
                values[v] = inputs[graph.nodes[v].src[0]]  # a cache read inside the split
        local = [v for v in local if v not in values]
        sizes = [memory.nbytes(*self._type(graph, v)) for v in local]
        lives = [memory.Lifetime(n, first[v], last[v]) for v, n in zip(local, sizes, strict=True)]
        offsets, total = memory.plan(lives)
        self._arena.reserve(total)
        arena = list(zip(local, offsets, strict=True))
        return CpuExecutable(split, inputs, outputs, calls, values, arena)

    def _type(self, graph: Graph, value: Value) -> tuple[DType, tuple[int, ...]]:
        if isinstance(value, Temp):
            return value.dtype, value.shape
        node = graph.nodes[value]
        return node.dtype, node.shape

    def _expand(self, graph: Graph, i: int) -> list[Call]:
        """The calls that compute node ``i``: one writer, a few (temporaries between them), or
        the definition's function."""
        node = graph.nodes[i]
        srcs: list[Value | _Form] = []
        for k, s in enumerate(node.src):
            src = graph.nodes[s]
            srcs.append(self._resolve(src, self._form(node.op, k)) if src.op is Op.WEIGHT else s)
        writers = self._writers
        if not self._compiled(node.op):
            return [Call(self.ops[node.op], i, tuple(srcs), node.arg, False)]
        if node.op is Op.RMS_NORM_MUL:
            return [Call(writers[Op.RMS_NORM_MUL], i, tuple(srcs), node.arg, True)]
        if node.op not in (Op.MATMUL, Op.MATMUL_ADD, Op.MATMUL_SWIGLU):
            return [Call(writers[node.op], i, tuple(srcs), node.arg, True)]
        calls: list[Call] = []
        x, x_node = srcs[0], graph.nodes[node.src[0]]
        matrices = [graph.nodes[node.src[k]] for k in matrix_sources(node)]
        xq = x  # the form of x each product reads: quantized for a quantized weight
        if x_node.dtype is DType.F32 and any(w.dtype.is_quantized for w in matrices):
            xq = Temp(i, 0, DType.Q8A, x_node.shape)  # quantize x once, for all of them
            calls.append(Call(writers[Op.QUANTIZE], xq, (x,), None, True))

        def x_for(k: int) -> Value:
            return xq if graph.nodes[node.src[k]].dtype.is_quantized else x

        matmul = writers[Op.MATMUL]
        if node.op is Op.MATMUL:
            return [*calls, Call(matmul, i, (x_for(1), *srcs[1:]), None, True)]
        if node.op is Op.MATMUL_ADD:
            *product, residual = srcs[1:]
            calls.append(Call(matmul, i, (x_for(1), *product), None, True))
            return [*calls, Call(writers[Op.ADD], i, (residual, i), None, True)]  # fl(r + y)
        gate, up = Temp(i, 1, DType.F32, node.shape), Temp(i, 2, DType.F32, node.shape)
        calls.append(Call(matmul, gate, (x_for(1), srcs[1]), None, True))
        calls.append(Call(matmul, up, (x_for(2), srcs[2]), None, True))
        return [*calls, Call(writers[Op.SWIGLU], i, (gate, up), None, True)]

    def _resolve(self, node: Node, form: str) -> _Form:
        self.weight(node.arg, form)
        return _Form(node.arg, form)

    def _bind(self, exe: CpuExecutable) -> None:
        """The calls as closures over this arena's views and the fixed buffers."""
        values = dict(exe.values)
        graph = exe.split.graph
        for v, offset in exe.arena:
            values[v] = memory.carve(self._arena.buffer, offset, *self._type(graph, v))
        bound = []
        for call in exe.calls:
            srcs = tuple(
                self._forms[s.key] if isinstance(s, _Form) else values[s] for s in call.srcs
            )
            out = values[call.out]
            if call.writer:
                bound.append(functools.partial(call.fn, out, *srcs, call.arg))
            else:
                bound.append(functools.partial(_store, call.fn, out, srcs, call.arg))
        exe.bound = tuple(bound)
        exe.generation = self._arena.generation

    def execute(self, executable: CpuExecutable) -> None:
        if executable.generation != self._arena.generation:
            self._bind(executable)
        if self._set_threads is None:
            with np.errstate(all="ignore"):  # overflow to inf, 0 * inf = NaN: IEEE, contracted
                for call in executable.bound:
                    call()
            return
        key = id(executable)
        n = self._governor.threads(key)
        self._set_threads(n)  # numba's setting is per calling thread
        t0 = time.perf_counter()
        with np.errstate(all="ignore"):
            for call in executable.bound:
                call()
        self._governor.record(key, n, time.perf_counter() - t0)

    def close(self) -> None:
        self._forms.clear()
        super().close()


def _store(fn: Callable[..., Any], out: Any, srcs: tuple, arg: Any) -> None:
    """Run a definition and keep its value in ``out``."""
    value = fn(*srcs, arg=arg)
    if value is out:  # KV_WRITE returns the cache it wrote in place
        return
    if isinstance(out, Q8Activations):
        for a, b in ((out.q, value.q), (out.d, value.d), (out.s, value.s)):
            np.copyto(a, b, casting="no")
    else:
        np.copyto(out, value, casting="no")
