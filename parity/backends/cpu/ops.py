"""The living definition of every op: one plain numpy function per op, named like the op.

Each function is the contract of docs/numerics.md written in numpy. float32 numpy arithmetic is
one correctly rounded operation per ufunc call and never fuses, so one expression per line is
one fl() of the contract. Reductions go through ``tree_sum`` (the fixed tree), ``exp`` is the
project's own, and max/argmax are exact in any order. Activations are float32
``(n_tokens, width)``; ids and positions are int32 ``(n_tokens,)``.
"""

from __future__ import annotations

import numpy as np

from parity import quant
from parity.numerics import F32, exp, next_pow2, tree_sum, tree_sum_leading
from parity.quant import PreparedWeight

CHUNK = 256  # attention reduces positions in chunks of this many slots, aligned at position 0
_ATTENTION_TEMP_BYTES = 64 << 20  # token-chunk budget for attention's largest temporary
_ATTENTION_TILE_BYTES = 4 << 20  # products formed at once (a few L2 caches' worth)

_ROPE_MODES = ("normal", "neox")


# --- argument checks: every message names the op and what to fix ---------------------------


def check_rows(op: str, x: np.ndarray, what: str = "x") -> None:
    if not isinstance(x, np.ndarray) or x.dtype != F32 or x.ndim != 2:
        got = f"{x.dtype}{list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{op}: {what} must be a float32 (n_tokens, width) array, got {got}")


def check_positions(op: str, positions: np.ndarray, n_tokens: int, limit: int, what: str) -> None:
    if (
        not isinstance(positions, np.ndarray)
        or positions.dtype != np.int32
        or positions.shape != (n_tokens,)
    ):
        got = (
            f"{positions.dtype}{list(positions.shape)}"
            if isinstance(positions, np.ndarray)
            else type(positions).__name__
        )
        raise ValueError(f"{op}: positions must be int32[{n_tokens}], got {got}")
    bad = (positions < 0) | (positions >= limit)
    if bad.any():
        p = int(positions[np.argmax(bad)])
        raise ValueError(f"{op}: position {p} is outside {what} rows 0..{limit - 1}")


def check_elementwise(op: str, a: np.ndarray, b: np.ndarray) -> None:
    check_rows(op, a, "a")
    if not isinstance(b, np.ndarray) or b.dtype != F32 or b.shape not in (a.shape, a.shape[1:]):
        got = f"{b.dtype}{list(b.shape)}" if isinstance(b, np.ndarray) else type(b).__name__
        raise ValueError(
            f"{op}: b must be float32 {list(a.shape)} or a row vector {list(a.shape[1:])}, "
            f"got {got}"
        )


# --- data movement ---------------------------------------------------------------------------


