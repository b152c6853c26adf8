"""Stop strings over streamed text: emit what is final, hold back what may begin a stop string.

Text ends where the first stop string to be completed begins (of two completed by the same
character, the one that began earlier): the text before it is emitted, the stop string and
anything after it are not. That is the result of feeding one character at a time, so it does
not depend on how the text is split into pieces. Between pieces only the longest tail that is
still a prefix of some stop string is held back, so streaming stalls no longer than it must.
"""

from __future__ import annotations

from collections.abc import Sequence

from parity.errors import ConfigError


class StopMatcher:
    """Feed the streamed text piece by piece; ``flush()`` at the end returns what was held."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            stops = [stops]  # one stop string, not a sequence of one-character ones
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop strings must be non-empty text, got {s!r}")
        self.stops = tuple(dict.fromkeys(stops))
        # every proper prefix of a stop string: the tails worth holding back
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self.stops), default=0)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one has

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that is final now, and whether a stop string was hit (after a hit the
        matcher stays stopped and emits nothing more)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        # (end, start, stop) of each stop string's first occurrence: the first to complete wins
        hits = [(i + len(s), i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            _, at, self.matched = min(hits)
            self._held = ""
            return buf[:at], True
        keep = self._held_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """What is still held back (the text ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held

    def _held_tail(self, buf: str) -> int:
        for n in range(min(len(buf), self._longest_prefix), 0, -1):
            if buf[-n:] in self._prefixes:
                return n
        return 0
