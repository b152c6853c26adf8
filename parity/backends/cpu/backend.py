"""CpuBackend: runs every op by calling its definition, one node at a time.

Two implementations of the same ops (``kernel_choice`` says how one is chosen): ``numpy``, the
readable definition (``ops``; weights unpacked into float32 planes by
``parity.quant.prepare_weight`` on first use), and ``numba`` (``jit``; weights read as packed
GGUF bytes where they lie, never copied). Both give the same bits.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from parity import quant
from parity.backends.cpu import kernel_choice, ops
from parity.core.backend import Availability, Backend, Device, Split
from parity.core.dtypes import DType, numpy_dtype
from parity.core.ir import AttentionArg, Node, Op, RopeArg
from parity.core.weights import WeightData
from parity.errors import ConfigError


def _rope(
    x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, arg: RopeArg
) -> np.ndarray:
    return ops.rope(
        x, pos, cos, sin, n_head=arg.n_head, head_dim=arg.head_dim, n_rot=arg.n_rot, mode=arg.mode
    )


def _attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, *, arg: AttentionArg
) -> np.ndarray:
    return ops.attention(
        q,
        k,
        v,
        pos,
        n_head=arg.n_head,
        n_head_kv=arg.n_head_kv,
        head_dim=arg.head_dim,
        scale=arg.scale,
    )


# op -> f(*source values, arg=node.arg); WEIGHT sources arrive as prepared weights
KERNELS: dict[Op, Callable[..., np.ndarray]] = {
    Op.GET_ROWS: lambda w, ids, arg: ops.get_rows(w, ids),
    Op.SLICE_ROWS: lambda x, arg: ops.slice_rows(x, arg.start, arg.count),
    Op.ADD: lambda a, b, arg: ops.add(a, b),
    Op.MUL: lambda a, b, arg: ops.mul(a, b),
    Op.SILU: lambda x, arg: ops.silu(x),
    Op.SWIGLU: lambda g, u, arg: ops.swiglu(g, u),
    Op.RMS_NORM: lambda x, arg: ops.rms_norm(x, arg),
    Op.MATMUL: lambda x, w, b=None, arg=None: ops.matmul(x, w, b),
    Op.ROPE: _rope,
    Op.KV_WRITE: lambda cache, rows, pos, arg: ops.kv_write(cache, rows, pos),
    Op.ATTENTION: _attention,
    Op.ARGMAX: lambda x, arg: ops.argmax(x),
}


# (op, source index) of the weights read in packed form: unpacked by parity.quant for the
# numpy kernels, raw GGUF bytes for the numba ones
PACKED_OPERANDS = frozenset({(Op.GET_ROWS, 0), (Op.MATMUL, 1)})


@attrs.define(eq=False)
class WeightSlot:
    """A weight operand of a step, resolved on first use (plans never unpack weights)."""

    name: str
    form: str  # "prepared" (numpy kernels), "packed" (numba kernels) or "array" (float32)
    value: Any = None


@attrs.frozen(eq=False)
class CpuExecutable:
    """A split as a list of steps: (node id, kernel, node arg, sources: env ids or weights)."""

    split: Split
    steps: tuple[tuple[int, Callable[..., Any], Any, tuple[int | WeightSlot, ...]], ...]


class CpuBackend(Backend):
    """The oracle. ``kernels="numpy"|"numba"`` picks the implementation and ``threads`` the
    numba kernels' thread count (both also ``[backends.cpu]`` options; ``kernel_choice``).
    ``kernels`` (class attribute) maps each op to its numpy definition; a subclass may
    replace entries, and those ops then run its functions in either mode."""

    name = "cpu"
    numerics_modes = ("exact", "fast")  # exact satisfies fast
    kernels: Mapping[Op, Callable[..., np.ndarray]] = KERNELS

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
        self.threads = kernel_choice.choose_threads(threads, self.options, self.kernel_mode)
        self.ops = dict(self.kernels)
        self._compiled: frozenset[Op] = frozenset()
        self._set_threads: Callable[[int], None] | None = None
        if self.kernel_mode == "numba":
            import numba

            from parity.backends.cpu.jit import ops as jit_ops

            # a compiled kernel stands in for an op only where this class runs the definition
            compiled = {
                op: jit_ops.KERNELS[op]
                for op, fn in self.ops.items()
                if op in jit_ops.KERNELS and fn is KERNELS.get(op)
            }
            self.ops.update(compiled)
            self._compiled = frozenset(compiled)
            self._set_threads = numba.set_num_threads
        self._prepared: dict[tuple[str, str], Any] = {}

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    @classmethod
    def devices(cls) -> list[Device]:
        return [Device("cpu", 0, f"numpy/numba on {os.cpu_count()} cores")]

    @classmethod
    def score(cls, device: Device) -> int:
        return 0  # the oracle: always there, never the fast choice

    def supports_op(self, node: Node, srcs: Sequence[Node]) -> bool:
        return node.op in self.ops

    def load_weight(self, weight: WeightData) -> None:
        pass  # zero-copy: the mapped bytes are read on first use

    def weight(self, name: str, form: str) -> Any:
        """A registered weight in a kernel's working form, built on first use: ``packed``
        (zero-copy GGUF bytes, numba kernels), ``prepared`` (unpacked by parity.quant, numpy
        kernels) or ``array`` (float32 values: norm weights, biases, rope tables)."""
        key = (name, form)
        value = self._prepared.get(key)
        if value is None:
            w = self.weights[name]
            if form == "packed":
                from parity.backends.cpu.jit.ops import pack_weight

                value = pack_weight(w)
            elif form == "prepared":
                value = quant.prepare_weight(w.dtype, w.raw(), w.shape)
            else:
                value = quant.dequantize(w.dtype, w.raw(), w.shape)
            self._prepared[key] = value
        return value

    def alloc(self, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, numpy_dtype(dtype))

    def upload(self, buffer: np.ndarray, host: np.ndarray) -> None:
        np.copyto(buffer, host, casting="no")

    def download(self, buffer: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, buffer, casting="no")

    def prepare(self, split: Split) -> CpuExecutable:
        nodes = split.graph.nodes
        steps = []
        for i in split.nodes:
            node = nodes[i]
            srcs: list[int | WeightSlot] = []
            for k, s in enumerate(node.src):
                if nodes[s].op is not Op.WEIGHT:
                    srcs.append(s)
                elif (node.op, k) not in PACKED_OPERANDS:
                    srcs.append(WeightSlot(nodes[s].arg, "array"))
                else:
                    form = "packed" if node.op in self._compiled else "prepared"
                    srcs.append(WeightSlot(nodes[s].arg, form))
            steps.append((i, self.ops[node.op], node.arg, tuple(srcs)))
        return CpuExecutable(split, tuple(steps))

    def execute(self, executable: CpuExecutable, inputs: Mapping[int, Any]) -> dict[int, Any]:
        env: dict[int, Any] = dict(inputs)
        if self._set_threads is not None:
            self._set_threads(self.threads)  # numba's setting is per calling thread
        with np.errstate(all="ignore"):  # overflow to inf, 0 * inf = NaN: IEEE, as contracted
            for i, fn, arg, srcs in executable.steps:
                args = [env[s] if type(s) is int else self._resolve(s) for s in srcs]
                env[i] = fn(*args, arg=arg)
        return {i: env[i] for i in executable.split.outputs}

    def _resolve(self, slot: WeightSlot) -> Any:
        if slot.value is None:
            slot.value = self.weight(slot.name, slot.form)
        return slot.value

    def close(self) -> None:
        self._prepared.clear()
        super().close()
