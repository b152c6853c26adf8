"""One sequence on a runtime: which tokens the KV cache holds, and the forward steps that extend it.

A new prompt reuses the cache's longest common prefix (chat turns, repeated prompts): batch
invariance makes that bit-identical to evaluating the whole prompt again. Stale cache rows past
the prefix are never read, because attention only looks at positions up to the query's own and
KV_WRITE overwrites a position before any query at that position reads it.

Every step runs through the runtime's prepared ``Step``s, writing ids and positions into the
host buffers the runtime owns and reading results from them. Decode keeps the position on the
device (it advances there after each step) and, in greedy decoding, feeds the token the last
step's ARGMAX left on the device straight back in: a greedy decode step reads back one 4-byte id
and uploads nothing.

On a backend that queues its work (a GPU), greedy decoding keeps LOOK_AHEAD steps queued: the
step for the position after a token is started before that token is read back, fed on the
device by the step that computes it, so the device goes from one step to the next without
waiting for the host. Two prepared steps of the decode graph take turns (each on its own
buffers, each position kept on the device advancing by two), so one runs while the other's
token is read; each waits for its own work alone (the backend's marks). The host's work between
tokens (the caller's, the sampler's, the next step's setup) overlaps the device's, and the
first decode steps start as soon as the prompt's token is known. When the caller goes another
way (a different token, logits, a new prompt), the steps started ahead are waited for and
dropped: the KV rows they wrote lie past the tokens the cache holds, so nothing reads them, and
the next steps at those positions overwrite them. A generation that ends (an end-of-generation
token, its length) leaves its two steps ahead to run on: two steps of device time, waited for
by the session's next call. With SHALLOW_REACH set, the decode steps below it are graphs of
their own (GraphParams.reach), with a pair of greedy steps of their own: the first step past it
is fed on the device by the last one below it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parity.arch.decoder import DecoderGraphs
from parity.arch.params import GraphParams
from parity.core.runtime import Runtime, Step
from parity.errors import ContextLengthError, InputError

DEFAULT_BATCH = 512  # prefill tokens per graph
LOOK_AHEAD = 2  # greedy decode steps queued at once where the backends queue (two take turns)
# decode steps at positions below this run graphs of their own that promise so
# (GraphParams.reach), where the cache holds more: a backend sizes its attention to the reach
# (the cuda backend's flash decoding: 2 chunks of 256 positions and one launch where n_ctx's
# 4,096 take 16 and two). 0: one set of decode graphs for every position. On an H100 at a
# 4,352-row cache and depth 100 it took SmolLM2's step 0.581-0.591 -> 0.543 ms and Qwen's
# 0.701-0.702 -> 0.670-0.671, as fast as a 512-row cache (twenty-second session, docs/perf.md)
SHALLOW_REACH = 512
INT32 = (-(2**31), 2**31 - 1)


def decode_reaches(n_ctx: int) -> tuple[int, ...]:
    """The reaches of a session's decode graphs (GraphParams.reach): SHALLOW_REACH's where the
    cache holds more positions, and 0 (any position)."""
    return (SHALLOW_REACH, 0) if 0 < SHALLOW_REACH < n_ctx else (0,)


def session_graphs(graphs: DecoderGraphs, n_ctx: int, n_batch: int = DEFAULT_BATCH) -> list:
    """The graphs a session runs most (the decode steps, a full prefill chunk): what a model
    registers its weights for at load."""
    n_batch = min(n_batch, n_ctx)
    decode = [
        graphs(GraphParams(n_tokens=1, n_ctx=n_ctx, n_out=1, output=output, reach=reach))
        for reach in decode_reaches(n_ctx)
        for output in ("argmax", "logits")
    ]
    return decode + [
        graphs(GraphParams(n_tokens=n_batch, n_ctx=n_ctx, n_out=1, output=output))
        for output in ("argmax", "logits")
    ]


class Session:
    """The KV cache of one sequence and the steps that grow it. A decode step allocates
    nothing: its graphs, steps and host buffers exist from the start.

    ``capture_prefill=False`` keeps prefill graphs out of graph capture (decode is always
    eligible; a backend captures a step only once it has run a few times). ``slot`` picks the
    KV cache: sessions of one runtime on different slots hold different sequences.
    ``look_ahead=False`` keeps greedy decoding from starting the next step early (on backends
    that queue; elsewhere it never does)."""

    def __init__(
        self,
        runtime: Runtime,
        graphs: DecoderGraphs,
        n_ctx: int,
        n_batch: int = DEFAULT_BATCH,
        *,
        capture_prefill: bool = True,
        slot: int = 0,
        look_ahead: bool = True,
    ) -> None:
        if n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {n_batch}")
        self.runtime = runtime
        self.graphs = graphs
        self.n_ctx = n_ctx
        self.n_batch = min(n_batch, n_ctx)
        self.n_vocab = graphs.spec.n_vocab
        self.capture_prefill = None if capture_prefill else False
        self.slot = slot  # whose KV caches: sessions of one runtime on other slots are independent
        self._ids_held = np.zeros(n_ctx, np.int32)  # what the cache holds, position by position
        self.n_tokens = 0  # positions the cache holds
        self.reused = 0  # prompt tokens the last prefill took from the cache
        # the decode graphs by (greedy, reach): below SHALLOW_REACH those that promise it, and
        # those of any position (reach 0)
        self._reaches = decode_reaches(n_ctx)
        self.decode_graphs = {
            (g, r): graphs(self._graph_params(1, 1, g, r))
            for g in (False, True)
            for r in self._reaches
        }
        self._last_step: Step | None = None  # the greedy step whose ARGMAX is on the device
        self._last_token = -1  # and that ARGMAX, as read back
        self.look_ahead = look_ahead
        # the greedy decode steps started ahead (in flight), oldest first: ahead[i] at position
        # n_tokens + i, ahead[0] fed ``_last_token`` on the device by ``_last_step``, each
        # later one by the one before it (a list of at most LOOK_AHEAD: no allocation a step)
        self._ahead: list[Step] = []
        self._make_steps()

    def _make_steps(self) -> None:
        """The decode steps of each reach (a second greedy one where the backends queue: they
        take turns), what each keeps on the device, and who feeds it."""
        rt = self.runtime
        self._decode = {m: rt.step(graph, pin=True) for m, graph in self.decode_graphs.items()}
        # ... by reach, then greedy: (sampled, greedy), looked up a step without a key to build
        self._steps_at = {
            r: (self._decode[(False, r)], self._decode[(True, r)]) for r in self._reaches
        }
        self._pairs: dict[int, tuple[Step, ...]] = {}  # the greedy steps of a reach
        for r in self._reaches:
            first = self._decode[(True, r)]
            copy = rt.step(first.graph, pin=True, copy=1) if first.queues else None
            self._pairs[r] = (first, copy) if copy is not None else (first,)
        self._pair_of = {step: pair for pair in self._pairs.values() for step in pair}
        copies = [pair[1] for pair in self._pairs.values() if len(pair) > 1]
        steps = (*self._decode.values(), *copies)
        self._next_position = dict.fromkeys(steps, -1)  # what each keeps on the device
        self._advance = dict.fromkeys(steps, 0)  # ... and how far it moves a run
        self._fed_from: dict[Step, Step | None] = dict.fromkeys(steps)

    def _reach(self, position: int) -> int:
        """The reach of the decode graphs a step at ``position`` runs."""
        return self._reaches[0] if position < self._reaches[0] else 0

    def decode_graph(self, greedy: bool, position: int):
        """The graph a decode step at ``position`` runs."""
        return self.decode_graphs[(greedy, self._reach(position))]

    def greedy_pair(self, position: int) -> tuple[Step, ...]:
        """The greedy decode steps at ``position``: the step, and where the backends queue its
        second copy (they take turns)."""
        return self._pairs[self._reach(position)]

    @property
    def greedy_steps(self) -> tuple[Step, ...]:
        """Every greedy decode step (each reach's step and second copy): what a benchmark warms
        up."""
        return tuple(step for pair in self._pairs.values() for step in pair)

    @property
    def tokens(self) -> np.ndarray:
        """The token ids the cache holds, position by position (a view: copy to keep it)."""
        return self._ids_held[: self.n_tokens]

    def reset(self) -> None:
        """Forget the cached tokens; the next prompt is evaluated from position 0."""
        self._settle()
        self.n_tokens = 0
        self._last_step = None

    def _settle(self) -> None:
        """Wait for the steps started ahead and drop them: the caller went another way."""
        if not self._ahead:
            return
        while self._ahead:
            self._ahead.pop().finish()
        self._last_step = None  # the ARGMAX on the device may be a dropped step's

    def _append(self, ids: np.ndarray | int) -> None:
        if isinstance(ids, int | np.integer):  # one decode token
            self._ids_held[self.n_tokens] = ids
            self.n_tokens += 1
            return
        self._ids_held[self.n_tokens : self.n_tokens + len(ids)] = ids
        self.n_tokens += len(ids)

    def check_fits(self, n_tokens: int, what: str = "the prompt") -> None:
        if n_tokens > self.n_ctx:
            raise ContextLengthError(
                f"{what} is {n_tokens} tokens but the context holds {self.n_ctx}; shorten it "
                f"or raise the context size (--ctx / n_ctx, up to the model's "
                f"{self.graphs.spec.n_ctx_train})"
            )
        if n_tokens == 0:
            raise ContextLengthError(f"{what} is empty: nothing to evaluate")

    def _ids(self, tokens: Sequence[int]) -> np.ndarray:
        """The ids as int32 (the runtime checks them against the vocabulary)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and (ids.min() < INT32[0] or ids.max() > INT32[1])):
            raise InputError(f"token ids must be a flat sequence of ints in 0..{self.n_vocab - 1}")
        return ids.astype(np.int32)

    def _graph_params(self, n: int, n_out: int, greedy: bool, reach: int = 0) -> GraphParams:
        output = "argmax" if greedy else "logits"
        return GraphParams(
            n_tokens=n, n_ctx=self.n_ctx, n_out=n_out, output=output, slot=self.slot, reach=reach
        )

    def _run(self, tokens: np.ndarray, start: int, n_out: int, greedy: bool) -> Step:
        # a one-token prefill runs the decode graph of its position: below SHALLOW_REACH the
        # shallow one, which every decode step there runs (captured early, where the deep one
        # would run eagerly for the first prompts)
        reach = self._reach(start) if len(tokens) == 1 else 0
        step = self.runtime.step(self.graphs(self._graph_params(len(tokens), n_out, greedy, reach)))
        if step in self._fed_from:  # a one-token prefill is a decode graph: feed it from the host
            step.feed_host("tokens")
            step.feed_host("positions")
            self._fed_from[step] = None
            self._next_position[step] = -1
        step.inputs["tokens"][...] = tokens
        step.inputs["positions"][...] = np.arange(start, start + len(tokens), dtype=np.int32)
        step.run(capture=self.capture_prefill)
        return step

    def prefill(self, prompt: Sequence[int], *, greedy: bool) -> np.ndarray | int:
        """Evaluate ``prompt`` as the whole sequence, reusing the cached common prefix.
        Returns the last position's logits (n_vocab,), or its argmax id when ``greedy``."""
        self.check_fits(len(prompt))
        ids = self._ids(prompt)
        self._settle()
        held = self.tokens[: len(ids)]
        differ = np.flatnonzero(held != ids[: len(held)])
        keep = int(differ[0]) if differ.size else len(held)  # the common prefix
        keep = min(keep, len(prompt) - 1)  # the last token must run to produce output
        self.n_tokens = keep
        self.reused = keep
        self._last_step = None
        step: Step | None = None
        for start in range(keep, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last = start + len(chunk) == len(ids)
            step = self._run(chunk, start, 1, greedy or not last)  # earlier chunks: argmax only
            self._append(chunk)
        assert step is not None
        out = step.outputs[step.graph.outputs[0]]
        if not greedy:
            return out[0]
        token = int(out[0])
        self._last_step, self._last_token = step, token
        self._start_ahead()
        return token

    def step(self, token: int, *, greedy: bool) -> np.ndarray | int:
        """Append one token; returns the next position's logits (a view of a buffer the next
        step reuses) or, when ``greedy``, the argmax id. The token last returned by a greedy
        step is fed to the next one on the device; only the new id is read back."""
        pos = self.n_tokens
        self.check_fits(pos + 1, "the sequence")
        ahead = self._ahead
        if (
            greedy
            and ahead
            and self._last_token == token
            and self._next_position[ahead[0]] - self._advance[ahead[0]] == pos
            and not ahead[0].released
        ):
            step = ahead.pop(0)  # started ahead at ``pos``, fed ``token`` on the device
        else:
            self._settle()
            step = self._steps_at[self._reach(pos)][greedy]
            if step.released:  # the runtime cleared its states: its steps are new ones now
                self._make_steps()
                self._last_step = None
                step = self._steps_at[self._reach(pos)][greedy]
            source = self._last_step if greedy and self._last_token == token else None
            self._start(step, pos, token, source)
        step.finish()
        self._append(token)
        out = step.outputs[step.graph.outputs[0]]
        if not greedy:
            self._last_step = None
            return out[0]
        self._last_step, self._last_token = step, out.item(0)  # (no numpy scalar on the way)
        self._start_ahead()
        return self._last_token

    def _start(self, step: Step, pos: int, token: int, source: Step | None) -> None:
        """Start decode ``step`` at position ``pos``, fed the ARGMAX ``source`` left on the
        device, or without a source ``token`` from the host."""
        step.finish()  # (its host inputs change below; at once unless it is in flight)
        if source is not None:
            if self._fed_from[step] is not source:
                step.feed("tokens", source)
                self._fed_from[step] = source
        else:
            if self._fed_from[step] is not None:
                step.feed_host("tokens")
                self._fed_from[step] = None
            if not INT32[0] <= token <= INT32[1]:  # (the runtime checks the vocabulary)
                raise InputError(f"token id {token} is outside the vocabulary of {self.n_vocab}")
            step.inputs["tokens"][0] = token
        # (the greedy steps take turns where they look ahead: each position advances by two)
        pair = self._pair_of.get(step)  # (a sampled step: none)
        advance = len(pair) if self.look_ahead and pair is not None else 1
        if self._next_position[step] != pos or self._advance[step] != advance:
            step.inputs["positions"][0] = pos  # the device holds another position: set it
            step.keep("positions", advance=advance)
            self._advance[step] = advance
        step.start()
        self._next_position[step] = pos + advance

    def _start_ahead(self) -> None:
        """Queue greedy decode steps until LOOK_AHEAD are in flight (at most the two copies),
        where the backends queue and the context has room: the first fed ``_last_token``
        (just read back) by ``_last_step`` on the device, each later one by the one before it.
        The two copies take turns: a step is never started while it is in flight, nor while
        its ARGMAX is still to be copied into the step after it (the copy is queued before
        the restart, and the stream keeps the order)."""
        if not self.look_ahead or len(self._pairs[0]) < 2:
            return
        ahead = self._ahead
        while len(ahead) < min(LOOK_AHEAD, len(self._pairs[0])):
            pos = self.n_tokens + len(ahead)
            source = ahead[-1] if ahead else self._last_step
            if pos >= self.n_ctx or source is None:
                return
            first, second = self.greedy_pair(pos)  # (another reach's from SHALLOW_REACH on)
            step = second if first is source or first in ahead else first
            if step.released or step in ahead:
                return
            self._start(step, pos, self._last_token, source)
            ahead.append(step)

    def logits(self, tokens: Sequence[int], n_out: int | None = None) -> np.ndarray:
        """Evaluate ``tokens`` from position 0 and return the logits of the last ``n_out``
        positions (all of them by default) as an (n_out, n_vocab) float32 array."""
        self.check_fits(len(tokens), "the token sequence")
        n = len(tokens)
        n_out = n if n_out is None else n_out
        if not 1 <= n_out <= n:
            raise ValueError(f"n_out must be in 1..{n}, got {n_out}")
        ids = self._ids(tokens)
        self._settle()
        self.n_tokens = 0
        self._last_step = None
        result = np.empty((n_out, self.n_vocab), np.float32)
        first_out = n - n_out  # positions >= first_out produce rows
        for start in range(0, n, self.n_batch):
            chunk = ids[start : start + self.n_batch]
            end = start + len(chunk)
            rows = end - max(start, first_out)
            if rows > 0:
                step = self._run(chunk, start, rows, greedy=False)
                lo = max(start, first_out) - first_out
                result[lo : end - first_out] = step.outputs[step.graph.outputs[0]]
            else:
                self._run(chunk, start, 1, greedy=True)
            self._append(chunk)
        return result
