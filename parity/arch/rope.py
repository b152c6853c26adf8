"""The host-side RoPE tables: computed once in float64, rounded to float32 once, shared by all
backends. Sharing the tables (not recomputing cos/sin on each device) is what makes ROPE exact
across backends (docs/numerics.md, "rope_tables")."""

from __future__ import annotations

import numpy as np


def rope_tables(n_ctx: int, n_rot: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each float32 ``(n_ctx, n_rot // 2)``: row p, column i holds the cos / sin
    of ``p * base ** (-(2 i) / n_rot)``, computed in float64 and rounded to float32 once."""
    if n_ctx < 1 or n_rot < 2 or n_rot % 2:
        raise ValueError(
            f"rope_tables needs n_ctx >= 1 and an even n_rot >= 2, got {n_ctx}, {n_rot}"
        )
    if not base > 0:
        raise ValueError(f"rope_tables needs a positive base (rope_freq_base), got {base}")
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = np.float64(base) ** (-(2.0 * i) / n_rot)  # (n_rot // 2,)
    angle = np.arange(n_ctx, dtype=np.float64)[:, None] * inv_freq[None, :]  # (n_ctx, n_rot // 2)
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
