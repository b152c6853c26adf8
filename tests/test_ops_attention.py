"""kv_write and attention: the chunked two-pass contract bit for bit against a scalar loop,
float64 softmax within a stated bound, batch invariance, chunk boundaries and GQA; the tiled
kernel (attention_tiled) bit for bit against the definition (ops.attention)."""

from __future__ import annotations

import numpy as np
import pytest

from parity.backends.cpu import attention_tiled as tiled
from parity.backends.cpu import ops
from parity.numerics import exp

F32 = np.float32
U = 2.0**-24


def tree(values: list[np.float32]) -> np.float32:
    """A plain pairwise sum over a power-of-two list (the caller pads)."""
    vals = list(values)
    while len(vals) > 1:
        vals = [F32(vals[i] + vals[i + 1]) for i in range(0, len(vals), 2)]
    return vals[0]


def chunked_sum(terms: list[np.float32], chunk: int = 256) -> np.float32:
    """Pad to whole chunks with +0.0, tree each chunk, fold chunk sums left to right."""
    n_chunks = (len(terms) - 1) // chunk + 1
    slots = terms + [F32(0.0)] * (n_chunks * chunk - len(terms))
    acc = tree(slots[:chunk])
    for c in range(1, n_chunks):
        acc = F32(acc + tree(slots[c * chunk : (c + 1) * chunk]))
    return acc


def attention_scalar(q, k, v, positions, *, n_head, n_head_kv, head_dim, scale) -> np.ndarray:
    """The contract written as loops over numpy float32 scalars."""
    d, rep = head_dim, n_head // n_head_kv
    out = np.zeros_like(q)
    for t, p in enumerate(positions):
        for h in range(n_head):
            g = h // rep
            qh = q[t, h * d : (h + 1) * d]
            s = []
            for j in range(p + 1):
                kj = k[j, g * d : (g + 1) * d]
                s.append(F32(tree([F32(a * b) for a, b in zip(qh, kj, strict=True)]) * scale))
            m = max(s)
            e = [F32(exp(F32(sj - m))) for sj in s]
            den = chunked_sum(e)
            for i in range(d):
                num = chunked_sum([F32(e[j] * v[j, g * d + i]) for j in range(p + 1)])
                out[t, h * d + i] = F32(num / den)
    return out


def make(seed, n_ctx, n_head, n_head_kv, head_dim, n_tok, q_scale=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((n_tok, n_head * head_dim)) * q_scale).astype(F32)
    k = rng.standard_normal((n_ctx, n_head_kv * head_dim)).astype(F32)
    v = rng.standard_normal((n_ctx, n_head_kv * head_dim)).astype(F32)
    return q, k, v


def test_attention_matches_scalar_loop_bitwise_across_chunk_boundaries() -> None:
    kw = {"n_head": 4, "n_head_kv": 2, "head_dim": 4, "scale": float(F32(0.5))}
    q, k, v = make(0, 520, 4, 2, 4, 7, q_scale=4.0)  # wide scores: some weights underflow
    positions = np.array([0, 1, 255, 256, 257, 511, 512], dtype=np.int32)
    k[513:], v[513:] = np.nan, np.inf  # rows no token may read
    v[3, :] = -0.0
    got = ops.attention(q, k, v, positions, **kw)
    want = attention_scalar(q, k, v, positions, **kw)
    assert got.tobytes() == want.tobytes()
    assert np.all(np.isfinite(got))


def softmax64(q, k, v, positions, *, n_head, n_head_kv, head_dim, scale):
    d, rep = head_dim, n_head // n_head_kv
    out = np.zeros(q.shape)
    bound = np.zeros(q.shape)
    for t, p in enumerate(positions):
        for h in range(n_head):
            g = h // rep
            qh = q[t, h * d : (h + 1) * d].astype(np.float64)
            kh = k[: p + 1, g * d : (g + 1) * d].astype(np.float64)
            vh = v[: p + 1, g * d : (g + 1) * d].astype(np.float64)
            s = kh @ qh * scale
            w = np.exp(s - s.max())
            out[t, h * d : (h + 1) * d] = w @ vh / w.sum()
            # score error: product 0.5u, 6 tree levels, scale 0.5u (< 8u of scale*sum|q k|),
            # plus the subtraction s - m (u |s - m|); each weight e_j/den sees it twice plus
            # exp's 1.25u; the chunked sums add (8 levels + chunk folds + 1) u each
            delta = 8 * U * scale * (np.abs(kh) @ np.abs(qh)).max() + U * np.ptp(s)
            n_chunks = p // 256 + 1
            rel = 2 * (2 * delta + 1.25 * U) + 2 * (10 + n_chunks) * U
            bound[t, h * d : (h + 1) * d] = rel * np.abs(vh).max()
    return out, bound