def get_rows(weight: PreparedWeight, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of a prepared weight, dequantized to float32 ``(len(ids), K)``."""
    return quant.get_rows(weight, ids)


def slice_rows(x: np.ndarray, start: int, count: int) -> np.ndarray:
    """Rows ``[start, start + count)`` of ``x``, as a new array."""
    if not isinstance(x, np.ndarray) or x.ndim < 1:
        raise ValueError("slice_rows: x must be an array with rows")
    if start < 0 or count < 1 or start + count > x.shape[0]:
        raise ValueError(
            f"slice_rows: rows [{start}, {start + count}) are outside 0..{x.shape[0]}; "
            "need start >= 0, count >= 1 and start + count <= n_rows"
        )
    return x[start : start + count].copy()


# --- elementwise -----------------------------------------------------------------------------


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fl(a + b); ``b`` is ``a``'s shape or a (width,) row vector added to every row."""
    check_elementwise("add", a, b)
    return a + b


def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fl(a * b); ``b`` is ``a``'s shape or a (width,) row vector multiplied into every row."""
    check_elementwise("mul", a, b)
    return a * b


def silu(x: np.ndarray) -> np.ndarray:
    """fl(x / fl(1 + exp(-x))): x <= -89 gives -0.0 (x / inf), silu(-inf) is NaN (inf / inf)."""
    check_rows("silu", x)
    with np.errstate(invalid="ignore"):  # -inf / inf = NaN is the contract's answer
        d = F32(1) + exp(-x)
        return x / d


def check_swiglu(gate: np.ndarray, up: np.ndarray) -> None:
    """ValueError unless gate and up are float32 (n_tokens, width) arrays of one shape."""
    check_rows("swiglu", gate, "gate")
    check_rows("swiglu", up, "up")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {list(gate.shape)} and up {list(up.shape)} must match")


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """fl(silu(gate) * up), with gate and up of one shape."""
    check_swiglu(gate, up)
    return silu(gate) * up


# --- normalization ---------------------------------------------------------------------------


def check_rms_norm(x: np.ndarray, eps: float) -> None:
    """ValueError unless x is float32 (n_tokens, width) and eps positive and exact in float32."""
    check_rows("rms_norm", x)
    if not (float(F32(eps)) == eps and eps > 0):
        raise ValueError(f"rms_norm: eps must be positive and exact in float32, got {eps!r}")


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """Per row: x * (1 / sqrt(tree_sum(x * x) / width + eps)), one fl() per step.

    ``eps`` must be exactly representable in float32. A row whose squares overflow (|x| above
    ~1.8e19) has ss = inf, so its scale is 0 and it comes out as zeros (NaN where x is inf).
    """
    check_rms_norm(x, eps)
    width = F32(x.shape[1])
    with np.errstate(over="ignore", invalid="ignore"):
        sq = x * x  # (n_tokens, width)
        ss = tree_sum(sq, axis=-1)  # (n_tokens,)
        mean = ss / width
        r = np.sqrt(mean + F32(eps))
        scale = F32(1) / r
        return x * scale[:, None]


# --- matrix products -------------------------------------------------------------------------


def matmul(x: np.ndarray, weight: PreparedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weight.T`` by parity.quant's contract, then ``add(y, bias)`` if a bias is given."""
    y = quant.matmul(x, weight)  # (n_tokens, n_out)
    if bias is not None:
        y = add(y, bias)
    return y


# --- positions -------------------------------------------------------------------------------


def check_rope(
    x: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    *,
    n_head: int,
    head_dim: int,
    n_rot: int,
    mode: str,
) -> None:
    """ValueError unless ROPE's operands, sizes, mode and positions are valid."""
    check_rows("rope", x)
    if mode not in _ROPE_MODES:
        raise ValueError(f"rope: mode must be one of {_ROPE_MODES}, got {mode!r}")
    if x.shape[1] != n_head * head_dim:
        raise ValueError(f"rope: x width {x.shape[1]} != n_head * head_dim = {n_head * head_dim}")
    if not (0 < n_rot <= head_dim and n_rot % 2 == 0):
        raise ValueError(f"rope: n_rot must be even and in (0, head_dim={head_dim}], got {n_rot}")
    half = n_rot // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, np.ndarray) or t.dtype != F32 or t.ndim != 2 or t.shape[1] != half:
            raise ValueError(f"rope: {name} must be a float32 (n_ctx, {half}) table")
    if cos.shape != sin.shape:
        raise ValueError(f"rope: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    check_positions("rope", positions, x.shape[0], cos.shape[0], "the rope tables'")


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    *,
    n_head: int,
    head_dim: int,
    n_rot: int,
    mode: str,
) -> np.ndarray:
    """Rotate the first ``n_rot`` dims of every head by the table row of each token's position.

    Pairs are (2i, 2i+1) in mode "normal" and (i, i + n_rot/2) in mode "neox", both using table
    column i: x0' = fl(fl(x0 c) - fl(x1 s)), x1' = fl(fl(x0 s) + fl(x1 c)). Dims >= n_rot pass.
    """
    check_rope(x, positions, cos, sin, n_head=n_head, head_dim=head_dim, n_rot=n_rot, mode=mode)
    half = n_rot // 2
    xh = x.reshape(x.shape[0], n_head, head_dim)  # (n_tokens, n_head, head_dim)
    c = cos[positions][:, None, :]  # (n_tokens, 1, n_rot // 2)
    s = sin[positions][:, None, :]
    if mode == "normal":
        i0, i1 = slice(0, n_rot, 2), slice(1, n_rot, 2)
    else:
        i0, i1 = slice(0, half), slice(half, n_rot)
    x0 = xh[..., i0]  # (n_tokens, n_head, n_rot // 2)
    x1 = xh[..., i1]
    out = xh.copy()
    out[..., i0] = (x0 * c) - (x1 * s)
    out[..., i1] = (x0 * s) + (x1 * c)
    return out.reshape(x.shape)


# --- attention -------------------------------------------------------------------------------


def kv_write(cache: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Write ``rows[t]`` into ``cache[positions[t]]`` IN PLACE and return the cache.

    Positions must be distinct and inside the cache (a GPU could write duplicates in any order).
    """
    check_rows("kv_write", cache, "cache")
    check_rows("kv_write", rows, "rows")
    if rows.shape[1] != cache.shape[1]:
        raise ValueError(f"kv_write: rows width {rows.shape[1]} != cache width {cache.shape[1]}")
    check_positions("kv_write", positions, rows.shape[0], cache.shape[0], "the cache's")
    if positions.size > 1 and np.unique(positions).size != positions.size:
        raise ValueError("kv_write: positions must be distinct within one write")
    cache[positions] = rows
    return cache


def check_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    *,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    scale: float,
) -> None:
    """ValueError unless ATTENTION's operands, head counts, scale and positions are valid."""
    check_rows("attention", q, "q")
    check_rows("attention", k_cache, "k_cache")
    check_rows("attention", v_cache, "v_cache")
    if n_head_kv < 1 or n_head % n_head_kv:
        raise ValueError(f"attention: n_head {n_head} must be a multiple of n_head_kv {n_head_kv}")
    if q.shape[1] != n_head * head_dim:
        raise ValueError(f"attention: q width {q.shape[1]} != n_head * head_dim")
    kv_width = n_head_kv * head_dim
    if k_cache.shape[1] != kv_width or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"attention: caches must both be (n_ctx, {kv_width}), "
            f"got {list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    if float(F32(scale)) != scale:
        raise ValueError(f"attention: scale must be exact in float32, got {scale!r}")
    check_positions("attention", positions, q.shape[0], k_cache.shape[0], "the caches'")


def attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    *,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    scale: float,
) -> np.ndarray:
    """Causal softmax attention of each token over cache rows 0..positions[t] (GQA).

    Two passes per (token, head): scores s_j = fl(tree_sum_d(fl(q_d k_jd)) * scale), m = max s_j,
    e_j = exp(fl(s_j - m)); numerator and denominator are tree sums over CHUNK-slot chunks
    aligned at position 0 (slots past the position are +0.0), chunk sums folded left to right;
    out = fl(num / den). Rows are computed independently (batch invariant).

    How the code maps onto those steps: tokens are sorted by position and cut into blocks whose
    positions lie in one chunk c, so chunks 0..c-1 are whole for all of them and only chunk c
    needs per-token masking; ``_lay_out_kv`` copies cache rows 0..max(positions) once per call
    (head dim first for the score tree, values with a column of ones that turns the numerator's
    tree into the denominator's too); ``_attention_block`` then runs the contract's steps in
    order, on all (token, head) rows of a block side by side. No row's operations depend on
    which other rows share its block, so every order and grouping gives the same bits.
    """
    check_attention(
        q,
        k_cache,
        v_cache,
        positions,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        scale=scale,
    )
    out = np.empty_like(q)  # (n_tokens, n_head * head_dim)
    n_tok = q.shape[0]
    if n_tok == 0:
        return out
    g_all, d = n_head_kv, head_dim
    rep = n_head // n_head_kv  # query heads per kv head: head h reads kv head h // rep
    q4 = q.reshape(n_tok, g_all, rep, d)
    out4 = out.reshape(n_tok, g_all, rep, d)
    n_keys = int(positions.max()) + 1  # cache rows 0..n_keys-1 are read, no others
    # tokens in position order, cut into blocks whose positions share one chunk, each small
    # enough that one chunk's products of all its rows stay within the tile
    blocks = _token_blocks(positions, max(1, _tile_bytes() // (n_head * CHUNK * (d + 1) * 4)))
    # kv heads laid out together (the laid-out keys and values stay within the budget)
    per_head = _n_slots(n_keys) * (next_pow2(d) + d + 1) * 4
    g_step = max(1, min(g_all, _ATTENTION_TEMP_BYTES // per_head))
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for g0 in range(0, g_all, g_step):
            g1 = min(g0 + g_step, g_all)
            keys, values = _lay_out_kv(k_cache, v_cache, n_keys, g0, g1, d)
            for block in blocks:
                qb, pos = q4[block, g0:g1], positions[block]
                out4[block, g0:g1] = _attention_block(qb, keys, values, n_keys, pos, F32(scale))
    return out


def _tile_bytes() -> int:
    """Bytes of products attention forms at once (never above the memory budget)."""
    return min(_ATTENTION_TILE_BYTES, _ATTENTION_TEMP_BYTES)


def _n_slots(n_keys: int) -> int:
    """Slots laid out for rows 0..n_keys-1: whole chunks, then the last chunk's rows padded to
    a power of two (a tree over 256 slots whose slots >= w are +0.0 needs only w of them)."""
    full = (n_keys - 1) // CHUNK * CHUNK
    return full + next_pow2(n_keys - full)


def _lay_out_kv(
    k_cache: np.ndarray, v_cache: np.ndarray, n_keys: int, g0: int, g1: int, d: int
) -> tuple[np.ndarray, np.ndarray]:
    """Cache rows 0..n_keys-1 of kv heads g0..g1-1, laid out for ``_attention_block``.

    keys: (dw, g, n_slots), dw = next_pow2(d), head dim first so that the score tree's levels
    add whole contiguous slabs; values: (n_slots, g, d + 1) with an extra column of 1.0, so the
    numerator's tree also computes the denominator (fl(e * 1.0) = e bit for bit, so that
    column's chunk sums are the contract's D_c). Padding slots and dims are +0.0.
    """
    g, dw, n_slots = g1 - g0, next_pow2(d), _n_slots(n_keys)
    k = k_cache[:n_keys, g0 * d : g1 * d].reshape(n_keys, g, d)
    v = v_cache[:n_keys, g0 * d : g1 * d].reshape(n_keys, g, d)
    keys = np.zeros((dw, g, n_slots), dtype=F32)
    keys[:d, :, :n_keys] = k.transpose(2, 1, 0)
    values = np.zeros((n_slots, g, d + 1), dtype=F32)
    values[:n_keys, :, :d] = v
    values[:n_keys, :, d] = 1.0
    return keys, values


def _token_blocks(positions: np.ndarray, step: int) -> list[np.ndarray]:
    """Token indices in position order, cut into blocks of <= step tokens in one chunk."""
    if positions.size == 1:
        return [np.zeros(1, dtype=np.intp)]
    order = np.argsort(positions, kind="stable")
    cuts = np.flatnonzero(np.diff(positions[order] // CHUNK)) + 1
    return [
        group[i : i + step] for group in np.split(order, cuts) for i in range(0, group.size, step)
    ]


def _attention_block(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    n_keys: int,
    pos: np.ndarray,
    scale: np.float32,
) -> np.ndarray:
    """The contract for tokens ``pos`` (ascending, all in chunk c) and a run of kv heads.

    ``q`` is (tb, g, rep, d), ``keys``/``values`` come from ``_lay_out_kv`` (cache rows
    0..n_keys-1); returns (tb, g, rep, d). Rows r = (token, head) are independent:
    the arrays below only put many rows' identical operation sequences side by side.
    Chunks 0..c-1 are whole for every token. Chunk c is reduced over its first
    w = next_pow2(slots any token here needs) slots: the 256-slot tree whose slots >= w are
    +0.0 is the w-slot tree followed by one fl(x + 0.0) (further +0.0 adds change nothing),
    so slots past w are never formed. Inside those w, slots past a token's own position are
    +0.0 in both sums (and -inf in the scores, so they never win the max), as in the contract.
    """
    tb, g, rep, d = q.shape
    r = tb * rep
    dw = keys.shape[0]
    c = int(pos[0]) // CHUNK
    n_full = c * CHUNK  # slots of chunks 0..c-1
    w = next_pow2(int(pos[-1]) - n_full + 1)
    need = n_full + w  # slots formed for this block

    # pass 1, scores: s = fl(tree_sum_d(fl(q_d * k_d)) * scale), rows (g, token, head)
    qt = q.transpose(3, 1, 0, 2)  # (d, g, tb, rep)
    if dw != d:  # head dims padded to a power of two with +0.0 (the keys' are +0.0 too)
        qt = np.concatenate([qt, np.zeros((dw - d, g, tb, rep), dtype=F32)])
    qt = qt.reshape(dw, g, r, 1)
    s = np.empty((g, r, need), dtype=F32)
    piece = max(1, _tile_bytes() // (dw * g * r * 4))  # slots per score tile
    for a in range(0, need, piece):
        b = min(a + piece, need)
        prod = qt * keys[:, :, None, a:b]  # (dw, g, r, b - a): fl(q_d * k_d)
        np.multiply(tree_sum_leading(prod), scale, out=s[..., a:b])

    # slot j holds cache row j; token t sees slots 0..pos[t], the rest of its slots are hidden
    hidden = [(t, int(p) + 1) for t, p in enumerate(pos) if p + 1 < need]
    s4 = s.reshape(g, tb, rep, need)
    for t, first in hidden:
        s4[:, t, :, first:] = -np.inf  # never the max
    m = s.max(axis=-1, keepdims=True)  # exact in any order
    s -= m  # fl(s - m)
    for t, first in hidden:
        s4[:, t, :, first:] = 0.0  # any finite value: these exps are replaced by +0.0 below
    e = exp(s)  # (g, r, need)
    e4 = e.reshape(g, tb, rep, need)
    for t, first in hidden:
        e4[:, t, :, first:] = 0.0

    # pass 2: per chunk, P = fl(e * v) (and fl(e * 1.0) = e in the extra column) summed by
    # tree_sum over its slots; chunk sums folded left to right: acc = fl(acc + N_c)
    acc = None
    step = max(1, _tile_bytes() // (CHUNK * g * r * (d + 1) * 4))  # chunks per tile
    for c0 in range(0, c, step):
        c1 = min(c0 + step, c)
        part = slice(c0 * CHUNK, c1 * CHUNK)
        prod = e[..., part].transpose(2, 0, 1)[..., None] * values[part, :, None, :]
        sums = tree_sum_leading(prod.reshape(c1 - c0, CHUNK, -1).transpose(1, 0, 2))
        for i in range(c1 - c0):  # (chunks, g*r*(d+1))
            acc = sums[i].copy() if acc is None else np.add(acc, sums[i], out=acc)
    prod = e[..., n_full:].transpose(2, 0, 1)[..., None] * values[n_full:need, :, None, :]
    prod5 = prod.reshape(w, g, tb, rep, d + 1)
    for t, first in hidden:
        # hidden slots are +0.0; where they hold padding (rows >= n_keys) v = +0.0 and
        # e = +0.0 already give fl(0 * 0) = +0.0, but a real row's v may be -0.0, inf or NaN
        prod5[first - n_full : n_keys - n_full, :, t] = 0.0
    last = tree_sum_leading(prod.reshape(w, -1))  # (g*r*(d+1),)
    if w < CHUNK:
        last += F32(0)  # the rest of the 256-slot tree: +0.0 slots (a -0.0 sum becomes +0.0)
    acc = last if acc is None else np.add(acc, last, out=acc)
    acc = acc.reshape(g, tb, rep, d + 1)
    out = acc[..., :d] / acc[..., d:]  # fl(num / den)
    return out.transpose(1, 0, 2, 3)


# --- reductions ------------------------------------------------------------------------------


def argmax(x: np.ndarray) -> np.ndarray:
    """Per row, the int32 index of the maximum: the first on ties; NaN beats every number
    (the first NaN wins), as numpy's argmax does."""
    check_rows("argmax", x)
    if x.shape[1] == 0:
        raise ValueError("argmax: rows must have at least one element")
    return np.argmax(x, axis=1).astype(np.int32)
