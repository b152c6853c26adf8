"""Sessions on different slots of one runtime hold different sequences: interleaving their
steps gives each the tokens it gets alone, and neither disturbs the other's cache."""

from __future__ import annotations

import pytest

import parity
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.gguf.writer import tiny_bpe_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    spec, weights = synthetic_model(tiny_spec("llama"), seed=3)
    path = tmp_path_factory.mktemp("slots") / "tiny.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer())
    m = parity.load(str(path), backend="cpu", n_ctx=128, progress=False)
    yield m
    m.close()


def _alone(model, prompt):
    model.reset()
    return model.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True).complete()


def test_interleaved_slots_match_each_sequence_alone(model):
    a, b = [5, 9, 14, 3], [7, 7, 21]
    want_a, want_b = _alone(model, a).tokens, _alone(model, b).tokens
    other = model.new_session(1)
    ga = model.generate(a, max_tokens=12, temperature=0.0, ignore_eos=True)
    gb = model.generate(b, max_tokens=12, temperature=0.0, ignore_eos=True, session=other)
    model.reset()
    for _ in zip(ga, gb, strict=False):  # one step of each, in turn
        pass
    ga.complete(), gb.complete()
    assert ga.tokens == want_a and gb.tokens == want_b
    assert list(other.tokens[: len(b)]) == b and other.slot == 1


def test_slot_zero_belongs_to_the_model_session(model):
    with pytest.raises(ValueError, match="slot 0"):
        model.new_session(0)
