"""A decoder's spec from GGUF metadata, and back: the keys llama.cpp's conversion writes, read
with every value checked, and the file's tensors checked against the family's tensor table."""

from __future__ import annotations

import numpy as np

from parity.arch.decoder import FAMILIES, DecoderSpec, tensor_table
from parity.core.dtypes import DType
from parity.errors import ModelError
from parity.gguf.reader import FLOAT_TYPES, GGUFFile, GGUFHeader, MetadataReader, V

MAX_CONTEXT = 1 << 24  # the loader builds RoPE tables of this many rows
SWA_PERIOD = {"gemma3": 6}  # llama.cpp's set_swa_pattern: every sixth layer is global


def decoder_spec(file: GGUFFile) -> DecoderSpec:
    """The hyperparameters of a llama-family file (``weights`` not filled in yet), with the
    file's tensors checked against the family's table. ModelFileError names what does not fit
    (ModelError for an architecture parity does not build)."""
    header, where = file.header, file.where
    m = MetadataReader(header, where)
    arch = m.string("general.architecture")
    if arch not in FAMILIES:
        raise ModelError(
            f"{where}: architecture {arch!r} is not supported; parity runs "
            f"{', '.join(FAMILIES)} models — use one of those"
        )
    n_layer = m.count(f"{arch}.block_count")
    if n_layer * 9 > len(header.tensors):  # 9 tensors per layer at the least
        m.fail(
            f"metadata '{arch}.block_count' is {n_layer}, but the file holds only "
            f"{len(header.tensors)} tensors"
        )
    n_ctx = m.count(f"{arch}.context_length")
    if n_ctx > MAX_CONTEXT:
        m.fail(f"metadata '{arch}.context_length' is {n_ctx}, more than parity's {MAX_CONTEXT}")
    n_embd = m.count(f"{arch}.embedding_length")
    n_head = m.count(f"{arch}.attention.head_count")
    n_head_kv = m.count(f"{arch}.attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        m.fail(f"{n_head} attention heads are not a multiple of {n_head_kv} key/value heads")
    if f"{arch}.attention.key_length" not in header.entries and n_embd % n_head:
        m.fail(f"embedding length {n_embd} is not a multiple of the head count {n_head}")
    head_dim = m.count(f"{arch}.attention.key_length", n_embd // n_head)
    if m.count(f"{arch}.attention.value_length", head_dim) != head_dim:
        m.fail("key and value heads differ in length", "parity runs models where they agree")
    rot = m.count(f"{arch}.rope.dimension_count", head_dim)
    if rot % 2 or rot > head_dim:
        m.fail(f"RoPE dimension count {rot} must be even and at most the head size {head_dim}")
    rms_eps = m.positive(f"{arch}.attention.layer_norm_rms_epsilon")
    if float(np.float32(rms_eps)) != rms_eps:
        m.fail(
            f"RMS norm epsilon {rms_eps!r} is not exactly a float32",
            "parity's RMS_NORM takes a float32 epsilon; store it as FLOAT32",
        )
    _check_no_rope_scaling(m, arch)
    window, period, base_local = 0, SWA_PERIOD.get(arch, 0), 0.0
    if period:
        window = m.count(f"{arch}.attention.sliding_window")
        base_local = m.positive(f"{arch}.rope.freq_base_swa", 10000.0)
    embd = header.tensors.get("token_embd.weight")
    n_vocab = embd.shape[0] if embd is not None and len(embd.dims) == 2 else 0
    spec = DecoderSpec(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=m.count(f"{arch}.feed_forward_length"),
        n_ctx_train=n_ctx,
        rope_base=m.positive(f"{arch}.rope.freq_base", 10000.0),
        rms_eps=rms_eps,
        n_rot=0 if rot == head_dim else rot,
        window=window,
        swa_period=period,
        rope_base_local=base_local,
    )
    _check_tensors(header, spec, m)
    _check_vocab(header, spec, m)
    return spec


def _check_no_rope_scaling(m: MetadataReader, arch: str) -> None:
    advice = "parity does not implement RoPE scaling; use a model without it"
    kind = m.string(f"{arch}.rope.scaling.type", "none")
    if kind != "none":
        m.fail(f"RoPE scaling {kind!r} is not supported", advice)
    for key in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear"):
        factor = float(m.get(key, FLOAT_TYPES, "a float", 1.0))
        if factor not in (0.0, 1.0):  # llama.cpp reads 0 as "no scaling"
            m.fail(f"metadata {key!r} is {factor}: RoPE scaling is not supported", advice)


def _check_tensors(header: GGUFHeader, spec: DecoderSpec, m: MetadataReader) -> None:
    """Every tensor the graph reads is present with its type family and shape; no others."""
    table = tensor_table(spec)
    problems = []
    for name, want in table.items():
        t = header.tensors.get(name)
        if t is None:
            if want.required:
                problems.append(f"{name} is missing")
            continue
        if t.shape != want.shape or (want.f32 and t.dtype is not DType.F32):
            kind = "F32" if want.f32 else "a weight type"
            problems.append(f"{name} is {t.dtype.name} {list(t.shape)}, expected {kind} "
                            f"{list(want.shape)}")  # fmt: skip
    extra = [n for n in header.tensors if n not in table]
    if extra:
        problems.append(f"{_listing(extra)} {'is' if len(extra) == 1 else 'are'} not used")
    if problems:
        m.fail(
            f"its tensors do not fit parity's {spec.arch} graph: {_listing(problems)}",
            f"the file is incomplete, corrupt, or a {spec.arch} variant parity does not run",
        )


def _check_vocab(header: GGUFHeader, spec: DecoderSpec, m: MetadataReader) -> None:
    tokens = header.entries.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if tokens.item_type is not V.STRING:
            m.fail("metadata 'tokenizer.ggml.tokens' is not an array of strings")
        if len(tokens.value) != spec.n_vocab:
            m.fail(
                f"the tokenizer has {len(tokens.value)} tokens but token_embd has "
                f"{spec.n_vocab} rows"
            )
    key = f"{spec.arch}.vocab_size"
    if key in header.entries and (n_vocab := m.count(key)) != spec.n_vocab:
        m.fail(f"metadata {key!r} is {n_vocab} but token_embd has {spec.n_vocab} rows")


def _listing(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def spec_metadata(spec: DecoderSpec) -> dict[str, object]:
    """The keys a llama.cpp conversion writes for ``spec``'s hyperparameters."""
    a = spec.arch
    meta: dict[str, object] = {
        "general.type": "model",
        "general.name": f"parity synthetic {a}",
        f"{a}.block_count": spec.n_layer,
        f"{a}.context_length": spec.n_ctx_train,
        f"{a}.embedding_length": spec.n_embd,
        f"{a}.feed_forward_length": spec.n_ff,
        f"{a}.attention.head_count": spec.n_head,
        f"{a}.attention.head_count_kv": spec.n_head_kv,
        f"{a}.rope.freq_base": spec.rope_base,
        f"{a}.attention.layer_norm_rms_epsilon": spec.rms_eps,
        f"{a}.rope.dimension_count": spec.rot,
        "general.quantization_version": 2,
    }
    if spec.n_head * spec.head_dim != spec.n_embd:  # readers default to n_embd / n_head
        meta[f"{a}.attention.key_length"] = spec.head_dim
        meta[f"{a}.attention.value_length"] = spec.head_dim
    if spec.swa_period:
        meta[f"{a}.attention.sliding_window"] = spec.window
        meta[f"{a}.rope.freq_base_swa"] = spec.rope_base_local
    return meta
