"""How many threads a step of the numba kernels gets, decided by measuring.

With another process busy on the cores, every parallel region waits for its slowest thread,
and a decode step runs hundreds of short regions: all threads can then be many times slower
than one (on a 2-core machine with one busy-loop competitor, SmolLM2's decode fell from 47 to
23 tok/s on 2 threads). Unless the thread count is fixed (``threads=``, ``PARITY_THREADS``,
``-j``), the governor times each executable's runs on all threads and on one, keeps the faster,
and measures again when the chosen count slows down or every ``RECHECK`` runs. Results never
depend on the count, so switching is free of any numeric effect.
"""

from __future__ import annotations

import attrs

RECHECK = 64  # runs between two checks of the other count, when nothing changes
SLOWER = 1.5  # a run this much slower than the chosen count's average: check the other now
SHORT_S = 0.05  # only steps shorter than this are governed (long ones are not sync-bound)
ALPHA = 0.3  # weight of a new time in the running average


@attrs.define
class _Stats:
    runs: int = 0
    governed: bool = True
    mean: dict[int, float] = attrs.Factory(dict)  # threads -> seconds (running average)
    chosen: int = 0
    since_check: int = 0
    probe: int | None = None  # the count the next run measures


class ThreadGovernor:
    """``threads(key)`` before a run of executable ``key``, ``record(key, n, seconds)`` after
    it ran on ``n`` threads."""

    def __init__(self, most: int, *, fixed: bool) -> None:
        self.most = most
        self.fixed = fixed or most == 1
        self._stats: dict[int, _Stats] = {}

    def threads(self, key: int) -> int:
        if self.fixed:
            return self.most
        s = self._stats.setdefault(key, _Stats(chosen=self.most))
        if not s.governed or s.runs == 0:  # the first run warms up on all threads
            return self.most
        return s.probe if s.probe is not None else s.chosen

    def record(self, key: int, n: int, seconds: float) -> None:
        if self.fixed:
            return
        s = self._stats[key]
        s.runs += 1
        if s.runs == 1 or not s.governed:
            return
        if s.runs == 2:
            if seconds > SHORT_S:  # a long step: all threads, always
                s.governed = False
                return
            s.mean[n], s.probe = seconds, 1  # next: the same on one thread
            return
        if s.probe is not None and n == s.probe:  # a check: its time as it is now
            s.mean[n], s.probe = seconds, None
            s.chosen = min(s.mean, key=s.mean.__getitem__)
            s.since_check = 0
            return
        old = s.mean.get(n, seconds)
        s.mean[n] = (1 - ALPHA) * old + ALPHA * seconds
        s.since_check += 1
        if seconds > SLOWER * old or s.since_check >= RECHECK:
            s.probe = 1 if s.chosen == self.most else self.most
