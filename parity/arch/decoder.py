"""The decoders parity builds (llama, qwen2, gemma3): their spec, tensor table and graph.

Weight names follow GGUF (``blk.N.attn_q.weight``, ...). ``tensor_table`` lists every tensor a
file of this family may hold, once: the loader checks files against it, synthetic models are
made from it and the graph reads it. Two host weights, ``rope.cos`` and ``rope.sin``, hold the
RoPE tables every backend shares (``parity.arch.rope``); they are part of the spec like any
other weight, so the spec a model is loaded with is the spec its graphs are built from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs
import numpy as np

from parity.arch.params import GraphParams
from parity.arch.rope import rope_tables
from parity.core.builder import GraphBuilder, GraphCache, Ref
from parity.core.dtypes import DType
from parity.core.ir import AttentionArg, Graph, Op, RopeArg, SliceArg
from parity.core.weights import WeightData


@attrs.frozen
class Family:
    """What tells the decoders apart (llama.cpp's src/models/ for each)."""

    name: str
    rope_mode: str  # "normal": pairs (2i, 2i+1); "neox": pairs (i, i + n_rot/2)
    qkv_bias: bool  # q, k and v projections carry biases
    # Gemma 3: embeddings scaled by sqrt(n_embd), q and k RMS-normed per head, a norm after the
    # attention and after the FFN (before each residual add), GeGLU; local layers
    gemma: bool = False


FAMILIES: Mapping[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "normal", False),
        Family("qwen2", "neox", True),
        Family("gemma3", "neox", False, gemma=True),
    )
}
ROPE_WEIGHTS = ("rope.cos", "rope.sin")
LOCAL_ROPE_WEIGHTS = ("rope_local.cos", "rope_local.sin")  # sliding-window layers' own base


@attrs.frozen
class TensorSpec:
    """One tensor of the file: its numpy shape, the role that picks its type in a quant mix
    (``norm`` and ``bias`` are always F32), and whether a file must hold it."""

    shape: tuple[int, ...]
    role: str
    required: bool = True

    @property
    def f32(self) -> bool:
        return self.role in ("norm", "bias")


@attrs.frozen
class DecoderSpec:
    """A decoder's hyperparameters and its weights' types and shapes (never their bytes):
    ``weights`` lists every weight its graphs read, the host RoPE tables included."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    n_rot: int = 0  # 0: head_dim
    # sliding-window attention: layers il with il % swa_period < swa_period - 1 read the last
    # ``window`` positions and rotate with ``rope_base_local`` (0: period, window none)
    window: int = 0
    swa_period: int = 0
    rope_base_local: float = 0.0
    weights: tuple[tuple[str, DType, tuple[int, ...]], ...] = ()

    @property
    def family(self) -> Family:
        if self.arch not in FAMILIES:
            raise ValueError(f"unknown architecture {self.arch!r}; parity builds {list(FAMILIES)}")
        return FAMILIES[self.arch]

    @property
    def rope_mode(self) -> str:
        return self.family.rope_mode

    @property
    def rot(self) -> int:
        return self.n_rot or self.head_dim

    def local(self, layer: int) -> bool:
        """Whether ``layer`` attends over a sliding window (Gemma 3: five of every six)."""
        return bool(self.swa_period) and layer % self.swa_period < self.swa_period - 1

    def weight_table(self) -> dict[str, tuple[DType, tuple[int, ...]]]:
        return {name: (dtype, shape) for name, dtype, shape in self.weights}

    def with_weights(self, weights: Iterable[WeightData]) -> DecoderSpec:
        return attrs.evolve(
            self, weights=tuple(sorted((w.name, w.dtype, w.shape) for w in weights))
        )


def _linears(spec: DecoderSpec) -> dict[str, tuple[tuple[int, int], str]]:
    """A layer's projections: name -> ((rows, cols), quant-mix role)."""
    e, f = spec.n_embd, spec.n_ff
    q, kv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    return {
        "attn_q": ((q, e), "attn"),
        "attn_k": ((kv, e), "attn"),
        "attn_v": ((kv, e), "attn_v"),
        "attn_output": ((e, q), "attn"),
        "ffn_gate": ((f, e), "ffn"),
        "ffn_up": ((f, e), "ffn"),
        "ffn_down": ((e, f), "ffn_down"),
    }


