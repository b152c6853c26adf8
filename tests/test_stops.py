"""StopMatcher: what is emitted, what is held back, and that splitting never changes the result."""

from __future__ import annotations

import random

import pytest

from parity.errors import ConfigError
from parity.generation.stops import StopMatcher


def run(stops, pieces) -> tuple[list[tuple[str, bool]], str]:
    m = StopMatcher(stops)
    return [m.feed(p) for p in pieces], m.flush()


def test_no_stops_passes_everything_through():
    m = StopMatcher([])
    assert m.feed("Hello") == ("Hello", False)
    assert m.feed("") == ("", False)
    assert m.feed(" world") == (" world", False)
    assert m.flush() == ""


def test_stop_within_one_piece():
    m = StopMatcher(["STOP"])
    assert m.feed("one two STOP three") == ("one two ", True)
    assert m.matched == "STOP"
    assert m.feed("more") == ("", True)  # stays stopped
    assert m.flush() == ""


def test_stop_spanning_pieces_holds_back_only_a_possible_start():
    m = StopMatcher(["world"])
    assert m.feed("Hello wor") == ("Hello ", False)  # "wor" may begin "world"
    assert m.feed("ld and more") == ("", True)


def test_stop_spanning_many_single_character_pieces():
    pieces = list("answer<|im_end|>tail")
    outs, _ = run(["<|im_end|>"], pieces)
    assert "".join(text for text, _ in outs) == "answer"
    assert outs[5] == ("r", False)  # text before the first "<" is never held
    assert [hit for _, hit in outs].index(True) == len("answer<|im_end|>") - 1
    assert all(text == "" for text, _ in outs[6:])


def test_a_false_start_is_released():
    m = StopMatcher(["abc"])
    assert m.feed("xxab") == ("xx", False)
    assert m.feed("d") == ("abd", False)
    assert m.feed("a") == ("", False)
    assert m.flush() == "a"
    assert m.flush() == ""


def test_held_back_is_the_longest_possible_start():
    m = StopMatcher(["aab"])
    assert m.feed("aaa") == ("a", False)  # "aa" may still begin "aab"
    assert m.feed("b") == ("", True)  # the text was "aaab": "a" before the stop


def test_overlapping_stops_the_first_completed_wins():
    assert run(["abcd", "bc"], ["abcd"])[0] == [("a", True)]  # "bc" completes first
    assert run(["bcd", "abcde"], ["abcdef"])[0] == [("a", True)]
    assert run(["END", "STOP"], ["x STOP y END"])[0] == [("x ", True)]
    m = StopMatcher(["bc", "abc"])  # both complete on "c": the one that began earlier
    assert m.feed("xabc") == ("x", True)
    assert m.matched == "abc"


def test_empty_pieces():
    m = StopMatcher(["</s>"])
    assert m.feed("") == ("", False)
    assert m.feed("a</") == ("a", False)
    assert m.feed("") == ("", False)  # nothing decided, nothing released
    assert m.feed("s>") == ("", True)


def test_text_ending_without_the_stop_is_flushed():
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("Sure.\n\nUse") == ("Sure.", False)
    assert m.flush() == "\n\nUse"


def test_non_ascii_stops():
    m = StopMatcher(["。終"])
    assert m.feed("答え。") == ("答え", False)
    assert m.feed("終わり") == ("", True)


def test_a_single_string_is_one_stop():
    assert StopMatcher("ab").feed("xaby") == ("x", True)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None]])
def test_bad_stop_strings(bad):
    with pytest.raises(ConfigError, match="stop strings must be non-empty text"):
        StopMatcher(bad)


def _expected(stops: list[str], text: str) -> tuple[str, bool]:
    """Feeding one character at a time: the first stop string completed, earliest start."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


@pytest.mark.parametrize("seed", range(200))
def test_any_split_gives_the_same_result(seed):
    rng = random.Random(seed)
    alphabet = "ab c"
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        for _ in range(rng.randint(0, 3))
    ]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    outs, tail = run(stops, pieces)
    hit = any(h for _, h in outs)
    emitted = "".join(t for t, _ in outs) + tail
    assert (emitted, hit) == _expected(stops, text)
    if hit:
        assert [h for _, h in outs] == sorted(h for _, h in outs)  # once stopped, stays
