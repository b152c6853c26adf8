"""Fusion passes: which nodes they fuse, which they must leave alone, the origins they record,
and that a rewritten graph computes the original's bits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from parity.arch.decoder import build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu.backend import CpuBackend
from parity.core.backend import Device
from parity.core.builder import GraphBuilder
from parity.core.dtypes import DType
from parity.core.fusion import fuse
from parity.core.ir import FUSED, Op, verify
from parity.core.runtime import Runtime


def everything(node, srcs):
    return True


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return synthetic_model(tiny_spec(request.param), seed=8)


def test_a_decoder_layer_fuses_as_expected(model):
    spec, _ = model
    graph = build_decoder(spec, GraphParams(n_tokens=3, n_ctx=16, output="argmax"))
    fused = fuse(graph, accept=everything)
    verify(fused)
    ops = Counter(n.op for n in fused.nodes)
    layers = spec.n_layer
    assert ops[Op.MATMUL_SWIGLU] == layers  # gate, up and their SWIGLU
    assert ops[Op.MATMUL_ADD] == 2 * layers  # o and down with their residuals
    assert ops[Op.RMS_NORM_MUL] == 2 * layers + 1  # and the output norm
    assert ops[Op.QUANTIZE] == layers  # q, k and v share one quantization of h
    assert ops[Op.RMS_NORM] == ops[Op.SWIGLU] == ops[Op.ADD] == 0
    assert ops[Op.MATMUL] == 3 * layers + 1  # q, k, v and the head
    quantized = [n for n in fused.nodes if n.op is Op.MATMUL and n.src
                 and fused.nodes[n.src[0]].dtype is DType.Q8A]  # fmt: skip
    assert len(quantized) == 3 * layers
    # every node's origin is the original node whose value it computes
    for i, node in enumerate(fused.nodes):
        o = fused.original(i)
        if node.op is Op.QUANTIZE:
            assert o == -1
        elif node.op in FUSED:
            assert graph.nodes[o].op in {Op.MUL, Op.ADD, Op.SWIGLU}
        else:
            assert graph.nodes[o].op is node.op and graph.nodes[o].arg == node.arg
    assert [fused.original(o) for o in fused.outputs] == list(graph.outputs)


def test_a_value_something_else_reads_is_never_fused_away():
    b = GraphBuilder()
    x = b.input("x", DType.F32, (2, 64))
    w = b.weight("w", DType.Q8_0, (64, 64))
    y = b.op(Op.MATMUL, x, w)
    s = b.op(Op.ADD, x, y)  # a residual ADD, but y is also an output
    norm = b.op(Op.RMS_NORM, s, arg=float(np.float32(1e-5)))
    m = b.op(Op.MUL, norm, b.weight("n", DType.F32, (64,)))
    twice = b.op(Op.ADD, norm, m)  # the norm is read twice
    graph = b.build(y, twice)
    fused = fuse(graph, accept=everything)
    assert Counter(n.op for n in fused.nodes)[Op.MATMUL_ADD] == 0
    assert Counter(n.op for n in fused.nodes)[Op.RMS_NORM_MUL] == 0
    assert fused is graph  # nothing fused, the graph as it was


def test_only_what_the_backend_accepts_is_fused(model):
    spec, _ = model
    graph = build_decoder(spec, GraphParams(n_tokens=1, n_ctx=16))
    assert fuse(graph, accept=lambda n, s: False) is graph
    no_swiglu = fuse(graph, accept=lambda n, s: n.op is not Op.MATMUL_SWIGLU)
    ops = Counter(n.op for n in no_swiglu.nodes)
    assert ops[Op.MATMUL_SWIGLU] == 0 and ops[Op.SWIGLU] == spec.n_layer
    assert ops[Op.QUANTIZE] == 2 * spec.n_layer  # q/k/v and now gate/up share one each
    only = fuse(graph, accept=everything, passes=("norm_mul",))
    assert {n.op for n in only.nodes} & set(FUSED) == {Op.RMS_NORM_MUL}
    with pytest.raises(ValueError, match="unknown fusion pass"):
        fuse(graph, accept=everything, passes=("nope",))


def test_share_min_one_quantizes_every_product_of_a_quantized_weight(model):
    spec, _ = model
    graph = build_decoder(spec, GraphParams(n_tokens=2, n_ctx=16))
    fused = fuse(graph, accept=everything, passes=("share_quantization",), share_min=1)
    products = [n for n in fused.nodes if n.op is Op.MATMUL]
    for n in products:
        weight = fused.nodes[n.src[1]]
        x = fused.nodes[n.src[0]]
        assert (x.dtype is DType.Q8A) == weight.dtype.is_quantized  # float weights read F32 x


def test_fusing_twice_changes_nothing_and_origins_compose(model):
    spec, _ = model
    graph = build_decoder(spec, GraphParams(n_tokens=2, n_ctx=16))
    once = fuse(graph, accept=everything, passes=("norm_mul", "matmul_add"))
    twice = fuse(once, accept=everything)
    assert {fuse(twice, accept=everything)} == {twice}
    for i in range(len(twice.nodes)):
        o = twice.original(i)
        if o >= 0 and twice.nodes[i].op not in FUSED and twice.nodes[i].op is not Op.QUANTIZE:
            assert graph.nodes[o].op is twice.nodes[i].op


def test_a_rewritten_graph_gives_the_definitions_bits(model):
    spec, weights = model
    graph = build_decoder(spec, GraphParams(n_tokens=5, n_ctx=16, n_out=5))
    inputs = graph_inputs(np.array([4, 2, 8, 16, 32]), 0)
    computed = [i for i, n in enumerate(graph.nodes) if not n.op.is_leaf]
    oracle = Runtime([CpuBackend(Device("cpu"), kernels="definition")], weights)
    want = oracle.run(graph, inputs, expose=computed)
    for kernels in ("numpy", "numba"):
        runtime = Runtime([CpuBackend(Device("cpu"), kernels=kernels)], weights)
        got = runtime.run(graph, inputs, expose=computed)
        fewer = set(got) < set(want) if kernels == "numba" else set(got) == set(want)
        assert fewer  # what numba fuses away has no value of its own; numpy only shares
        for i, value in got.items():
            assert value.tobytes() == want[i].tobytes(), (kernels, i, graph.nodes[i].op)
