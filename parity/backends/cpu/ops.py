"""The living definition of every op: one plain numpy function per op, named like the op.

Each function is the contract of docs/numerics.md written in numpy. float32 numpy arithmetic is
one correctly rounded operation per ufunc call and never fuses, so one expression per line is
one fl() of the contract. Reductions go through ``tree_sum`` (the fixed tree), ``exp`` is the
project's own, and max/argmax are exact in any order. Activations are float32
``(n_tokens, width)``; ids and positions are int32 ``(n_tokens,)``.
"""

from __future__ import annotations

import numpy as np

from parity import numerics, quant
from parity.numerics import F32, exp, tree_sum, tree_sum_leading
from parity.quant import PreparedWeight, Q8Activations

CHUNK = 256  # attention reduces positions in chunks of this many slots, aligned at position 0

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


def reshape(x: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """``x``'s values in row-major order as a new ``shape`` array (a copy, bit for bit)."""
    check_rows("reshape", x)
    if len(shape) != 2 or shape[0] * shape[1] != x.size:
        raise ValueError(f"reshape: {list(x.shape)} cannot be viewed as {list(shape)}")
    return x.reshape(shape).copy()


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


def check_glu(op: str, gate: np.ndarray, up: np.ndarray) -> None:
    """ValueError unless gate and up are float32 (n_tokens, width) arrays of one shape."""
    check_rows(op, gate, "gate")
    check_rows(op, up, "up")
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate {list(gate.shape)} and up {list(up.shape)} must match")


def check_swiglu(gate: np.ndarray, up: np.ndarray) -> None:
    check_glu("swiglu", gate, up)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """fl(silu(gate) * up), with gate and up of one shape."""
    check_swiglu(gate, up)
    return silu(gate) * up


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh form as the contract writes it (``parity.numerics.gelu``)."""
    check_rows("gelu", x)
    return numerics.gelu(x)


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """fl(gelu(gate) * up), with gate and up of one shape."""
    check_glu("geglu", gate, up)
    return numerics.gelu(gate) * up


def scale(x: np.ndarray, c: float) -> np.ndarray:
    """fl(x * c), c a float32 constant."""
    check_rows("scale", x)
    if not (np.isfinite(c) and float(np.float32(c)) == c):
        raise ValueError(f"scale: the constant {c!r} is not a finite float32 value")
    return x * F32(c)


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


def matmul(
    x: np.ndarray | Q8Activations, weight: PreparedWeight, bias: np.ndarray | None = None
) -> np.ndarray:
    """``x @ weight.T`` by parity.quant's contract, then ``add(y, bias)`` if a bias is given.
    ``x`` may come quantized already (``quantize``), for a quantized weight."""
    y = quant.matmul(x, weight)  # (n_tokens, n_out)
    if bias is not None:
        y = add(y, bias)
    return y


def quantize(x: np.ndarray) -> Q8Activations:
    """The activation quantization MATMUL applies to x (docs/numerics.md), on its own: for
    several matrix products that read one x."""
    check_rows("quantize", x)
    return quant.quantize_activations(x)


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
    window: int = 0,
) -> None:
    """ValueError unless ATTENTION's operands, head counts, scale, window and positions are
    valid."""
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
    if not isinstance(window, int | np.integer) or window < 0:
        raise ValueError(f"attention: window must be an int >= 0, got {window!r}")
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
    window: int = 0,
) -> np.ndarray:
    """Causal softmax attention of each token over cache rows lo..positions[t] (GQA), where
    lo = 0, or lo = max(0, p - window + 1) with a sliding ``window`` > 0.

    The contract's loop, one token at a time. For token t at position p, query head h reads kv
    head h // (n_head / n_head_kv), and:

    - pass 1: scores s_j = fl(tree_sum_d(fl(q_d k_jd)) * scale) for j = lo..p, m = max s_j,
      e_j = exp(fl(s_j - m));
    - pass 2: for each CHUNK-slot chunk c = lo // CHUNK .. p // CHUNK (aligned at position 0),
      D_c is the tree sum of e over the chunk's CHUNK slots and N_c that of P_j = fl(e_j v_jd),
      slots j < lo and j > p being +0.0 (those cache rows are never read: they may hold
      anything); the chunk sums are folded left to right, den = fl(den + D_c),
      num = fl(num + N_c); out = fl(num / den).

    The heads of a token, and the positions of one chunk, sit side by side in the arrays: each
    element goes through its own (token, head)'s operations, so that changes none of them. A
    token reads only its own q row, its position and cache rows lo..p (batch invariant).
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
        window=window,
    )
    d = head_dim
    kv_head = np.arange(n_head) // (n_head // n_head_kv)  # the kv head each query head reads
    out = np.empty_like(q)  # (n_tokens, n_head * head_dim)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for t, p in enumerate(positions.tolist()):
            first = max(0, p - window + 1) if window else 0  # cache rows first..p are read
            n = p + 1 - first
            qt = q[t].reshape(n_head, d)
            k = k_cache[first : p + 1].reshape(n, n_head_kv, d)[:, kv_head]  # (n, n_head, d)
            v = v_cache[first : p + 1].reshape(n, n_head_kv, d)[:, kv_head]

            # pass 1: scores, their max, the exps
            prod = qt * k  # fl(q_d * k_jd), (n, n_head, d)
            s = tree_sum(prod, axis=-1) * F32(scale)  # (n, n_head)
            m = s.max(axis=0)  # exact in any order
            e = exp(s - m)  # exp(fl(s_j - m))

            # pass 2: tree sums over each chunk's CHUNK slots, folded left to right
            for c in range(first // CHUNK, p // CHUNK + 1):
                lo = max(c * CHUNK, first)  # the chunk's positions first..p: lo..hi-1
                hi = min((c + 1) * CHUNK, p + 1)
                at = lo - c * CHUNK  # their slots; the others stay +0.0
                e_c = np.zeros((CHUNK, n_head), dtype=F32)
                e_c[at : at + hi - lo] = e[lo - first : hi - first]
                pv_c = np.zeros((CHUNK, n_head, d), dtype=F32)
                pv_c[at : at + hi - lo] = (  # P_j = fl(e_j * v_jd)
                    e[lo - first : hi - first, :, None] * v[lo - first : hi - first]
                )
                den_c = tree_sum_leading(e_c)  # D_c, (n_head,)
                num_c = tree_sum_leading(pv_c)  # N_c, (n_head, d)
                if c == first // CHUNK:
                    den, num = den_c, num_c
                else:
                    den = den + den_c
                    num = num + num_c
            out[t] = (num / den[:, None]).reshape(-1)  # fl(num / den)
    return out


# --- fused ops: exact compositions of the ops above ----------------------------------------


def rms_norm_mul(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """MUL(RMS_NORM(x, eps), w): the norm and its weight, both roundings kept."""
    return mul(rms_norm(x, eps), w)


def matmul_add(
    x: np.ndarray | Q8Activations,
    weight: PreparedWeight,
    residual: np.ndarray,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """ADD(residual, MATMUL(x, weight[, bias])): a projection added to the residual stream."""
    return add(residual, matmul(x, weight, bias))


def matmul_swiglu(
    x: np.ndarray | Q8Activations, w_gate: PreparedWeight, w_up: PreparedWeight
) -> np.ndarray:
    """SWIGLU(MATMUL(x, w_gate), MATMUL(x, w_up)): the FFN's gate and up projections."""
    return swiglu(matmul(x, w_gate), matmul(x, w_up))


# --- reductions ------------------------------------------------------------------------------


def argmax(x: np.ndarray) -> np.ndarray:
    """Per row, the int32 index of the maximum: the first on ties; NaN beats every number
    (the first NaN wins), as numpy's argmax does."""
    check_rows("argmax", x)
    if x.shape[1] == 0:
        raise ValueError("argmax: rows must have at least one element")
    return np.argmax(x, axis=1).astype(np.int32)
