"""JaxBackend: parity's ops as jit-compiled jax programs, bit for bit the cpu oracle.

Discovery (``available``, ``devices``, ``score``) imports no jax; an instance imports it when
it is created. How exactness survives XLA is ``binary32``'s story; the ops are ``ops``.

Execution: ``prepare`` lowers a split to jax programs (``program``): one program for the whole
split under ``jit = "graph"``, one per node under ``jit = "op"``. Compiled
functions are cached by the program's structure, so a decode step compiles once, however many
runtimes or plans use it. Set the mode with ``[backends.jax] jit = "op"`` in parity.toml, or
``JaxBackend(device, jit="op")``; the default is ``op`` on a CPU and ``graph`` elsewhere
(``choose_jit``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np

from parity.core.backend import Availability, Backend, Device, Split
from parity.core.dtypes import DType, numpy_dtype
from parity.core.ir import Node, Op
from parity.core.weights import WeightData
from parity.errors import BackendError, ConfigError
from parity.quant import SUPPORTED_TYPES

if TYPE_CHECKING:
    from parity_jax.program import Binding

JIT_MODES = ("graph", "op")
INSTALL_HINT = "pip install 'jax>=0.4.30' (CPU), or 'jax[cuda12]' for NVIDIA GPUs"


@attrs.define(eq=False)
class JaxBuffer:
    """A device buffer. jax arrays are immutable, so a buffer holds one and ``upload``,
    ``execute`` and KV_WRITE replace it: the buffer object stays the same for the runtime's
    life, which is what the Backend API's stable buffers ask for."""

    value: Any  # jax.Array


@attrs.frozen(eq=False)
class Call:
    """One compiled program of an executable, with the weights it reads already resolved."""

    fn: Callable[..., Any]
    binding: Binding
    weights: tuple[Any, ...]  # device forms, in the program's weight slots


@attrs.frozen(eq=False)
class JaxExecutable:
    """A split's calls, and its output buffers (refilled in place by every execute)."""

    split: Split
    calls: tuple[Call, ...]
    results: Mapping[int, JaxBuffer]


