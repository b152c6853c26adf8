"""GraphParams: everything about one step that changes the graph's structure.

Params are part of a graph's identity: graphs are built from (model spec, params) and cached by
them. Values that change every step without changing the structure (token ids, positions) are
graph inputs, never params, so one graph (and one captured CUDA graph) serves every decode step.
"""

from __future__ import annotations

import attrs

OUTPUTS = ("logits", "argmax")


def _positive(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attr.name} must be >= 1, got {value}")


@attrs.frozen
class GraphParams:
    n_tokens: int = attrs.field(validator=_positive)  # tokens computed in this step
    n_ctx: int = attrs.field(validator=_positive)  # KV cache capacity (positions 0..n_ctx-1)
    n_out: int = attrs.field(default=1, validator=_positive)  # last rows that produce output
    output: str = attrs.field(default="logits", validator=attrs.validators.in_(OUTPUTS))
    # which sequence's KV cache the step reads and writes (a server's slots): slot 0's caches
    # are named cache.k.L / cache.v.L, slot s's slot{s}.cache.k.L
    slot: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # > 0: every position the step computes is below this (a shallow decode step's promise,
    # which the session keeps by switching graphs as the sequence grows), so a backend may size
    # its attention launches to it rather than to n_ctx; 0: any position up to n_ctx - 1
    reach: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @property
    def cache_prefix(self) -> str:
        return f"slot{self.slot}." if self.slot else ""

    def __attrs_post_init__(self) -> None:
        if self.n_out > self.n_tokens:
            raise ValueError(f"n_out ({self.n_out}) exceeds n_tokens ({self.n_tokens})")
        if self.n_tokens > self.n_ctx:
            raise ValueError(f"n_tokens ({self.n_tokens}) exceeds the context n_ctx ({self.n_ctx})")
        if self.reach and not self.n_tokens <= self.reach <= self.n_ctx:
            raise ValueError(f"reach ({self.reach}) must be 0 or in n_tokens..n_ctx")
