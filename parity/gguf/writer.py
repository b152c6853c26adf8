"""Writing GGUF files, for tests and synthetic twins: metadata typed as the real files type it,
tensors in their packed layout, and a tiny byte-level BPE vocabulary."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from parity.core.weights import WeightData

V = GGUFValueType
# numpy scalar kinds -> GGUF value types, for values the caller typed explicitly
_NUMPY_TYPES = {
    np.dtype(np.uint8): V.UINT8, np.dtype(np.int8): V.INT8, np.dtype(np.uint16): V.UINT16,
    np.dtype(np.int16): V.INT16, np.dtype(np.uint32): V.UINT32, np.dtype(np.int32): V.INT32,
    np.dtype(np.float32): V.FLOAT32, np.dtype(np.bool_): V.BOOL, np.dtype(np.uint64): V.UINT64,
    np.dtype(np.int64): V.INT64, np.dtype(np.float64): V.FLOAT64,
}  # fmt: skip


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    metadata: Mapping[str, object],
    tensors: Iterable[WeightData],
) -> Path:
    """Write a GGUF v3 file: ``metadata`` (a value of None leaves a key out) and ``tensors``.

    Values are typed as the real files type them: int -> UINT32 (INT32 in arrays), float ->
    FLOAT32 when exact, else FLOAT64, bool, str, lists of those; a numpy scalar or array keeps
    its own type. ``general.alignment`` sets the alignment the data is padded to.
    """
    path = Path(path)
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        if value is None:
            continue
        if key == "general.alignment":  # also pads the data to it
            writer.add_custom_alignment(int(value))
            continue
        vtype, item = _value_type(key, value)
        if item is not None:
            value = value.tolist() if isinstance(value, np.ndarray) else list(value)
        writer.add_key_value(key, value, vtype, sub_type=item)
    for w in tensors:
        rows = w.raw().reshape(*w.shape[:-1], -1)  # (..., bytes per row): the writer's raw form
        writer.add_tensor(w.name, rows, raw_dtype=GGMLQuantizationType(w.dtype.value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_type(key: str, value: object) -> tuple[GGUFValueType, GGUFValueType | None]:
    """(value type, element type for an array) of a metadata value."""
    if isinstance(value, np.ndarray):
        return V.ARRAY, _NUMPY_TYPES[value.dtype]
    if isinstance(value, list | tuple):
        if not value:
            raise ValueError(f"metadata {key!r}: GGUF writers cannot store an empty array")
        item = _scalar_type(key, value[0])
        return V.ARRAY, V.INT32 if item is V.UINT32 else item  # real token_type is INT32
    return _scalar_type(key, value), None


def _scalar_type(key: str, value: object) -> GGUFValueType:
    if isinstance(value, np.generic):
        return _NUMPY_TYPES[value.dtype]
    if isinstance(value, bool):
        return V.BOOL
    if isinstance(value, int):
        return V.UINT32 if 0 <= value < 2**32 else V.INT64
    if isinstance(value, float):
        return V.FLOAT32 if float(np.float32(value)) == value else V.FLOAT64
    if isinstance(value, str):
        return V.STRING
    raise TypeError(f"metadata {key!r}: cannot store a {type(value).__name__} in GGUF")


# the first merges of SmolLM2's tokenizer, in its order
_REAL_MERGES = (
    "Ġ t", "Ġ a", "i n", "h e", "Ġ Ġ", "r e", "o n", "e r", "Ġt he", "a t", "Ġ s", "Ġ o",
    "e n", "Ġ c", "e s", "Ġ w", "n d", "i t", "o r", "i s", "a l", "Ġ p", "in g", "Ġ f", "a n",
    "e d", "Ġ b", "o u", "a r", "Ġ in", "Ġo f", "Ġ m", "Ġa nd", "i on", "i c", "Ġ d", "Ġt o",
    "ĠĠ ĠĠ", "l e", "r o", "a s", "en t", "Ġ h", "Ġt h", "c t", "Ġ e", "Ġ re", "e l", "o m",
    "i l", "s t", "Ġ l", "Ġ n", "e t", "i m", "v e", "o l", "at ion", "Ġ g", "i d",
)  # fmt: skip
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


def byte_symbols() -> list[str]:
    """The 256 byte-level BPE symbols in GPT-2's order (printable bytes first, as
    ``bytes_to_unicode`` lists them)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


def tiny_bpe_tokenizer(n_vocab: int = 512) -> dict[str, object]:
    """Tokenizer metadata of a byte-level BPE ("gpt2" model, "smollm" pre-tokenizer) with
    ``n_vocab`` tokens: the control tokens <|endoftext|>, <|im_start|>, <|im_end|> (ids 0-2,
    as in SmolLM2), all 256 byte symbols, then merged tokens, each from one merge."""
    tokens = [*CONTROL_TOKENS, *byte_symbols()]
    if n_vocab < len(tokens):
        raise ValueError(f"a byte-level vocabulary needs at least {len(tokens)} tokens")
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    candidates = [
        *_REAL_MERGES,
        *(f"Ġ {c}" for c in letters),
        *(f"{a} {b}" for a in letters for b in letters),
        *(f"Ġ{a} {b}" for a in letters for b in letters),
    ]
    known = set(tokens)
    merges = []
    for merge in candidates:
        if len(tokens) == n_vocab:
            break
        left, right = merge.split(" ")
        if left in known and right in known and left + right not in known:
            merges.append(merge)
            tokens.append(left + right)
            known.add(left + right)
    if len(tokens) < n_vocab:
        raise ValueError(f"tiny_bpe_tokenizer makes at most {len(tokens)} tokens")
    token_type = np.full(n_vocab, TOKEN_NORMAL, np.int32)
    token_type[: len(CONTROL_TOKENS)] = TOKEN_CONTROL
    return {
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_type,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
    }
