"""Speed of one model on its backend, as users feel it: prefill, time to first token, the
first decode step (a stall there is a bug) and the steady-state step.

A warm-up pass runs the same prefill and decode graphs first (JIT compilation, weight
preparation, graph capture and its verification); its time to first token is reported as
``cold_ttft_ms``. Prompt
tokens are seeded random ids; decode is greedy and ignores end-of-generation, so exactly
``gen_tokens`` tokens are produced.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import attrs
import numpy as np

from parity.core.runtime import CAPTURE_AFTER_RUNS

if TYPE_CHECKING:
    from parity.model import Model


@attrs.frozen
class BenchResult:
    model: str
    backend: str
    prompt_tokens: int
    gen_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    ttft_ms: float
    first_step_ms: float
    step_ms: float  # median of the steps after the first
    cold_ttft_ms: float
    load_s: float
    # per split of each greedy decode step the measured run took (the copies that take turns,
    # and past a session's SHALLOW_REACH the deeper ones): "" when it replays a captured graph,
    # else why not
    decode_capture: list[str] = attrs.Factory(list)

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def bench(
    model: Model, prompt_tokens: int, gen_tokens: int, *, seed: int = 0, load_s: float = 0.0
) -> BenchResult:
    if prompt_tokens < 1 or gen_tokens < 2:
        raise ValueError("bench needs prompt_tokens >= 1 and gen_tokens >= 2")
    model.session.check_fits(prompt_tokens + gen_tokens, "prompt plus generated tokens")
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.spec.n_vocab, prompt_tokens).tolist()

    def once(n: int) -> tuple[float, list[float]]:
        model.reset()
        gen = model.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True).complete()
        return gen.stats.prefill_s, gen.stats.step_s

    # the warm-up decodes past the step that captures and the one that verifies the capture,
    # of each of the session's greedy decode steps (two copies take turns where it queues).
    # Where the run crosses the session's SHALLOW_REACH (its decode graphs change there) the
    # steps of either side run over that side's positions alone: the run itself is repeated
    # until each has run that often
    session = model.session
    last = prompt_tokens + gen_tokens - 2  # (the last decode step's position)
    crosses = session.greedy_pair(prompt_tokens) is not session.greedy_pair(last)
    warm = len(session.greedy_pair(prompt_tokens)) * (CAPTURE_AFTER_RUNS + 3)
    cold_ttft, _ = once(gen_tokens if crosses else warm)
    for _ in range(CAPTURE_AFTER_RUNS + 2 if crosses else 0):
        once(gen_tokens)
    used = (*session.greedy_pair(prompt_tokens), *session.greedy_pair(last))
    before = {step: step.runs for step in used}  # (one entry a step)
    ttft, steps = once(gen_tokens)
    copies = [step for step, runs in before.items() if step.runs > runs]  # (those the run took)
    decode_s = sum(steps)
    return BenchResult(
        model=model.name,
        backend=model.backends[0].device.id,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        prefill_tok_s=round(prompt_tokens / ttft, 2),
        decode_tok_s=round(len(steps) / decode_s, 2),
        ttft_ms=round(ttft * 1e3, 3),
        first_step_ms=round(steps[0] * 1e3, 3),
        step_ms=round(statistics.median(steps[1:]) * 1e3, 3),
        cold_ttft_ms=round(cold_ttft * 1e3, 3),
        load_s=round(load_s, 3),
        decode_capture=[status for step in copies for status in step.capture_status],
    )
