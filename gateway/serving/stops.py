"""Stop strings matched across token boundaries.

Text arrives in pieces (one per detokenized token batch). `StopMatcher.push` returns only the text
that can no longer become part of a stop string: it holds back the longest tail that is a prefix of
some stop string, so a stop split over two tokens is still found and never reaches the client.

Which stop ends the text: the one first completed in the stream, as vLLM's stop checker (which looks only
at each step's new text) finds it: of the occurrences in the text, the one that ends earliest; of two
that end at the same character, the longer (it starts earlier). So `baa` with stops `a` and `baa` ends
at the first `a` and yields `b`, however the text is split into pieces: the answer never depends on how
the engine batched its tokens.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (the first completed)

    def push(self, text: str) -> str:
        """Feed new text; returns the text safe to emit. After a match `stopped` is True and the
        returned text ends right before the stop string."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        # nothing completed in earlier pieces, and a stop begun there is still in the held-back tail, so
        # each stop's first occurrence in `buf` is where it is first completed in the whole stream
        found = [(i + len(s), i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if found:
            _end, first, self.matched = min(found)  # the earliest end; at a tie the earliest start
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
