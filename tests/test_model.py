"""The model layer end to end on a tiny synthetic GGUF (real layout, random weights, a small
byte-level BPE vocabulary): loading, logits, generation, prefix reuse, chat, perplexity."""

from __future__ import annotations

import math

import numpy as np
import pytest

import parity
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.errors import ChatTemplateError, ConfigError, ContextLengthError, ModelError
from parity.gguf.writer import tiny_bpe_tokenizer
from parity.measure.perplexity import perplexity, token_nll

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_path(request, tmp_path_factory):
    spec, weights = synthetic_model(tiny_spec(request.param), seed=3)
    path = tmp_path_factory.mktemp("models") / f"tiny-{request.param}.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer(), chat_template=CHATML)
    return path


@pytest.fixture
def model(model_path):
    with parity.load(model_path, backend="cpu", n_ctx=64, n_batch=8) as m:
        yield m


def greedy_by_prefill(model, prompt: list[int], n: int) -> list[int]:
    """The greedy continuation computed the slow way: a fresh full prefill per token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(model.logits(seq)[-1])))
    return seq[len(prompt) :]


def test_logits_shape_and_tail(model):
    ids = model.tokenize("hello world, hello")
    full = model.logits(ids)
    assert full.shape == (len(ids), model.spec.n_vocab) and full.dtype == np.float32
    tail = model.logits(ids, n_out=3)
    assert tail.tobytes() == full[-3:].tobytes()


def test_greedy_generation_equals_repeated_prefill(model):
    ids = model.tokenize("the quick brown fox")
    gen = model.generate(ids, max_tokens=6, temperature=0.0, ignore_eos=True).complete()
    assert gen.finish_reason == "length"
    assert gen.tokens == greedy_by_prefill(model, ids, 6)
    assert gen.text == model.detokenize(gen.tokens)


def test_sampling_through_the_model_is_seeded(model):
    ids = model.tokenize("abc")
    runs = [
        model.generate(ids, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
        .complete()
        .tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_prefix_reuse_is_bit_identical(model_path, model):
    a = model.tokenize("one two three four five")
    b = a + model.tokenize(" six seven")
    model.generate(a, max_tokens=2, temperature=0.0, ignore_eos=True).complete()
    gen = model.generate(b, max_tokens=5, temperature=0.0, ignore_eos=True).complete()
    assert gen.stats.reused_tokens > 0
    with parity.load(model_path, backend="cpu", n_ctx=64) as fresh:
        want = fresh.generate(b, max_tokens=5, temperature=0.0, ignore_eos=True).complete()
    assert gen.tokens == want.tokens


def test_stream_pieces_concatenate_to_text(model):
    gen = model.generate("stream me", max_tokens=8, temperature=0.0, ignore_eos=True)
    pieces = list(gen)
    assert "".join(p.text for p in pieces) == gen.text
    assert pieces[-1].finish == "length" and all(p.finish is None for p in pieces[:-1])


def test_stop_string_cuts_the_text(model):
    ids = model.tokenize("x")
    free = model.generate(ids, max_tokens=10, temperature=0.0, ignore_eos=True).complete()
    stop = free.text[2:4]
    assert stop, "the tiny model should produce some text"
    gen = model.generate(ids, max_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop])
    gen.complete()
    assert gen.finish_reason == "stop"
    assert gen.text == free.text[: free.text.index(stop)]


def test_max_tokens_zero(model):
    gen = model.generate("hi", max_tokens=0).complete()
    assert gen.tokens == [] and gen.finish_reason == "length"


def test_prompt_beyond_context_is_a_clear_error(model):
    with pytest.raises(ContextLengthError, match="context holds 64"):
        model.generate(list(range(65)), max_tokens=1)


def test_generation_stops_at_the_context_end(model):
    gen = model.generate(list(range(60)), max_tokens=50, temperature=0.0, ignore_eos=True)
    gen.complete()
    assert gen.finish_reason == "context"
    assert len(gen.tokens) == 64 - 60 + 1  # the last sampled token needs no cache slot


def test_a_model_without_a_template_asks_for_one(tmp_path):
    spec, weights = synthetic_model(tiny_spec("llama"), seed=5)
    path = tmp_path / "base.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer())
    base = parity.load(str(path), backends=())
    with pytest.raises(ChatTemplateError, match=r"base has no chat template .*use_template"):
        base.render_chat([{"role": "user", "content": "hi"}])
    base.use_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}")
    assert base.render_chat([{"role": "user", "content": "hi"}]) == "[hi]" + base.template.eos_token


def test_chat_uses_the_template(model):
    rendered = model.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = model.chat([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0)
    gen.complete()
    assert gen.stats.prompt_tokens == len(model.tokenize(rendered))


def test_bad_context_size_and_unknown_model(model_path):
    with pytest.raises(ConfigError, match="context size"):
        parity.load(model_path, backend="cpu", n_ctx=10**9)
    with pytest.raises(ModelError, match="unknown model"):
        parity.load("no-such-model", backend="cpu", pull=False)


def test_perplexity_follows_the_protocol(model):
    text = " ".join(f"word{i % 17}" for i in range(200))
    result = perplexity(model, text, 16, max_chunks=3)
    tokens = model.tokenize(text, parse_special=False)
    nll = []
    for c in range(3):
        chunk = tokens[c * 16 : (c + 1) * 16]
        logits = model.logits(chunk)
        nll += list(token_nll(logits[8:15], np.asarray(chunk[9:16])))
    assert result.scored == len(nll) == 3 * 7
    assert math.isclose(result.ppl, math.exp(np.mean(nll)), rel_tol=1e-12)
    assert result.line().startswith("PPL = ")