def tensor_table(spec: DecoderSpec) -> dict[str, TensorSpec]:
    """Every tensor a file of ``spec``'s family may hold, in file order: the required ones and
    the optional (an untied output projection, biases the family does not require)."""
    e, v = spec.n_embd, spec.n_vocab
    qkv_bias = spec.family.qkv_bias
    gemma = spec.family.gemma
    table = {"token_embd.weight": TensorSpec((v, e), "embd")}
    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        linears = _linears(spec)
        for name, (shape, role) in linears.items():
            if name in ("attn_q", "ffn_gate"):  # each block of the layer starts with its norm
                norm = "attn_norm" if name == "attn_q" else "ffn_norm"
                table[f"{blk}.{norm}.weight"] = TensorSpec((e,), "norm")
            table[f"{blk}.{name}.weight"] = TensorSpec(shape, role)
        if gemma:
            for norm, width in (("attn_q_norm", spec.head_dim), ("attn_k_norm", spec.head_dim),
                                ("post_attention_norm", e), ("post_ffw_norm", e)):  # fmt: skip
                table[f"{blk}.{norm}.weight"] = TensorSpec((width,), "norm")
        for name, (shape, _) in linears.items():
            needs_bias = qkv_bias and name in ("attn_q", "attn_k", "attn_v")
            table[f"{blk}.{name}.bias"] = TensorSpec((shape[0],), "bias", needs_bias)
    table["output_norm.weight"] = TensorSpec((e,), "norm")
    table["output.weight"] = TensorSpec((v, e), "output", required=False)  # else tied
    table["output.bias"] = TensorSpec((v,), "bias", required=False)
    return table


def rope_weights(spec: DecoderSpec) -> list[WeightData]:
    """The host-computed RoPE tables as the two F32 weights the graph reads (read-only, like
    the file's weights)."""
    bases = [(ROPE_WEIGHTS, spec.rope_base)]
    if spec.swa_period and spec.rope_base_local and spec.rope_base_local != spec.rope_base:
        bases.append((LOCAL_ROPE_WEIGHTS, spec.rope_base_local))
    out = []
    for names, base in bases:
        tables = rope_tables(spec.n_ctx_train, spec.rot, base)
        for name, table in zip(names, tables, strict=True):
            table.setflags(write=False)
            out.append(WeightData(name, DType.F32, table.shape, table))
    return out


