"""ATTENTION, compiled: the contract's two passes for one (token, head) at a time
(docs/numerics.md, "ATTENTION"; ``ops.attention`` is the numpy definition).

For token t at position p and query head h (kv head g = h // (n_head / n_head_kv)):

    s[j]  = fl(TREE_d(fl(q[d] * k[j, d])) * scale)            j = lo..p
    m     = max_j s[j] (a NaN score makes m NaN, as numpy's max does)
    e[j]  = exp(fl(s[j] - m))
    per chunk c of 256 slots from lo's: D_c = TREE(e), N_c[d] = TREE(fl(e * v[., d])), slots
    < lo or > p = +0.0
    den, num = chunk sums folded left to right;  out[d] = fl(num[d] / den)

lo is 0, or p - window + 1 (at least 0) with a sliding window.

Scores are formed TILE positions at a time with the head dim as the leading axis, so each level
of the tree over d is one add of two rows of TILE positions: the same adds, in the same pairs.
The last chunk's tree is taken over its first w = next_pow2(slots <= p) slots, then one
fl(x + 0.0) when w < 256: the 256-slot tree whose slots from w on are +0.0 is exactly that
(``attention_tiled._attention_block`` says why), so slots past w are never formed.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from parity.backends.cpu.jit.compile import kernel
from parity.backends.cpu.jit.elementwise import exp32
from parity.backends.cpu.jit.reduce import next_pow2, tree_rows, tree_sum

F32 = np.float32
U64 = np.uint64
CHUNK = 256
TILE = 64
"""Positions whose scores are formed side by side (products of a tile fit in L1)."""
SUB = 32
"""Slots whose fl(e * v) are formed at once in pass 2 (an L1-sized run of the chunk tree)."""


@kernel()
def keys_by_dim(k: np.ndarray, n_keys: int, n_head_kv: int) -> np.ndarray:
    """Cache rows 0..n_keys-1 as (n_head_kv, next_pow2(d), n_keys): head dim first, padded with
    +0.0, so that the score tree of many positions adds whole rows."""
    d = k.shape[1] // n_head_kv
    kt = np.zeros((n_head_kv, next_pow2(d), n_keys), F32)
    for g in range(n_head_kv):
        for j in range(n_keys):
            for i in range(d):
                kt[g, i, j] = k[j, g * d + i]
    return kt


@kernel(inline=True)
def scale_row(
    dst: np.ndarray, at: int, src: np.ndarray, src_at: int, c: np.float32, n: int
) -> None:
    """dst[at + i] = fl(c * src[src_at + i]) for i < n (unsigned indices, as in
    ``reduce.tree_rows``)."""
    du, su = U64(at), U64(src_at)
    for i in range(n):
        iu = U64(i)
        dst[du + iu] = c * src[su + iu]


@kernel()
def attention_rows(
    q: np.ndarray,
    kt: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    n_head: int,
    scale: np.float32,
    window: int,
    out: np.ndarray,
    lo: int,
    hi: int,
) -> None:
    """(token, head) pairs r = lo..hi-1 (t = r // n_head, h = r % n_head); ``kt`` from
    ``keys_by_dim``; positions checked; ``window`` 0 (none) or the sliding window. Arrays are
    used flat, rows at computed offsets."""
    n_head_kv, dw, n_keys = kt.shape
    d = q.shape[1] // n_head
    rep = n_head // n_head_kv
    qf, ktf, vf, of = q.reshape(-1), kt.reshape(-1), v.reshape(-1), out.reshape(-1)
    width, v_width = q.shape[1], v.shape[1]
    e = np.empty((n_keys + CHUNK - 1) // CHUNK * CHUNK, F32)
    prod = np.empty(dw * TILE, F32)  # row i: fl(q_i * k_i) of TILE positions
    prod2 = np.empty_like(prod)
    ev = np.empty(SUB * d, F32)  # row j: fl(e_j * v_j) of SUB slots
    ev2 = np.empty_like(ev)
    ee = np.empty(SUB, F32)
    ee_tmp = np.empty(1, F32)
    part = np.empty(CHUNK // SUB * d, F32)  # tree values of each run of SUB slots
    part2 = np.empty_like(part)
    part_e = np.empty(CHUNK // SUB, F32)
    num = np.empty(d, F32)
    for r in range(lo, hi):
        t, h = r // n_head, r % n_head
        qo, g = t * width + h * d, h // rep
        p = positions[t]
        first = max(0, p - window + 1) if window > 0 else 0  # positions first..p are read
        # pass 1: scores (TILE positions side by side), their max (NaN propagates), exps
        for j0 in range(first, p + 1, TILE):
            nj = min(TILE, p + 1 - j0)
            for i in range(d):
                scale_row(prod, i * TILE, ktf, (g * dw + i) * n_keys + j0, qf[qo + i], nj)
            for i in range(d, dw):
                for j in range(nj):
                    prod[i * TILE + j] = F32(0)
            top = tree_rows(prod, prod2, dw, TILE, nj)  # the tree over d, TILE positions wide
            for j in range(nj):
                e[j0 + j] = top[j] * scale
        m = F32(-np.inf)
        nan = False
        for j in range(first, p + 1):
            if e[j] > m:
                m = e[j]
            if e[j] != e[j]:
                nan = True
        if nan:
            m = F32(np.nan)
        for j in range(first, p + 1):
            e[j] = exp32(e[j] - m)
        # pass 2: per chunk, trees over its slots (SUB slots at a time: levels 1..5 of a tree
        # only add within runs of 32); chunk sums folded left to right
        den = F32(0)
        vo = g * d
        c0 = first // CHUNK
        for c in range(c0, p // CHUNK + 1):
            j0 = c * CHUNK
            w = next_pow2(min(CHUNK, p + 1 - j0))  # slots of this chunk's tree that can be != 0
            runs = max(w // SUB, 1)
            for b in range(runs):
                jb, nb = j0 + b * SUB, min(w, SUB)  # slots jb .. jb + nb - 1
                for j in range(nb):
                    if first <= jb + j <= p:
                        ee[j] = e[jb + j]
                        scale_row(ev, j * d, vf, (jb + j) * v_width + vo, e[jb + j], d)
                    else:  # before the window or past the position: +0.0 slots
                        ee[j] = F32(0)
                        for i in range(d):
                            ev[j * d + i] = F32(0)
                top = tree_rows(ev, ev2, nb, d, d)  # the tree over these slots, all d at once
                for i in range(d):
                    part[b * d + i] = top[i]
                part_e[b] = tree_sum(ee, nb, ee_tmp)
            top = tree_rows(part, part2, runs, d, d)  # the levels above the runs of SUB slots
            dc = tree_sum(part_e, runs, ee_tmp)
            if w < CHUNK:  # the rest of the 256-slot tree: +0.0 slots
                dc = dc + F32(0)
                for i in range(d):
                    top[i] = top[i] + F32(0)
            if c == c0:
                den = dc
                for i in range(d):
                    num[i] = top[i]
            else:
                den = den + dc
                for i in range(d):
                    num[i] = num[i] + top[i]
        for i in range(d):
            of[qo + i] = num[i] / den


@kernel(parallel=True)
def attention_parallel(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    n_head: int,
    n_head_kv: int,
    scale: np.float32,
    window: int,
    out: np.ndarray,
    chunks: int,
) -> None:
    """``attention_rows`` over all (token, head) pairs, in ``chunks`` parallel ranges."""
    kt = keys_by_dim(k, positions.max() + 1, n_head_kv)
    n = q.shape[0] * n_head
    for c in prange(chunks):
        lo, hi = c * n // chunks, (c + 1) * n // chunks
        attention_rows(q, kt, v, positions, n_head, scale, window, out, lo, hi)
