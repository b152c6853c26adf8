"""TritonBackend: the IR's ops as Triton kernels on the shared GPU runtime (``parity.backends.gpu``:
PyTorch memory, one stream, pinned readback, CUDA graphs), bit for bit the cpu oracle in
``exact`` numerics; or, with ``TRITON_INTERPRET=1``, the same kernels in Triton's interpreter
on host memory (``HostRuntime``), so a machine without a GPU checks them.

Every op of the IR has an ``exact`` kernel (kernels/*.py), written for exactness first: one
program per block of output rows or per (token, head, part of a chunk), TREEs as
reshape-and-split levels. Under ``numerics = "fast"`` (``fast_manifest``) products and attention
of ``FAST_GEMM_TOKENS`` tokens or more (a prefill) take tiled GEMMs on tensor cores
(kernels/gemm_fast.py) and flash attention (kernels/attention_fast.py); the other ops, and
those of fewer tokens (a decode step), keep the exact kernels, which meet any bound. ``auto``
prefers cuda on a GPU (score 90 against cuda's 100: cuda is exact on every op too and, by the
benchmarks in docs/perf.md, faster on most of them); the interpreter's device scores -1,
below the cpu oracle, so it is only used when asked for.

Quantized weights are repacked when a split is prepared (kernels/dequant.py ``repack``: a byte a
quant, binary32 scales and mins, about 1.2 bytes a weight beside the raw GGUF bytes, which
GET_ROWS keeps reading), so a product's program loads whole aligned rows.

Some launches do the work of several nodes, with the same operations and so the same bits: a
norm or an attention quantizes its output for the products that read it, gate and up take one
launch with their SWIGLU, and a layer's two ROPEs and two KV_WRITEs are one launch
(``_rope_kv_groups``). On sm_90 and newer the kernels of a decode step are launched with
programmatic dependent launch (kernels/pdl.py): each starts while the one before finishes.

Kernels are compiled when a split is prepared (Triton's own cache keeps them across runs),
never inside a capture.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np

from parity.backends.gpu.backend import GpuBackend, GpuExecutable
from parity.backends.triton import discovery
from parity.core.backend import (
    Availability,
    Buffer,
    CaptureResult,
    Device,
    Split,
)
from parity.core.dtypes import WEIGHT_TYPES, DType
from parity.core.fusion import PASSES, fuse
from parity.core.ir import MATRICES, Graph, Node, Op
from parity.core.scheduler import accepts
from parity.errors import BackendError, ConfigError

OPS = frozenset(
    {Op.ADD, Op.MUL, Op.SILU, Op.SWIGLU, Op.GELU, Op.GEGLU, Op.SCALE, Op.SLICE_ROWS, Op.RESHAPE,
     Op.RMS_NORM, Op.RMS_NORM_MUL, Op.ROPE, Op.KV_WRITE, Op.ARGMAX, Op.QUANTIZE, Op.GET_ROWS,
     Op.MATMUL, Op.MATMUL_ADD, Op.MATMUL_SWIGLU, Op.ATTENTION}
)  # fmt: skip
PRODUCTS = (Op.MATMUL, Op.MATMUL_ADD, Op.MATMUL_SWIGLU)
# outputs of one token a product's program computes: few on a GPU (each holds K quants), many
# in the interpreter (whose cost is per operation, not per element); the bits do not depend on
# it. On an H200 4 rows in 2 warps beat 1 in 1 (Qwen's decode step 995 -> 826 us; 2, 8 or 16
# rows and 1, 4 or 8 warps measured between: docs/perf.md)
PRODUCT_ROWS = {False: 4, True: 64}
# elements of K a product's program takes at a time (the interpreter: all of them at once)
PRODUCT_GROUP = {False: 2048, True: 1 << 20}
PRODUCT_WARPS = 2  # a product's program's warps on a GPU
NORM_WARPS = 8  # an RMS_NORM's (one row a program; 1, 2, 4 and 16 measured slower)
INT_SOURCES = {Op.ROPE: (1,), Op.KV_WRITE: (2,), Op.GET_ROWS: (1,), Op.ATTENTION: (3,)}
TABLE_TYPES = WEIGHT_TYPES  # GET_ROWS reads every weight type (kernels/dequant.py)
SILU, GELU = 0, 1  # the kernels' OP constants
MIN_TERMS = {DType.Q4_1: 1, DType.Q4_K: 2}  # kernels/matmul.py PLUS_MIN, MINUS_MIN
KERNELS_SO_FAR = "every op"
ARGMAX_BLOCK = 2048  # columns of a row an ARGMAX program takes
# slots x head_dim an attention program holds at a time, and the most slots (interpreter: one
# step per chunk)
ATTENTION_TILE = {False: (1024, 128), True: (1 << 16, 256)}
# up to this many tokens, attention programs take one sub-tile each (else a chunk each)
ATTENTION_SPLIT_TOKENS = 16
# under fast numerics, products of at least this many tokens run as tiled GEMMs on tensor
# cores (kernels/gemm_fast.py; fewer tokens take the exact kernels), BM x BN (x BK) tiles
FAST_GEMM_TOKENS = 16
FAST_GEMM_TILE = (64, 64, 32)
FAST_GEMM_WARPS = 8  # (4 warps hold a 64 x 64 tile only by spilling)
# ... and with PARITY_TRITON_HALF_GEMM=1 (read once), a quantized product's x and W as float16
# rows first (to_half), then a float16 GEMM (gemm_h; NMSE about 1.6e-7, the integer dots'
# about 1e-12): the float work of every output and sub-block goes. BM x BN x BK tiles, its
# warps and pipeline stages; rows a to_half program. Until a GPU times it: off. (The products'
# fast tier follows the variable at import; a test that sets FAST_GEMM_HALF afterwards runs
# the kernels without the declaration changing.)
HALF_GEMM_ENV = "PARITY_TRITON_HALF_GEMM"
FAST_GEMM_HALF = os.environ.get(HALF_GEMM_ENV, "0").strip().lower() in ("1", "true", "on", "yes")
HALF_GEMM_TILE = (64, 128, 32)  # (ptxas, sm_90: 234 registers, no spills; 128 x 128 in 8
HALF_GEMM_WARPS = 4  # warps, or BK 64, spill with the integer dots' branch in the kernel)
HALF_GEMM_STAGES = 3
HALF_ROWS = 8
# and attention of at least this many tokens as flash attention (kernels/attention_fast.py),
# in tiles of tokens x slots (heads up to 64, larger heads)
FAST_ATTENTION_TOKENS = 16
FLASH_TILE = (32, 16)
# the float32 dots of flash attention and the float GEMM: three TF32 products (tensor cores,
# about float32's accuracy), not plain TF32
FAST_DOT_PRECISION = "tf32x3"
# the fast kernels' tiers: a product's float additions in another order; attention's online
# softmax, with tl.exp
# launch each kernel of a decode-sized split (GpuBackend.decode_sized) with programmatic
# dependent launch where the GPU has it (sm_90+; kernels/pdl.py; PARITY_PDL=0 turns it off):
# its launch and first weight loads overlap the previous kernel. On an H200 it takes SmolLM2's
# decode step from 0.98 to 0.85 ms, and makes a 512-token prefill slower (Qwen fast: 10.0
# against 11.8 ms): docs/perf.md
FAST_TIERS = {**{op.name: "nmse<=1e-6" if FAST_GEMM_HALF else "nmse<=1e-8" for op in PRODUCTS},
              "ATTENTION": "nmse<=1e-8"}  # fmt: skip


class TritonExecutable(GpuExecutable):
    pass


@attrs.frozen
class Packed:
    """A quantized weight as the products read it (kernels/dequant.py ``repack``)."""

    q: Any  # int8 (N, K): the integer quants
    a: Any  # float32 (N, K / sub): each sub-block's scale
    m: Any  # float32 (N, K / sub): each sub-block's min (``a`` for types without one)
    sub: int  # elements a sub-block
    min: int  # the min term (kernels/matmul.py NO_MIN, PLUS_MIN, MINUS_MIN)


def packed_kind(dtype: DType) -> tuple[int, int]:
    """(elements a sub-block, the min term) of a quantized type's products."""
    return (16 if dtype is DType.Q6_K else 32), MIN_TERMS.get(dtype, 0)


