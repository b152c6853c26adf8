"""JaxBackend: parity's ops as jit-compiled jax programs, bit for bit the cpu oracle.

Discovery (``available``, ``devices``, ``score``) imports no jax; an instance imports it when
it is created. How exactness survives XLA is ``binary32``'s story; the ops are ``ops``.

Execution: ``prepare`` lowers a split to jax programs (``program``): one program for the whole
split under ``jit = "graph"``, one per node under ``jit = "op"``, and binds it to its buffers
(plugin API 2: the input buffers it is given, output buffers made once). Compiled
functions are cached by the program's structure, so a decode step compiles once, however many
runtimes or plans use it. Set the mode with ``[backends.jax] jit = "op"`` in parity.toml, or
``JaxBackend(device, jit="op")``; the default is ``op`` on a CPU and ``graph`` elsewhere
(``choose_jit``).

Buffers are ``JaxBuffer`` holders around immutable jax arrays (a Q8A value: a ``quant.Q8`` of
three): ``upload``, ``execute``, ``zero``, ``increment`` and ``copy_from`` put a new array into
the same holder, so the buffers bound at prepare stay the ones the runtime refills. jax
dispatches asynchronously, which is the Backend API's queue: ``download`` starts the copy to
the host and ``synchronize`` completes it into the host array.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import numpy as np

from parity.core.backend import Availability, Backend, Device, Executable, Split
from parity.core.dtypes import Q8A_BLOCK, DType, host_layout
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
    """A device buffer. jax arrays are immutable, so a buffer holds one (a Q8A value: a
    ``quant.Q8`` of its quants and scales) and ``upload``, ``execute`` and KV_WRITE replace it:
    the buffer object stays the same for the runtime's life, which is what the Backend API's
    stable buffers ask for."""

    value: Any  # jax.Array, or quant.Q8 of jax.Arrays


@attrs.frozen(eq=False)
class Call:
    """One compiled program of an executable: its weights already resolved, and per value slot
    the bound buffer it reads, or the id of a value an earlier call of the split computes."""

    fn: Callable[..., Any]
    binding: Binding
    weights: tuple[Any, ...]  # device forms, in the program's weight slots
    values: tuple[JaxBuffer | int, ...]
    states: tuple[JaxBuffer, ...]


class JaxExecutable(Executable):
    """A split's calls, bound to its input buffers and to output buffers made at prepare (a
    KV_WRITE's: its state buffer), which every execute refills in place."""

    def __init__(
        self,
        split: Split,
        inputs: Mapping[int, JaxBuffer],
        outputs: Mapping[int, JaxBuffer],
        calls: tuple[Call, ...],
    ) -> None:
        super().__init__(split, inputs, outputs)
        self.calls = calls
        kv = {i for i in split.outputs if split.graph.nodes[i].op is Op.KV_WRITE}
        self.results = tuple((i, b) for i, b in outputs.items() if i not in kv)


