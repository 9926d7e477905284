"""Stop strings matched across token boundaries.

Text arrives in pieces (one per detokenized token batch). `StopMatcher.push` returns only the text
that can no longer become part of a stop string: it holds back the longest tail that is a prefix of
some stop string, so a stop split over two tokens is still found and never reaches the client.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (the earliest in it)

    def push(self, text: str) -> str:
        """Feed new text; returns the text safe to emit. After a match `stopped` is True and the
        returned text ends right before the stop string."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, self.matched = i, s
        if first >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:first]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The held-back tail, at the end of generation (it turned out not to be a stop)."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
