"""The GGUF tokenizer: llama.cpp's token ids on both real models (fixtures recorded by
tests/data/record_llamacpp_tokens.py), round trips, streaming, pieces, end-of-generation ids,
special-token rules and errors on small hand-made vocabularies."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from parity.arch.model_file import read_model_file
from parity.errors import TokenizerError
from parity.text.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenType

FIXTURES = json.loads((Path(__file__).parent / "data" / "llamacpp_tokens.json").read_text("utf-8"))
CASES = FIXTURES["cases"]
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")


@functools.cache
def real_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_metadata(read_model_file(path).metadata)


@pytest.fixture(params=MODELS)
def model(request, real_model) -> tuple[str, Tokenizer]:
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


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_decode_round_trips(model, case):
    _, tok = model
    assert tok.decode(tok.encode(case["text"])) == case["text"]
    assert tok.decode(tok.encode(case["text"], parse_special=False)) == case["text"]


def test_vocabulary_facts(model):
    name, tok = model
    facts = {
        # (n_vocab, bos, eos, add_bos), from each GGUF and llama.cpp's own load log
        "smollm2-135m": (49152, 1, 2, False),
        "qwen2.5-coder-0.5b": (151936, 151643, 151645, False),
    }
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.add_bos) == facts[name]


def test_eog_ids_match_llama_cpp(model):
    name, tok = model
    # llama.cpp's "printing all EOG tokens" for each file: <|endoftext|>, <|im_end|> and the
    # fim repo token <reponame> for SmolLM2; Qwen adds fim pad/repo/sep and a normal-typed </s>
    expected = {
        "smollm2-135m": {0, 2, 4},
        "qwen2.5-coder-0.5b": {128247, 151643, 151645, 151662, 151663, 151664},
    }
    assert tok.eog_ids == expected[name]


def test_pieces(model):
    name, tok = model
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


def test_skip_special_drops_control_tokens_only(model):
    name, tok = model
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    if name == "qwen2.5-coder-0.5b":  # <tool_call> is user-defined: always text
        ids = tok.encode("<tool_call>x<|im_end|>")
        assert tok.decode(ids, skip_special=True) == "<tool_call>x"


@pytest.mark.parametrize("text", ["👨‍👩‍👧‍👦 family", "🫠🪐 melting", "𓀀 龘 𝄞"])
def test_stream_decoder_holds_back_split_characters(model, text):
    _, tok = model
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    pushed = [stream.push(i) for i in ids]
    assert "" in pushed  # some character's bytes spanned tokens
    assert all("\ufffd" not in p for p in pushed)
    assert "".join(pushed) + stream.flush() == tok.decode(ids) == text


def test_stream_decoder_flush_replaces_an_unfinished_character(model):
    _, tok = model
    first = tok.encode("🫠")[0]
    stream = tok.stream_decoder()
    assert stream.push(first) == ""
    assert stream.flush() == tok.decode([first]) == "\ufffd"
    assert stream.push(tok.encode(" ok")[0]) == " ok"  # usable after a flush


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
    with pytest.raises(TokenizerError, match=r"'llama'.*supports 'gpt2'"):
        Tokenizer.from_metadata(tiny_metadata(**{"tokenizer.ggml.model": "llama"}))


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