class JaxBackend(Backend):
    """Every op of parity.core.ir.Op on every weight type the cpu oracle reads, exactly.

    ``jit`` ("graph" or "op", also ``[backends.jax] jit``) picks one jit over the whole split or
    one per node; the results are the same bits either way.
    """

    name = "jax"
    numerics_modes = ("exact", "fast")  # exact satisfies fast
    # every op bit for bit in both jit modes, as the conformance suite shows (`parity conformance
    # jax`, tests/test_backend_ops.py --backend jax, plugins/parity-jax/tests); the fused ops
    # are their compositions' kernels in a row
    manifest: ClassVar[Mapping[str, str]] = {
        "GET_ROWS": "exact",
        "SLICE_ROWS": "exact",
        "RESHAPE": "exact",
        "ADD": "exact",
        "MUL": "exact",
        "SILU": "exact",
        "SWIGLU": "exact",
        "GELU": "exact",
        "GEGLU": "exact",
        "SCALE": "exact",
        "RMS_NORM": "exact",
        "MATMUL": "exact",
        "QUANTIZE": "exact",
        "ROPE": "exact",
        "KV_WRITE": "exact",
        "ATTENTION": "exact",
        "ARGMAX": "exact",
        "RMS_NORM_MUL": "exact",
        "MATMUL_ADD": "exact",
        "MATMUL_SWIGLU": "exact",
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

        from parity_jax import binary32, ops, program, quant

        self._jax = jax
        self._float64 = binary32.float64_enabled
        self._program = program
        self._q8 = quant.Q8
        self._ops = frozenset(ops.KERNELS)
        found = jax.devices()
        if device.index >= len(found):
            raise BackendError(
                f"jax has no device {device.index}: it has {', '.join(map(str, found))}"
            )
        self._device = found[device.index]
        self.jit = choose_jit(jit, self.options, self._device.platform)
        self._forms: dict[str, Any] = {}  # weight name -> device form (parity_jax.quant)
        self._pending: list[tuple[Any, np.ndarray]] = []  # downloads synchronize completes
        self._add = jax.jit(lambda a, by: a + by)  # increment: int32 + int32

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
        return JaxBuffer(self._zeros(dtype, tuple(shape)))

    def upload(self, buffer: JaxBuffer, host: np.ndarray) -> None:
        have = buffer.value
        if isinstance(have, self._q8):
            _, shape = host_layout(DType.Q8A, have.q.shape)
            self._check_host("upload of", host, Q8A_BLOCK, shape, have)
            t, k = have.q.shape
            parts = (host["q"].reshape(t, k), host["d"], host["s"])
            # copies: device_put may alias host memory on a CPU, and the host array is reused
            buffer.value = self._q8(*(self._put(np.array(p, copy=True)) for p in parts))
            return
        self._check_host("upload of", host, have.dtype, have.shape, have)
        buffer.value = self._put(np.array(host, copy=True))

    def download(self, buffer: JaxBuffer, out: np.ndarray) -> None:
        value = buffer.value
        if isinstance(value, self._q8):
            _, shape = host_layout(DType.Q8A, value.q.shape)
            self._check_host("download into", out, Q8A_BLOCK, shape, value)
        else:
            self._check_host("download into", out, value.dtype, value.shape, value)
        for array in _arrays(value):
            array.copy_to_host_async()  # queued behind the work that computes it
        self._pending.append((value, out))

    def synchronize(self) -> None:
        pending, self._pending = self._pending, []
        for value, out in pending:
            if isinstance(value, self._q8):
                out["q"] = np.asarray(value.q).reshape(out["q"].shape)
                out["d"], out["s"] = np.asarray(value.d), np.asarray(value.s)
            else:
                np.copyto(out, np.asarray(value), casting="no")

    def prepare(self, split: Split, inputs: Mapping[int, JaxBuffer]) -> JaxExecutable:
        graph = split.graph
        needed = [i for i in split.inputs if graph.nodes[i].op is not Op.WEIGHT]
        missing = [i for i in needed if i not in inputs]
        if missing:
            raise BackendError(f"jax.prepare needs buffers for the split's inputs {missing}")
        if self.jit == "graph":
            groups, leaving = [split.nodes], set(split.outputs)
        else:
            groups, leaving = [(i,) for i in split.nodes], set(split.nodes)
        calls = []
        for nodes in groups:
            program, binding = self._program.lower(graph, nodes, leaving)
            weights = tuple(self._forms[name] for name in binding.weights)
            values = tuple(inputs.get(i, i) for i in binding.values)
            states = tuple(inputs[s] for s in binding.states)
            fn = self._program.compiled(program)
            calls.append(Call(fn, binding, weights, values, states))
        outputs: dict[int, JaxBuffer] = {}
        for i in split.outputs:
            node = graph.nodes[i]
            if node.op is Op.KV_WRITE:
                outputs[i] = inputs[node.src[0]]  # a KV_WRITE's value is its (updated) state
            else:
                outputs[i] = JaxBuffer(self._zeros(node.dtype, node.shape))
        return JaxExecutable(split, dict(inputs), outputs, tuple(calls))

    def execute(self, executable: JaxExecutable) -> None:
        if self._pending:  # a download before this step must read the values before it
            self.synchronize()  # (the step donates the caches it writes)
        values: dict[int, Any] = {}  # node id -> jax value computed in this split
        with self._float64():
            for call in executable.calls:
                b = call.binding
                args = tuple(values[v] if isinstance(v, int) else v.value for v in call.values)
                states = tuple(buf.value for buf in call.states)
                outputs, written = call.fn(call.weights, args, states)
                for buf, writer, cache in zip(call.states, b.writes, written, strict=True):
                    buf.value = cache  # the state buffer now holds the written cache
                    values[writer] = cache
                values.update(zip(b.outputs, outputs, strict=True))
        for i, buf in executable.results:
            buf.value = values[i]

    # -- optional ---------------------------------------------------------------------------

    def zero(self, buffer: JaxBuffer, dtype: DType, shape: tuple[int, ...]) -> None:
        buffer.value = self._zeros(dtype, tuple(shape))  # a device fill, no host transfer

    def increment(self, buffer: JaxBuffer, dtype: DType, shape: tuple[int, ...], by: int) -> None:
        buffer.value = self._add(buffer.value, np.int32(by))  # on the device, queued

    def copy_from(self, dst: JaxBuffer, src: Any, source: Backend) -> bool:
        if not (isinstance(source, JaxBackend) and isinstance(src, JaxBuffer)):
            return False  # another backend's buffer: through the host
        have, given = _arrays(dst.value), _arrays(src.value)
        if [(a.dtype, a.shape) for a in have] != [(a.dtype, a.shape) for a in given]:
            raise BackendError(
                f"copy_from a jax buffer of {_describe(src.value)} into one of "
                f"{_describe(dst.value)}; the buffers must hold the same type and shape"
            )
        copies = tuple(self._copy(a) for a in given)
        dst.value = self._q8(*copies) if isinstance(src.value, self._q8) else copies[0]
        return True

    def close(self) -> None:
        self._forms.clear()
        self._pending.clear()
        super().close()

    # -- helpers ----------------------------------------------------------------------------

    def _put(self, host: np.ndarray) -> Any:
        return self._jax.device_put(host, self._device)

    def _copy(self, array: Any) -> Any:
        """A new device array with ``array``'s value on this backend's device: never the same
        buffer, since an executable donates the caches it writes."""
        if array.devices() == {self._device}:
            return array.copy()
        return self._jax.device_put(array, self._device)

    def _zeros(self, dtype: DType, shape: tuple[int, ...]) -> Any:
        """A new zero-filled device value (a fill on the device, never a shared constant: the
        caches are donated)."""
        jnp = self._jax.numpy
        if dtype is DType.Q8A:
            _, (t, blocks) = host_layout(dtype, shape)
            q = jnp.zeros(shape, jnp.int8, device=self._device)
            d, s = (jnp.zeros((t, blocks), jnp.float32, device=self._device) for _ in "ds")
            return self._q8(q, d, s)
        np_dtype, _ = host_layout(dtype, shape)
        return jnp.zeros(shape, np_dtype, device=self._device)

    def _check_host(
        self, what: str, host: np.ndarray, dtype: Any, shape: tuple[int, ...], have: Any
    ) -> None:
        if (host.dtype, tuple(host.shape)) != (np.dtype(dtype), tuple(shape)):
            raise BackendError(
                f"{what} {host.dtype}{list(host.shape)} a jax buffer of {_describe(have)} "
                f"(host layout {np.dtype(dtype)}{list(shape)}); use an array in the buffer's "
                "host layout (parity.core.dtypes.host_layout)"
            )


def _arrays(value: Any) -> tuple[Any, ...]:
    """The jax arrays of a buffer's value: itself, or a Q8's three."""
    return tuple(value) if isinstance(value, tuple) else (value,)


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return "Q8A" + str(list(value[0].shape))
    return f"{value.dtype}{list(value.shape)}"


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