@pytest.mark.parametrize("n_head, n_head_kv", [(9, 3), (14, 2)])
def test_attention_within_stated_bound_of_float64_softmax(n_head: int, n_head_kv: int) -> None:
    scale = float(F32(1 / np.sqrt(64.0)))
    kw = {"n_head": n_head, "n_head_kv": n_head_kv, "head_dim": 64, "scale": scale}
    q, k, v = make(1, 600, n_head, n_head_kv, 64, 6, q_scale=2.0)
    positions = np.array([0, 100, 255, 256, 300, 599], dtype=np.int32)
    got = ops.attention(q, k, v, positions, **kw).astype(np.float64)
    want, bound = softmax64(q, k, v, positions, **kw)
    assert np.all(np.abs(got - want) <= bound)


def test_attention_is_batch_invariant_and_deterministic(monkeypatch) -> None:
    kw = {"n_head": 14, "n_head_kv": 2, "head_dim": 64, "scale": 0.125}
    q, k, v = make(2, 320, 14, 2, 64, 300)
    positions = np.arange(300, dtype=np.int32)
    batch = ops.attention(q, k, v, positions, **kw)
    assert batch.tobytes() == ops.attention(q, k, v, positions, **kw).tobytes()
    for t in (0, 100, 255, 256, 299):
        alone = ops.attention(q[t : t + 1], k, v, positions[t : t + 1], **kw)
        assert alone.tobytes() == batch[t : t + 1].tobytes()
    # nor does the order tokens come in
    rev = ops.attention(q[::-1].copy(), k, v, positions[::-1].copy(), **kw)
    assert rev[::-1].tobytes() == batch.tobytes()
    # the tiled kernel gives the same bits, and its token chunking for memory changes nothing
    assert tiled.attention_tiled(q, k, v, positions, **kw).tobytes() == batch.tobytes()
    monkeypatch.setattr(tiled, "_ATTENTION_TEMP_BYTES", 1 << 20)
    assert tiled.attention_tiled(q, k, v, positions, **kw).tobytes() == batch.tobytes()
    rev = tiled.attention_tiled(q[::-1].copy(), k, v, positions[::-1].copy(), **kw)
    assert rev[::-1].tobytes() == batch.tobytes()


def test_attention_padding_slots_are_plus_zero() -> None:
    # every product e_j * -0.0 is -0.0; the +0.0 slots past p turn a partial chunk's sum into +0.0
    kw = {"n_head": 1, "n_head_kv": 1, "head_dim": 2, "scale": 1.0}
    q, k, v = make(3, 300, 1, 1, 2, 3)
    v[:] = -0.0
    out = ops.attention(q, k, v, np.array([0, 255, 256], dtype=np.int32), **kw)
    assert out.tobytes() == np.array([[0.0] * 2, [-0.0] * 2, [0.0] * 2], F32).tobytes()


def test_attention_gqa_head_mapping_and_uniform_rows() -> None:
    # kv head g holds v = 2^g: scaling by a power of two is exact, so out = 2^g exactly
    n_head, n_head_kv, d = 6, 3, 8
    q, k, v = make(4, 40, n_head, n_head_kv, d, 2)
    v = np.repeat(np.array([1.0, 2.0, 4.0], F32), d)[None, :].repeat(40, axis=0)
    kw = {"n_head": n_head, "n_head_kv": n_head_kv, "head_dim": d, "scale": 0.25}
    out = ops.attention(q, k, v, np.array([5, 39], np.int32), **kw)
    heads = out.reshape(2, n_head, d)
    assert np.all(heads == np.array([1, 1, 2, 2, 4, 4], F32)[None, :, None])
    # all scores equal: weights 1, out = (p + 1) * 0.5 / (p + 1) = 0.5 exactly
    out = ops.attention(
        np.zeros_like(q), k, np.full_like(v, 0.5), np.array([0, 39], np.int32), **kw
    )
    assert np.all(out == 0.5)


