"""Parity tiers: what a backend promises, per op, about agreeing with the cpu oracle.

A backend declares a manifest (``Backend.manifest``): op keys mapped to a tier. A tier is
``exact`` (bit for bit: every element's bits equal the oracle's, NaN positions equal) or a bound
on the distance from the oracle on the same inputs: ``ulp<=N`` (no element further than N
binary32 units in the last place, NaN positions equal), ``nmse<=X`` (normalized mean squared
error over the finite elements), or both joined by a comma (both must hold).

Keys, most specific first: ``OP:TYPE`` (an op on one weight type, e.g. ``MATMUL:Q4_K``; the type
of the node's WEIGHT source), ``OP`` (``MATMUL``), ``*`` (every other op). A manifest without
``*`` leaves unlisted ops exact. No declaration may be looser than the op's budget
(``BUDGETS``, docs/numerics.md): such an entry is refused, except under ``*``, which then
applies only to the ops whose budget it fits (the others stay exact). Examples::

    manifest = {"*": "exact"}                                   # the default
    manifest = {"*": "exact", "MATMUL": "nmse<=1e-5", "SILU": "ulp<=8"}

The conformance kit (``parity conformance``) and ``parity compare`` enforce what is declared, and
the scheduler reads it: a node whose tier is a bound computes in ``fast`` numerics, so under
``numerics = "exact"`` it is placed on an exact backend instead. A backend whose ``fast``
kernels differ from its ``exact`` ones declares them apart: ``manifest`` is what it keeps in
``exact``, ``fast_manifest`` in ``fast`` (``manifest_of(backend)`` is the one in force).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from parity.core.dtypes import DType
from parity.core.ir import MATRICES, Node, Op
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
            parts.append(f"ulp<={_number(self.max_ulp)}")
        if self.max_nmse is not None:
            parts.append(f"nmse<={_number(self.max_nmse)}")
        return ",".join(parts)

    def within(self, budget: Tier) -> bool:
        """Is this tier at least as strict as ``budget``? A ULP bound also bounds the NMSE:
        every element is then within ``max_ulp`` units of 2^-23 of its own magnitude."""
        if self.exact:
            return True
        if budget.exact:
            return False
        ulp_ok = (
            self.max_ulp is not None
            and budget.max_ulp is not None
            and (self.max_ulp <= budget.max_ulp)
        )
        nmse = self.max_nmse
        if self.max_ulp is not None:
            implied = (2 * self.max_ulp * 2.0**-23) ** 2
            nmse = implied if nmse is None else min(nmse, implied)
        nmse_ok = nmse is not None and budget.max_nmse is not None and nmse <= budget.max_nmse
        return ulp_ok or nmse_ok

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
                raise ValueError(f"bad tier {text!r}: {value.strip()!r} is not a number") from None
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
        return math.isfinite(diff.max_ulp)  # infinite where a special value or an id differs

    def verdict(self, diff: NodeDiff) -> str:
        """``exact``, ``bound`` (not identical but within this tier) or ``FAIL``."""
        if diff.identical:
            return "exact"
        return "bound" if self.admits(diff) else "FAIL"


EXACT = Tier()

# the most a backend may declare per op: docs/numerics.md, "fast numerics budgets"
BUDGETS: dict[Op, Tier] = {
    Op.GET_ROWS: EXACT,  # data movement and exact selection
    Op.SLICE_ROWS: EXACT,
    Op.RESHAPE: EXACT,
    Op.KV_WRITE: EXACT,
    Op.ARGMAX: EXACT,
    Op.ADD: Tier(max_ulp=1),
    Op.MUL: Tier(max_ulp=1),
    Op.ROPE: Tier(max_ulp=2),
    Op.SILU: Tier(max_ulp=8),
    Op.SWIGLU: Tier(max_ulp=8),
    Op.GELU: Tier(max_nmse=1e-10),  # (ill-conditioned for x < -4: an ulp budget cannot be met)
    Op.GEGLU: Tier(max_nmse=1e-10),
    Op.SCALE: Tier(max_ulp=1),
    Op.RMS_NORM: Tier(max_ulp=4),
    Op.MATMUL: Tier(max_nmse=1e-5),
    Op.ATTENTION: Tier(max_nmse=1e-5),
    Op.QUANTIZE: EXACT,  # integer quants: exact or wrong
    Op.RMS_NORM_MUL: Tier(max_ulp=5),  # RMS_NORM's 4, one more rounding for the weight
    Op.MATMUL_ADD: Tier(max_nmse=1e-5),
    Op.MATMUL_SWIGLU: Tier(max_nmse=1e-5),
}


def _number(x: float) -> str:
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


# op -> the source index of its packed weight: a table's, a product's (first) matrix
PACKED_AT = {Op.GET_ROWS: 0, **{op: ks[0] for op, ks in MATRICES.items()}}


def packed_type(node: Node, srcs: Sequence[Node]) -> DType | None:
    """The type of a node's packed weight operand (a matrix product's matrix, the gate's for
    MATMUL_SWIGLU; GET_ROWS's table)."""
    at = PACKED_AT.get(node.op)
    if at is None or srcs[at].op is not Op.WEIGHT:
        return None
    return srcs[at].dtype


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
            tier = tiers[_check_key(key)] = Tier.parse(value)
            ops = [op for op in BUDGETS if key in (ANY, op.name) or key.startswith(f"{op.name}:")]
            over = [op.name for op in ops if not tier.within(BUDGETS[op])]
            if over and key != ANY:
                raise ValueError(
                    f"{key!r}: {tier} is looser than the budget of {over[0]} "
                    f"({BUDGETS[Op[over[0]]]}; docs/numerics.md)"
                )
        return cls(tiers)

    def tier(self, op: Op, weight_type: DType | None = None) -> Tier:
        if weight_type is not None:
            found = self.tiers.get(f"{op.name}:{weight_type.name}")
            if found is not None:
                return found
        return self.tiers.get(op.name) or self.tiers.get(ANY) or EXACT

    def tier_of(self, node: Node, srcs: Sequence[Node]) -> Tier:
        """The tier of one graph node: its op, on the type of its packed weight if it has one.
        A ``*`` entry never loosens an op past its budget: there the op stays exact."""
        tier = self.tier(node.op, packed_type(node, srcs))
        return tier if tier.within(BUDGETS[node.op]) else EXACT

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
def backend_manifest(cls: type, numerics: str = "exact") -> Manifest:
    """The parsed manifest of a backend class in ``numerics``: its ``fast_manifest`` under
    ``fast`` where it declares one, else its ``manifest``. A PluginError names the class and
    the fault."""
    fast = getattr(cls, "fast_manifest", None) if numerics == "fast" else None
    which = "fast_manifest" if fast is not None else "manifest"
    try:
        return Manifest.parse(fast if fast is not None else getattr(cls, "manifest", None))
    except ValueError as e:
        raise PluginError(
            f"backend {getattr(cls, 'name', cls)!r} declares a bad {which}: {e}"
        ) from None


def manifest_of(backend: object) -> Manifest:
    """The tiers a backend instance keeps: its class's manifest in its numerics."""
    return backend_manifest(type(backend), getattr(backend, "numerics", "exact"))
