"""A fast numpy kernel for ATTENTION, bit for bit the definition in ``ops.attention``.

``ops.attention`` is the contract's loop (docs/numerics.md, "ATTENTION"): one token at a time,
pass 1 forms the scores, their max and the exps, pass 2 tree-sums each 256-slot chunk and folds
the chunk sums left to right. ``attention_tiled`` runs the same operations on many (token, head)
rows side by side.

How the code maps onto those steps: tokens are sorted by position and cut into blocks whose
positions lie in one chunk c, so chunks 0..c-1 are whole for all of them and only chunk c
needs per-token masking; ``_lay_out_kv`` copies cache rows 0..max(positions) once per call
(head dim first for the score tree, values with a column of ones that turns the numerator's
tree into the denominator's too); ``_attention_block`` then runs the contract's steps in
order, on all (token, head) rows of a block side by side. No row's operations depend on
which other rows share its block, so every order and grouping gives the same bits.

The tiling cannot change a bit either: the products are formed a tile at a time (at most
``_ATTENTION_TILE_BYTES``) and kv heads are laid out in runs (bounded by
``_ATTENTION_TEMP_BYTES``), but each row's operations, and the pairs each tree level adds, are
the contract's whatever the tile and run sizes.
"""

from __future__ import annotations

import numpy as np

from parity.backends.cpu.ops import CHUNK, attention, check_attention
from parity.numerics import F32, exp, next_pow2, tree_sum_leading

_ATTENTION_TEMP_BYTES = 64 << 20  # token-chunk budget for attention's largest temporary
_ATTENTION_TILE_BYTES = 4 << 20  # products formed at once (a few L2 caches' worth)


def attention_tiled(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    *,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    scale: float,
    window: int = 0,
) -> np.ndarray:
    """``ops.attention`` bit for bit (same arguments, same checks), tiled and vectorised; a
    sliding window runs the definition itself (the compiled kernels are the fast path)."""
    args = dict(n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, scale=scale)
    if window:
        return attention(q, k_cache, v_cache, positions, **args, window=window)
    check_attention(q, k_cache, v_cache, positions, **args)
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