@pytest.mark.parametrize("attention", [ops.attention, tiled.attention_tiled])
def test_attention_errors(attention) -> None:
    kw = {"n_head": 2, "n_head_kv": 1, "head_dim": 4, "scale": 0.5}
    q, k, v = make(5, 10, 2, 1, 4, 2)
    with pytest.raises(
        ValueError, match=r"attention: position 10 is outside the caches' rows 0..9"
    ):
        attention(q, k, v, np.array([0, 10], np.int32), **kw)
    with pytest.raises(ValueError, match="attention: position -3 is outside"):
        attention(q, k, v, np.array([-3, 0], np.int32), **kw)
    with pytest.raises(ValueError, match=r"attention: positions must be int32\[2\]"):
        attention(q, k, v, np.array([0], np.int32), **kw)
    with pytest.raises(ValueError, match="must be a multiple of n_head_kv"):
        attention(q, k, v, np.array([0, 1], np.int32), **{**kw, "n_head_kv": 3})
    with pytest.raises(ValueError, match=r"caches must both be \(n_ctx, 4\)"):
        attention(q, k, v[:, :2], np.array([0, 1], np.int32), **kw)
    with pytest.raises(ValueError, match="q width 8 != n_head"):
        attention(q, k, v, np.array([0, 1], np.int32), **{**kw, "n_head": 4})
    with pytest.raises(ValueError, match="scale must be exact in float32"):
        attention(q, k, v, np.array([0, 1], np.int32), **{**kw, "scale": 0.1})
    # no tokens: an empty (0, n_head * head_dim) result
    empty = attention(q[:0], k, v, np.zeros(0, np.int32), **kw)
    assert empty.shape == (0, 8) and empty.dtype == F32


def test_kv_write_in_place() -> None:
    cache = np.zeros((8, 4), F32)
    rows = np.arange(8, dtype=F32).reshape(2, 4)
    out = ops.kv_write(cache, rows, np.array([5, 2], np.int32))
    assert out is cache
    assert np.array_equal(cache[5], rows[0]) and np.array_equal(cache[2], rows[1])
    assert np.count_nonzero(cache) == 7  # rows[0, 0] is 0.0; nothing else was touched


def test_kv_write_errors() -> None:
    cache = np.zeros((8, 4), F32)
    rows = np.ones((2, 4), F32)
    with pytest.raises(ValueError, match=r"kv_write: position 8 is outside the cache's rows 0..7"):
        ops.kv_write(cache, rows, np.array([0, 8], np.int32))
    with pytest.raises(ValueError, match="kv_write: positions must be distinct"):
        ops.kv_write(cache, rows, np.array([3, 3], np.int32))
    with pytest.raises(ValueError, match="kv_write: rows width 3 != cache width 4"):
        ops.kv_write(cache, rows[:, :3], np.array([0, 1], np.int32))
    assert not cache.any()  # a rejected write writes nothing


# --- the blocked attention against the previous straightforward vectorisation ------------------


