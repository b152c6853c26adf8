"""The generation engine: one model, ``slots`` KV caches, a bounded FIFO queue, one thread.

A request becomes a ``Job``. ``Engine.submit`` queues it, or refuses it with a 429 when more
than ``queue`` requests already wait for a slot. The engine thread gives each waiting job, in
order of arrival, the free slot whose cached tokens share the longest prefix with its prompt
(a shared system prompt or a growing chat is not evaluated again), then runs the active jobs
one step each, in turn. A cancelled job (its client went away) gives its slot back before the
next step. Pieces travel to the job's asyncio queue on the server's event loop, so the loop
never waits on the model.

Batching several sequences into one step can replace ``_step_all`` without changing the slot,
queue or job code.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from parity.errors import ParityError
from parity.generation.generate import Generation, Piece
from parity.generation.sampling import SamplingParams
from parity.generation.session import Session
from parity.server.metrics import Metrics
from parity.server.protocol import ApiError

DONE = object()  # the last item a job's queue receives


@attrs.define(eq=False)
class Job:
    """One request's generation, as the engine runs it."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str]
    logprobs: int | None
    loop: asyncio.AbstractEventLoop
    ignore_eos: bool = False
    out: asyncio.Queue = attrs.Factory(asyncio.Queue)
    cancelled: threading.Event = attrs.Factory(threading.Event)
    submitted: float = attrs.Factory(time.perf_counter)
    generation: Generation | None = None
    slot: int | None = None
    error: Exception | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def _emit(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


class Engine:
    """Runs jobs on ``model``'s slots; ``start`` launches the thread, ``stop`` ends it."""

    def __init__(self, model: Any, *, slots: int, queue: int, metrics: Metrics) -> None:
        if slots < 1 or queue < 0:
            raise ValueError(f"need slots >= 1 and queue >= 0, got {slots} and {queue}")
        self.model = model
        self.sessions: list[Session] = [model.session] + [
            model.new_session(s) for s in range(1, slots)
        ]
        self.queue_limit = queue
        self.metrics = metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[int, Job] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="parity-engine", daemon=True)

    # -- the server's side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def submit(self, job: Job) -> None:
        with self._cond:
            free = len(self.sessions) - len(self._active)
            if len(self._waiting) + 1 - free > self.queue_limit:  # it would wait beyond the queue
                raise ApiError(
                    429,
                    f"the server is busy: {len(self._waiting)} requests wait for one of "
                    f"{len(self.sessions)} slots; retry shortly",
                    type="rate_limit_exceeded",
                    code="server_busy",
                    headers={"Retry-After": "1"},
                )
            self._waiting.append(job)
            self.metrics.queue_depth = len(self._waiting)
            self._cond.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._drop_cancelled()
                self._assign()
                while not self._active and not self._stopping:
                    self._cond.wait()
                    self._drop_cancelled()
                    self._assign()
                if self._stopping:
                    for job in [*self._waiting, *self._active.values()]:
                        job._emit(ApiError(503, "the server is shutting down", type="server_error"))
                        job._emit(DONE)
                    return
                jobs = list(self._active.items())
            self._step_all(jobs)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled.is_set()]:
            self._waiting.remove(job)
        for slot, job in list(self._active.items()):
            if job.cancelled.is_set():
                del self._active[slot]
        self.metrics.queue_depth = len(self._waiting)

    def _assign(self) -> None:
        """Waiting jobs, first come first served, onto free slots: each to the free slot whose
        cached tokens share the longest prefix with its prompt."""
        while self._waiting and len(self._active) < len(self.sessions):
            job = self._waiting.popleft()
            free = [s for s in range(len(self.sessions)) if s not in self._active]
            job.slot = max(free, key=lambda s: (_shared(self.sessions[s].tokens, job.prompt), -s))
            self._active[job.slot] = job
        self.metrics.queue_depth = len(self._waiting)

    def _step_all(self, jobs: list[tuple[int, Job]]) -> None:
        for slot, job in jobs:
            if job.cancelled.is_set():
                continue
            try:
                piece = self._step(slot, job)
            except Exception as e:  # one request's failure must not stop the others
                job.error = e
                if not isinstance(e, ParityError):
                    print(f"parity serve: a request failed: {type(e).__name__}: {e}",
                          file=sys.stderr)  # fmt: skip
                piece = None
            if piece is None or piece.finish is not None:
                job._emit(job.error if piece is None else piece)
                job._emit(DONE)
                with self._cond:
                    self._active.pop(slot, None)
                continue
            job._emit(piece)

    def _step(self, slot: int, job: Job) -> Piece:
        if job.generation is None:
            job.generation = self.model.generate(
                job.prompt, max_tokens=job.max_tokens, sampling=job.sampling, stop=job.stop,
                session=self.sessions[slot], logprobs=job.logprobs, ignore_eos=job.ignore_eos,
            )  # fmt: skip
            piece = next(job.generation)
            self.metrics.observe_ttft(time.perf_counter() - job.submitted)
            return piece
        t0 = time.perf_counter()
        piece = next(job.generation)
        self.metrics.observe_token(time.perf_counter() - t0)
        return piece


def _shared(held: np.ndarray, prompt: Sequence[int]) -> int:
    n = min(len(held), len(prompt))
    if n == 0:
        return 0
    differ = np.flatnonzero(held[:n] != np.asarray(prompt[:n], dtype=held.dtype))
    return int(differ[0]) if differ.size else n
