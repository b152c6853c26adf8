"""``parity compare``: a model run step by step on two backends, every node of every step compared.

Step 0 is the prompt's prefill; each later step decodes one token; ``n_tokens`` steps sample
``n_tokens`` tokens. Both backends are fed the
reference's token at every step (teacher forcing), so their graphs see the same sequence and each
step's comparison is meaningful; each side's own choice of the next token is recorded, and their
agreement reported.

A node breaks its tier when its difference from the reference exceeds what the candidate's
manifest declares for it (``parity.core.tiers``). When its sources were bit-identical in the run,
that is a violation outright. When they were not (an earlier node's bounded error flowed into
them), the node is replayed alone on the reference's values of its sources: it is a violation only
if it breaks its tier there too, else the difference was inherited. The first violation is saved
as a case file (``parity.conformance.case``) that ``parity conformance NAME --case FILE`` replays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from parity.arch.decoder import DecoderSpec, build_decoder, graph_inputs
from parity.arch.params import GraphParams
from parity.conformance.case import node_case, save_case
from parity.conformance.harness import judge, oracle
from parity.core.backend import Backend
from parity.core.compare import NodeDiff, diff_arrays, jsonable
from parity.core.ir import Graph, Op
from parity.core.runtime import Runtime
from parity.core.tiers import Tier, manifest_of
from parity.core.weights import WeightData
from parity.generation.sampling import Sampler, SamplingParams


@attrs.frozen
class Violation:
    step: int
    diff: NodeDiff
    tier: Tier
    sources_identical: bool  # the node's inputs were bit-identical in the run
    replay: str  # what replaying it alone showed
    case_path: Path | None

    def describe(self) -> str:
        where = "its inputs were bit-identical" if self.sources_identical else self.replay
        saved = f"\nsaved as {self.case_path}" if self.case_path else ""
        tier = f"beyond its declared tier ({self.tier})"
        return f"step {self.step} {self.diff.describe()}, {tier}; {where}{saved}"


@attrs.frozen
class StepsReport:
    model: str
    reference: str
    candidate: str
    steps: int
    nodes_compared: int
    nodes_on_candidate: int  # the rest ran on the fallback backend
    nodes_identical: int
    max_ulp: float
    worst_nmse: float
    reference_tokens: tuple[int, ...]
    candidate_tokens: tuple[int, ...]
    first_divergent: tuple[int, NodeDiff] | None  # (step, node): any difference at all
    violation: Violation | None
    nodes_fused: int = 0  # original nodes the candidate's rewrite fused into others

    @property
    def identical_share(self) -> float:
        return self.nodes_identical / self.nodes_compared if self.nodes_compared else 1.0

    @property
    def tokens_agree(self) -> int:
        return sum(
            a == b for a, b in zip(self.reference_tokens, self.candidate_tokens, strict=True)
        )

    def summary(self) -> str:
        lines = [
            f"{self.candidate} vs {self.reference} on {self.model}: {self.steps} steps, "
            f"{self.nodes_compared} nodes compared, {self.identical_share:.2%} bit-identical, "
            f"max ULP {self.max_ulp:g}, worst NMSE {self.worst_nmse:.3g}",
            f"nodes run by {self.candidate}: {self.nodes_on_candidate}/{self.nodes_compared}"
            + ("" if self.nodes_on_candidate == self.nodes_compared else " (the rest fell back)")
            + (
                f"; {self.nodes_fused} more fused into the nodes that replace them"
                if self.nodes_fused
                else ""
            ),
            f"sampled tokens agree: {self.tokens_agree}/{len(self.reference_tokens)}",
        ]
        if self.first_divergent is None:
            lines.append("every node of every step is bit-identical")
        else:
            step, d = self.first_divergent
            lines.append(f"first divergent node: step {step} {d.describe()}")
        if self.violation is None:
            lines.append(f"no node breaks the tiers {self.candidate} declares")
        else:
            lines.append(f"VIOLATION: {self.violation.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        first = self.first_divergent
        v = self.violation
        return jsonable(
            {
                "model": self.model,
                "reference": self.reference,
                "candidate": self.candidate,
                "steps": self.steps,
                "nodes_compared": self.nodes_compared,
                "nodes_on_candidate": self.nodes_on_candidate,
                "nodes_fused": self.nodes_fused,
                "bit_identical_share": self.identical_share,
                "max_ulp": self.max_ulp,
                "worst_nmse": self.worst_nmse,
                "reference_tokens": list(self.reference_tokens),
                "candidate_tokens": list(self.candidate_tokens),
                "tokens_agree": self.tokens_agree,
                "first_divergent": None
                if first is None
                else {"step": first[0], **attrs.asdict(first[1])},
                "violation": None
                if v is None
                else {
                    "step": v.step,
                    "node": attrs.asdict(v.diff),
                    "tier": str(v.tier),
                    "sources_identical": v.sources_identical,
                    "replay": v.replay,
                    "case": None if v.case_path is None else str(v.case_path),
                },
            }
        )


def compare_steps(
    model: str,
    spec: DecoderSpec,
    weights: Mapping[str, WeightData],
    prompt: Sequence[int],
    n_tokens: int,
    reference: Callable[[], Backend],
    candidate: Callable[[], Backend],
    *,
    sampling: SamplingParams | None = None,
    case_dir: Path | None = None,
    fallback: Callable[[], Backend] | None = None,
    n_ctx: int | None = None,
) -> StepsReport:
    """Prefill ``prompt`` and decode until ``n_tokens`` tokens are sampled, on both backends
    (``reference`` and ``candidate`` make instances), comparing every node at every step.
    With ``fallback``, nodes the candidate does not support run there instead of failing.
    ``n_ctx`` (default: what the run needs) sizes the KV caches."""
    if not prompt or n_tokens < 1:
        raise ValueError("compare needs a prompt of at least one token and n_tokens >= 1")
    n_ctx = n_ctx or len(prompt) + n_tokens - 1
    sampling = sampling or SamplingParams(temperature=0.0)
    ref_backend, cand_backend = reference(), candidate()
    manifest = manifest_of(cand_backend)
    cand_backends = [cand_backend, *([fallback()] if fallback else [])]
    runtimes = [
        Runtime([ref_backend], weights, rewrite=False),  # the graph as written: every node
        Runtime(cand_backends, weights, strict=not fallback),
    ]
    samplers = [Sampler(sampling, spec.n_vocab), Sampler(sampling, spec.n_vocab)]
    states: dict[str, np.ndarray] = {}  # the reference's caches before the step
    dirty: set[str] = set()  # caches whose candidate copy differs from the reference's
    history: list[int] = list(prompt)
    ref_tokens: list[int] = []
    cand_tokens: list[int] = []
    compared = identical = nodes_on_candidate = fused = 0
    max_ulp = worst_nmse = 0.0
    first: tuple[int, NodeDiff] | None = None
    violation: Violation | None = None
    step_tokens: list[int] = list(prompt)
    for step in range(n_tokens):
        params = GraphParams(n_tokens=len(step_tokens), n_ctx=n_ctx)
        graph = build_decoder(spec, params)
        inputs = graph_inputs(np.array(step_tokens), len(history) - len(step_tokens))
        computed = tuple(i for i, n in enumerate(graph.nodes) if not n.op.is_leaf)
        ref_out = runtimes[0].run(graph, inputs, expose=computed)
        ran = runtimes[1].step(graph, computed, inserted=True)  # its graph is its rewrite
        ran.write(inputs)
        ran.run()
        cand_out = {i: v.copy() for i, v in ran.outputs.items()}
        rewritten = ran.rewritten
        for name, s in graph.leaves(Op.STATE).items():
            states.setdefault(name, np.zeros(graph.nodes[s].shape, np.float32))
        fused += sum(i not in cand_out for i in computed)  # their values live inside others
        values = {r: ref_out[o] for o, r in rewritten.rewritten().items() if o in ref_out}
        differs: set[int] = set()  # the candidate's nodes (its ids) that differed
        for r, node in enumerate(rewritten.nodes):
            if node.op.is_leaf:
                continue
            o = rewritten.original(r)
            if o >= 0:
                want, got, label = ref_out[o], cand_out[o], o
            else:  # put in by the rewrite: the oracle's value of it on the reference's inputs
                alone = node_case(rewritten, r, values, inputs, weights, states, "inserted")
                want = oracle(alone).outputs[alone.graph.outputs[0]]
                got, label = ran.inserted[r], r
                values[r] = want
            d = diff_arrays(label, node.op.name, want, got)
            compared += 1
            on_candidate = ran.plan.backend_of(r) == cand_backend.name
            nodes_on_candidate += on_candidate
            identical += d.identical
            max_ulp, worst_nmse = max(max_ulp, d.max_ulp), _max_nan(worst_nmse, d.nmse)
            if d.identical:
                continue
            differs.add(r)
            first = first or (step, d)
            tier = manifest.tier_of(node, [rewritten.nodes[s] for s in node.src])
            if violation is not None or not on_candidate or tier.admits(d):
                continue  # a fallback node is the oracle's own code: its inputs differed
            sources_identical = not _inherits(rewritten, r, differs, dirty)
            case = node_case(rewritten, r, values, inputs, weights, states,
                             f"{model}-step{step}-n{label}-{node.op.name.lower()}",
                             note=f"parity compare {model}: {cand_backend.name} vs "
                                  f"{ref_backend.name}, step {step}, node %{label}")  # fmt: skip
            alone = judge(candidate, case)
            if sources_identical or alone.failed:
                replay = (
                    "replayed alone it breaks its tier too"
                    if alone.failed
                    else "replayed alone it stays within its tier (a whole-graph effect)"
                )
                path = save_case(case, case_dir / f"{case.id}.npz") if case_dir else None
                violation = Violation(step, d, tier, sources_identical, replay, path)
        logits = [out[graph.outputs[0]][-1] for out in (ref_out, cand_out)]
        tokens = [sampler(lg, history) for sampler, lg in zip(samplers, logits, strict=True)]
        ref_tokens.append(tokens[0])
        cand_tokens.append(tokens[1])
        for r, node in enumerate(rewritten.nodes):  # the caches after this step: the next's
            if node.op is Op.KV_WRITE:
                name = rewritten.nodes[node.src[0]].arg
                states[name] = ref_out[rewritten.original(r)]
                if r in differs:
                    dirty.add(name)
        history.append(tokens[0])
        step_tokens = [tokens[0]]
    for rt in runtimes:
        for b in rt.backends:
            b.close()
    return StepsReport(model, ref_backend.name, cand_backend.name, n_tokens, compared,
                       nodes_on_candidate, identical, max_ulp, worst_nmse, tuple(ref_tokens),
                       tuple(cand_tokens), first, violation, fused)  # fmt: skip


def _inherits(graph: Graph, node: int, differs: set[int], dirty: set[str]) -> bool:
    """Did ``node`` read a value that already differed from the reference's: a source that
    differed (``differs``: ids of ``graph``), or a KV cache an earlier step left different?"""
    for s in graph.nodes[node].src:
        src = graph.nodes[s]
        if (src.op is Op.STATE and src.arg in dirty) or s in differs:
            return True
    return False


def _max_nan(a: float, b: float) -> float:
    return b if math.isnan(b) or b > a else a
