"""Agreement with llama.cpp's saved logits (``llama-perplexity --kl-divergence-base``): the file
is read as llama.cpp writes it, the chunks run as llama.cpp ran them, and the figures count
what they say."""

from __future__ import annotations

import math

import numpy as np
import pytest

import parity
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.gguf.writer import tiny_bpe_tokenizer
from parity.measure.agreement import BaseLogitsError, agreement, read_base, record_width
from parity.measure.perplexity import token_nll

N_CTX = 16


def encode_record(logits: np.ndarray) -> np.ndarray:
    """One position's record as perplexity.cpp's log_softmax writes it (float32 arithmetic)."""
    logits = logits.astype(np.float32)
    n_vocab = len(logits)
    top = np.float32(logits.max())
    low = np.float32(max(logits.min(), top - np.float32(16)))
    lse = np.float32(math.log(float(np.exp((logits - top).astype(np.float32)).sum())))
    scale = np.float32((top - low) / np.float32(65535))
    out = np.zeros(record_width(n_vocab), np.uint16)
    out[:4] = np.array([scale, low - top - lse], np.float32).view(np.uint16)
    if scale:
        q = np.rint(np.float32(1 / scale) * (logits - low)).astype(np.int64)
        out[4 : 4 + n_vocab] = np.where(logits > low, q, 0)
    return out


def write_base(path, chunks: list[np.ndarray], logits: list[np.ndarray]) -> None:
    """A llama-perplexity logits file: header, every chunk's tokens, then the records."""
    n_vocab = logits[0].shape[1]
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([N_CTX, n_vocab, len(chunks)], np.int32).tobytes())
        f.write(np.concatenate(chunks).astype(np.int32).tobytes())
        for rows in logits:
            f.write(np.stack([encode_record(r) for r in rows]).tobytes())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    spec, weights = synthetic_model(tiny_spec("llama"), seed=3)
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer())
    return path


@pytest.fixture
def model(model_path):
    with parity.load(model_path, backend="cpu", n_ctx=64, n_batch=8) as m:
        yield m


def own_base(model, tmp_path, n_chunks=2, change=None):
    """The model's own logits as llama.cpp would save them; ``change(c, rows)`` edits them."""
    rng = np.random.default_rng(7)
    chunks, saved = [], []
    for c in range(n_chunks):
        chunk = rng.integers(3, model.tokenizer.n_vocab, N_CTX).astype(np.int32)
        run = chunk.copy()
        if model.tokenizer.add_bos:
            run[0] = model.tokenizer.bos_id
        rows = model.logits(run, n_out=N_CTX // 2)[:-1].copy()
        if change is not None:
            change(c, rows)
        chunks.append(chunk)
        saved.append(rows)
    path = tmp_path / "base.kld"
    write_base(path, chunks, saved)
    return path, chunks, saved


def test_the_model_against_its_own_logits_agrees_everywhere(model, tmp_path):
    path, chunks, saved = own_base(model, tmp_path)
    base = read_base(path)
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (N_CTX, model.tokenizer.n_vocab, 2)
    assert np.array_equal(base.tokens, np.stack(chunks))
    result = agreement(model, base)
    assert result.scored == 2 * (N_CTX - 1 - N_CTX // 2)
    assert result.top1 == result.top1_strict == result.scored
    assert abs(result.kld) < 1e-6  # only the file's 16-bit rounding (it need not sum to 1)
    pairs = zip(saved, chunks, strict=True)
    nll = np.concatenate([token_nll(s, c[N_CTX // 2 + 1 :]) for s, c in pairs])
    assert math.isclose(result.ppl, math.exp(nll.mean()), rel_tol=1e-12)
    assert math.isclose(result.base_ppl, result.ppl, rel_tol=1e-4)


def test_a_moved_top_token_counts_as_a_disagreement(model, tmp_path):
    def change(c, rows):
        if c == 1:  # three positions whose top token llama.cpp saw elsewhere
            for j in (0, 3, 6):
                rows[j, (rows[j].argmax() + 1) % rows.shape[1]] = rows[j].max() + 5

    path, _, _ = own_base(model, tmp_path, change=change)
    result = agreement(model, read_base(path))
    assert result.scored - result.top1 == 3 and result.kld > 0.01
    assert agreement(model, read_base(path), max_chunks=1).top1 == N_CTX - 1 - N_CTX // 2


def test_a_tie_in_the_file_agrees_with_either_token(model, tmp_path):
    def change(c, rows):  # a second token level with the top at position 2
        rows[2, (rows[2].argmax() + 1) % rows.shape[1]] = rows[2].max()

    path, _, _ = own_base(model, tmp_path, n_chunks=1, change=change)
    result = agreement(model, read_base(path))
    assert result.ties == 1 and result.top1 == result.scored


def test_bad_files_say_what_is_wrong(model, tmp_path):
    path, _, _ = own_base(model, tmp_path, n_chunks=1)
    data = path.read_bytes()
    bad = tmp_path / "bad.kld"
    bad.write_bytes(data[:-10])
    with pytest.raises(BaseLogitsError, match="truncated"):
        read_base(bad)
    bad.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(BaseLogitsError, match=r"not a llama\.cpp logits file"):
        read_base(bad)
    with pytest.raises(BaseLogitsError, match="cannot read"):
        read_base(tmp_path / "missing.kld")
    other = np.frombuffer(data[8:20], np.int32).copy()
    other[1] += 2  # another vocabulary: a file of the right size for it
    rows = N_CTX - 1 - N_CTX // 2
    body = data[20 : 20 + N_CTX * 4] + bytes(rows * record_width(int(other[1])) * 2)
    bad.write_bytes(b"_logits_" + other.tobytes() + body)
    with pytest.raises(BaseLogitsError, match="made with another model"):
        agreement(model, read_base(bad))


def test_the_cli_prints_the_three_figures(capsys, model_path, tmp_path):
    from parity.cli.main import main

    with parity.load(model_path, backend="cpu", n_ctx=64, n_batch=8) as m:
        path, _, _ = own_base(m, tmp_path)
    argv = ["perplexity", "-m", str(model_path), "-b", "cpu", "--kl-divergence-base", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PPL = ") and "llama.cpp's logits" in out[0]
    assert out[1].startswith("top-1 agreement with llama.cpp: 100.00 % (14/14")
    assert main([*argv, "--ctx", "32"]) == 1
    assert "leave out --ctx" in capsys.readouterr().err
