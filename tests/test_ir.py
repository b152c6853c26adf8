"""The IR: builder typing, determinism, caching, dumps, and verify() rejecting bad graphs."""

from __future__ import annotations

import attrs
import pytest

from parity.arch.decoder import DecoderGraphs, build_decoder
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.core.builder import GraphBuilder, GraphCache
from parity.core.dtypes import DType
from parity.core.dump import format_graph, to_dot
from parity.core.ir import AttentionArg, Graph, Node, Op, RopeArg, SliceArg, verify
from parity.errors import GraphError

F32, I32 = DType.F32, DType.I32


@pytest.fixture(scope="module")
def llama():
    return synthetic_model(tiny_spec("llama"))[0]


def small_graph() -> Graph:
    b = GraphBuilder()
    ids = b.input("tokens", I32, (3,))
    emb = b.weight("emb", DType.Q8_0, (16, 64))
    w = b.weight("w", DType.Q4_0, (32, 64))
    x = b.op(Op.GET_ROWS, emb, ids)
    y = b.op(Op.MATMUL, x, w)
    return b.build(b.op(Op.ARGMAX, y))


def test_builder_puts_leaves_first_and_types_nodes():
    g = small_graph()
    assert [n.op for n in g] == [Op.INPUT, Op.WEIGHT, Op.WEIGHT, Op.GET_ROWS, Op.MATMUL, Op.ARGMAX]
    assert g.nodes[3].shape == (3, 64) and g.nodes[4].shape == (3, 32)
    assert g.nodes[5].dtype is I32 and g.outputs == (5,)
    assert g.leaves(Op.WEIGHT) == {"emb": 1, "w": 2}


def test_builder_dedupes_leaves_and_refuses_conflicts():
    b = GraphBuilder()
    assert b.weight("w", F32, (4, 32)) == b.weight("w", F32, (4, 32))
    with pytest.raises(ValueError, match="redeclared"):
        b.weight("w", F32, (8, 32))


def test_builder_rejects_bad_signatures():
    b = GraphBuilder()
    x = b.input("x", F32, (2, 64))
    w = b.weight("w", DType.Q8_0, (8, 96))
    with pytest.raises(GraphError, match="x width 64 != weight cols 96"):
        b.op(Op.MATMUL, x, w)
    with pytest.raises(GraphError, match="takes 1 sources"):
        b.op(Op.SILU, x, x)
    with pytest.raises(GraphError, match="eps"):
        b.op(Op.RMS_NORM, x, arg=None)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_graph_is_deterministic_and_valid(arch):
    spec, _ = synthetic_model(tiny_spec(arch))
    p = GraphParams(n_tokens=4, n_ctx=32, n_out=2)
    g1, g2 = build_decoder(spec, p), build_decoder(spec, p)
    assert g1 == g2 and hash(g1) == hash(g2)
    assert format_graph(g1) == format_graph(g2)
    verify(g1)
    assert build_decoder(spec, attrs.evolve(p, n_tokens=5)) != g1
    # inputs are declared at the head, before any computed node
    first_computed = next(i for i, n in enumerate(g1) if not n.op.is_leaf)
    assert all(n.op.is_leaf for n in g1.nodes[:first_computed])
    assert not any(n.op.is_leaf for n in g1.nodes[first_computed:])


def test_decoder_graph_shapes(llama):
    g = build_decoder(llama, GraphParams(n_tokens=5, n_ctx=64, n_out=2))
    (out,) = g.outputs
    assert g.nodes[out].shape == (2, llama.n_vocab)
    ops = [n.op for n in g]
    assert ops.count(Op.ATTENTION) == llama.n_layer and ops.count(Op.SLICE_ROWS) == 1
    g = build_decoder(llama, GraphParams(n_tokens=1, n_ctx=64, output="argmax"))
    assert g.nodes[g.outputs[0]].dtype is I32
    assert Op.SLICE_ROWS not in [n.op for n in g]


def test_tied_embedding_is_one_weight_leaf(llama):
    g = build_decoder(llama, GraphParams(n_tokens=2, n_ctx=8))
    weights = g.leaves(Op.WEIGHT)
    assert "output.weight" not in weights
    head = g.nodes[g.outputs[0]]
    assert head.op is Op.MATMUL and head.src[1] == weights["token_embd.weight"]


def test_missing_weight_is_named(llama):
    broken = attrs.evolve(llama, weights=tuple(w for w in llama.weights if "ffn_up" not in w[0]))
    with pytest.raises(ValueError, match=r"needs weight 'blk.0.ffn_up.weight'"):
        build_decoder(broken, GraphParams(n_tokens=1, n_ctx=8))


def test_graph_params_validate():
    with pytest.raises(ValueError, match="n_out"):
        GraphParams(n_tokens=2, n_ctx=8, n_out=3)
    with pytest.raises(ValueError, match="exceeds the context"):
        GraphParams(n_tokens=9, n_ctx=8)
    with pytest.raises(ValueError):
        GraphParams(n_tokens=1, n_ctx=8, output="probs")
    assert GraphParams(n_tokens=1, n_ctx=8) == GraphParams(n_tokens=1, n_ctx=8)


def test_graph_cache_builds_once_per_key(llama):
    cache = GraphCache(capacity=2)
    built = []

    def build(p):
        built.append(p)
        return build_decoder(llama, p)

    p1, p2, p3 = (GraphParams(n_tokens=n, n_ctx=16) for n in (1, 2, 3))
    g = cache.get((llama, p1), lambda: build(p1))
    assert cache.get((llama, p1), lambda: build(p1)) is g
    cache.get((llama, p2), lambda: build(p2))
    cache.get((llama, p3), lambda: build(p3))  # evicts p1, the least recently used
    cache.get((llama, p1), lambda: build(p1))
    assert built == [p1, p2, p3, p1] and cache.hits == 1


