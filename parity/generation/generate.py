"""Streaming generation: prefill, then one decode step per token, until a stop condition.

Greedy decoding without a repetition penalty asks the graph for ARGMAX, so each step reads back
one token id instead of a vocabulary of logits. Text is streamed as it becomes final: a token
that ends inside a UTF-8 sequence, or text that may be the start of a stop string, is held back
until the next token decides it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from parity.generation.sampling import Sampler, SamplingParams
from parity.generation.session import Session
from parity.generation.stops import StopMatcher
from parity.text.tokenizer import StreamDecoder, Tokenizer

FINISH_REASONS = ("eos", "stop", "length", "context")


@attrs.frozen
class Piece:
    """One step of a stream: the text that became final (may be empty), the token sampled at
    this step (None for the closing flush), and on the last piece why generation ended."""

    text: str
    token: int | None
    finish: str | None = None


@attrs.frozen
class TokenLogprob:
    """The log-probability of a sampled token under the model's distribution (the logits'
    log-softmax, before any sampling transform), and the ``top`` most likely (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    z = logits.astype(np.float64)
    z = z - z.max()
    log_norm = math.log(math.fsum(np.exp(z)))
    best = np.argsort(-z, kind="stable")[:top] if top else ()
    return TokenLogprob(
        token, float(z[token] - log_norm), tuple((int(i), float(z[i] - log_norm)) for i in best)
    )


@attrs.define
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the cache
    generated_tokens: int = 0
    prefill_s: float = 0.0  # evaluating the prompt, up to the first sampled token
    # the time from one token to the next, sampling and the generation's own work included and
    # the caller's time between pieces left out (with a step started ahead, the time inside
    # Session.step alone would leave out what overlapped)
    step_s: list[float] = attrs.Factory(list)

    @property
    def ttft_s(self) -> float:
        return self.prefill_s

    @property
    def decode_s(self) -> float:
        return sum(self.step_s)


class Generation:
    """A generation in progress. Iterate it for ``Piece``s; when it is exhausted ``text``,
    ``tokens``, ``finish_reason`` and ``stats`` describe the whole."""

    def __init__(
        self,
        session: Session,
        tokenizer: Tokenizer,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        logprobs: int | None = None,
    ) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        session.check_fits(len(prompt))
        self.session = session
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.sampler = Sampler(sampling, tokenizer.n_vocab)
        # logprobs: the logits are needed, so no ARGMAX graph (the same tokens either way)
        self.logprobs = logprobs
        self.greedy = sampling.greedy and sampling.repetition_penalty == 1.0 and logprobs is None
        self.last_logprob: TokenLogprob | None = None  # of the token last picked, with logprobs
        self.stop = StopMatcher(stop)
        self.ignore_eos = ignore_eos
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self._iter = self._run()

    def __iter__(self) -> Iterator[Piece]:
        return self._iter

    def __next__(self) -> Piece:
        return next(self._iter)

    def complete(self) -> Generation:
        """Run to the end without streaming; returns self."""
        for _ in self._iter:
            pass
        return self

    def _pick(self, out: object) -> int:
        if self.greedy:
            return int(out)  # type: ignore[call-overload]
        token = self.sampler(out, self.session.tokens)  # type: ignore[arg-type]
        if self.logprobs is not None:
            self.last_logprob = token_logprob(out, token, self.logprobs)  # type: ignore[arg-type]
        return token

    def _run(self) -> Iterator[Piece]:
        session, stats = self.session, self.stats
        t0 = time.perf_counter()
        if self.max_tokens == 0:
            self.finish_reason = "length"
            yield Piece("", None, "length")
            return
        out = session.prefill(self.prompt, greedy=self.greedy)
        stats.reused_tokens = session.reused
        token = self._pick(out)
        picked = time.perf_counter()
        stats.prefill_s = picked - t0
        decoder = self.tokenizer.stream_decoder()
        eog = frozenset() if self.ignore_eos else self.tokenizer.eog_ids
        while True:
            if token in eog:
                yield self._finish("eos", token, "", decoder)
                return
            self.tokens.append(token)
            stats.generated_tokens += 1
            emit, stopped = self.stop.feed(decoder.push(token))
            self.text += emit
            if stopped:
                yield self._finish("stop", token, emit)
                return
            if len(self.tokens) >= self.max_tokens:
                yield self._finish("length", token, emit, decoder)
                return
            if session.n_tokens >= session.n_ctx:
                yield self._finish("context", token, emit, decoder)
                return
            paused = time.perf_counter()
            yield Piece(emit, token)
            resumed = time.perf_counter()
            token = self._pick(session.step(token, greedy=self.greedy))
            now = time.perf_counter()
            stats.step_s.append((paused - picked) + (now - resumed))
            picked = now

    def _finish(
        self, reason: str, token: int, emit: str = "", decoder: StreamDecoder | None = None
    ) -> Piece:
        """The last piece: what is final now, plus whatever was held back (a partial UTF-8
        sequence or a possible stop-string prefix), unless a stop string cut the text."""
        if reason != "stop":
            tail, stopped = self.stop.feed(decoder.flush() if decoder is not None else "")
            if stopped:
                reason = "stop"
            else:
                tail += self.stop.flush()
            self.text += tail
            emit += tail
        self.finish_reason = reason
        return Piece(emit, token, reason)