def attention_reference(q, k, v, positions, *, n_head, n_head_kv, head_dim, scale) -> np.ndarray:
    """The oracle's earlier implementation, kept as a reference: every token scores the whole
    span 0..256*nc-1 of the batch's largest chunk count nc, masks, and folds its own chunks."""
    from parity.numerics import tree_sum

    n_tok, g, d = q.shape[0], n_head_kv, head_dim
    rep = n_head // n_head_kv
    n_chunks = positions // 256 + 1
    nc = int(n_chunks.max())
    span = nc * 256
    n = min(span, k.shape[0])
    qh = q.reshape(n_tok, g, rep, d)
    kh = k[:n].reshape(n, g, d)
    vh = np.zeros((span, g, d), dtype=F32)
    vh[:n] = v[:n].reshape(n, g, d)
    valid = np.arange(span)[None, :] <= positions[:, None]
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        prod = qh.transpose(3, 0, 1, 2)[..., None] * kh.transpose(2, 1, 0)[:, None, :, None, :]
        dot = tree_sum(prod, axis=0)
        s = np.full((n_tok, g, rep, span), -np.inf, dtype=F32)
        s[..., :n] = dot * F32(scale)
        s = np.where(valid[:, None, None, :], s, F32(-np.inf))
        m = s.max(axis=-1, keepdims=True)
        e = exp(s - m)
        e = np.where(valid[:, None, None, :], e, F32(0))
        den_c = tree_sum(e.reshape(n_tok, g, rep, nc, 256), axis=-1)
        pv = e.transpose(3, 0, 1, 2)[..., None] * vh[:, None, :, None, :]
        np.copyto(pv, F32(0), where=~valid.T[:, :, None, None, None])
        num_c = tree_sum(pv.reshape(nc, 256, n_tok, g, rep, d), axis=1)
        den, num = den_c[..., 0], num_c[0]
        for c in range(1, nc):
            more = (c < n_chunks)[:, None, None]
            den = np.where(more, den + den_c[..., c], den)
            num = np.where(more[..., None], num + num_c[c], num)
        out = num / den[..., None]
    return out.reshape(n_tok, n_head * d)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, NaN positions compared instead of NaN bits (rule 4)."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(nan_a, nan_b)) and a[~nan_a].tobytes() == b[~nan_b].tobytes()


POSITION_SETS = {
    "decode-0": [0],
    "decode-1": [1],
    "decode-50": [50],
    "decode-255": [255],
    "decode-256": [256],
    "decode-257": [257],
    "decode-511": [511],
    "decode-512": [512],
    "prefill-0-299": list(range(300)),
    "chunk-boundary-250-262": list(range(250, 263)),
    "shuffled-with-duplicates": [257, 3, 255, 256, 511, 0, 256, 512, 100, 3],
}


