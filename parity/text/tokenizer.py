"""Tokenizers built from GGUF metadata, giving the token ids llama.cpp gives: byte-level BPE
(``tokenizer.ggml.model = gpt2``) and SentencePiece-style (``llama``, ``parity.text.spm``).

The vocabulary, merges and scores come from ``tokenizer.ggml.*``; the pre-tokenizer regexes,
special token rules and end-of-generation rules are ported from llama.cpp
(``src/llama-vocab.cpp``, ``src/unicode.cpp``); the BPE merges run in HF ``tokenizers``, the SPM
merges in ``parity.text.spm``.

Special tokens are split out of the text first, in Python, exactly as llama.cpp's
``tokenizer_st_partition`` does: longest token text first across the whole text, user-defined
tokens always, control and unknown tokens only with ``parse_special``. ``parse_special`` is on
by default, as in ``llama-tokenize`` and llama.cpp's completion tools, so a chat prompt's
``<|im_start|>`` is one token; pass ``parse_special=False`` for text that must never produce
control tokens (it is then spelled out as ordinary text).

Not ported: llama.cpp's ``clean_spaces`` pass in ``llama_detokenize`` (for the gpt2, llama3
and default pre-tokenizers it drops the space in " ." and the like; its per-token pieces, which
streaming prints, keep it, and so does ``decode`` here), the same function's removal of the
space an SPM ``add_space_prefix`` put before the first token (again kept, as the pieces keep
it), ``add_eos_token``, and per-model lstrip/rstrip token attributes (phi-3, jina).
"""

from __future__ import annotations

import codecs
import enum
import operator
import warnings
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from parity.errors import TokenizerError
from parity.text.spm import SpmEncoder, decode_piece


class TokenType(enum.IntEnum):
    """GGUF ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


_SKIPPABLE = (TokenType.CONTROL, TokenType.UNKNOWN)  # dropped by decode(skip_special=True)
_SPECIAL = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)  # matched in text

# The regexes of llama-vocab.cpp's llm_tokenizer_bpe, applied in order, each splitting the
# pieces the previous one left (tokenizers' Split with "isolated" behaves the same way).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@attrs.frozen
class PreTokenizer:
    """How llama.cpp pre-tokenizes for one ``tokenizer.ggml.pre`` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token skips the merges
    add_bos: bool = False  # llama.cpp's default where the GGUF has no add_bos_token


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt-2": PreTokenizer((_GPT2,)),
    "llama-bpe": _LLAMA3_PRE,
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "qwen2": PreTokenizer((_QWEN2,)),
    "smollm": PreTokenizer((r"\p{N}", _GPT2)),
}

_GPT2_DEFAULT_ID = 11  # llama.cpp's bos/eos for a gpt2 vocabulary whose GGUF names none
_SPM_DEFAULT_IDS = (1, 2)  # llama.cpp's bos and eos for an SPM vocabulary whose GGUF names none
MODELS = ("gpt2", "llama")  # the tokenizer.ggml.model values parity builds

# Tokens that end generation by their text alone (llama.cpp's special_eog_ids); llama.cpp also
# makes each of them a control token.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",  # noqa: RUF001
)  # fmt: skip

# Fill-in-the-middle tokens: GGUF keys, then the texts llama.cpp looks for when no key is set.
_FIM: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "pre": (
        ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
        ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",  # noqa: RUF001
         "<|code_prefix|>", "<|prefix|>"),
    ),
    "suf": (
        ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
        ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",  # noqa: RUF001
         "<|code_suffix|>", "<|suffix|>"),
    ),
    "mid": (
        ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
        ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",  # noqa: RUF001
         "<|code_middle|>", "<|middle|>"),
    ),
    "pad": (
        ("tokenizer.ggml.fim_pad_token_id",),
        ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ),
    "rep": (
        ("tokenizer.ggml.fim_rep_token_id",),
        ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ),
    "sep": (("tokenizer.ggml.fim_sep_token_id",), ("<|file_sep|>",)),
}  # fmt: skip

# llama.cpp's gpt-oss workaround: these always render and are always parsed
_USER_DEFINED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for
    U+0100 onwards, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    moved = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(moved)) for b in range(256)}