class TritonBackend(GpuBackend):
    name = "triton"
    numerics_modes = ("exact", "fast")
    queues = True  # on a GPU, every per-step call goes on the runtime's stream
    manifest: ClassVar[Mapping[str, str]] = {op.name: "exact" for op in sorted(OPS, key=str)}
    fast_manifest: ClassVar[Mapping[str, str]] = {**manifest, **FAST_TIERS}

    def __init__(self, device: Device, *, pinned: bool | None = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        unknown = sorted(set(self.options) - {"pinned"})
        if unknown:
            raise ConfigError(
                f"[backends.triton] has unknown option(s) {', '.join(unknown)}; "
                "the triton backend takes pinned"
            )
        ok = self.available()
        if not ok.ok:
            raise BackendError(f"the triton backend cannot run here: {ok.reason}")
        self.interpreted = discovery.interpreting()
        if self.interpreted:
            from parity.backends.gpu.host import HostRuntime

            self.rt: Any = HostRuntime()
            self.pdl = False
        else:
            from parity.backends.cuda.discovery import probe
            from parity.backends.gpu.driver import pdl_wanted
            from parity.backends.gpu.pinned import pinning_wanted
            from parity.backends.gpu.runtime import GpuRuntime

            gpu = next((g for g in probe().usable if g.index == device.index), None)
            if gpu is None:
                have = ", ".join(f"triton:{g.index}" for g in probe().usable) or "none"
                raise BackendError(f"there is no usable GPU triton:{device.index} (usable: {have})")
            if pinned is None:
                pinned = bool(self.options.get("pinned", pinning_wanted()))
            self.rt = GpuRuntime(device.index, pinned=pinned)
            self.pdl = pdl_wanted() and gpu.capability >= (9, 0)  # (kernels/pdl.py)
        import triton

        from parity.backends.triton.kernels import (
            attention,
            attention_fast,
            dequant,
            elementwise,
            gemm_fast,
            matmul,
            norm,
            rows,
        )

        self.triton = triton
        self.k = elementwise
        self.norm = norm
        self.rows = rows
        self.dequant = dequant
        self.matmul = matmul
        self.gemm_fast = gemm_fast
        self.attention = attention
        self.attention_fast = attention_fast
        self.init_memory()
        self._packed: dict[str, Packed] = {}
        self._half: dict[str, Any] = {}  # the float16 GEMM's scratch (_half_scratch)
        self._advance: dict[tuple[int, int, int], Any] = {}  # increment's launches
        self._pdl_split = self.pdl  # (the split being prepared takes PDL: see prepare)

    # -- discovery -------------------------------------------------------------------------

    @classmethod
    def available(cls) -> Availability:
        missing = discovery.missing_packages()
        if missing:
            return Availability(False, missing)
        if discovery.interpreting():
            return Availability(True)
        from parity.backends.cuda.discovery import probe

        found = probe()
        if not found.gpus:
            return Availability(
                False, f"{found.reason} (set {discovery.INTERPRET_ENV}=1 for the interpreter)"
            )
        if not found.usable:
            names = ", ".join(f"{g.name} ({g.arch})" for g in found.gpus)
            return Availability(False, f"no GPU of sm_80 or newer (found {names})")
        return Availability(True)

    @classmethod
    def devices(cls) -> list[Device]:
        if discovery.interpreting():
            return [Device("triton", 0, "Triton's interpreter on the CPU (TRITON_INTERPRET=1)")]
        from parity.backends.cuda.discovery import probe

        return [Device("triton", g.index, g.describe()) for g in probe().usable]

    @classmethod
    def score(cls, device: Device) -> int:
        return -1 if discovery.interpreting() else 90

    # -- graphs ----------------------------------------------------------------------------

    def supports_op(self, node: Node, srcs: Sequence[Node]) -> bool:
        if node.op not in OPS:
            return False
        ints = INT_SOURCES.get(node.op, ())
        if node.op is Op.GET_ROWS:
            return srcs[0].dtype in TABLE_TYPES and srcs[1].dtype is DType.I32
        if node.op in PRODUCTS:
            return self._supports_product(node, srcs)
        if node.op is Op.ATTENTION and node.arg.head_dim & (node.arg.head_dim - 1):
            return False  # (its TREE over head_dim is a power-of-two block)
        return all(s.dtype is (DType.I32 if k in ints else DType.F32) for k, s in enumerate(srcs))

    @staticmethod
    def _supports_product(node: Node, srcs: Sequence[Node]) -> bool:
        x, *rest = srcs
        weights = [rest[k - 1] for k in MATRICES[node.op]]
        others = [s for k, s in enumerate(rest, 1) if k not in MATRICES[node.op]]
        if any(w.dtype not in WEIGHT_TYPES or len(w.shape) != 2 for w in weights):
            return False
        if x.dtype is DType.Q8A:
            ok_x = all(w.dtype.is_quantized for w in weights)
        else:
            ok_x = x.dtype is DType.F32 and (x.shape[1] % 32 == 0 or not any(
                w.dtype.is_quantized for w in weights))  # fmt: skip
        return ok_x and all(s.dtype is DType.F32 for s in others)

    def rewrite(self, graph: Graph) -> Graph:
        return fuse(graph, accept=lambda n, s: accepts(self, n, s), passes=PASSES, share_min=1)

    def why_unsupported(self, node: Node, srcs: Sequence[Node]) -> str:
        if node.op not in OPS:
            return f"triton has no kernel for {node.op.name} yet (its kernels: {KERNELS_SO_FAR})"
        return super().why_unsupported(node, srcs)

    # -- running -----------------------------------------------------------------------------

    def prepare(self, split: Split, inputs: Mapping[int, Buffer]) -> TritonExecutable:
        graph = split.graph
        values, self._views = self.split_values(split, inputs)
        torch = self.rt.torch
        views = {DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.int16}
        weights = {s for i in split.nodes for s in graph.nodes[i].src
                   if graph.nodes[s].op is Op.WEIGHT}  # fmt: skip
        for i in weights:  # float types in their own type, the others as bytes
            node = graph.nodes[i]
            raw = self._weights[node.arg]
            values[i] = raw.view(views[node.dtype]) if node.dtype in views else raw
        self.graph_nodes = graph.nodes
        self._pdl_split = self.pdl and self.decode_sized(split)
        self._readers: dict[int, list[int]] = {}
        for i in split.nodes:
            for s in graph.nodes[i].src:
                self._readers.setdefault(s, []).append(i)
        self._fused: set[int] = set()  # nodes an earlier launch computes too
        self._half_x: Any = None  # the x the float16 scratch holds, at this point of the split
        self._rope_kv = self._rope_kv_groups(split)
        for last, group in self._rope_kv.items():
            self._fused.update(set(group) - {last})  # (launched with the group's last node)
        # (not the nodes another launch computes: _lower adds to _fused as it goes; nor views)
        launches = [self._lower(i, graph.nodes[i], values[i], values) for i in split.nodes
                    if i not in self._fused and i not in self._views]  # fmt: skip
        if not self.interpreted:
            for fn in launches:  # compile now (Triton's cache keeps it), not in a capture
                fn(warmup=True)
        outputs = {i: values[i] for i in split.outputs}
        return TritonExecutable(split, inputs, outputs, launches, values)

    def _rope_kv_groups(self, split: Split) -> dict[int, tuple[int, ...]]:
        """Each attention's ROPE of q, ROPE of k, KV_WRITE of k and KV_WRITE of v, launched as
        one kernel (rows.rope_kv_f32) at the last of the four, keyed by that node (the group
        in that order): where the two ROPEs share positions and tables with the writes, the
        caches are as wide as k, and no other node reads the four's values before then."""
        nodes = self.graph_nodes
        order = {i: j for j, i in enumerate(split.nodes)}
        groups: dict[int, tuple[int, ...]] = {}
        for i in split.nodes:
            node = nodes[i]
            if node.op is not Op.ATTENTION:
                continue
            rq, kw, vw = node.src[:3]
            if not all(j in order for j in (rq, kw, vw)):
                continue
            rk = nodes[kw].src[1]
            if rk not in order or nodes[rq].op is not Op.ROPE or nodes[rk].op is not Op.ROPE:
                continue
            a, b = nodes[rq], nodes[rk]
            same = (a.src[1:] == b.src[1:] and a.src[1] == nodes[kw].src[2] == nodes[vw].src[2]
                    and attrs.evolve(a.arg, n_head=b.arg.n_head) == b.arg
                    and nodes[kw].shape[1:] == nodes[vw].shape[1:] == b.shape[1:])  # fmt: skip
            members = (rq, rk, kw, vw)
            last = max(members, key=order.__getitem__)
            early = [u for m in members for u in self._readers.get(m, [])
                     if u not in members and order.get(u, len(order)) < order[last]]  # fmt: skip
            if same and not early:
                groups[last] = members
        return groups

    def _rope_kv_launch(self, group: tuple[int, ...], values: Mapping[int, Any]):
        """The launch of a group of ``_rope_kv_groups``: (ROPE q, ROPE k, KV_WRITE k and v)."""
        nodes = self.graph_nodes
        rq, rk, kw, vw = group
        q, k = nodes[rq], nodes[rk]
        arg = q.arg
        t = q.shape[0]
        _, pos, cos, sin = (values[s] for s in q.src)
        block = 1 << max(0, arg.head_dim - 1).bit_length()
        heads = arg.n_head + 2 * k.arg.n_head
        return self._kernel(self.rows.rope_kv_f32, 0, values[rq], values[q.src[0]], values[rk],
                            values[k.src[0]], values[nodes[vw].src[1]], values[kw],
                            values[vw], pos, cos, sin, arg.n_head, k.arg.n_head,
                            arg.head_dim, arg.n_rot // 2, grid=(t, heads),
                            NEOX=arg.mode == "neox", BLOCK=block, block=False)  # fmt: skip

    def _quantize_reader(self, i: int, values: Mapping[int, Any]) -> Any:
        """The value of a QUANTIZE of node ``i`` in the split, which ``i``'s launch then
        writes too (marked fused), or None."""
        for u in self._readers.get(i, []):
            if self.graph_nodes[u].op is Op.QUANTIZE and u not in self._fused:
                self._fused.add(u)
                return values[u]
        return None

    def _lower(self, i: int, node: Node, out: Any, values: Mapping[int, Any]):
        """A callable that enqueues node ``i``'s kernel (``warmup=True``: only compile it)."""
        if i in self._rope_kv:
            return self._rope_kv_launch(self._rope_kv[i], values)
        src = [values[s] for s in node.src]
        n = int(np.prod(node.shape))
        k = self.k
        if node.op is Op.SLICE_ROWS:
            start, count = node.arg.start, node.arg.count
            return functools.partial(self._copy, out, src[0][start : start + count])
        if node.op is Op.RESHAPE:
            return functools.partial(self._copy, out, src[0])
        if node.op in (Op.ADD, Op.MUL):
            row = src[1].dim() == 1
            op = 0 if node.op is Op.ADD else 1
            return self._kernel(k.binary_f32, n, out, src[0], src[1], n, node.shape[1],
                                OP=op, ROW=row)  # fmt: skip
        if node.op in (Op.SILU, Op.GELU):
            return self._kernel(k.unary_f32, n, out, src[0], n,
                                OP=SILU if node.op is Op.SILU else GELU)  # fmt: skip
        if node.op in (Op.SWIGLU, Op.GEGLU):
            return self._kernel(k.glu_f32, n, out, src[0], src[1], n,
                                OP=SILU if node.op is Op.SWIGLU else GELU)  # fmt: skip
        if node.op is Op.SCALE:
            return self._kernel(k.scale_f32, n, out, src[0], n, float(node.arg))
        if node.op in (Op.RMS_NORM, Op.RMS_NORM_MUL):
            rows, width = node.shape
            p = 1 << max(0, width - 1).bit_length()
            mul = node.op is Op.RMS_NORM_MUL
            weight = src[1] if mul else src[0]  # (read only with MUL)
            q8 = self._quantize_reader(i, values)
            parts = (out, out, out) if q8 is None else (q8.q, q8.d, q8.s)
            return self._kernel(self.norm.rms_norm_f32, 0, out, *parts, src[0], weight, width,
                                float(node.arg), grid=(rows,), MUL=mul, P=p,
                                LOG=p.bit_length() - 1, QUANT=q8 is not None,
                                num_warps=NORM_WARPS, block=False)  # fmt: skip
        if node.op is Op.ROPE:
            arg = node.arg
            t = node.shape[0]
            block = 1 << max(0, arg.head_dim - 1).bit_length()
            return self._kernel(self.rows.rope_f32, 0, out, *src, arg.n_head, arg.head_dim,
                                arg.n_rot // 2, node.shape[1], grid=(t, arg.n_head),
                                NEOX=arg.mode == "neox", BLOCK=block, block=False)  # fmt: skip
        if node.op is Op.KV_WRITE:
            t, width = src[1].shape  # the rows
            grid = (t, self.triton.cdiv(width, self.k.BLOCK))
            return self._kernel(self.rows.kv_write_f32, 0, src[0], src[1], src[2], width,
                                grid=grid)  # fmt: skip
        if node.op is Op.ARGMAX:
            return self._argmax(out, src[0])
        if node.op in PRODUCTS:
            return self._products(node, out, src)
        if node.op is Op.ATTENTION:
            return self._attention(i, node, out, src, values)
        if node.op is Op.GET_ROWS:
            table = self.graph_nodes[node.src[0]]
            t, k = node.shape
            grid = (t, self.triton.cdiv(k, self.k.BLOCK))
            return self._kernel(self.dequant.get_rows, 0, out, src[0], src[1], k,
                                table.dtype.nbytes(k), grid=grid,
                                TYPE=table.dtype.value)  # fmt: skip
        if node.op is Op.QUANTIZE:
            t, k = node.shape
            nb = k // 32
            return self._kernel(self.rows.quantize_q8, 0, out.q, out.d, out.s, src[0], k, nb,
                                grid=(t, self.triton.cdiv(nb, 32)), BLOCKS=32,
                                block=False)  # fmt: skip
        raise BackendError(f"triton cannot lower {node.op.name}")  # (supports_op said no)

    def _argmax(self, out: Any, x: Any):
        """ARGMAX in two launches (kernels/rows.py): each row's parts of ARGMAX_BLOCK columns
        side by side, then one program a row over its parts' answers (a vocabulary of 151,936
        is 75 programs a row, not one program walking it)."""
        rows, width = x.shape
        n_parts = self.triton.cdiv(width, ARGMAX_BLOCK)
        best = self.alloc(DType.F32, (rows, n_parts))
        at = self.alloc(DType.I32, (rows, n_parts))
        steps = [
            self._kernel(self.rows.argmax_parts, 0, best, at, x, width, grid=(rows, n_parts),
                         BLOCK=ARGMAX_BLOCK, block=False),
            self._kernel(self.rows.argmax_fold, 0, out, best, at, n_parts, grid=(rows,),
                         NP=1 << max(0, n_parts - 1).bit_length(), block=False),
        ]  # fmt: skip
        return self._sequence(steps)

    def _products(self, node: Node, out: Any, src: list[Any]):
        """MATMUL, MATMUL_ADD (bias and residual in the epilogue) and MATMUL_SWIGLU (both
        products and SWIGLU in one launch; as two products into scratch, then SWIGLU, where the
        weights' sub-blocks differ or the products are tiled GEMMs); an F32 x of a quantized
        product is quantized into scratch first. Quantized weights are read repacked."""
        nodes = self.graph_nodes
        x_node = nodes[node.src[0]]
        t, k = x_node.shape
        steps = []
        xq = src[0] if x_node.dtype is DType.Q8A else None
        tiled = self.numerics == "fast" and t >= FAST_GEMM_TOKENS

        def quantized_x():
            nonlocal xq
            if xq is None:
                xq = self.alloc(DType.Q8A, (t, k))
                steps.append(self._kernel(self.rows.quantize_q8, 0, xq.q, xq.d, xq.s, src[0],
                                          k, k // 32, grid=(t, self.triton.cdiv(k // 32, 32)),
                                          BLOCKS=32, block=False))  # fmt: skip
            return xq

        def product(y, wi, bias=None, res=None, up=None):
            w_node = nodes[node.src[wi]]
            n_out = w_node.shape[0]
            bn = PRODUCT_ROWS[self.interpreted]
            grid = (self.triton.cdiv(n_out, bn), t)
            extra = dict(HAS_BIAS=bias is not None, HAS_RES=res is not None, BN=bn)
            bias = y if bias is None else bias
            res = y if res is None else res
            dtype = w_node.dtype
            if tiled:
                bm, bn, bk = FAST_GEMM_TILE
                grid = (self.triton.cdiv(t, bm), self.triton.cdiv(n_out, bn))
                extra.update(BM=bm, BN=bn, num_warps=FAST_GEMM_WARPS, block=False)
                if dtype.is_quantized and FAST_GEMM_HALF:
                    q, w = quantized_x(), self._packed_weight(node.src[wi])
                    steps.extend(self._half_gemm(y, q, w, bias, res, t, k, n_out, extra))
                elif dtype.is_quantized:
                    q, w = quantized_x(), self._packed_weight(node.src[wi])
                    steps.append(self._kernel(self.gemm_fast.gemm_q, 0, y, q.q, q.d, q.s,
                                              w.q, w.a, w.m, bias, res, t, k, n_out,
                                              grid=grid, MIN=w.min, L=w.sub,
                                              **extra))  # fmt: skip
                else:
                    steps.append(self._kernel(self.gemm_fast.gemm_f, 0, y, src[0], src[wi],
                                              bias, res, t, k, n_out, dtype.nbytes(k),
                                              grid=grid, TYPE=dtype.value, BK=bk,
                                              PRECISION=FAST_DOT_PRECISION,
                                              **extra))  # fmt: skip
            elif dtype.is_quantized:
                q, w = quantized_x(), self._packed_weight(node.src[wi])
                u = w if up is None else self._packed_weight(node.src[up])
                p = 1 << max(0, k // w.sub - 1).bit_length()
                g = min(p, PRODUCT_GROUP[self.interpreted] // w.sub)
                steps.append(self._kernel(self.matmul.matmul_q, 0, y, q.q, q.d, q.s, w.q, w.a,
                                          w.m, u.q, u.a, u.m, bias, res, k, n_out, grid=grid,
                                          MIN=w.min, L=w.sub, P=p, LOG=p.bit_length() - 1,
                                          G=g, LOGG=g.bit_length() - 1, GLU=up is not None,
                                          num_warps=PRODUCT_WARPS, block=False,
                                          **extra))  # fmt: skip
            else:
                p = 1 << max(0, k - 1).bit_length()
                g = min(p, PRODUCT_GROUP[self.interpreted])
                steps.append(self._kernel(self.matmul.matmul_f, 0, y, src[0], src[wi], bias,
                                          res, k, n_out, dtype.nbytes(k), grid=grid,
                                          TYPE=dtype.value, P=p, LOG=p.bit_length() - 1, G=g,
                                          LOGG=g.bit_length() - 1, block=False,
                                          **extra))  # fmt: skip

        if node.op is Op.MATMUL_SWIGLU:
            gate, up = (nodes[node.src[j]].dtype for j in (1, 2))
            if not tiled and gate.is_quantized and up.is_quantized and (
                    packed_kind(gate) == packed_kind(up)):  # fmt: skip
                product(out, 1, up=2)
                return self._sequence(steps)
            gate, up = (self.alloc(DType.F32, node.shape) for _ in range(2))
            product(gate, 1)
            product(up, 2)
            n = int(np.prod(node.shape))
            steps.append(self._kernel(self.k.glu_f32, n, out, gate, up, n, OP=SILU))
        else:
            has_bias = len(node.src) == (3 if node.op is Op.MATMUL else 4)
            bias = src[2] if has_bias else None
            res = src[-1] if node.op is Op.MATMUL_ADD else None
            product(out, 1, bias, res)
        return self._sequence(steps)

    def _half_gemm(self, y, q, w: Packed, bias, res, t: int, k: int, n_out: int, extra):
        """A quantized product on float16 tensor cores (FAST_GEMM_HALF): x's and W's rows as
        float16 into scratch, then the GEMM, which takes the integer dots for tiles of rows
        whose scales float16 cannot span (kernels/gemm_fast.py)."""
        torch = self.rt.torch
        xh = self._half_scratch("x", torch.float16, t * k)
        wh = self._half_scratch("w", torch.float16, n_out * k)
        sx = self._half_scratch("x scales", torch.float32, t)
        sw = self._half_scratch("w scales", torch.float32, n_out)
        bm, bn, bk = HALF_GEMM_TILE
        rows = HALF_ROWS
        bk_rows = min(bk, 1 << max(0, k - 1).bit_length()) if self.interpreted else bk
        half = self.gemm_fast.to_half
        steps = []
        if self._half_x is not q.q:  # (the split's products in order: q, k and v, or gate and
            self._half_x = q.q  # up, read one x, which the scratch then holds already)
            steps.append(self._kernel(half, 0, xh, sx, q.q, q.d, q.d, t, k,
                                      grid=(self.triton.cdiv(t, rows),), MIN=0, L=32, BR=rows,
                                      BK=bk_rows, block=False))  # fmt: skip
        return [
            *steps,
            self._kernel(half, 0, wh, sw, w.q, w.a, w.m, n_out, k,
                         grid=(self.triton.cdiv(n_out, rows),), MIN=w.min, L=w.sub, BR=rows,
                         BK=bk_rows, block=False),
            self._kernel(self.gemm_fast.gemm_h, 0, y, xh, sx, wh, sw, q.q, q.d, q.s, w.q, w.a,
                         w.m, bias, res, t, k, n_out,
                         grid=(self.triton.cdiv(t, bm), self.triton.cdiv(n_out, bn)),
                         MIN=w.min, L=w.sub, BM=bm, BN=bn, BK=bk, HAS_BIAS=extra["HAS_BIAS"],
                         HAS_RES=extra["HAS_RES"], num_warps=HALF_GEMM_WARPS,
                         num_stages=HALF_GEMM_STAGES, block=False),
        ]  # fmt: skip

    def _half_scratch(self, name: str, dtype: Any, n: int) -> Any:
        """A buffer of at least ``n`` elements that every float16 product shares (their launches
        run one after another on the stream); a larger one replaces it, and the launches made
        with the old one keep it."""
        have = self._half.get(name)
        if have is None or have.numel() < n:
            have = self._half[name] = self.rt.empty(dtype, (n,), f"the float16 GEMM's {name}")
        return have

    def _packed_weight(self, i: int) -> Packed:
        """Weight node ``i`` (quantized) repacked (kernels/dequant.py ``repack``) on its first
        use by a product: its quants a byte each, its scales and mins as binary32, the same
        values the products computed from the GGUF bytes. Once a weight, at prepare."""
        node = self.graph_nodes[i]
        if node.arg in self._packed:
            return self._packed[node.arg]
        n, k = node.shape
        sub, minimum = packed_kind(node.dtype)
        torch = self.rt.torch
        what = f"weight {node.arg} (repacked for the products)"
        q = self.rt.empty(torch.int8, (n, k), what)
        a = self.rt.empty(torch.float32, (n, k // sub), what)
        m = self.rt.empty(torch.float32, (n, k // sub), what) if minimum else a
        rows, block = (64, 1 << max(0, k - 1).bit_length()) if self.interpreted else (8, 256)
        block = max(block, sub)
        launch = self._kernel(self.dequant.repack, 0, q, a, m, self._weights[node.arg], n, k,
                              node.dtype.nbytes(k), grid=(self.triton.cdiv(n, rows),
                              self.triton.cdiv(k, block)), TYPE=node.dtype.value, L=sub,
                              HAS_MIN=bool(minimum), R=rows, BLOCK=block,
                              block=False)  # fmt: skip
        self._run([launch])
        packed = self._packed[node.arg] = Packed(q, a, m, sub, minimum)
        return packed

    def _attention(self, i: int, node: Node, out: Any, src: list[Any], values):
        """ATTENTION in three launches (kernels/attention.py) over scratch for each (token,
        head, part of a chunk): the part's max score and its sums. A few tokens (a decode step)
        take one sub-tile a program, for enough programs; more take a chunk a program. The
        last launch writes a QUANTIZE of the attention too."""
        arg = node.arg
        t, d = node.shape[0], arg.head_dim
        if self.numerics == "fast" and t >= FAST_ATTENTION_TOKENS:
            return self._flash_attention(node, out, src)
        q8 = self._quantize_reader(i, values) if d % 32 == 0 else None
        q8_parts = (out, out, out) if q8 is None else (q8.q, q8.d, q8.s)
        n_ctx = src[1].shape[0]
        tile, most = ATTENTION_TILE[self.interpreted]
        sub = max(16, min(most, tile // d))  # slots taken at a time
        parts = 256 // sub if t <= ATTENTION_SPLIT_TOKENS else 1  # programs a chunk
        per = 256 // sub // parts  # sub-tiles a program
        n_parts = self.triton.cdiv(n_ctx, 256) * parts
        mx, dens = (self.alloc(DType.F32, (t, arg.n_head, n_parts)) for _ in range(2))
        nums = self.alloc(DType.F32, (t, arg.n_head, n_parts, d))
        q, k, v, positions = src
        group, kv_width = arg.n_head // arg.n_head_kv, arg.n_head_kv * d
        shape = dict(D=d, LOGD=d.bit_length() - 1, SUB=sub, PER=per, block=False)
        grid = (t, arg.n_head, n_parts)
        steps = [
            self._kernel(self.attention.chunk_max, 0, mx, q, k, positions, arg.n_head, group,
                         kv_width, arg.window, arg.scale, n_parts, grid=grid, **shape),
            self._kernel(self.attention.chunk_sums, 0, dens, nums, mx, q, k, v, positions,
                         arg.n_head, group, kv_width, arg.window, arg.scale, n_parts, grid=grid,
                         LOGSUB=sub.bit_length() - 1, LOGPER=per.bit_length() - 1,
                         NPP=1 << max(0, n_parts - 1).bit_length(), **shape),
            self._kernel(self.attention.fold, 0, out, *q8_parts, dens, nums, positions,
                         arg.n_head, arg.window, n_parts, grid=(t, arg.n_head), D=d,
                         PARTS=parts, LOGPARTS=parts.bit_length() - 1, QUANT=q8 is not None,
                         block=False),
        ]  # fmt: skip
        return self._sequence(steps)

    def _flash_attention(self, node: Node, out: Any, src: list[Any]):
        """Fast ATTENTION for a prefill: one launch of flash attention."""
        arg = node.arg
        t, d = node.shape[0], arg.head_dim
        bm = bn = FLASH_TILE[0] if d <= 64 else FLASH_TILE[1]  # (in registers, unspilled)
        q, k, v, positions = src
        return self._kernel(self.attention_fast.flash, 0, out, q, k, v, positions, t,
                            arg.n_head, arg.n_head // arg.n_head_kv, arg.n_head_kv * d,
                            arg.window, arg.scale, grid=(self.triton.cdiv(t, bm), arg.n_head),
                            D=d, BM=bm, BN=bn, PRECISION=FAST_DOT_PRECISION,
                            num_warps=FAST_GEMM_WARPS, block=False)  # fmt: skip

    @staticmethod
    def _sequence(steps):
        def run(warmup: bool = False) -> None:
            for step in steps:
                step(warmup)

        return run

    def _kernel(self, kernel, n: int, *args, grid=None, block: bool = True, **constants):
        """A launch over ``n`` elements in programs of BLOCK (or over ``grid``, without BLOCK).
        On a GPU the warm-up keeps the compiled kernel, and launches call it directly with the
        arguments in the kernel's order: Triton's JIT dispatch (binding, specialization key,
        cache lookup) costs tens of microseconds a launch, which an eager prefill pays for
        every kernel."""
        if grid is None:
            grid = (max(1, self.triton.cdiv(n, self.k.BLOCK)),)
        opts = dict(constants, enable_fp_fusion=False)
        if block:
            opts["BLOCK"] = self.k.BLOCK
        if "PDL" in kernel.arg_names:  # (kernels/pdl.py: it waits for the previous kernel)
            opts["PDL"] = self._pdl_split
            if self._pdl_split:
                opts["launch_pdl"] = True
        compiled: list[Any] = []

        def launch(warmup: bool = False) -> None:
            if compiled:
                compiled[0](*compiled[1])
            elif warmup:
                named = dict(zip(kernel.arg_names, args, strict=False), **opts)
                full = (*grid, 1, 1)[:3]  # (the compiled kernel's runner reads three)
                run = kernel.warmup(*args, grid=grid, **opts)[full]
                compiled.extend((run, [named[name] for name in kernel.arg_names]))
            else:
                kernel[grid](*args, **opts)

        return launch

    def increment(self, buffer: Any, dtype: DType, shape: tuple[int, ...], by: int) -> None:
        """Queued on the stream like the steps (the base class's host round trip would wait for
        the step just started); one launch made per kept input, so decode allocates nothing."""
        if dtype is not DType.I32:
            raise BackendError(f"increment takes I32 values, not {dtype.name}")
        key = (buffer.data_ptr(), buffer.numel(), by)
        launch = self._advance.get(key)
        if launch is None:
            n = buffer.numel()
            launch = self._kernel(self.rows.add_i32, n, buffer, n, by)
            if not self.interpreted:
                launch(warmup=True)
            self._advance[key] = launch
        self._run([launch])

    def _copy(self, dst: Any, src: Any, warmup: bool = False) -> None:
        if not warmup:
            self.rt.copy(dst, src)

    def execute(self, executable: TritonExecutable) -> None:
        if executable.graph is not None:
            self.rt.replay(executable.graph)
            return
        self._run(executable.launches)

    def _run(self, launches) -> None:
        """Enqueue ``launches`` on the runtime's stream (the interpreter: run them)."""
        if self.interpreted:  # (numpy's warnings on inf and NaN are the kernels' answers)
            with np.errstate(all="ignore"):
                for fn in launches:
                    fn()
            return
        torch = self.rt.torch
        with torch.cuda.device(self.rt.device), torch.cuda.stream(self.rt.stream):
            for fn in launches:
                fn()

    def close(self) -> None:
        self._packed.clear()
        super().close()

    def capture(self, executable: TritonExecutable) -> CaptureResult:
        if self.interpreted:
            return CaptureResult(reason="Triton's interpreter does not capture graphs")
        return super().capture(executable)