class JaxBackend(Backend):
    """Every op of parity.core.ir.Op on every weight type the cpu oracle reads, exactly.

    ``jit`` ("graph" or "op", also ``[backends.jax] jit``) picks one jit over the whole split or
    one per node; the results are the same bits either way.
    """

    name = "jax"
    numerics_modes = ("exact", "fast")  # exact satisfies fast
    # every op bit for bit in both jit modes, as the conformance suite shows (`parity conformance
    # jax`, tests/test_backend_ops.py --backend jax, plugins/parity-jax/tests)
    manifest: ClassVar[Mapping[str, str]] = {
        "GET_ROWS": "exact",
        "SLICE_ROWS": "exact",
        "ADD": "exact",
        "MUL": "exact",
        "SILU": "exact",
        "SWIGLU": "exact",
        "RMS_NORM": "exact",
        "MATMUL": "exact",
        "ROPE": "exact",
        "KV_WRITE": "exact",
        "ATTENTION": "exact",
        "ARGMAX": "exact",
    }

    def __init__(self, device: Device, *, jit: str | None = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        unknown = sorted(set(self.options) - {"jit"})
        if unknown:
            raise ConfigError(
                f"[backends.jax] has unknown option(s) {', '.join(unknown)}; "
                "the jax backend takes jit"
            )
        import jax

        from parity_jax import binary32, ops, program

        self._jax = jax
        self._float64 = binary32.float64_enabled
        self._program = program
        self._ops = frozenset(ops.KERNELS)
        found = jax.devices()
        if device.index >= len(found):
            raise BackendError(
                f"jax has no device {device.index}: it has {', '.join(map(str, found))}"
            )
        self._device = found[device.index]
        self.jit = choose_jit(jit, self.options, self._device.platform)
        self._forms: dict[str, Any] = {}  # weight name -> device form (parity_jax.quant)

    # -- discovery: no jax import ----------------------------------------------------------

    @classmethod
    def available(cls) -> Availability:
        if importlib.util.find_spec("jax") is None or importlib.util.find_spec("jaxlib") is None:
            return Availability(False, f"jax is not installed; {INSTALL_HINT}")
        return Availability(True)

    @classmethod
    def devices(cls) -> list[Device]:
        # listing jax's devices would import jax and start its runtimes (seconds, and every
        # GPU), which discovery must not do; index i picks jax.devices()[i] when created
        return [Device("jax", 0, "jax's default device (jax.devices()[0])")]

    @classmethod
    def score(cls, device: Device) -> int:
        # below cpu (0): on a CPU the numba oracle is faster and never waits for a compile;
        # with a jax GPU plugin installed, above cpu and below parity's own GPU backends
        gpu = any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
        return 10 if gpu else -10

    # -- required ---------------------------------------------------------------------------

    def supports_op(self, node: Node, srcs: Sequence[Node]) -> bool:
        weights_ok = all(s.dtype in SUPPORTED_TYPES for s in srcs if s.op is Op.WEIGHT)
        return node.op in self._ops and weights_ok

    def load_weight(self, weight: WeightData) -> None:
        from parity_jax.quant import prepare_weight

        with self._float64():  # carriers are float64
            self._forms[weight.name] = self._jax.device_put(prepare_weight(weight), self._device)

    def alloc(self, dtype: DType, shape: tuple[int, ...]) -> JaxBuffer:
        return JaxBuffer(self._jax.device_put(np.zeros(shape, numpy_dtype(dtype)), self._device))

    def upload(self, buffer: JaxBuffer, host: np.ndarray) -> None:
        have = buffer.value
        if (host.dtype, host.shape) != (have.dtype, have.shape):
            raise BackendError(
                f"upload of {host.dtype}{list(host.shape)} into a jax buffer of "
                f"{have.dtype}{list(have.shape)}; allocate a buffer of the host array's type"
            )
        # a copy: device_put may alias host memory on a CPU, and the host array is reused
        buffer.value = self._jax.device_put(np.array(host, copy=True), self._device)

    def download(self, buffer: JaxBuffer, out: np.ndarray) -> None:
        np.copyto(out, np.asarray(buffer.value), casting="no")

    def prepare(self, split: Split) -> JaxExecutable:
        graph = split.graph
        if self.jit == "graph":
            groups, leaving = [split.nodes], set(split.outputs)
        else:
            groups, leaving = [(i,) for i in split.nodes], set(split.nodes)
        calls = []
        for nodes in groups:
            program, binding = self._program.lower(graph, nodes, leaving)
            weights = tuple(self._forms[name] for name in binding.weights)
            calls.append(Call(self._program.compiled(program), binding, weights))
        results = {
            i: JaxBuffer(None) for i in split.outputs if graph.nodes[i].op is not Op.KV_WRITE
        }
        return JaxExecutable(split, tuple(calls), results)

    def execute(self, executable: JaxExecutable, inputs: Mapping[int, Any]) -> dict[int, Any]:
        values: dict[int, Any] = {}  # node id -> jax array computed in this split
        with self._float64():
            for call in executable.calls:
                b = call.binding
                args = tuple(values[i] if i in values else inputs[i].value for i in b.values)
                states = tuple(inputs[s].value for s in b.states)
                outputs, written = call.fn(call.weights, args, states)
                for s, writer, cache in zip(b.states, b.writes, written, strict=True):
                    inputs[s].value = cache  # the state buffer now holds the written cache
                    values[writer] = cache
                values.update(zip(b.outputs, outputs, strict=True))
        nodes = executable.split.graph.nodes
        out = {}
        for i in executable.split.outputs:
            if nodes[i].op is Op.KV_WRITE:
                out[i] = inputs[nodes[i].src[0]]  # a KV_WRITE's value is its (updated) state
            else:
                out[i] = executable.results[i]
                out[i].value = values[i]
        return out

    # -- optional ---------------------------------------------------------------------------

    def close(self) -> None:
        self._forms.clear()
        super().close()


def choose_jit(requested: str | None, options: Mapping[str, Any], platform: str) -> str:
    """``graph`` or ``op``: the constructor argument, else ``[backends.jax] jit``, else by the
    device: ``op`` on a CPU, where compiling a whole forward pass takes tens of seconds for a
    few percent of speed, ``graph`` on an accelerator, where one launch per node costs more
    than the work (docs/perf.md: a SmolLM2 decode step on an H200 takes 10.5 ms as one graph,
    39.2 ms per op; on a 2-core CPU 49.9 ms and 59.1 ms, after a 26 s or a 2 s compile)."""
    for value, where in ((requested, "jit={!r} (argument)"), (options.get("jit"), None)):
        if value is None:
            continue
        if value not in JIT_MODES:
            where = where or "[backends.jax] jit = {!r}"
            raise ConfigError(f"{where.format(value)}: use one of {', '.join(JIT_MODES)}")
        return value
    return "op" if platform == "cpu" else "graph"