def _unbyte_table() -> dict[int, str]:
    """A ``str.translate`` table taking a byte-level token text to a latin-1 string of its
    bytes; raw characters outside the alphabet keep their UTF-8 bytes."""
    table = {ord(char): chr(b) for b, char in _byte_alphabet().items()}
    for code in range(256):
        table.setdefault(code, chr(code).encode().decode("latin-1"))
    return table


_UNBYTE = _unbyte_table()


def _byte_decode(text: str) -> bytes:
    mapped = text.translate(_UNBYTE)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:  # a character outside the alphabet: keep its UTF-8 bytes
        return b"".join(c.encode("latin-1" if ord(c) < 256 else "utf-8") for c in mapped)


class Tokenizer:
    """A GGUF model's tokenizer. Build it with :meth:`from_metadata`."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    eog_ids: frozenset[int]  # end-of-generation ids, as llama.cpp computes them

    def __init__(
        self,
        *,
        tokens: list[str],
        types: np.ndarray,
        bpe: _HFTokenizer | None = None,
        spm: SpmEncoder | None = None,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        eog_ids: frozenset[int],
    ) -> None:
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.eog_ids = eog_ids
        self._tokens = tokens
        self._types = types.astype(np.uint8).tobytes()  # one TokenType per id
        if (bpe is None) == (spm is None):
            raise ValueError("a Tokenizer takes one of bpe (gpt2) and spm (llama)")
        self._bpe = bpe
        self._spm = spm
        self._pieces: dict[int, bytes] = {}
        special = np.flatnonzero(np.isin(types, _SPECIAL)).tolist()
        # llama.cpp matches the longest texts first; ties in id order (llama.cpp leaves them open)
        special.sort(key=lambda i: (-len(tokens[i].encode()), i))
        self._special = [(tokens[i], i) for i in special]
        self._user_defined = [
            (text, i) for text, i in self._special if types[i] == TokenType.USER_DEFINED
        ]

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object]) -> Tokenizer:
        """Build the tokenizer from a GGUF's key/value metadata (string arrays as lists of str,
        numeric arrays as numpy arrays or lists)."""
        model = _required(metadata, "tokenizer.ggml.model")
        if model not in MODELS:
            raise TokenizerError(
                f"tokenizer type {model!r} (tokenizer.ggml.model) is not supported; parity "
                "supports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece-style): use a "
                "model with such a vocabulary"
            )
        spm = model == "llama"
        pre = None if spm else _pre_tokenizer(metadata)  # (SPM ignores tokenizer.ggml.pre)
        tokens = _strings(metadata, "tokenizer.ggml.tokens")
        merges = [] if spm else _strings(metadata, "tokenizer.ggml.merges")
        n = len(tokens)
        if "" in tokens:  # as llama.cpp names them, so they stay distinct and never match text
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        vocab = dict(zip(tokens, range(n), strict=True))  # text -> id, as llama.cpp's token_to_id
        if len(vocab) != n:
            raise TokenizerError(
                f"tokenizer.ggml.tokens lists {n - len(vocab)} token text(s) twice; the GGUF's "
                "vocabulary is corrupt: re-convert the model"
            )
        types = _token_types(metadata, n)

        def token_id(keys: Sequence[str], default: int | None) -> int | None:
            # like llama.cpp: a missing or out-of-range id keeps the (in-range) default
            chosen = default if default is not None and default < n else None
            for key in keys:
                value = metadata.get(key)
                if value is not None and 0 <= int(value) < n:
                    chosen = int(value)
            return chosen

        bos, eos = _SPM_DEFAULT_IDS if spm else (_GPT2_DEFAULT_ID, _GPT2_DEFAULT_ID)
        ids = {
            "bos": token_id(("tokenizer.ggml.bos_token_id",), bos),
            "eos": token_id(("tokenizer.ggml.eos_token_id",), eos),
            "eot": token_id(("tokenizer.ggml.eot_token_id",), None),
            "eom": token_id(("tokenizer.ggml.eom_token_id",), None),
        }
        for name, (keys, texts) in _FIM.items():
            ids[name] = token_id(keys, None)
            if ids[name] is None:
                found = [vocab[t] for t in texts if t in vocab]
                if found:  # llama.cpp takes the first in hash order; the lowest id here
                    ids[name] = min(found)
                    types[ids[name]] = TokenType.CONTROL
        eog = _end_of_generation(tokens, vocab, types, ids)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        if spm:
            prefix = metadata.get("tokenizer.ggml.add_space_prefix")
            encoders = {
                "spm": SpmEncoder(
                    vocab,
                    _scores(metadata, n),
                    add_space_prefix=True if prefix is None else bool(prefix),
                )
            }
        else:
            assert pre is not None
            encoders = {"bpe": _bpe(vocab, merges, pre)}
        default_bos = True if pre is None else pre.add_bos  # llama.cpp: SPM adds BOS
        return cls(
            tokens=tokens,
            types=types,
            **encoders,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            add_bos=default_bos if add_bos is None else bool(add_bos),
            eog_ids=eog,
        )

    def encode(
        self, text: str, *, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``: BOS first when ``add_bos`` (default: the model's
        ``add_bos_token``); control tokens written in the text become those tokens when
        ``parse_special`` (user-defined ones always do)."""
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError(
                    "this model's vocabulary has no BOS token; encode with add_bos=False"
                )
            ids.append(self.bos_id)
        first = True  # (SPM: the fragment starts the text or follows a special token)
        for fragment in self._split_special(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                first = True
                continue
            try:
                if self._spm is not None:
                    ids.extend(self._spm.encode(fragment, first=first))
                else:
                    ids.extend(self._bpe.encode(fragment, add_special_tokens=False).ids)
            except (TypeError, UnicodeEncodeError) as err:
                raise TokenizerError(
                    "the text is not valid Unicode (it holds a lone surrogate); decode it "
                    "with errors='replace' before tokenizing"
                ) from err
            first = False
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of ``ids``; ``skip_special`` drops control tokens (``<|im_end|>`` ...).
        Bytes that are not valid UTF-8 become U+FFFD."""
        data = b"".join(self._piece(int(i), skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> bytes:
        """The bytes one token stands for: a normal token's byte-level text decoded, a
        special token's text as written (llama.cpp's ``token_to_piece`` with special on)."""
        return self._piece(int(token_id), False)

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """A decoder for tokens arriving one at a time (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, skip_special=skip_special)

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        if not 0 <= token_id < self.n_vocab:
            raise TokenizerError(
                f"token id {token_id} is outside this vocabulary of {self.n_vocab} tokens; "
                "pass ids produced by this model's tokenizer"
            )
        kind = self._types[token_id]
        if skip_special and kind in _SKIPPABLE:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id, kind)
        return piece

    def _make_piece(self, token_id: int, kind: int) -> bytes:
        text = self._tokens[token_id]
        if kind in _SPECIAL:
            return text.encode()
        if kind == TokenType.NORMAL:
            return decode_piece(text) if self._spm is not None else _byte_decode(text)
        if kind == TokenType.BYTE:  # "<0xAB>"
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                raise TokenizerError(
                    f"byte token {token_id} is {text!r}, not of the form <0xAB>; the GGUF's "
                    "vocabulary is corrupt: re-convert the model"
                ) from None
        return b""  # unused and undefined tokens stand for nothing, as in llama.cpp

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """``text`` as plain fragments and special token ids, llama.cpp's way: each special
        token in turn (longest first) splits every plain fragment where it occurs."""
        fragments: list[str | int] = [text] if text else []
        for special, token_id in self._special if parse_special else self._user_defined:
            if not any(isinstance(f, str) and special in f for f in fragments):
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special not in fragment:
                    split.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(special)):
                    if k:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments


class StreamDecoder:
    """Text for tokens pushed one at a time. ``push`` returns what is complete so far and
    holds back a UTF-8 sequence split across tokens; ``flush`` returns what is left (U+FFFD for
    an unfinished sequence). The concatenated output equals ``Tokenizer.decode`` of all ids."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer._piece(int(token_id), self._skip_special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _required(metadata: Mapping[str, object], key: str) -> object:
    if key not in metadata:
        raise TokenizerError(
            f"the model's GGUF metadata has no {key}, so parity cannot build its tokenizer; "
            "use a GGUF converted with its vocabulary (llama.cpp's convert_hf_to_gguf.py)"
        )
    return metadata[key]


def _strings(metadata: Mapping[str, object], key: str) -> list[str]:
    value = _required(metadata, key)
    is_sequence = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    strings = list(value) if is_sequence else None
    if strings is None or (strings and not isinstance(strings[0], str)):
        raise TokenizerError(
            f"{key} in the GGUF metadata is not a list of strings; the GGUF's tokenizer "
            "metadata is corrupt: re-convert the model"
        )
    return strings


def _scores(metadata: Mapping[str, object], n: int) -> np.ndarray:
    """``tokenizer.ggml.scores``: one float32 score a token, which SPM merges rank pairs by."""
    value = _required(metadata, "tokenizer.ggml.scores")
    try:
        scores = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        scores = None
    if scores is None or scores.shape != (n,):
        shape = None if scores is None else scores.shape
        raise TokenizerError(
            f"tokenizer.ggml.scores has shape {shape} for {n} tokens; the GGUF's tokenizer "
            "metadata is corrupt: re-convert the model"
        )
    return scores


def _pre_tokenizer(metadata: Mapping[str, object]) -> PreTokenizer:
    name = metadata.get("tokenizer.ggml.pre")
    if name is None:
        warnings.warn(
            "the GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer, "
            "which may split text unlike the model's training: re-convert the model",
            stacklevel=3,
        )
        name = "default"
    if name not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; parity supports "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[str(name)]


def _token_types(metadata: Mapping[str, object], n: int) -> np.ndarray:
    value = metadata.get("tokenizer.ggml.token_type")
    if value is None:
        return np.full(n, TokenType.NORMAL, dtype=np.uint8)
    types = np.asarray(value).astype(np.int64, copy=False)
    if types.shape != (n,):
        raise TokenizerError(
            f"tokenizer.ggml.token_type has shape {types.shape} for {n} tokens; the GGUF's "
            "tokenizer metadata is corrupt: re-convert the model"
        )
    # values llama.cpp does not know count as undefined
    known = (types >= TokenType.UNDEFINED) & (types <= TokenType.BYTE)
    return np.where(known, types, TokenType.UNDEFINED).astype(np.uint8)


def _end_of_generation(
    tokens: list[str], vocab: dict[str, int], types: np.ndarray, ids: dict[str, int | None]
) -> frozenset[int]:
    """llama.cpp's special_eog_ids; updates ``types`` with the overrides llama.cpp makes."""
    eog = {i for i in (ids["pad"], ids["rep"], ids["sep"]) if i is not None}
    for text in _EOG_TEXTS:
        if (token_id := vocab.get(text)) is not None:
            eog.add(token_id)
            types[token_id] = TokenType.CONTROL
    for text in _USER_DEFINED_TEXTS:
        if (token_id := vocab.get(text)) is not None:
            types[token_id] = TokenType.USER_DEFINED
    eog.update(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None)
    texts = {tokens[i]: i for i in eog}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        # gpt-oss, solar-open: <|end|> ends a message, not the generation
        eog.discard(texts["<|end|>"])
        types[texts["<|end|>"]] = TokenType.USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])  # gemma4, plamo: a normal token
        types[texts["</s>"]] = TokenType.NORMAL
    return frozenset(eog)