def test_decoder_graphs_reuse_built_graphs(llama):
    graphs = DecoderGraphs(llama)
    p = GraphParams(n_tokens=1, n_ctx=16)
    assert graphs(p) is graphs(p) and graphs.cache.misses == 1
    assert graphs(GraphParams(n_tokens=2, n_ctx=16)) is not graphs(p)


def test_dumps():
    g = small_graph()
    text = format_graph(g)
    assert "%4 = MATMUL F32[3, 32] (%3, %2)" in text and text.endswith("outputs: %5")
    dot = to_dot(g)
    assert dot.startswith("digraph parity {") and "n3 -> n4;" in dot and dot.endswith("}")


# -- verify() rejects malformed graphs ------------------------------------------------------


def _nodes() -> list[Node]:
    return list(small_graph().nodes)


def _graph(nodes, outputs=(5,)) -> Graph:
    return Graph(tuple(nodes), tuple(outputs))


def _replace(i, **changes):
    nodes = _nodes()
    nodes[i] = attrs.evolve(nodes[i], **changes)
    return _graph(nodes)


@pytest.mark.parametrize(
    "graph, message",
    [
        (_replace(4, src=(3, 5)), "not an earlier node"),  # forward reference
        (_replace(4, src=(4, 2)), "not an earlier node"),  # self reference
        (_replace(4, shape=(3, 33)), "declared F32"),  # wrong shape
        (_replace(5, dtype=DType.F32), "declared F32"),  # wrong dtype
        (_replace(1, arg="w"), "declared twice"),  # two weights, one name
        (_replace(0, src=(1,)), "a leaf has no sources"),
        (_replace(3, src=(1,)), "takes 2 sources"),
        (_replace(3, src=(0, 1)), "source 0 must be a 2-D weight"),
        (_graph(_nodes(), outputs=()), "no outputs"),
        (_graph(_nodes(), outputs=(9,)), "output %9 is not a node"),
        (_graph([*_nodes(), Node(Op.INPUT, I32, (1,), (), "late")]), "graph head"),
        (_replace(4, arg=SliceArg(0, 1)), None),  # MATMUL ignores arg: still valid
        (_graph([*_nodes()[:5], "not a node"]), "not a Node, got str"),
        (_graph(_nodes(), outputs=(5, 5)), "name a node twice"),
        (_graph(_nodes(), outputs=(1,)), "is a leaf"),
        (_replace(0, shape=(-3,)), "must be positive integers"),
        (_replace(0, dtype=DType.Q4_0), r"\(INPUT\): cannot be Q4_0"),
    ],
)
def test_verify_rejects(graph, message):
    if message is None:
        verify(graph)
        return
    with pytest.raises(GraphError, match=message):
        verify(graph)


def test_verify_rejects_bad_attention_and_state_use():
    b = GraphBuilder()
    q = b.input("q", F32, (2, 128))
    k = b.input("k", F32, (2, 64))
    pos = b.input("pos", I32, (2,))
    cos = b.weight("cos", F32, (16, 32))
    cache = b.state("cache", (16, 64))
    kc = b.op(Op.KV_WRITE, cache, k, pos)
    with pytest.raises(GraphError, match="n_head must be a multiple"):
        b.op(Op.ATTENTION, q, kc, kc, pos, arg=AttentionArg(2, 3, 64, 0.125))
    with pytest.raises(GraphError, match="n_head must be a multiple of n_head_kv >= 1"):
        b.op(Op.ATTENTION, q, kc, kc, pos, arg=AttentionArg(2, 0, 64, 0.125))
    with pytest.raises(GraphError, match="scale must be exactly representable"):
        b.op(Op.ATTENTION, q, kc, kc, pos, arg=AttentionArg(2, 1, 64, 0.1))
    with pytest.raises(GraphError, match="k and v must be KV_WRITE"):
        b.op(Op.ATTENTION, q, k, k, pos, arg=AttentionArg(2, 1, 64, 0.125))
    with pytest.raises(GraphError, match="unknown mode"):
        b.op(Op.ROPE, q, pos, cos, cos, arg=RopeArg(2, 64, 64, "yarn"))
    a = b.op(Op.ATTENTION, q, kc, kc, pos, arg=AttentionArg(2, 1, 64, 0.125))
    g = b.build(a)
    # a second KV_WRITE on the same state breaks the one-writer rule
    inputs, state = g.leaves(Op.INPUT), g.leaves(Op.STATE)["cache"]
    extra = Node(Op.KV_WRITE, F32, (16, 64), (state, inputs["k"], inputs["pos"]))
    with pytest.raises(GraphError, match="exactly one KV_WRITE"):
        verify(Graph((*g.nodes, extra), g.outputs))


def test_gelu_geglu_and_scale_signatures():
    b = GraphBuilder()
    x = b.input("x", F32, (2, 64))
    y = b.input("y", F32, (2, 32))
    assert b.build(b.op(Op.GELU, x)).nodes[-1].shape == (2, 64)
    assert b.build(b.op(Op.GEGLU, x, x)).nodes[-1].shape == (2, 64)
    with pytest.raises(GraphError, match=r"gate \(2, 64\) and up \(2, 32\) differ"):
        b.op(Op.GEGLU, x, y)
    assert b.build(b.op(Op.SCALE, x, arg=0.5)).nodes[-1].shape == (2, 64)
    for bad in (0.1, float("inf"), 3, None):  # not a float32 value; not finite; not a float
        with pytest.raises(GraphError, match="finite float that float32 holds exactly"):
            b.op(Op.SCALE, x, arg=bad)