def build_decoder(spec: DecoderSpec, params: GraphParams) -> Graph:
    """The forward pass of ``params.n_tokens`` tokens at the positions given as input."""
    spec.family  # noqa: B018  (an unknown architecture is an error here, not a KeyError later)
    table = spec.weight_table()
    b = GraphBuilder()
    n = params.n_tokens

    def w(name: str) -> Ref:
        if name not in table:
            raise ValueError(f"the {spec.arch} graph needs weight {name!r}, which is missing")
        dtype, shape = table[name]
        return b.weight(name, dtype, shape)

    def linear(x: Ref, name: str) -> Ref:
        bias = f"{name}.bias"
        srcs = (x, w(f"{name}.weight"), *((w(bias),) if bias in table else ()))
        return b.op(Op.MATMUL, *srcs)

    def norm(x: Ref, name: str) -> Ref:
        return b.op(Op.MUL, b.op(Op.RMS_NORM, x, arg=spec.rms_eps), w(name))

    def head_norm(x: Ref, heads: int, name: str) -> Ref:
        """RMS-norm each head of x (n, heads * head_dim) with one (head_dim,) weight."""
        d = spec.head_dim
        by_head = b.op(Op.RESHAPE, x, arg=(n * heads, d))
        return b.op(Op.RESHAPE, norm(by_head, name), arg=(n, heads * d))

    gemma = spec.family.gemma
    tokens = b.input("tokens", DType.I32, (n,))
    pos = b.input("positions", DType.I32, (n,))
    tables = {False: tuple(w(name) for name in ROPE_WEIGHTS)}
    tables[True] = (
        tuple(w(name) for name in LOCAL_ROPE_WEIGHTS)
        if LOCAL_ROPE_WEIGHTS[0] in table
        else tables[False]
    )
    kv_width = spec.n_head_kv * spec.head_dim
    rope_q = RopeArg(spec.n_head, spec.head_dim, spec.rot, spec.rope_mode)
    rope_k = RopeArg(spec.n_head_kv, spec.head_dim, spec.rot, spec.rope_mode)
    scale = float(np.float32(1.0 / math.sqrt(spec.head_dim)))
    attn = {
        local: AttentionArg(
            spec.n_head,
            spec.n_head_kv,
            spec.head_dim,
            scale,
            spec.window if local else 0,
            params.reach,
        )
        for local in (False, True)
    }
    slot = params.cache_prefix

    x = b.op(Op.GET_ROWS, w("token_embd.weight"), tokens)  # (n, n_embd)
    if gemma:  # llama.cpp: ggml_scale(x, sqrtf(n_embd)), the float32 square root
        x = b.op(Op.SCALE, x, arg=float(np.sqrt(np.float32(spec.n_embd), dtype=np.float32)))
    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        local = spec.local(il)
        cos, sin = tables[local]
        h = norm(x, f"{blk}.attn_norm.weight")
        q, k = linear(h, f"{blk}.attn_q"), linear(h, f"{blk}.attn_k")
        if gemma:
            q = head_norm(q, spec.n_head, f"{blk}.attn_q_norm.weight")
            k = head_norm(k, spec.n_head_kv, f"{blk}.attn_k_norm.weight")
        q = b.op(Op.ROPE, q, pos, cos, sin, arg=rope_q)
        k = b.op(Op.ROPE, k, pos, cos, sin, arg=rope_k)
        v = linear(h, f"{blk}.attn_v")  # (n, n_head_kv * head_dim)
        k_cache = b.op(
            Op.KV_WRITE, b.state(f"{slot}cache.k.{il}", (params.n_ctx, kv_width)), k, pos
        )
        v_cache = b.op(
            Op.KV_WRITE, b.state(f"{slot}cache.v.{il}", (params.n_ctx, kv_width)), v, pos
        )
        a = b.op(Op.ATTENTION, q, k_cache, v_cache, pos, arg=attn[local])  # (n, n_head * hd)
        o = linear(a, f"{blk}.attn_output")
        if gemma:
            o = norm(o, f"{blk}.post_attention_norm.weight")
        x = b.op(Op.ADD, x, o)
        h = norm(x, f"{blk}.ffn_norm.weight")
        glu = Op.GEGLU if gemma else Op.SWIGLU
        ff = b.op(glu, linear(h, f"{blk}.ffn_gate"), linear(h, f"{blk}.ffn_up"))
        d = linear(ff, f"{blk}.ffn_down")
        if gemma:
            d = norm(d, f"{blk}.post_ffw_norm.weight")
        x = b.op(Op.ADD, x, d)
    if params.n_out < n:  # only the last n_out rows reach the head
        x = b.op(Op.SLICE_ROWS, x, arg=SliceArg(n - params.n_out, params.n_out))
    x = norm(x, "output_norm.weight")
    head = "output" if "output.weight" in table else "token_embd"  # tied embeddings
    logits = linear(x, head)  # (n_out, n_vocab)
    return b.build(b.op(Op.ARGMAX, logits) if params.output == "argmax" else logits)


class DecoderGraphs:
    """One spec's graphs, built once per GraphParams and then reused from the cache."""

    def __init__(self, spec: DecoderSpec, capacity: int = 32) -> None:
        self.spec = spec
        self.cache = GraphCache(capacity)

    def __call__(self, params: GraphParams) -> Graph:
        return self.cache.get(params, lambda: build_decoder(self.spec, params))


def graph_inputs(tokens: np.ndarray, start: int) -> Mapping[str, np.ndarray]:
    """Inputs for tokens placed at consecutive positions from ``start``."""
    tokens = np.asarray(tokens, dtype=np.int32)
    return {"tokens": tokens, "positions": np.arange(start, start + len(tokens), dtype=np.int32)}