@pytest.mark.parametrize("name", sorted(POSITION_SETS))
@pytest.mark.parametrize("n_head, n_head_kv, head_dim", [(9, 3, 64), (14, 2, 64), (4, 2, 6)])
def test_attention_matches_reference_bitwise(name, n_head, n_head_kv, head_dim) -> None:
    positions = np.array(POSITION_SETS[name], dtype=np.int32)
    kw = {"n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim, "scale": 0.125}
    q, k, v = make(6, 540, n_head, n_head_kv, head_dim, positions.size, q_scale=3.0)
    v[7] = -0.0
    k[int(positions.max()) + 1 :] = np.nan  # rows no token may read
    v[int(positions.max()) + 1 :] = np.inf
    got = ops.attention(q, k, v, positions, **kw)
    assert same_bits(got, attention_reference(q, k, v, positions, **kw))


@pytest.mark.parametrize("tile, temp", [(1, 64 << 20), (1 << 14, 1 << 15), (1 << 30, 1 << 30)])
def test_attention_tiling_changes_nothing(monkeypatch, tile: int, temp: int) -> None:
    # one token per block and one slot per score tile; several kv-head runs; one block per chunk
    kw = {"n_head": 6, "n_head_kv": 3, "head_dim": 8, "scale": 0.25}
    positions = np.array([0, 5, 255, 256, 257, 300, 511, 512, 513], dtype=np.int32)
    q, k, v = make(7, 520, 6, 3, 8, positions.size, q_scale=2.0)
    want = attention_reference(q, k, v, positions, **kw)
    assert ops.attention(q, k, v, positions, **kw).tobytes() == want.tobytes()
    monkeypatch.setattr(tiled, "_ATTENTION_TILE_BYTES", tile)
    monkeypatch.setattr(tiled, "_ATTENTION_TEMP_BYTES", temp)
    assert tiled.attention_tiled(q, k, v, positions, **kw).tobytes() == want.tobytes()


def test_attention_hidden_real_rows_are_plus_zero(monkeypatch) -> None:
    # tokens 256..511 in one block: row j > p is a real cache row for the block, but hidden for
    # token p; v = -0.0 everywhere makes a -0.0 leak visible (the full 256-slot tail has no
    # +0.0 padding to hide it), and inf/NaN rows inside the block's span must not leak either
    monkeypatch.setattr(tiled, "_ATTENTION_TILE_BYTES", 1 << 30)
    kw = {"n_head": 2, "n_head_kv": 1, "head_dim": 2, "scale": 1.0}
    positions = np.arange(256, 512, dtype=np.int32)
    q, k, v = make(8, 512, 2, 1, 2, positions.size)
    v[:] = -0.0
    want = np.zeros((positions.size, 4), F32)  # tail sums +0.0 (hidden slots), -0.0 + +0.0
    want[-1] = -0.0  # position 511 sees every slot of chunk 1: all -0.0, so -0.0 + -0.0
    for attention in (ops.attention, tiled.attention_tiled):
        out = attention(q, k, v, positions, **kw)
        assert out.tobytes() == want.tobytes()
        assert out.tobytes() == attention_reference(q, k, v, positions, **kw).tobytes()
    v = make(9, 512, 2, 1, 2, 1)[2]
    v[400], k[450] = np.inf, np.nan
    for attention in (ops.attention, tiled.attention_tiled):
        got = attention(q, k, v, positions, **kw)
        assert np.isfinite(got[: 400 - 256]).all()
        assert same_bits(got, attention_reference(q, k, v, positions, **kw))


def test_attention_special_values_match_reference() -> None:
    # inf and NaN in q, k and v inside the span, -0.0 rows, scores that overflow to inf, rows
    # whose scores are all -inf (m = -inf gives NaN) and weights that underflow to 0
    kw = {"n_head": 4, "n_head_kv": 2, "head_dim": 4, "scale": 0.5}
    positions = np.array([0, 1, 2, 40, 255, 256, 257, 300], dtype=np.int32)
    q, k, v = make(10, 320, 4, 2, 4, positions.size, q_scale=30.0)
    q[1, :4] = np.inf
    q[2, 4:8] = np.nan
    k[3, :] = 1e30  # q * k overflows
    k[0, 4:] = -np.inf
    v[5, :] = -0.0
    v[260, :2] = np.inf
    v[280, 2:] = np.nan
    q[7, :] = -0.0
    got = ops.attention(q, k, v, positions, **kw)
    assert same_bits(got, attention_reference(q, k, v, positions, **kw))
    assert np.isnan(got).any() and np.isfinite(got).any()


def test_attention_small_cases_match_reference() -> None:
    # head_dim not a power of two (padded dims), one dim, a single kv head, repeated positions
    for n_head, n_head_kv, head_dim in [(3, 1, 3), (2, 2, 1), (4, 1, 5), (2, 1, 2)]:
        kw = {"n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim, "scale": 0.5}
        positions = np.array([6, 0, 3, 6], dtype=np.int32)
        q, k, v = make(11, 12, n_head, n_head_kv, head_dim, positions.size, q_scale=3.0)
        got = ops.attention(q, k, v, positions, **kw)
        assert got.tobytes() == attention_reference(q, k, v, positions, **kw).tobytes()
        if head_dim & (head_dim - 1) == 0:  # the scalar loop's tree wants a power of two
            assert got.tobytes() == attention_scalar(q, k, v, positions, **kw).tobytes()


# --- the tiled kernel against the definition, bit for bit ---------------------------------------


def assert_same_u32(got: np.ndarray, want: np.ndarray) -> None:
    """Equal float32 bit patterns everywhere but at NaNs, whose positions must be equal (NaN
    payloads are not part of the contract)."""
    assert got.shape == want.shape and got.dtype == want.dtype == F32
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), "NaN positions differ"
    differ = (got.view(np.uint32) != want.view(np.uint32)) & ~nan
    assert not differ.any(), (
        f"{int(differ.sum())} elements differ, first at {np.argwhere(differ)[0]}"
    )


HEAD_LAYOUTS = [(9, 3, 64), (14, 2, 64), (6, 3, 48), (3, 1, 5)]  # smollm2, qwen2.5, odd dims

TILED_POSITIONS = {
    "prefill-0-299": np.arange(300),
    **{f"decode-{p}": np.array([p]) for p in (0, 1, 255, 256, 257, 511, 512, 1000)},
    "shuffled": np.random.default_rng(20).permutation(
        np.r_[0:6, 250:262, 509:515, 700, 1000, 1000, 256, 3]  # duplicates too
    ),
}


def plant_past(k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
    """NaN and inf in every cache row past every position: rows no token may read."""
    first = int(positions.max()) + 1
    k[first::2], k[first + 1 :: 2] = np.nan, np.inf
    v[first::2], v[first + 1 :: 2] = -np.inf, np.nan


@pytest.mark.parametrize("name", list(TILED_POSITIONS))
@pytest.mark.parametrize("n_head, n_head_kv, head_dim", HEAD_LAYOUTS)
def test_tiled_matches_definition_bitwise(name, n_head, n_head_kv, head_dim) -> None:
    positions = TILED_POSITIONS[name].astype(np.int32)
    scale = float(F32(1 / np.sqrt(head_dim)))
    kw = {"n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim, "scale": scale}
    seed = sum(map(ord, name)) + n_head
    q, k, v = make(seed, 1040, n_head, n_head_kv, head_dim, positions.size, q_scale=3.0)
    plant_past(k, v, positions)
    want = ops.attention(q, k, v, positions, **kw)
    assert np.isfinite(want).all()  # nothing planted past the positions leaked in
    assert_same_u32(tiled.attention_tiled(q, k, v, positions, **kw), want)


SPECIALS = {
    # +-0, the smallest subnormal, subnormals, the smallest normal
    "tiny": np.array([0.0, -0.0, 1e-45, -1e-45, 3e-39, -6e-40, 1.1754944e-38], F32),
    "huge": np.array([1e30, -1e30, 0.0, -0.0], F32),
}


def special(rng, a: np.ndarray, values: np.ndarray, rows: int, share: float = 0.1) -> None:
    """Replace a random share of the first ``rows`` rows of ``a`` with ``values``, in place."""
    hit = rng.random((rows, a.shape[1])) < share
    a[:rows][hit] = rng.choice(values, size=int(hit.sum()))


SPECIAL_KINDS = [
    "tiny-qkv",
    "huge-q",
    "huge-v",
    "overflow",
    "v-all-minus-zero",
    "nonfinite-in-span",
]


@pytest.mark.parametrize("kind", SPECIAL_KINDS)
@pytest.mark.parametrize("n_head, n_head_kv, head_dim", HEAD_LAYOUTS)
def test_tiled_matches_definition_on_special_values(kind, n_head, n_head_kv, head_dim) -> None:
    positions = np.random.default_rng(21).permutation(
        np.r_[0, 1, 2, 40, 250:260, 511, 512, 513, 1000].astype(np.int32)
    )
    kw = {"n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim, "scale": 0.125}
    rng = np.random.default_rng(sum(map(ord, kind)) + head_dim)
    q, k, v = make(rng, 1040, n_head, n_head_kv, head_dim, positions.size)
    n = int(positions.max()) + 1
    if kind == "tiny-qkv":
        for a, rows in ((q, q.shape[0]), (k, n), (v, n)):
            special(rng, a, SPECIALS["tiny"], rows)
        q[0] = -0.0  # a whole q row of -0.0: every score is +-0.0, every weight 1
    elif kind == "huge-q":  # scores near +-1e30: most weights underflow to +0.0
        special(rng, q, SPECIALS["huge"], q.shape[0], share=0.02)
    elif kind == "huge-v":
        special(rng, v, SPECIALS["huge"], n)
    elif kind == "overflow":  # q * k overflows: inf and NaN scores, NaN heads
        special(rng, q, SPECIALS["huge"], q.shape[0], share=0.01)
        special(rng, k, SPECIALS["huge"], n, share=0.01)
        q[::3, 0], k[0, 0] = 1e30, 1e30  # row 0 is read by every token: some scores are inf
    elif kind == "v-all-minus-zero":  # every product -0.0: the +0.0 padding slots decide the sign
        v[:n] = -0.0
    else:  # rows some tokens of a chunk read and others must not: 0, 1, 2, 40 stay finite
        k[45, 1], v[100], v[257, 0], v[258, 1] = np.nan, np.inf, -np.inf, np.nan
    plant_past(k, v, positions)
    want = ops.attention(q, k, v, positions, **kw)
    if kind == "overflow":
        assert np.isnan(want).any() and np.isfinite(want).any()
    elif kind == "nonfinite-in-span":
        assert np.isfinite(want[positions < 45]).all() and not np.isfinite(want).all()
    else:
        assert np.isfinite(want).all()  # nothing planted past the positions leaked in
    if kind == "v-all-minus-zero":
        assert not want.any()
        minus = np.signbit(want).all(axis=1)  # -0.0 where the last chunk is whole
        assert minus.tolist() == [p in (255, 511) for p in positions.tolist()]
    assert_same_u32(tiled.attention_tiled(q, k, v, positions, **kw), want)


# -- sliding windows -----------------------------------------------------------------------


def window_fold(terms: dict[int, np.float32], lo: int, p: int) -> np.float32:
    """The 256-slot chunk trees lo // 256 .. p // 256 folded left to right, slots outside
    lo..p (not in ``terms``) being +0.0."""
    acc = None
    for c in range(lo // 256, p // 256 + 1):
        slots = [terms.get(j, F32(0.0)) for j in range(c * 256, c * 256 + 256)]
        acc = tree(slots) if acc is None else F32(acc + tree(slots))
    return acc


def windowed_scalar(q, k, v, positions, *, n_head, n_head_kv, head_dim, scale, window):
    """The windowed contract as scalar loops: a token at p reads positions lo..p,
    lo = max(0, p - window + 1)."""
    d, rep = head_dim, n_head // n_head_kv
    out = np.zeros_like(q)
    for t, p in enumerate(positions):
        lo = max(0, p - window + 1)
        for h in range(n_head):
            g = h // rep
            qh = q[t, h * d : (h + 1) * d]
            s = {}
            for j in range(lo, p + 1):
                kj = k[j, g * d : (g + 1) * d]
                s[j] = F32(tree([F32(a * b) for a, b in zip(qh, kj, strict=True)]) * scale)
            m = max(s.values())
            e = {j: F32(exp(F32(sj - m))) for j, sj in s.items()}
            den = window_fold(e, lo, p)
            for i in range(d):
                terms = {j: F32(ej * v[j, g * d + i]) for j, ej in e.items()}
                out[t, h * d + i] = F32(window_fold(terms, lo, p) / den)
    return out


@pytest.mark.parametrize("attention", [ops.attention, tiled.attention_tiled])
def test_sliding_window_matches_scalar_loop_bitwise(attention) -> None:
    kw = {"n_head": 4, "n_head_kv": 2, "head_dim": 4, "scale": float(F32(0.5))}
    q, k, v = make(3, 800, 4, 2, 4, 6, q_scale=4.0)
    positions = np.array([0, 5, 300, 511, 767, 700], dtype=np.int32)
    window = 256
    v[600:640, :] = -0.0  # a chunk whose numerator is -0.0 for some rows
    k[6:45], v[6:45] = np.nan, np.inf  # read by no window (tokens at 0 and 5 read 0..5)
    k[768:], v[768:] = np.nan, np.inf  # past every position
    got = attention(q, k, v, positions, **kw, window=window)
    want = windowed_scalar(q, k, v, positions, **kw, window=window)
    assert got.tobytes() == want.tobytes()
    assert np.all(np.isfinite(got))


def test_sliding_window_limits() -> None:
    kw = {"n_head": 4, "n_head_kv": 2, "head_dim": 8, "scale": float(F32(0.25))}
    q, k, v = make(5, 600, 4, 2, 8, 3)
    positions = np.array([0, 299, 599], dtype=np.int32)
    full = ops.attention(q, k, v, positions, **kw)
    assert ops.attention(q, k, v, positions, **kw, window=600).tobytes() == full.tobytes()
    one = ops.attention(q, k, v, positions, **kw, window=1)  # softmax of one: v itself
    want = np.repeat(v[positions].reshape(3, 2, 1, 8), 2, axis=2).reshape(3, 32)
    assert one.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="window"):
        ops.attention(q, k, v, positions, **kw, window=-1)
