"""A float64 forward pass of the llama, qwen2 and gemma3 decoders from dequantized weights: an
independent statement of the architectures (numpy, no IR, no contract rounding), for tests and
for accuracy measurements on real files. Slow: it dequantizes each weight when it uses it."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from parity.arch.decoder import DecoderSpec
from parity.core.weights import WeightData
from parity.quant import dequantize, quantize_activations


def q8_round_trip(x: np.ndarray) -> np.ndarray:
    """x after the contract's 8-bit activation quantization, in float64."""
    a = quantize_activations(x.astype(np.float32))
    blocks = a.q.reshape(len(x), -1, 32).astype(np.float64) * a.d[..., None].astype(np.float64)
    return blocks.reshape(x.shape)


def reference_forward(
    spec: DecoderSpec,
    weights: Mapping[str, WeightData],
    tokens: np.ndarray,
    quantize_inputs: bool = False,
) -> np.ndarray:
    """Float64 llama/qwen2/gemma3 forward with dequantized weights: an independent statement of
    the architecture (rope pairing, GQA, biases, tied head; Gemma's embedding scale, per-head
    q/k norms, post norms, GeGLU, sliding windows with their own RoPE base), not of the
    contract's rounding.
    ``quantize_inputs`` applies the contract's activation quantization before quantized
    matmuls, leaving only float rounding between this and the graph."""

    def w(name):
        wd = weights[name]
        return dequantize(wd.dtype, wd.raw(), wd.shape).astype(np.float64)

    def norm(x, name):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.rms_eps) * w(name)

    def linear(x, name):
        if quantize_inputs and weights[f"{name}.weight"].dtype.is_quantized:
            x = q8_round_trip(x)
        y = x @ w(f"{name}.weight").T
        return y + w(f"{name}.bias") if f"{name}.bias" in weights else y

    n, hd, rot = len(tokens), spec.head_dim, spec.rot
    pos = np.arange(n)
    gemma = spec.arch == "gemma3"

    def rope(x, heads, base):
        ang = pos[:, None] * (base ** (-np.arange(0, rot, 2) / rot))[None, :]  # (n, rot/2)
        x = x.reshape(n, heads, hd).copy()
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if spec.rope_mode == "normal":
            a, b = x[..., 0:rot:2].copy(), x[..., 1:rot:2].copy()
            x[..., 0:rot:2], x[..., 1:rot:2] = a * c - b * s, a * s + b * c
        else:
            a, b = x[..., : rot // 2].copy(), x[..., rot // 2 : rot].copy()
            x[..., : rot // 2], x[..., rot // 2 : rot] = a * c - b * s, a * s + b * c
        return x

    def heads_norm(x, heads, name):
        return norm(x.reshape(n, heads, hd), name).reshape(n, heads * hd)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    x = w("token_embd.weight")[tokens]
    if gemma:
        x = x * np.sqrt(spec.n_embd)
    group = spec.n_head // spec.n_head_kv
    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        local = spec.local(il)
        base = spec.rope_base_local if local else spec.rope_base
        h = norm(x, f"{blk}.attn_norm.weight")
        q, k = linear(h, f"{blk}.attn_q"), linear(h, f"{blk}.attn_k")
        if gemma:
            q = heads_norm(q, spec.n_head, f"{blk}.attn_q_norm.weight")
            k = heads_norm(k, spec.n_head_kv, f"{blk}.attn_k_norm.weight")
        q, k = rope(q, spec.n_head, base), rope(k, spec.n_head_kv, base)
        v = linear(h, f"{blk}.attn_v").reshape(n, spec.n_head_kv, hd)
        hidden = np.triu(np.ones((n, n), bool), 1)  # the future
        if local:
            hidden |= np.tril(np.ones((n, n), bool), -spec.window)  # before the window
        out = np.zeros((n, spec.n_head, hd))
        for head in range(spec.n_head):
            g = head // group
            s = q[:, head] @ k[:, g].T / np.sqrt(hd)
            s[hidden] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        o = linear(out.reshape(n, -1), f"{blk}.attn_output")
        x = x + (norm(o, f"{blk}.post_attention_norm.weight") if gemma else o)
        h = norm(x, f"{blk}.ffn_norm.weight")
        gate, up = linear(h, f"{blk}.ffn_gate"), linear(h, f"{blk}.ffn_up")
        act = gelu(gate) if gemma else gate / (1 + np.exp(-gate))
        d = linear(act * up, f"{blk}.ffn_down")
        x = x + (norm(d, f"{blk}.post_ffw_norm.weight") if gemma else d)
    head = "output" if "output.weight" in weights else "token_embd"
    return linear(norm(x, "output_norm.weight"), head)
