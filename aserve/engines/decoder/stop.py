"""Stop strings over streamed text.

The stop text itself is never emitted, and text that could still turn into
a stop string (a suffix that is a prefix of one) is held back until the next
piece shows whether it does. Released text therefore never contains any part
of a stop string that later matched.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Per sequence; ``push`` each text piece, ``flush`` when the sequence ends otherwise."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None

    def push(self, piece: str, armed: bool = True) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string matched.

        After a match, the text before it is returned and the matcher is done.
        Not ``armed`` (before a request's ``min_tokens``), nothing matches and
        nothing is held back: that text is never part of a stop string.
        """
        if not self.stops or self.matched is not None:
            return (piece if self.matched is None else ""), self.matched is not None
        text = self._held + piece
        if not armed:
            self._held = ""
            return text, False
        hit = -1
        for stop in self.stops:
            at = text.find(stop)
            if at != -1 and (hit == -1 or at < hit):
                hit, self.matched = at, stop
        if hit != -1:
            self._held = ""
            return text[:hit], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text; for when the sequence ends without a match."""
        text, self._held = self._held, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
