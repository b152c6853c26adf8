"""CpuBackend: runs every op by calling its definition in ``ops``, one node at a time.

Weights stay memory-mapped; each is unpacked into the matmul's working layout on first use
(``parity.quant.prepare_weight``) and kept, so the unpacking is paid once per weight.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from parity import quant
from parity.backends.cpu import ops
from parity.core.backend import Availability, Backend, Device, Split
from parity.core.dtypes import DType, numpy_dtype
from parity.core.ir import AttentionArg, Node, Op, RopeArg
from parity.core.weights import WeightData


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


# (op, source index) of the weights read in the quant module's unpacked form
PACKED_OPERANDS = frozenset({(Op.GET_ROWS, 0), (Op.MATMUL, 1)})


class CpuExecutable:
    def __init__(self, split: Split) -> None:
        self.split = split


class CpuBackend(Backend):
    name = "cpu"
    numerics_modes = ("exact", "fast")  # exact satisfies fast
    kernels: Mapping[Op, Callable[..., np.ndarray]] = KERNELS

    def __init__(self, device: Device, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._prepared: dict[tuple[str, bool], Any] = {}

    @classmethod
    def available(cls) -> Availability:
        return Availability(True)

    @classmethod
    def devices(cls) -> list[Device]:
        return [Device("cpu", 0, f"numpy on {os.cpu_count()} cores")]

    @classmethod
    def score(cls, device: Device) -> int:
        return 0  # the oracle: always there, never the fast choice

    def supports_op(self, node: Node, srcs: Sequence[Node]) -> bool:
        return node.op in self.kernels

    def load_weight(self, weight: WeightData) -> None:
        pass  # zero-copy: the mapped bytes are read on first use

    def weight(self, name: str, packed: bool) -> Any:
        """A registered weight in working form, built on first use: unpacked for the matrix
        ops (``packed``), else a plain float32 array (norm weights, biases, rope tables)."""
        key = (name, packed)
        value = self._prepared.get(key)
        if value is None:
            w = self.weights[name]
            if packed:
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
        return CpuExecutable(split)

    def execute(self, executable: CpuExecutable, inputs: Mapping[int, Any]) -> dict[int, Any]:
        split = executable.split
        env: dict[int, Any] = dict(inputs)
        with np.errstate(all="ignore"):  # overflow to inf, 0 * inf = NaN: IEEE, as contracted
            self._run(split, env)
        return {i: env[i] for i in split.outputs}

    def _run(self, split: Split, env: dict[int, Any]) -> None:
        nodes = split.graph.nodes
        for i in split.nodes:
            node = nodes[i]
            args = [
                self.weight(nodes[s].arg, (node.op, k) in PACKED_OPERANDS)
                if nodes[s].op is Op.WEIGHT
                else env[s]
                for k, s in enumerate(node.src)
            ]
            env[i] = self.kernels[node.op](*args, arg=node.arg)

    def close(self) -> None:
        self._prepared.clear()
        super().close()