def _bpe(vocab: dict[str, int], merges: list[str], pre: PreTokenizer) -> _HFTokenizer:
    """The HF tokenizer doing llama.cpp's regex splits, byte-level mapping and merges."""
    # tokenizers panics (a Rust backtrace on stderr) on a merge whose result is not a token
    if not all(map(vocab.__contains__, map(operator.methodcaller("replace", " ", "", 1), merges))):
        raise TokenizerError(_bad_merge(vocab, merges))
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    except Exception as err:  # tokenizers raises bare Exception/TypeError for bad merges
        raise TokenizerError(_bad_merge(vocab, merges)) from err
    bpe = _HFTokenizer(model)
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return bpe


def _bad_merge(vocab: dict[str, int], merges: list[str]) -> str:
    for rank, merge in enumerate(merges):
        parts = merge.split(" ", 1)
        missing = [p for p in (*parts, "".join(parts)) if p not in vocab]
        if len(parts) != 2 or missing:
            what = f"refers to {missing[0]!r}, which is not a token" if missing else "has no space"
            return (
                f"merge {rank} ({merge!r}) in tokenizer.ggml.merges {what}; the GGUF's "
                "tokenizer metadata is inconsistent: re-convert the model"
            )
    return "tokenizer.ggml.merges does not fit the vocabulary: re-convert the model"
