"""The GGUF tokenizer: llama.cpp's token ids on the real models, two byte-level BPE
vocabularies and one SentencePiece-style (fixtures recorded by
tests/data/record_llamacpp_tokens.py), round trips, streaming, pieces, end-of-generation ids,
special-token rules and errors on small hand-made vocabularies."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from parity.errors import TokenizerError
from parity.gguf.reader import read_gguf
from parity.text.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenType

FIXTURES = json.loads((Path(__file__).parent / "data" / "llamacpp_tokens.json").read_text("utf-8"))
CASES = FIXTURES["cases"]
BPE_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
MODELS = (*BPE_MODELS, "gemma3-270m")


@functools.cache
def real_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_metadata(read_gguf(path).metadata)  # (the tokenizer alone)


@pytest.fixture(params=MODELS)
def model(request, real_model) -> tuple[str, Tokenizer]:
    return request.param, real_tokenizer(real_model(request.param))


@pytest.fixture(params=BPE_MODELS)
def bpe_model(request, real_model) -> tuple[str, Tokenizer]:
    return request.param, real_tokenizer(real_model(request.param))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_ids_equal_llama_cpp(model, case):
    name, tok = model
    assert tok.encode(case["text"]) == case["ids"][name]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_ids_equal_llama_cpp_without_parse_special(model, case):
    name, tok = model
    expected = case.get("ids_no_parse_special", {}).get(name, case["ids"][name])
    assert tok.encode(case["text"], parse_special=False) == expected


# where the vocabulary cannot give the text back, and llama.cpp's ids (equal to ours) lose it too
LOSSY = {
    # SmolLM2's byte-level vocabulary has no token for these six bytes: they are dropped
    ("smollm2-135m", "every ascii control character"): lambda t: t.translate(
        dict.fromkeys(b"\x04\x06\x13\x14\x16\x1d")
    ),
    # SPM writes spaces as U+2581, so one written in the text comes back as a space
    ("gemma3-270m", "literal sentencepiece spaces"): lambda t: t.replace("\u2581", " "),
}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_decode_round_trips(model, case):
    name, tok = model
    text = case["text"]
    want = LOSSY.get((name, case["name"]), lambda t: t)(text)
    assert tok.decode(tok.encode(text, add_bos=False)) == want
    assert tok.decode(tok.encode(text, add_bos=False, parse_special=False)) == want


def test_vocabulary_facts(model):
    name, tok = model
    facts = {
        # (n_vocab, bos, eos, add_bos), from each GGUF and llama.cpp's own load log
        "smollm2-135m": (49152, 1, 2, False),
        "qwen2.5-coder-0.5b": (151936, 151643, 151645, False),
        "gemma3-270m": (262144, 2, 1, True),
    }
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.add_bos) == facts[name]


def test_eog_ids_match_llama_cpp(model):
    name, tok = model
    # llama.cpp's "printing all EOG tokens" for each file: <|endoftext|>, <|im_end|> and the
    # fim repo token <reponame> for SmolLM2; Qwen adds fim pad/repo/sep and a normal-typed </s>
    expected = {
        "smollm2-135m": {0, 2, 4},
        "qwen2.5-coder-0.5b": {128247, 151643, 151645, 151662, 151663, 151664},
        "gemma3-270m": EOG_GEMMA3,
    }
    assert tok.eog_ids == expected[name]


def test_pieces(bpe_model):
    name, tok = bpe_model
    (the,) = tok.encode(" the")
    assert tok.piece(the) == b" the"
    (im_end,) = tok.encode("<|im_end|>")
    assert tok.piece(im_end) == b"<|im_end|>"
    emoji = tok.encode("🫠")  # 4 UTF-8 bytes, three tokens in both vocabularies
    assert len(emoji) == 3
    assert b"".join(tok.piece(i) for i in emoji) == "🫠".encode()
    if name == "qwen2.5-coder-0.5b":
        assert tok.piece(151665) == b""  # [PAD151665] is an unused token
        assert tok.piece(128247) == b"</s>"


def test_sentencepiece_pieces_and_byte_fallback(real_model):
    tok = real_tokenizer(real_model("gemma3-270m"))
    (the,) = tok.encode(" the", add_bos=False)  # no space prefix in this file
    assert tok.piece(the) == b" the"
    (turn,) = tok.encode("<end_of_turn>", add_bos=False)
    assert tok.piece(turn) == b"<end_of_turn>"
    rare = tok.encode("\U0002a6a5", add_bos=False)  # not in the vocabulary: its 4 bytes
    assert [tok.piece(i) for i in rare] == [bytes([b]) for b in "\U0002a6a5".encode()]
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert ids[0] == tok.bos_id
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert tok.encode("a\n\n\nb", add_bos=False, parse_special=False)[1] == 109  # user-defined


def test_skip_special_drops_control_tokens_only(bpe_model):
    name, tok = bpe_model
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    if name == "qwen2.5-coder-0.5b":  # <tool_call> is user-defined: always text
        ids = tok.encode("<tool_call>x<|im_end|>")
        assert tok.decode(ids, skip_special=True) == "<tool_call>x"


@pytest.mark.parametrize(  # each with a character no vocabulary holds whole (\U0002a6a5)
    "text", ["👨‍👩‍👧‍👦 family \U0002a6a5", "🫠🪐 melting \U0002a6a5", "𓀀 龘 𝄞 \U0002a6a5"]
)
def test_stream_decoder_holds_back_split_characters(model, text):
    _, tok = model
    ids = tok.encode(text, add_bos=False)
    stream = tok.stream_decoder()
    pushed = [stream.push(i) for i in ids]
    assert "" in pushed  # some character's bytes spanned tokens
    assert all("\ufffd" not in p for p in pushed)
    assert "".join(pushed) + stream.flush() == tok.decode(ids) == text


def test_stream_decoder_flush_replaces_an_unfinished_character(model):
    _, tok = model
    first = tok.encode("\U0002a6a5", add_bos=False)[0]  # a rare CJK character: split in all
    stream = tok.stream_decoder()
    assert stream.push(first) == ""
    assert stream.flush() == tok.decode([first]) == "\ufffd"
    assert stream.push(tok.encode(" ok", add_bos=False)[0]) == " ok"  # usable after a flush


EOG_GEMMA3 = {1, 106, 212}  # <eos>, <end_of_turn> and </s>: llama.cpp's "printing all EOG tokens"


# --- small hand-made vocabularies ---------------------------------------------------------


def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, written out independently of the module under test."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


EXTRA = [
    ("he", TokenType.NORMAL),
    ("ll", TokenType.NORMAL),
    ("hell", TokenType.NORMAL),
    ("hello", TokenType.NORMAL),
    ("Ġw", TokenType.NORMAL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<tool>", TokenType.USER_DEFINED),
    ("bcd", TokenType.USER_DEFINED),
    ("ab", TokenType.USER_DEFINED),
    ("<0x41>", TokenType.BYTE),
    ("[unused]", TokenType.UNUSED),
]
IDS = {text: 256 + k for k, (text, _) in enumerate(EXTRA)}


def tiny_metadata(**changes: object) -> dict[str, object]:
    metadata: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": byte_alphabet() + [text for text, _ in EXTRA],
        "tokenizer.ggml.token_type": np.array(
            [TokenType.NORMAL] * 256 + [kind for _, kind in EXTRA], dtype=np.int32
        ),
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w"],
        "tokenizer.ggml.bos_token_id": IDS["<|im_start|>"],
        "tokenizer.ggml.eos_token_id": IDS["<|im_end|>"],
    }
    metadata.update(changes)
    return {key: value for key, value in metadata.items() if value is not None}


def test_tiny_encode_and_pieces():
    tok = Tokenizer.from_metadata(tiny_metadata())
    assert tok.encode("hello world") == [IDS["hello"], IDS["Ġw"], *b"orld"]
    assert tok.encode("é") == [0xC3, 0xA9]  # one byte token each
    assert tok.piece(0xC3) == b"\xc3"
    assert tok.piece(IDS["<0x41>"]) == b"A"
    assert tok.piece(IDS["[unused]"]) == b""
    assert tok.eog_ids == {IDS["<|im_end|>"]}
    stream = tok.stream_decoder(skip_special=True)
    pushed = [stream.push(i) for i in (0xC3, 0xA9, IDS["<|im_end|>"], IDS["<tool>"])]
    assert pushed == ["", "é", "", "<tool>"]


def test_tiny_special_tokens_llama_cpp_rules():
    tok = Tokenizer.from_metadata(tiny_metadata())
    start, end, tool = IDS["<|im_start|>"], IDS["<|im_end|>"], IDS["<tool>"]
    assert tok.encode("<|im_start|>hello<tool><|im_end|>") == [start, IDS["hello"], tool, end]
    # control tokens are text without parse_special; user-defined ones are always tokens
    plain = tok.encode("<|im_start|><tool>", parse_special=False)
    assert plain[-1] == tool and start not in plain
    # longest token first across the whole text, not leftmost: "bcd" wins over "ab"
    assert tok.encode("abcd") == [ord("a"), IDS["bcd"]]
    assert tok.encode("ab ab") == [IDS["ab"], ord(" "), IDS["ab"]]


def test_tiny_add_bos():
    tok = Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert tok.add_bos
    assert tok.encode("he") == [IDS["<|im_start|>"], IDS["he"]]
    assert tok.encode("he", add_bos=False) == [IDS["he"]]
    assert tok.encode("") == [IDS["<|im_start|>"]]


def test_missing_special_ids_fall_back_to_llama_cpp_defaults():
    tok = Tokenizer.from_metadata(
        tiny_metadata(**{"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.eos_token_id": None})
    )
    assert (tok.bos_id, tok.eos_id) == (11, 11)  # llama.cpp's gpt2 defaults
    assert tok.eog_ids == {11, IDS["<|im_end|>"]}


def test_decode_and_stream_reject_ids_outside_the_vocabulary():
    tok = Tokenizer.from_metadata(tiny_metadata())
    with pytest.raises(TokenizerError, match="outside this vocabulary"):
        tok.decode([tok.n_vocab])
    with pytest.raises(TokenizerError, match="outside this vocabulary"):
        tok.stream_decoder().push(-1)


def test_lone_surrogate_is_a_tokenizer_error():
    tok = Tokenizer.from_metadata(tiny_metadata())
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.encode("a\ud800b")


@pytest.mark.parametrize(
    "key", ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"]
)
def test_missing_key(key):
    with pytest.raises(TokenizerError, match=key.replace(".", r"\.")):
        Tokenizer.from_metadata(tiny_metadata(**{key: None}))


def test_unsupported_model_type():
    with pytest.raises(TokenizerError, match=r"'bert'.*supports 'gpt2'.*and 'llama'"):
        Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.model": "bert"}))


def test_unknown_pre_tokenizer_names_the_supported_ones():
    with pytest.raises(TokenizerError, match="'deepseek-coder'") as err:
        Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.pre": "deepseek-coder"}))
    assert all(name in str(err.value) for name in PRE_TOKENIZERS)


def test_missing_pre_tokenizer_warns_and_uses_default():
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre"):
        tok = Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.pre": None}))
    assert tok.encode("hello") == [IDS["hello"]]


@pytest.mark.parametrize(
    ("merges", "missing"),
    [
        (["h e", "hel lo"], "'hel lo'"),  # parts that are not tokens
        (["h e", "he h"], "'he h'"),  # a result that is not a token (tokenizers would panic)
        (["h e", "hello"], "'hello'"),  # no space
    ],
)
def test_bad_merges(merges, missing):
    with pytest.raises(TokenizerError, match=f"merge 1 \\({missing}\\)"):
        Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.merges": merges}))


def test_duplicate_tokens():
    tokens = byte_alphabet() + [text for text, _ in EXTRA]
    tokens[-1] = "he"
    with pytest.raises(TokenizerError, match="twice"):
        Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.tokens": tokens}))


def test_token_types_must_cover_the_vocabulary():
    with pytest.raises(TokenizerError, match="token_type"):
        Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.token_type": [1, 1]}))


# --- a small SentencePiece-style vocabulary -----------------------------------------------

SPM_TOKENS = [  # (text, type, score)
    ("<unk>", TokenType.UNKNOWN, 0.0),
    ("<s>", TokenType.CONTROL, 0.0),
    ("</s>", TokenType.CONTROL, 0.0),
    *((f"<0x{b:02X}>", TokenType.BYTE, 0.0) for b in range(256)),
    ("▁", TokenType.NORMAL, -1.0),
    ("a", TokenType.NORMAL, -2.0),
    ("b", TokenType.NORMAL, -2.0),
    ("ab", TokenType.NORMAL, -5.0),
    ("ba", TokenType.NORMAL, -5.0),  # ties ab: the leftmost pair merges first
    ("aba", TokenType.NORMAL, -1.5),
    ("▁a", TokenType.NORMAL, -4.0),
    ("é", TokenType.NORMAL, -3.0),
    ("<turn>", TokenType.CONTROL, 0.0),
    ("\n", TokenType.USER_DEFINED, 0.0),
]
SPM = {text: i for i, (text, _, _) in enumerate(SPM_TOKENS)}


def spm_metadata(**changes: object) -> dict[str, object]:
    metadata: dict[str, object] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [t for t, _, _ in SPM_TOKENS],
        "tokenizer.ggml.token_type": np.array([k for _, k, _ in SPM_TOKENS], dtype=np.int32),
        "tokenizer.ggml.scores": np.array([s for _, _, s in SPM_TOKENS], dtype=np.float32),
    }
    metadata.update(changes)
    return {key: value for key, value in metadata.items() if value is not None}


def test_spm_merges_by_score_then_leftmost():
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)  # llama.cpp's SPM defaults
    # "bab": ba and ab score alike; ba is leftmost, and "bab" is no token: ba + b
    assert tok.encode("bab", add_bos=False) == [SPM["ba"], SPM["b"]]
    # "abab": the leftmost ab first; then ab + a makes "aba", which outscores the other ab
    assert tok.encode("abab", add_bos=False) == [SPM["aba"], SPM["b"]]
    assert tok.encode("a a", add_bos=False) == [SPM["a"], SPM["▁a"]]  # spaces become ▁
    assert tok.encode("x", add_bos=False) == [SPM["<0x78>"]]  # not a token: its byte
    assert tok.encode("ü", add_bos=False) == [SPM["<0xC3>"], SPM["<0xBC>"]]
    assert tok.encode("é") == [1, SPM["é"]]
    assert tok.decode(tok.encode("a ab\nx é", add_bos=False)) == "a ab\nx é"


def test_spm_space_prefix_at_the_start_and_after_specials():
    tok = Tokenizer.from_metadata(spm_metadata())  # add_space_prefix: llama.cpp's default, on
    assert tok.encode("a", add_bos=False) == [SPM["▁a"]]
    # after any token split out of the text (the user-defined newline too), a space again
    assert tok.encode("a<turn>a\naa", add_bos=False) == [
        SPM["▁a"], SPM["<turn>"], SPM["▁a"], SPM["\n"], SPM["▁a"], SPM["a"],
    ]  # fmt: skip
    assert tok.piece(SPM["▁a"]) == b" a"


def test_spm_needs_scores_and_byte_tokens():
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.scores"):
        Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.scores": None}))
    with pytest.raises(TokenizerError, match=r"scores has shape \(3,\)"):
        Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.scores": np.zeros(3)}))
    no_bytes = [t if k != TokenType.BYTE else f"[b{i}]" for i, (t, k, _) in enumerate(SPM_TOKENS)]
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.tokens": no_bytes}))
    with pytest.raises(TokenizerError, match="no byte token"):
        tok.encode("ü")
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tok.encode("a\ud800")
