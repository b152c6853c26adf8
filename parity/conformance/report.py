"""Run the suite (or saved cases) on a backend and lay the results out as a table."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from parity.conformance.case import load_case
from parity.conformance.harness import FUSION, VERDICTS, CaseResult, judge
from parity.conformance.suite import CaseSpec, op_suite
from parity.core.backend import Backend
from parity.core.config import load_config
from parity.core.plugins import Registry
from parity.core.selection import choose_backend
from parity.errors import PluginError


class BackendUnavailable(PluginError):
    """The backend is installed but cannot run on this machine (e.g. no GPU)."""


def checked_modes(cls: type[Backend]) -> list[str]:
    """The numerics the kit checks a backend in: ``exact`` where offered, and ``fast`` too
    where its fast kernels differ (a ``fast_manifest``); one of them otherwise."""
    modes = [m for m in ("exact", "fast") if m in cls.numerics_modes]
    if "exact" in modes and getattr(cls, "fast_manifest", None) is None:
        modes = ["exact"]
    return modes or list(cls.numerics_modes[:1])


def backend_factory(
    registry: Registry,
    name: str,
    device: int | None = None,
    *,
    reference: bool = False,
    numerics: str = "exact",
) -> Callable[[], Backend]:
    """A maker of fresh instances of backend ``name``, built as a run builds it: the device
    by index, the options of ``[backends.NAME]`` in the config file, in ``numerics`` (a
    backend that offers only ``fast`` gets that). As the ``reference`` of a comparison,
    ``cpu`` is the readable definition (its ``definition`` kernels), whatever the config
    picks for running."""
    cls = registry.get(name)  # PluginError: not installed, or its plugin is broken
    ok = cls.available()
    if not ok.ok:
        raise BackendUnavailable(f"backend {name!r} is not available here: {ok.reason}")
    if numerics not in cls.numerics_modes:
        if numerics == "fast" or "fast" not in cls.numerics_modes:
            raise BackendUnavailable(
                f"backend {name!r} offers numerics {', '.join(cls.numerics_modes)}, "
                f"not {numerics!r}"
            )
        numerics = "fast"
    config = load_config(backend=name, device=device, numerics=numerics)
    chosen = choose_backend(config, registry)
    options = config.backend_options.get(name, {})
    if reference and name == "cpu":  # the argument outranks the environment and the file
        return lambda: chosen.cls(
            chosen.device, numerics=numerics, options=options, kernels="definition"
        )
    return lambda: chosen.cls(chosen.device, numerics=numerics, options=options)


def select(specs: Sequence[CaseSpec], patterns: Sequence[str]) -> list[CaseSpec]:
    """Cases whose id contains any of ``patterns`` (all when there are none)."""
    return [s for s in specs if not patterns or any(p in s.id for p in patterns)]


def run_suite(
    factory: Callable[[], Backend],
    *,
    patterns: Sequence[str] = (),
    case_files: Sequence[str] = (),
    suite: bool = True,
    progress: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Judge the suite's cases (filtered by ``patterns``) and the saved ``case_files`` (read
    first, so a bad file fails before anything runs)."""
    saved = [load_case(f) for f in case_files]
    builds = [s.build for s in select(op_suite(), patterns)] if suite else []
    builds += [lambda c=c: c for c in saved]
    results = []
    for build in builds:
        result = judge(factory, build())
        results.append(result)
        if progress is not None:
            progress(result)
    return results


@attrs.frozen
class Row:
    op: str
    type: str
    tier: str
    cases: int
    verdict: str
    max_ulp: float
    nmse: float


def rows(results: Sequence[CaseResult]) -> list[Row]:
    """One row per (op, type): the worst verdict of its cases and the largest errors."""
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for r in results:
        groups.setdefault((r.op, r.type), []).append(r)
    out = []
    for (op, type_name), group in groups.items():
        verdict = max((r.verdict for r in group), key=VERDICTS.index)
        tiers = ", ".join(dict.fromkeys(str(r.tier) for r in group))
        out.append(
            Row(op, type_name, tiers, len(group), verdict, max(r.max_ulp for r in group),
                max(r.nmse for r in group))
        )  # fmt: skip
    return out


def format_table(backend: str, results: Sequence[CaseResult]) -> str:
    header = ("op", "type", "declared", "cases", "result", "max ULP", "worst NMSE")
    body = [
        (r.op, r.type, r.tier, str(r.cases), r.verdict, f"{r.max_ulp:g}", f"{r.nmse:.3g}")
        for r in rows(results)
    ]
    widths = [max(len(line[k]) for line in (header, *body)) for k in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in (header, *body)]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    lines.append("")
    lines.append(
        f"{backend}: {len(results)} cases: {counts['exact']} bit-exact, {counts['bound']} within "
        f"the declared bound, {counts['FAIL']} FAIL, {counts['unsupported']} unsupported"
    )
    unsupported = sorted({r.op for r in results if r.verdict == "unsupported"} - {FUSION})
    if unsupported:
        lines.append(
            f"{backend} does not support {', '.join(unsupported)} (on some or all types); in a "
            "model those nodes run on cpu, or fail under strict"
        )
    if any(r.op == FUSION and r.verdict == "unsupported" for r in results):
        lines.append(
            f"{backend}'s rewrite leaves some FUSION patterns as written (no fused ops of its "
            "own there): nothing to check, nothing wrong"
        )
    for r in results:
        if r.failed:
            lines.append(f"\nFAIL {r.case}:")
            lines.extend(f"  {line}" for line in r.explain().splitlines())
    ran = [r for r in results if r.diffs]
    if ran and not any(r.guarded for r in ran):
        lines.append(
            f"\nnote: {backend}'s buffers cannot be sliced into views, so writes past the end "
            "of its own buffers were not checked (inputs, states and readback were)"
        )
    return "\n".join(lines)
