"""Parity tiers: what a backend promises, per op, about agreeing with the cpu oracle.

A backend declares a manifest (``Backend.manifest``): op keys mapped to a tier. A tier is
``exact`` (bit for bit: every element's bits equal the oracle's, NaN positions equal) or a bound
on the distance from the oracle on the same inputs: ``ulp<=N`` (no element further than N
binary32 units in the last place, NaN positions equal), ``nmse<=X`` (normalized mean squared
error over the finite elements), or both joined by a comma (both must hold).

Keys, most specific first: ``OP:TYPE`` (an op on one weight type, e.g. ``MATMUL:Q4_K``; the type
of the node's WEIGHT source), ``OP`` (``MATMUL``), ``*`` (every other op). A manifest without
``*`` leaves unlisted ops exact. Examples::

    manifest = {"*": "exact"}                                   # the default
    manifest = {"*": "exact", "MATMUL": "nmse<=1e-5", "SILU": "ulp<=8"}

The conformance kit (``parity conformance``) and ``parity compare`` enforce what is declared, and
the scheduler reads it: a node whose tier is a bound computes in ``fast`` numerics, so under
``numerics = "exact"`` it is placed on an exact backend instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from parity.core.dtypes import DType
from parity.core.ir import Node, Op
from parity.errors import PluginError

if TYPE_CHECKING:
    from parity.core.compare import NodeDiff

ANY = "*"


@attrs.frozen
class Tier:
    """``exact`` (both bounds None) or a bound on the ULP distance and/or the NMSE."""

    max_ulp: float | None = None
    max_nmse: float | None = None

    @property
    def exact(self) -> bool:
        return self.max_ulp is None and self.max_nmse is None

    def __str__(self) -> str:
        if self.exact:
            return "exact"
        parts = []
        if self.max_ulp is not None:
            parts.append(f"ulp<={self.max_ulp:g}")
        if self.max_nmse is not None:
            parts.append(f"nmse<={self.max_nmse:g}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str | Tier) -> Tier:
        if isinstance(text, Tier):
            return text
        if not isinstance(text, str):
            raise ValueError(f"a tier is a string such as 'exact' or 'ulp<=2', not {text!r}")
        if text.strip() == "exact":
            return cls()
        bounds: dict[str, float] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition("<=")
            name = name.strip()
            if not sep or name not in ("ulp", "nmse") or name in bounds:
                raise ValueError(
                    f"bad tier {text!r}: write 'exact', 'ulp<=N', 'nmse<=X' or 'ulp<=N,nmse<=X'"
                )
            try:
                bound = float(value)
            except ValueError:
                bound = math.nan
            if not (bound >= 0 and math.isfinite(bound)):
                raise ValueError(f"bad tier {text!r}: {name} needs a finite bound >= 0")
            bounds[name] = bound
        return cls(bounds.get("ulp"), bounds.get("nmse"))

    def admits(self, diff: NodeDiff) -> bool:
        """Does a node's difference from the oracle stay within this tier?"""
        if diff.identical:
            return True
        if self.exact:
            return False
        if self.max_ulp is not None and not diff.max_ulp <= self.max_ulp:
            return False
        if self.max_nmse is not None and not diff.nmse <= self.max_nmse:
            return False
        return math.isfinite(diff.max_ulp)  # infinite only where NaN meets a number

    def verdict(self, diff: NodeDiff) -> str:
        """``exact``, ``bound`` (not identical but within this tier) or ``FAIL``."""
        if diff.identical:
            return "exact"
        return "bound" if self.admits(diff) else "FAIL"


EXACT = Tier()


@attrs.frozen
class Manifest:
    """A backend's declared tiers, by key (``OP:TYPE``, ``OP`` or ``*``)."""

    tiers: Mapping[str, Tier] = attrs.field(factory=dict)

    @classmethod
    def parse(cls, declared: Mapping[str, str | Tier] | Manifest | None) -> Manifest:
        """Check a backend's declaration; a ValueError says which entry is wrong and why."""
        if isinstance(declared, Manifest):
            return declared
        if declared is None:
            return cls()
        if not isinstance(declared, Mapping):
            raise ValueError(f"a manifest maps op keys to tiers, not {type(declared).__name__}")
        tiers = {}
        for key, value in declared.items():
            tiers[_check_key(key)] = Tier.parse(value)
        return cls(tiers)

    def tier(self, op: Op, weight_type: DType | None = None) -> Tier:
        if weight_type is not None:
            found = self.tiers.get(f"{op.name}:{weight_type.name}")
            if found is not None:
                return found
        return self.tiers.get(op.name) or self.tiers.get(ANY) or EXACT

    def tier_of(self, node: Node, srcs: Sequence[Node]) -> Tier:
        """The tier of one graph node: its op, on the type of its WEIGHT source if it has one."""
        weight = next((s.dtype for s in srcs if s.op is Op.WEIGHT and s.dtype is not DType.F32),
                      None)  # fmt: skip
        return self.tier(node.op, weight)

    @property
    def all_exact(self) -> bool:
        return all(t.exact for t in self.tiers.values())

    def to_dict(self) -> dict[str, str]:
        return {k: str(t) for k, t in self.tiers.items()}


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise ValueError(f"manifest key {key!r} is not a string")
    if key == ANY:
        return key
    op_name, _, type_name = key.partition(":")
    computed = [op.name for op in Op if not op.is_leaf]
    if op_name not in computed:
        raise ValueError(
            f"manifest key {key!r}: unknown op {op_name!r}; ops: {', '.join(computed)}"
        )
    if type_name and type_name not in DType.__members__:
        raise ValueError(
            f"manifest key {key!r}: unknown type {type_name!r}; "
            f"types: {', '.join(DType.__members__)}"
        )
    return key


@functools.cache
def backend_manifest(cls: type) -> Manifest:
    """The parsed manifest of a backend class; a PluginError names the class and the fault."""
    try:
        return Manifest.parse(getattr(cls, "manifest", None))
    except ValueError as e:
        raise PluginError(
            f"backend {getattr(cls, 'name', cls)!r} declares a bad manifest: {e}"
        ) from None
