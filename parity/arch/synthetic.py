"""Synthetic models: real layouts, random weights. For tests and for GPU benchmarks that must
not move real weights ("synthetic twins")."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from parity.arch.decoder import ROPE_WEIGHTS, DecoderSpec, rope_weights, tensor_table
from parity.arch.metadata import spec_metadata
from parity.core.dtypes import DType
from parity.core.weights import WeightData
from parity.gguf.writer import write_gguf
from parity.quant.synthetic import random_weight

# the quant mixes of the real models (SmolLM2 Q4_1; Qwen2.5 Q4_K_M; Gemma 3 Q4_K_M, whose
# output is the Q8_0 embedding)
QUANT_MIXES = {
    "llama": {
        "attn": DType.Q4_1,
        "attn_v": DType.Q4_1,
        "ffn": DType.Q4_1,
        "ffn_down": DType.Q4_1,
        "embd": DType.Q8_0,
        "output": None,
    },
    "qwen2": {
        "attn": DType.Q4_K,
        "attn_v": DType.Q6_K,
        "ffn": DType.Q4_K,
        "ffn_down": DType.Q6_K,
        "embd": DType.Q8_0,
        "output": DType.Q6_K,
    },
    "gemma3": {
        "attn": DType.Q5_0,
        "attn_v": DType.Q8_0,
        "ffn": DType.Q5_0,
        "ffn_down": DType.Q6_K,
        "embd": DType.Q8_0,
        "output": None,
    },
}


def model_layout(
    spec: DecoderSpec,
    types: Mapping[str, DType | None] | None = None,
    layer_types: Mapping[int, Mapping[str, DType]] | None = None,
) -> dict[str, tuple[DType, tuple[int, ...]]]:
    """Every file tensor's (type, shape) in ``spec``'s layout (``tensor_table``: the required
    tensors, and the output projection unless tied). ``types`` overrides the arch's quant mix
    and ``layer_types[il]`` the mix of layer ``il`` (roles as in QUANT_MIXES);
    ``types["output"] = None`` ties the output projection to the token embedding."""
    types = {**QUANT_MIXES[spec.arch], **(types or {})}
    tensors: dict[str, tuple[DType, tuple[int, ...]]] = {}
    for name, t in tensor_table(spec).items():
        mix = types
        if name.startswith("blk."):
            mix = {**types, **(layer_types or {}).get(int(name.split(".")[1]), {})}
        dtype = DType.F32 if t.f32 else mix[t.role]
        if t.required or (t.role == "output" and dtype is not None):
            tensors[name] = (dtype, t.shape)
    return tensors


def synthetic_model(
    spec: DecoderSpec,
    seed: int = 0,
    types: Mapping[str, DType | None] | None = None,
    layer_types: Mapping[int, Mapping[str, DType]] | None = None,
) -> tuple[DecoderSpec, dict[str, WeightData]]:
    """Random weights in ``model_layout(spec, types, layer_types)``."""
    tensors = model_layout(spec, types, layer_types)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, (dtype, shape) in tensors.items():
        if name.endswith("norm.weight"):  # norms near 1, as trained models have them
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            weights[name] = WeightData(name, dtype, shape, data)
        else:
            data = random_weight(dtype, shape, rng, std=0.5 / np.sqrt(shape[-1]))
            weights[name] = WeightData(name, dtype, shape, data)
    for w in rope_weights(spec):
        weights[w.name] = w
    return spec.with_weights(weights.values()), weights


def tiny_spec(arch: str = "llama", **overrides: object) -> DecoderSpec:
    """A small decoder with the real models' head_dim and GQA, fast enough for unit tests."""
    base = dict(
        arch=arch,
        n_vocab=512,
        n_embd=256,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_ff=512,
        n_ctx_train=1024,
        rope_base=100000.0 if arch == "llama" else 1000000.0,
        rms_eps=float(np.float32(1e-5 if arch == "llama" else 1e-6)),
    )
    if arch == "gemma3":  # layer 0 local (a 3-position window, its own RoPE base), 1 global
        base |= dict(window=3, swa_period=2, rope_base_local=10000.0)
    return DecoderSpec(**(base | overrides))


# the real models' shapes, for synthetic twins in benchmarks (weights are random)
REAL_SPECS = {
    "smollm2-135m": DecoderSpec(
        arch="llama", n_vocab=49152, n_embd=576, n_layer=30, n_head=9, n_head_kv=3,
        head_dim=64, n_ff=1536, n_ctx_train=8192, rope_base=100000.0,
        rms_eps=float(np.float32(1e-5)),
    ),
    "qwen2.5-coder-0.5b": DecoderSpec(
        arch="qwen2", n_vocab=151936, n_embd=896, n_layer=24, n_head=14, n_head_kv=2,
        head_dim=64, n_ff=4864, n_ctx_train=32768, rope_base=1000000.0,
        rms_eps=float(np.float32(1e-6)),
    ),
}  # fmt: skip
# the real files' quant mixes (read from their GGUF headers). Qwen2.5 Q4_K_M: rows of 896
# cannot hold 256-element blocks, so llama.cpp stores those tensors Q5_0, and gives the
# "more bits" layers Q8_0 attn_v and Q6_K ffn_down (Q4_K elsewhere); the output is untied Q8_0
REAL_MIXES = {
    "smollm2-135m": QUANT_MIXES["llama"],
    "qwen2.5-coder-0.5b": {"attn": DType.Q5_0, "attn_v": DType.Q5_0, "ffn": DType.Q5_0,
                           "ffn_down": DType.Q4_K, "embd": DType.Q5_0, "output": DType.Q8_0},
}  # fmt: skip
REAL_LAYER_TYPES: dict[str, dict[int, dict[str, DType]]] = {
    "smollm2-135m": {},
    "qwen2.5-coder-0.5b": {
        il: {"attn_v": DType.Q8_0, "ffn_down": DType.Q6_K}
        for il in (0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21)
    },
}
"""Per-layer departures from REAL_MIXES, as the real files have them."""


def twin_layout(name: str) -> dict[str, tuple[DType, tuple[int, ...]]]:
    """A real model's tensors, (type, shape) by name, without making any weights."""
    return model_layout(REAL_SPECS[name], REAL_MIXES[name], REAL_LAYER_TYPES[name])


def synthetic_twin(name: str, seed: int = 0) -> tuple[DecoderSpec, dict[str, WeightData]]:
    """A real model's shapes and quant mix (per layer) with random weights."""
    return synthetic_model(
        REAL_SPECS[name], seed=seed, types=REAL_MIXES[name], layer_types=REAL_LAYER_TYPES[name]
    )


def write_model_gguf(
    path: str | os.PathLike,
    spec: DecoderSpec,
    weights: Mapping[str, WeightData],
    *,
    metadata: Mapping[str, object] | None = None,
    tokenizer: Mapping[str, object] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write ``spec`` and ``weights`` (the host RoPE tables left out) as a GGUF file that
    ``read_model_file`` reads back unchanged: the keys a llama.cpp conversion writes, then
    ``tokenizer`` (e.g. ``tiny_bpe_tokenizer()``) and ``metadata``, which add or override keys
    (None leaves a key out); see ``parity.gguf.writer.write_gguf`` for the value types."""
    values: dict[str, object] = {**spec_metadata(spec), **(tokenizer or {}), **(metadata or {})}
    if chat_template is not None:
        values["tokenizer.chat_template"] = chat_template
    tensors = [w for name, w in weights.items() if name not in ROPE_WEIGHTS]
    return write_gguf(path, spec.arch, values, tensors)
