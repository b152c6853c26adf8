"""CudaBackend: every op of the IR as CUDA C kernels compiled at run time (NVRTC), on the shared
GPU runtime (PyTorch memory, one stream, pinned readback, CUDA graphs), bit for bit the cpu
oracle in ``exact`` numerics.

Discovery (``available``, ``devices``, ``score``) asks the driver through ctypes and imports
neither torch nor the CUDA bindings. An instance owns one GPU: its runtime, its compiled
kernels, its resident weights (the GGUF's own bytes, uploaded once).

``rewrite`` fuses as the cpu's numba mode does, and quantizes every quantized product's x in a
QUANTIZE node of its own, which the launch that produces x writes (``lowering``). ``prepare``
builds a split's launches once, on buffers bound for the executable's life; ``execute`` enqueues
them; ``capture`` records them as one CUDA graph. On sm_90 and newer the launches of a
decode-sized split (``GpuBackend.decode_sized``) use programmatic dependent launch: each kernel
starts while the one before it finishes, and a product loads its first weights before it waits
(kernels/common.cuh, ``pdl_begin``). ``pdl = false`` in ``[backends.cuda]`` (or
``PARITY_PDL=0``) turns it off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from parity.backends.cuda import discovery
from parity.backends.gpu.backend import GpuBackend, GpuExecutable
from parity.core.backend import (
    Availability,
    Buffer,
    Device,
    Split,
)
from parity.core.dtypes import DType
from parity.core.fusion import PASSES, fuse
from parity.core.ir import Graph, Node, Op
from parity.core.scheduler import accepts
from parity.errors import BackendError, ConfigError

OPS = frozenset(Op) - {Op.INPUT, Op.WEIGHT, Op.STATE}
ADVANCE = ("rows.cu", "advance_i32")  # the kernel of ``increment``


class CudaExecutable(GpuExecutable):
    pass


class CudaBackend(GpuBackend):
    name = "cuda"
    numerics_modes = ("exact", "fast")  # exact satisfies fast
    queues = True  # every per-step call goes on the runtime's stream
    manifest: ClassVar[Mapping[str, str]] = {op.name: "exact" for op in sorted(OPS, key=str)}
    # under numerics = "fast", a prefill's attention may be flash attention on the tensor cores
    # (lowering.FAST_ATTENTION; TF32 products of split operands, as triton's fast tier), and
    # its products of quantized weights plain float16 (or TF32) GEMMs (lowering.FAST_GEMM:
    # inputs rounded to 10 bits of mantissa, so the contract's budget, not the split
    # products' 1e-8)
    fast_manifest: ClassVar[Mapping[str, str]] = {
        **manifest,
        "ATTENTION": "nmse<=1e-8",
        **{op.name: "nmse<=1e-5" for op in (Op.MATMUL, Op.MATMUL_ADD, Op.MATMUL_SWIGLU)},
    }

    def __init__(
        self, device: Device, *, pinned: bool | None = None, pdl: bool | None = None, **kwargs: Any
    ) -> None:
        super().__init__(device, **kwargs)
        unknown = sorted(set(self.options) - {"pinned", "pdl"})
        if unknown:
            raise ConfigError(
                f"[backends.cuda] has unknown option(s) {', '.join(unknown)}; "
                "the cuda backend takes pinned and pdl"
            )
        ok = self.available()
        if not ok.ok:
            raise BackendError(f"the cuda backend cannot run here: {ok.reason}")
        from parity.backends.cuda.library import Library
        from parity.backends.cuda.nvrtc import Compiler
        from parity.backends.gpu.driver import pdl_wanted
        from parity.backends.gpu.pinned import pinning_wanted
        from parity.backends.gpu.runtime import GpuRuntime

        gpu = next((g for g in discovery.probe().usable if g.index == device.index), None)
        if gpu is None:
            have = ", ".join(f"cuda:{g.index}" for g in discovery.probe().usable) or "none"
            raise BackendError(f"there is no usable GPU cuda:{device.index} (usable: {have})")
        if pinned is None:
            pinned = bool(self.options.get("pinned", pinning_wanted()))
        if pdl is None:
            pdl = bool(self.options.get("pdl", pdl_wanted()))
        self.pdl = pdl and gpu.capability >= (9, 0)
        self.rt = GpuRuntime(device.index, pinned=pinned)
        self.driver = self.rt.driver
        self.library = Library(self.driver, Compiler(gpu.arch))
        self.multiprocessors = gpu.multiprocessors
        self.clusters = gpu.capability >= (9, 0)
        self.library.ensure([ADVANCE])  # (a step's kernels are compiled when it is prepared)
        # (address, size, by) -> the launch that advances a kept input, and the buffer (alive)
        self._advance: dict[tuple[int, int, int], tuple[Any, Any]] = {}
        self.init_memory()

    # -- discovery -------------------------------------------------------------------------

    @classmethod
    def available(cls) -> Availability:
        missing = discovery.missing_packages()
        if missing:
            return Availability(False, missing)
        probe = discovery.probe()
        if not probe.gpus:
            return Availability(False, probe.reason)
        if not probe.usable:
            found = ", ".join(f"{g.name} ({g.arch})" for g in probe.gpus)
            return Availability(False, f"no GPU of sm_80 or newer (found {found})")
        return Availability(True)

    @classmethod
    def devices(cls) -> list[Device]:
        return [Device("cuda", g.index, g.describe()) for g in discovery.probe().usable]

    @classmethod
    def score(cls, device: Device) -> int:
        return 100  # a GPU beats the cpu oracle

    # -- graphs ----------------------------------------------------------------------------

    def supports_op(self, node: Node, srcs: Sequence[Node]) -> bool:
        if node.op not in OPS:
            return False
        if node.op is Op.ATTENTION:
            return node.arg.head_dim in (64, 128, 256)
        return True

    def rewrite(self, graph: Graph) -> Graph:
        return fuse(graph, accept=lambda n, s: accepts(self, n, s), passes=PASSES, share_min=1)

    # -- weights and buffers -----------------------------------------------------------------

    def increment(self, buffer: Buffer, dtype: DType, shape: tuple[int, ...], by: int) -> None:
        if dtype is not DType.I32:
            raise BackendError(f"increment takes I32 values, not {dtype.name}")
        key = (buffer.data_ptr(), buffer.numel(), by)
        made = self._advance.get(key)
        if made is None:  # made once per kept input: the decode loop allocates nothing
            from parity.backends.gpu.driver import Launch, pack, pointer

            n = buffer.numel()
            fn = self.library.function(*ADVANCE)
            grid = (min(-(-n // 256), 1024), 1, 1)
            args = pack((pointer(buffer), n, by))
            made = self._advance[key] = (Launch(ADVANCE[1], fn, grid, (256, 1, 1), 0, args), buffer)
        self.driver.launch(made[0], self.rt.handle)

    # -- running -----------------------------------------------------------------------------

    def prepare(self, split: Split, inputs: Mapping[int, Buffer]) -> CudaExecutable:
        from parity.backends.cuda.lowering import Lowering

        graph = split.graph
        values, views = self.split_values(split, inputs)
        outputs = {i: values[i] for i in split.outputs}
        readers: dict[int, list[int]] = {}
        for i in split.nodes:
            for s in graph.nodes[i].src:
                readers.setdefault(s, []).append(i)
        pdl = self.pdl and self.decode_sized(split)
        lowering = Lowering(
            graph,
            values,
            self._weights,
            self._enqueue,
            self._copy,
            self.alloc,
            pdl,
            views,
            self.multiprocessors,
            self.numerics == "fast",
            self.rt.matmul,
            self.rt.half_gemm,
            clusters=self.clusters,
        )
        lowered = lowering.lower(split.nodes, readers)
        self.library.ensure(lowered.kernels)  # one batch, compiled in parallel (or cached)
        lowered.bind(self.library.function)
        return CudaExecutable(split, inputs, outputs, lowered.launches, (values, lowered.scratch))

    def _enqueue(self, launch) -> None:
        self.driver.launch(launch, self.rt.handle)

    def _copy(self, dst, src) -> None:
        self.rt.copy(dst, src)

    def execute(self, executable: CudaExecutable) -> None:
        if executable.graph is not None:
            self.rt.replay(executable.graph)
            return
        for fn, args in executable.launches:
            fn(*args)
