"""The sampler chain: each stage on hand-made logits, the fast top-k against a full sort,
penalties, greedy ties, seeded reproducibility, the drawn distribution, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity.errors import BackendError, ConfigError
from parity.generation.sampling import Sampler, SamplingParams
from parity.numerics import exp

OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}  # every filter disabled


def logp(*probs: float) -> np.ndarray:
    return np.log(np.array(probs, dtype=np.float64)).astype(np.float32)


def kept(logits, history=(), **params) -> list[int]:
    p = SamplingParams(**{**OFF, **params})
    return Sampler(p, len(logits)).candidates(np.asarray(logits, np.float32), history).tolist()


# -- each stage alone ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (6, [0, 1, 2, 3, 4, 5]), (0, [0, 1, 2, 3, 4, 5])],
)
def test_top_k_keeps_the_k_largest(k, expected):
    assert kept([1, 5, 3, 5, 2, 0], top_k=k) == expected


def test_top_k_breaks_ties_at_the_cut_toward_lower_ids():
    assert kept([4, 7, 4, 4, 1, 4], top_k=2) == [0, 1]
    assert kept([4, 7, 4, 4, 1, 4], top_k=4) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, [2]),
        (0.5, [2]),
        (0.7, [0, 2]),
        (0.9, [0, 2, 3]),
        (0.99, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    # probabilities 0.3, 0.05, 0.5, 0.15: best first 0.5, 0.8, 0.95, 1.0
    assert kept(logp(0.3, 0.05, 0.5, 0.15), top_p=top_p) == expected


def test_top_p_renormalises_over_what_top_k_kept():
    logits = logp(0.4, 0.3, 0.2, 0.1)
    assert kept(logits, top_p=0.55) == [0, 1]  # 0.4 < 0.55 over the whole vocabulary
    assert kept(logits, top_k=2, top_p=0.55) == [0]  # 0.4 / 0.7 = 0.57 over top-2


def test_top_p_over_a_large_flat_vocabulary_sorts_everything():
    # 1000 equal logits: reaching 49.95% takes 500 tokens, more than the first guess of 256
    assert kept(np.zeros(1000, np.float32), top_p=0.4995) == list(range(500))


def test_top_p_over_a_large_peaked_vocabulary():
    logits = np.zeros(1000, np.float32)
    peaks = [3, 70, 150, 333, 400, 512, 640, 777, 901, 999]
    logits[peaks] = 10.0  # each peak ~9.6%: nine reach 86%, ten 96%
    assert kept(logits, top_p=0.9) == peaks


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, [0, 1, 2, 3]), (0.1, [0, 1, 3]), (0.25, [0, 3]), (0.7, [0]), (1.0, [0])],
)
def test_min_p_is_relative_to_the_most_likely(min_p, expected):
    # probabilities 0.5, 0.1, 0.02, 0.3 (sum 0.92: min-p reads ratios, not sums)
    assert kept(logp(0.5, 0.1, 0.02, 0.3), min_p=min_p) == expected


def test_min_p_keeps_ties_of_the_maximum():
    assert kept([2, 0, 2, 1], min_p=1.0) == [0, 2]


def test_filters_judge_untempered_logits():
    logits = logp(0.5, 0.1, 0.02, 0.3, 0.08)
    for t in (0.3, 1.0, 3.0):
        assert kept(logits, temperature=t, top_p=0.75) == [0, 3]
        assert kept(logits, temperature=t, min_p=0.18) == [0, 1, 3]


def test_default_chain_on_hand_made_logits():
    # best first 0.4, 0.3, 0.2, 0.03, 0.019, 0.018 (ids 1, 4, 6, 3, 0, 5) reach 0.967 >= 0.95;
    # min-p then drops what is below 0.05 * 0.4 = 0.02
    logits = logp(0.019, 0.4, 0.015, 0.03, 0.3, 0.018, 0.2, 0.018)
    assert kept(logits, top_k=40, top_p=0.95) == [0, 1, 3, 4, 5, 6]
    assert kept(logits, top_k=40, top_p=0.95, min_p=0.05, temperature=0.8) == [1, 3, 4, 6]
    assert Sampler(SamplingParams(), 8).candidates(logits, []).tolist() == [1, 3, 4, 6]


def _reference_candidates(x: np.ndarray, p: SamplingParams) -> list[int]:
    """The chain written the obvious way: one full sort, ties by lower id."""
    order = np.lexsort((np.arange(x.size), -x))
    if p.top_k:
        order = order[: p.top_k]
    if p.top_p < 1:
        cum = np.cumsum(exp(x[order] - x[order[0]]), dtype=np.float64)
        order = order[: min(int(np.searchsorted(cum, p.top_p * cum[-1])) + 1, order.size)]
    if p.min_p > 0:
        top = x[order[0]]
        order = order[x[order] >= top + np.float32(math.log(p.min_p))]
    return sorted(order.tolist())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"top_k": 1},
        {"top_k": 300, "top_p": 0.99, "min_p": 0.001},
        {"top_k": 0, "top_p": 0.9, "min_p": 0.0},
        {"top_k": 5000, "top_p": 1.0, "min_p": 0.0},
    ],
)
def test_fast_selection_matches_a_full_sort_on_a_real_sized_vocabulary(seed, options):
    rng = np.random.default_rng(seed)
    n = 151_936
    x = (rng.standard_normal(n) * 2).astype(np.float32)
    x[rng.integers(0, n, 30)] += rng.uniform(4, 12, 30).astype(np.float32)
    if seed % 2:
        x = np.round(x * 4) / 4  # many ties, some at the top-k cut
        x[rng.integers(0, n, 2000)] = -np.inf
    params = SamplingParams(seed=0, **options)
    assert Sampler(params, n).candidates(x, []).tolist() == _reference_candidates(x, params)


# -- greedy and penalties ------------------------------------------------------------------


def test_greedy_picks_the_first_maximum():
    s = Sampler(SamplingParams(temperature=0), 5)
    assert s(np.array([1, 3, -np.inf, 3, 2], np.float32), []) == 1
    assert s(np.array([-np.inf, -np.inf, -7, -np.inf, -np.inf], np.float32), []) == 2


def _greedy(logits, history, **penalty) -> int:
    s = Sampler(SamplingParams(temperature=0, **penalty), len(logits))
    return s(np.array(logits, np.float32), history)


def test_penalty_divides_positive_logits():
    assert _greedy([2.0, 1.9], [0], repetition_penalty=1.2) == 1  # 2 / 1.2 = 1.67
    assert _greedy([2.0, 1.9], [0], repetition_penalty=1.0) == 0


def test_penalty_multiplies_negative_logits():
    # division would lift -1.0 to -0.83 and keep it ahead; multiplication lowers it to -1.2
    assert _greedy([-1.0, -1.1], [0], repetition_penalty=1.2) == 1


def test_penalty_below_one_favours_repeats():
    assert _greedy([1.9, 2.0, -1.1, -1.0], [0], repetition_penalty=0.9) == 0
    assert _greedy([-1.1, -1.0], [0], repetition_penalty=0.9) == 0


def test_penalty_counts_a_repeated_token_once():
    assert _greedy([2.0, 1.6], [0, 0, 0, 0], repetition_penalty=1.2) == 0  # 1.67 > 1.6


def test_penalty_window():
    logits, history = [2.0, 1.9, 0.0], [0, 2, 2]
    assert _greedy(logits, history, repetition_penalty=1.2, repeat_last_n=2) == 0
    assert _greedy(logits, history, repetition_penalty=1.2, repeat_last_n=3) == 1
    assert _greedy(logits, history, repetition_penalty=1.2, repeat_last_n=-1) == 1
    assert _greedy(logits, history, repetition_penalty=1.2, repeat_last_n=0) == 0
    assert _greedy(logits, [], repetition_penalty=1.2) == 0


def test_penalty_exact_values_and_the_callers_logits_stay_untouched():
    logits = np.array([3.0, -2.0, 0.0, 1.5], np.float32)
    before = logits.copy()
    s = Sampler(SamplingParams(repetition_penalty=1.5, **OFF), 4)
    s(logits, [0, 1, 2])
    assert np.array_equal(logits, before)
    expected = np.array([3.0 / 1.5, -2.0 * 1.5, 0.0, 1.5], np.float32)
    assert np.array_equal(s._apply_penalty(logits, [0, 1, 2]), expected)


def test_penalty_then_filters():
    # penalised: 2.0/2 = 1.0 falls below 1.5 and out of top-1
    assert kept([2.0, 1.5, 0.0], [0], top_k=1, repetition_penalty=2.0) == [1]


# -- the draw ------------------------------------------------------------------------------


def _draws(params: SamplingParams, logits: np.ndarray, n: int) -> np.ndarray:
    s = Sampler(params, logits.size)
    return np.array([s(logits, []) for _ in range(n)])


def test_same_seed_same_tokens():
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((50, 1000)) * 3).astype(np.float32)
    a, b, c = (Sampler(SamplingParams(seed=s), 1000) for s in (123, 123, 124))
    ta, tb, tc = ([s(r, [1, 2]) for r in rows] for s in (a, b, c))
    assert ta == tb
    assert ta != tc


def test_seeded_tokens_are_pinned():
    # a change here changes what every seeded run produces: make it on purpose, or not at all
    rows = (np.random.default_rng(2024).standard_normal((12, 1000)) * 3).astype(np.float32)
    s = Sampler(SamplingParams(seed=42), 1000)
    assert [s(r, []) for r in rows] == [660, 388, 732, 885, 302, 945, 603, 217, 342, 194, 125, 561]
    s = Sampler(SamplingParams(seed=42, **{**OFF, "temperature": 1.5}), 1000)
    assert [s(r, []) for r in rows] == [793, 389, 827, 699, 214, 963, 633, 727, 184, 426, 371, 902]


def test_a_random_seed_is_recorded_and_replays():
    rng = np.random.default_rng(8)
    rows = (rng.standard_normal((40, 500)) * 2).astype(np.float32)
    first = Sampler(SamplingParams(), 500)
    again = Sampler(SamplingParams(seed=first.seed), 500)
    assert [first(r, []) for r in rows] == [again(r, []) for r in rows]
    assert Sampler(SamplingParams(), 500).seed != first.seed


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}  # critical values at p = 0.001


@pytest.mark.parametrize(
    ("options", "probs"),
    [
        ({}, [0.4, 0.3, 0.15, 0.1, 0.05]),
        ({"temperature": 0.5}, np.array([0.4, 0.3, 0.15, 0.1, 0.05]) ** 2),
        ({"temperature": 2.0}, np.array([0.4, 0.3, 0.15, 0.1, 0.05]) ** 0.5),
        ({"top_k": 3}, [0.4, 0.3, 0.15, 0, 0]),
        ({"min_p": 0.3}, [0.4, 0.3, 0.15, 0, 0]),
    ],
)
def test_draws_follow_the_distribution(options, probs):
    probs = np.asarray(probs, dtype=np.float64)
    probs /= probs.sum()
    logits = logp(0.1, 0.4, 0.05, 0.3, 0.15)  # shuffled: the draw must follow ids correctly
    ids = [1, 3, 4, 0, 2]
    draws = _draws(SamplingParams(seed=0, **{**OFF, **options}), logits, 6000)
    counts = np.bincount(draws, minlength=5)[ids].astype(np.float64)
    live = probs > 0
    assert counts[~live].sum() == 0  # filtered tokens are never drawn
    assert _chi_square(counts[live], probs[live]) < CHI2_999[int(live.sum()) - 1]


def test_minus_inf_logits_are_never_drawn():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf], np.float32)
    draws = _draws(SamplingParams(seed=3, **OFF), logits, 400)
    assert set(draws.tolist()) == {1, 3}


def test_a_single_survivor_is_always_drawn():
    draws = _draws(SamplingParams(seed=4, top_k=1), logp(0.2, 0.5, 0.3), 50)
    assert set(draws.tolist()) == {1}


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize(
    ("bad", "message"),
    [(np.nan, "NaN .first at token 2"), (np.inf, r"\+inf .at token 2"), (None, "-inf everywhere")],
)
def test_invalid_logits_are_an_error(greedy, bad, message):
    logits = np.array([0.5, 1.0, 0.0, 0.25], np.float32)
    if bad is None:
        logits[:] = -np.inf
    else:
        logits[2] = bad
    s = Sampler(SamplingParams(temperature=0 if greedy else 0.8, seed=0), 4)
    with pytest.raises(BackendError, match=message):
        s(logits, [])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be a finite number >= 0"),
        ("temperature", math.inf, "temperature must be"),
        ("temperature", "hot", "temperature must be"),
        ("top_k", -1, "top_k must be an integer >= 0"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, "top_p must be in"),
        ("min_p", -0.01, r"min_p must be in \[0, 1\]"),
        ("min_p", 1.01, "min_p must be in"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
        ("repetition_penalty", -1.1, "repetition_penalty must be"),
        ("repetition_penalty", math.nan, "repetition_penalty must be"),
        ("repeat_last_n", -2, "repeat_last_n must be an integer >= -1"),
        ("seed", -1, "seed must be an integer >= 0, or None"),
        ("seed", True, "seed must be"),
    ],
)
def test_bad_params_are_config_errors(field, value, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**{field: value})


def test_bad_calls():
    with pytest.raises(ConfigError, match="n_vocab must be a positive integer"):
        Sampler(SamplingParams(), 0)
    s = Sampler(SamplingParams(repetition_penalty=1.1), 4)
    with pytest.raises(ValueError, match=r"logits must have shape \(4,\)"):
        s(np.zeros(5, np.float32), [])
    with pytest.raises(ValueError, match=r"history must be a flat sequence of ids in 0..3"):
        s(np.zeros(4, np.float32), [1, 4])
    with pytest.raises(ValueError, match="history must be"):
        s(np.zeros(4, np.float32), [-1])


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, repetition_penalty=1.3).greedy
    assert not SamplingParams().greedy
