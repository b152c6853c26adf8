"""SentencePiece-style tokenization (GGUF ``tokenizer.ggml.model = llama``) as llama.cpp does it.

llama.cpp's SPM tokenizer (``llm_tokenizer_spm_session`` in ``src/llama-vocab.cpp``) is not
SentencePiece's own code, and HF ``tokenizers`` has no model that states it: its BPE takes a
ranked merge list, and a ranking derived from the scores would have to reproduce the tie rule
and the byte fallback below exactly. So the algorithm is written out here:

- spaces become U+2581 ("▁"); with ``add_space_prefix``, a fragment that starts the text or
  follows a special token gets one space in front first;
- every character is a symbol; every adjacent pair whose concatenation is a token is queued
  with that token's score;
- the queue gives the highest score first, and among equal scores the leftmost pair; a pair
  whose symbols have changed since it was queued is skipped; merging a pair queues the new
  symbol's pairs with its neighbours;
- each final symbol is its token, or, when it is not one (a character the vocabulary lacks),
  its UTF-8 bytes as ``<0xAB>`` byte tokens.

A merged symbol is always a token (a pair is queued only when its text is one), so llama.cpp's
``resegment`` through its ``rev_merge`` map never splits one, and is left out.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

import numpy as np

from parity.errors import TokenizerError

SPACE = "\u2581"  # "▁", SentencePiece's visible space


class SpmEncoder:
    """Encodes plain text (special tokens already split out) to token ids."""

    def __init__(
        self, vocab: Mapping[str, int], scores: np.ndarray, *, add_space_prefix: bool
    ) -> None:
        self._vocab = vocab
        self._scores = np.asarray(scores, dtype=np.float32).astype(np.float64).tolist()
        self.add_space_prefix = add_space_prefix
        self._byte_ids: list[int | None] = [
            vocab.get(f"<0x{b:02X}>", vocab.get(chr(b)) if b < 0x80 else None) for b in range(256)
        ]

    def encode(self, text: str, *, first: bool) -> list[int]:
        """The ids of one plain fragment; ``first``: it starts the text or follows a special
        token (where ``add_space_prefix`` puts a space)."""
        if self.add_space_prefix and first:
            text = " " + text
        text = text.replace(" ", SPACE)
        n = len(text)
        if not n:
            return []
        vocab, scores = self._vocab, self._scores
        length = [1] * n  # symbol i starts at character i; 0 once merged into its left
        prev = list(range(-1, n - 1))
        after = list(range(1, n + 1))
        after[-1] = -1
        queue: list[tuple[float, int, int, int]] = []

        def pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            size = length[left] + length[right]
            token = vocab.get(text[left : left + size])
            if token is not None:  # highest score first, then the leftmost
                heapq.heappush(queue, (-scores[token], left, right, size))

        for i in range(1, n):
            pair(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if not length[left] or not length[right] or length[left] + length[right] != size:
                continue  # one side was merged elsewhere since this pair was queued
            length[left] = size
            length[right] = 0
            after[left] = after[right]
            if after[right] >= 0:
                prev[after[right]] = left
            pair(prev[left], left)
            pair(left, after[left])
        ids: list[int] = []
        i = 0
        while i >= 0:
            piece = text[i : i + length[i]]
            token = vocab.get(piece)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self._byte(b, piece) for b in piece.encode("utf-8"))
            i = after[i]
        return ids

    def _byte(self, byte: int, piece: str) -> int:
        token = self._byte_ids[byte]
        if token is None:
            raise TokenizerError(
                f"{piece!r} is not in the vocabulary and its byte 0x{byte:02X} has no byte "
                f"token (<0x{byte:02X}>); the GGUF's vocabulary cannot encode this text"
            )
        return token


def decode_piece(text: str) -> bytes:
    """The bytes a normal SPM token stands for: its text with "▁" back to spaces."""
    return text.replace(SPACE, " ").encode("utf-8")
