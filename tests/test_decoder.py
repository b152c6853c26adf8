"""The llama, qwen2 and gemma3 decoder graphs on the cpu oracle: a float64 reference forward
pass, batch invariance (prefill == token-by-token decode, bit for bit), n_out and argmax heads."""

from __future__ import annotations

import numpy as np
import pytest

from parity.arch.decoder import build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.reference import reference_forward
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu.backend import CpuBackend
from parity.core.backend import Device
from parity.core.dtypes import DType
from parity.core.runtime import Runtime

TOKENS = np.array([7, 300, 42, 511, 0, 9, 128], np.int32)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def model(request):
    return synthetic_model(tiny_spec(request.param), seed=11)


def runtime(weights):
    return Runtime([CpuBackend(Device("cpu"))], weights)


def logits_of(spec, weights, tokens, n_out=None):
    n = len(tokens)
    g = build_decoder(spec, GraphParams(n_tokens=n, n_ctx=64, n_out=n_out or n))
    return runtime(weights).run(g, graph_inputs(tokens, 0))[g.outputs[0]]


def nmse(got, ref):
    return float(np.sum((got - ref) ** 2) / np.sum(ref**2))


def test_matches_float64_reference(model):
    spec, weights = model
    got = logits_of(spec, weights, TOKENS).astype(np.float64)
    # with the activation quantization modelled, only float32 rounding separates the two
    assert nmse(got, reference_forward(spec, weights, TOKENS, quantize_inputs=True)) < 1e-10
    # against pure float64 the 8-bit activations dominate; random weights have outliers
    assert nmse(got, reference_forward(spec, weights, TOKENS)) < 0.05


def test_prefill_equals_token_by_token_decode(model):
    spec, weights = model
    prefill = logits_of(spec, weights, TOKENS)
    rt = runtime(weights)
    step = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=64))
    rows = [
        rt.run(step, graph_inputs(TOKENS[p : p + 1], p))[step.outputs[0]][0]
        for p in range(len(TOKENS))
    ]
    assert np.stack(rows).tobytes() == prefill.tobytes()


def test_chunked_prefill_equals_whole_prefill(model):
    spec, weights = model
    whole = logits_of(spec, weights, TOKENS)
    rt = runtime(weights)
    first = build_decoder(spec, GraphParams(n_tokens=4, n_ctx=64, n_out=4))
    rest = build_decoder(spec, GraphParams(n_tokens=3, n_ctx=64, n_out=3))
    a = rt.run(first, graph_inputs(TOKENS[:4], 0))[first.outputs[0]]
    b = rt.run(rest, graph_inputs(TOKENS[4:], 4))[rest.outputs[0]]
    assert np.concatenate([a, b]).tobytes() == whole.tobytes()


def test_n_out_and_argmax_heads(model):
    spec, weights = model
    whole = logits_of(spec, weights, TOKENS)
    last2 = logits_of(spec, weights, TOKENS, n_out=2)
    assert last2.tobytes() == whole[-2:].tobytes()
    g = build_decoder(spec, GraphParams(n_tokens=len(TOKENS), n_ctx=64, output="argmax"))
    ids = runtime(weights).run(g, graph_inputs(TOKENS, 0))[g.outputs[0]]
    assert ids.dtype == np.int32 and ids.tolist() == [int(np.argmax(whole[-1]))]


def test_runs_are_deterministic(model):
    spec, weights = model
    assert logits_of(spec, weights, TOKENS).tobytes() == logits_of(spec, weights, TOKENS).tobytes()


def test_untied_output_and_float_weights():
    spec, weights = synthetic_model(
        tiny_spec("llama"), seed=5, types={"output": DType.Q6_K, "attn_v": DType.F16}
    )
    assert "output.weight" in weights
    got = logits_of(spec, weights, TOKENS[:3]).astype(np.float64)
    assert nmse(got, reference_forward(spec, weights, TOKENS[:3], quantize_inputs=True)) < 1e-10


def test_positions_beyond_the_cache_are_refused(model):
    spec, weights = model
    g = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=8))
    with pytest.raises(ValueError, match="position"):
        runtime(weights).run(g, graph_inputs(TOKENS[:1], 8))
