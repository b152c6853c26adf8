"""Every op of the numeric contract in jax, transcribing parity.backends.cpu.ops line by line.

Values are carriers (``binary32``: each fl() of the contract is one ``add``/``sub``/``mul``/
``div``/``sqrt``), except the KV caches, which stay float32 arrays (``kv_write`` writes rows
into them; ``attention`` widens the rows it reads), and ids, positions and ARGMAX results,
which are int32, and quantized activations (Q8A), which are a ``quant.Q8`` of int8 quants and
carrier scales. Weight operands of the matrix products and GET_ROWS arrive as a
``DeviceWeight``; every other weight (norms, biases, RoPE tables) as its carrier array.
Position and id values are valid: the host checks them before a graph runs (docs/numerics.md).

The fused ops (``ir.FUSED``) are their compositions written out: the same kernels in a row,
every rounding kept, so they give the unfused oracle's bits by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from parity import numerics
from parity.core.dtypes import DType
from parity.core.ir import AttentionArg, Op, RopeArg, SliceArg
from parity_jax import quant
from parity_jax.binary32 import add, div, exp, mul, narrow, sqrt, sub, tree_sum, widen

CHUNK = 256  # attention reduces positions in chunks of this many slots, aligned at position 0


@jax.tree_util.register_pytree_node_class
@attrs.frozen(eq=False)
class DeviceWeight:
    """A weight operand inside a traced program: its type (static) and its device form
    (``quant``), a pytree so kernels can be jitted on their own."""

    dtype: DType
    arrays: quant.Weight

    def tree_flatten(self) -> tuple[tuple[quant.Weight], DType]:
        return (self.arrays,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype: DType, children: tuple[quant.Weight]) -> DeviceWeight:
        return cls(dtype, children[0])


def get_rows(w: DeviceWeight, ids: jax.Array, arg: None) -> jax.Array:
    return quant.get_rows(w.arrays, w.dtype, ids)


def slice_rows(x: jax.Array | quant.Q8, arg: SliceArg) -> jax.Array | quant.Q8:
    rows = slice(arg.start, arg.start + arg.count)
    return quant.Q8(*(a[rows] for a in x)) if isinstance(x, quant.Q8) else x[rows]


def reshape(x: jax.Array, arg: tuple[int, int]) -> jax.Array:
    return x.reshape(arg)


def add_op(a: jax.Array, b: jax.Array, arg: None) -> jax.Array:
    return add(a, b)  # b is a's shape or a row vector


def mul_op(a: jax.Array, b: jax.Array, arg: None) -> jax.Array:
    return mul(a, b)


def silu(x: jax.Array, arg: None = None) -> jax.Array:
    """fl(x / fl(1 + exp(-x)))."""
    return div(x, add(1.0, exp(-x)))


def swiglu(gate: jax.Array, up: jax.Array, arg: None) -> jax.Array:
    return mul(silu(gate), up)


GELU_A = float(numerics.GELU_A)
GELU_S = float(numerics.GELU_S)


def gelu(x: jax.Array, arg: None = None) -> jax.Array:
    """parity.numerics.gelu: u = fl(S * fl(x * fl(1 + fl(A * fl(x * x))))), v = fl(u * -2);
    v > 0: e = exp(-v), fl(fl(x * e) / fl(1 + e)); else fl(x / fl(1 + exp(v)))."""
    u = mul(GELU_S, mul(x, add(1.0, mul(GELU_A, mul(x, x)))))
    v = mul(u, -2.0)
    right = v > 0
    e = exp(jnp.where(right, -v, v))
    return div(jnp.where(right, mul(x, e), x), add(1.0, e))


def geglu(gate: jax.Array, up: jax.Array, arg: None) -> jax.Array:
    return mul(gelu(gate), up)


def scale(x: jax.Array, arg: float) -> jax.Array:
    return mul(x, arg)


def rms_norm(x: jax.Array, arg: float) -> jax.Array:
    """x * fl(1 / fl(sqrt(fl(fl(tree_sum(x * x) / width) + eps)))), per row."""
    ss = tree_sum(mul(x, x), axis=1)  # (n_tokens,)
    mean = div(ss, float(x.shape[1]))
    scale = div(1.0, sqrt(add(mean, arg)))
    return mul(x, scale[:, None])


def matmul(
    x: jax.Array | quant.Q8, w: DeviceWeight, bias: jax.Array | None = None, *, arg: None = None
) -> jax.Array:
    """x @ w.T (+ bias); x is a carrier, or already quantized (``quantize``) for a quantized w."""
    y = quant.matmul(x, w.arrays, w.dtype)  # (n_tokens, n_out)
    return y if bias is None else add(y, bias)


def quantize(x: jax.Array, arg: None) -> quant.Q8:
    """QUANTIZE: the activation quantization MATMUL applies to x, on its own."""
    return quant.quantize_activations(x)


def rope(
    x: jax.Array, positions: jax.Array, cos: jax.Array, sin: jax.Array, arg: RopeArg
) -> jax.Array:
    """x0' = fl(fl(x0 c) - fl(x1 s)), x1' = fl(fl(x0 s) + fl(x1 c)) on the first n_rot dims of
    each head; pairs (2i, 2i+1) in mode "normal", (i, i + n_rot/2) in mode "neox"."""
    t, n_rot, half = x.shape[0], arg.n_rot, arg.n_rot // 2
    xh = x.reshape(t, arg.n_head, arg.head_dim)  # (n_tokens, n_head, head_dim)
    c = cos[positions][:, None, :]  # (n_tokens, 1, n_rot // 2)
    s = sin[positions][:, None, :]
    if arg.mode == "normal":
        x0, x1 = xh[..., 0:n_rot:2], xh[..., 1:n_rot:2]
    else:
        x0, x1 = xh[..., :half], xh[..., half:n_rot]
    y0 = sub(mul(x0, c), mul(x1, s))
    y1 = add(mul(x0, s), mul(x1, c))
    if arg.mode == "normal":
        rotated = jnp.stack([y0, y1], axis=-1).reshape(t, arg.n_head, n_rot)
    else:
        rotated = jnp.concatenate([y0, y1], axis=-1)
    return jnp.concatenate([rotated, xh[..., n_rot:]], axis=-1).reshape(x.shape)


def kv_write(cache: jax.Array, rows: jax.Array, positions: jax.Array, arg: None) -> jax.Array:
    """The float32 cache with rows[t] at positions[t] (distinct, in range)."""
    return cache.at[positions].set(narrow(rows), unique_indices=True)


def attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, arg: AttentionArg
) -> jax.Array:
    """Causal attention of each token over cache rows lo..positions[t] (lo = 0, or the
    sliding window's first position), by the contract: scores and their max in a first pass,
    then 256-slot chunk trees folded left to right from lo's chunk."""
    pad = -k_cache.shape[0] % CHUNK  # whole chunks, so every chunk is one dynamic slice
    if pad:
        k_cache, v_cache = (jnp.pad(c, ((0, pad), (0, 0))) for c in (k_cache, v_cache))
    # per token: one chunk's products, and the scores of every slot
    per_token = arg.n_head * max(CHUNK * arg.head_dim, k_cache.shape[0])
    block = max(1, quant.TEMP_ELEMENTS // per_token)

    def run(qb: jax.Array, pb: jax.Array) -> jax.Array:
        return _attention_block(qb, pb, k_cache, v_cache, arg)

    return quant.map_rows(run, q, positions, block=block)


def _attention_block(
    q: jax.Array, pos: jax.Array, k_cache: jax.Array, v_cache: jax.Array, arg: AttentionArg
) -> jax.Array:
    """Attention for tokens ``pos`` (any order) over whole-chunk float32 caches."""
    t, g, d = q.shape[0], arg.n_head_kv, arg.head_dim
    rep = arg.n_head // g  # query heads per kv head: head h reads kv head h // rep
    qd = q.reshape(t, g, rep, d).transpose(3, 0, 1, 2)[..., None]  # (d, t, g, rep, 1)
    n_chunks = pos // CHUNK + 1  # chunks holding a position <= p, per token
    stop = jnp.max(n_chunks)
    first = jnp.maximum(pos - arg.window + 1, 0) if arg.window else jnp.zeros_like(pos)
    c0 = (first // CHUNK)[:, None, None]  # the chunk of the first position read, per token

    def rows(cache: jax.Array, c: jax.Array) -> jax.Array:  # (CHUNK, g, d)
        return widen(lax.dynamic_slice_in_dim(cache, c * CHUNK, CHUNK)).reshape(CHUNK, g, d)

    def seen(c: jax.Array) -> jax.Array:  # (t, 1, 1, CHUNK): slot j holds row j; first..p seen
        j = c * CHUNK + jnp.arange(CHUNK)[None, :]
        return ((j <= pos[:, None]) & (j >= first[:, None]))[:, None, None, :]

    def pass_scores(c: jax.Array, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Chunk c's scores fl(tree_sum_d(fl(q_d k_d)) * scale), kept, and the running max."""
        scores, m = acc
        k = rows(k_cache, c).transpose(2, 1, 0)[:, None, :, None, :]  # (d, 1, g, 1, CHUNK)
        s = mul(tree_sum(mul(qd, k), axis=0), arg.scale)  # (t, g, rep, CHUNK)
        chunk = quant.nan_max(jnp.where(seen(c), s, -jnp.inf), axis=-1)  # exact; NaN wins
        m = jnp.where(jnp.isnan(m) | jnp.isnan(chunk), jnp.nan, jnp.maximum(m, chunk))
        return lax.dynamic_update_slice_in_dim(scores, s, c * CHUNK, axis=3), m

    slots = k_cache.shape[0]
    start = jnp.zeros((t, g, rep, slots)), jnp.full((t, g, rep), -jnp.inf)
    scores, m = lax.fori_loop(0, stop, pass_scores, start)

    def pass_sums(c: jax.Array, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Chunk c's numerator and denominator trees, folded left to right into acc."""
        s = lax.dynamic_slice_in_dim(scores, c * CHUNK, CHUNK, axis=3)
        e = jnp.where(seen(c), exp(sub(s, m[..., None])), 0.0)  # unseen slots are +0.0 literally
        e = e.transpose(3, 0, 1, 2)  # (CHUNK, t, g, rep)
        v = rows(v_cache, c)[:, None, :, None, :]  # (CHUNK, 1, g, 1, d)
        p = jnp.where(seen(c).transpose(3, 0, 1, 2)[..., None], mul(e[..., None], v), 0.0)
        num_c, den_c = tree_sum(p, axis=0), tree_sum(e, axis=0)  # 256 leaves each
        live = (c < n_chunks)[:, None, None] & (c >= c0)  # fold exactly this token's chunks
        num, den = acc
        start = c == c0  # the first chunk this token folds
        num = jnp.where(live[..., None], jnp.where(start[..., None], num_c, add(num, num_c)), num)
        den = jnp.where(live, jnp.where(start, den_c, add(den, den_c)), den)
        return num, den

    zeros = jnp.zeros((t, g, rep, d)), jnp.zeros((t, g, rep))
    num, den = lax.fori_loop(0, stop, pass_sums, zeros)
    return div(num, den[..., None]).reshape(t, arg.n_head * d)  # fl(num / den)


# --- fused ops: exact compositions of the kernels above ------------------------------------


def rms_norm_mul(x: jax.Array, w: jax.Array, arg: float) -> jax.Array:
    """RMS_NORM_MUL: MUL(RMS_NORM(x, eps), w), both roundings kept."""
    return mul(rms_norm(x, arg), w)


def matmul_add(x: jax.Array | quant.Q8, w: DeviceWeight, *rest: jax.Array, arg: None) -> jax.Array:
    """MATMUL_ADD (x, w[, bias], residual): ADD(residual, MATMUL(x, w[, bias]))."""
    *bias, residual = rest
    return add(residual, matmul(x, w, *bias))


def matmul_swiglu(
    x: jax.Array | quant.Q8, w_gate: DeviceWeight, w_up: DeviceWeight, arg: None
) -> jax.Array:
    """MATMUL_SWIGLU: SWIGLU(MATMUL(x, w_gate), MATMUL(x, w_up)); an F32 x read by two
    quantized weights is quantized once (each product would quantize it to the same bits)."""
    quantized = "qw" in w_gate.arrays and "qw" in w_up.arrays
    if quantized and not isinstance(x, quant.Q8):
        x = quant.quantize_activations(x)
    return swiglu(matmul(x, w_gate), matmul(x, w_up), None)


def argmax(x: jax.Array, arg: None) -> jax.Array:
    """First index of the row maximum; NaN beats every number (numpy's argmax)."""
    return jnp.argmax(x, axis=1).astype(jnp.int32)


# op -> f(*sources, arg=node.arg)
KERNELS: dict[Op, Callable[..., jax.Array]] = {
    Op.GET_ROWS: get_rows,
    Op.SLICE_ROWS: slice_rows,
    Op.RESHAPE: reshape,
    Op.ADD: add_op,
    Op.MUL: mul_op,
    Op.SILU: silu,
    Op.SWIGLU: swiglu,
    Op.GELU: gelu,
    Op.GEGLU: geglu,
    Op.SCALE: scale,
    Op.RMS_NORM: rms_norm,
    Op.MATMUL: matmul,
    Op.QUANTIZE: quantize,
    Op.ROPE: rope,
    Op.KV_WRITE: kv_write,
    Op.ATTENTION: attention,
    Op.ARGMAX: argmax,
    Op.RMS_NORM_MUL: rms_norm_mul,
    Op.MATMUL_ADD: matmul_add,
    Op.MATMUL_SWIGLU: matmul_swiglu,
}
