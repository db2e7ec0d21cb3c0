"""Incremental detokenization with stop strings: the streamed pieces concatenate to exactly the non-streamed text.

The whole token list is decoded on every update (outputs are at most a few hundred tokens), and text that may still
change is held back: a trailing incomplete UTF-8 character (U+FFFD) and any suffix that could be the start of a stop
string. The final text is ``decode(all tokens)`` cut before the first stop string, as the engines produce it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StreamText:
    """Feed token ids as they are committed; get back the text that is final so far."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly final text (possibly empty). After a stop string nothing more is returned."""
        if self.stopped or not token_ids:
            return ""
        self.ids.extend(int(t) for t in token_ids)
        full = self._decode(self.ids)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            self.text = full[:cut]
            return self._take(len(self.text))
        self.text = full
        return self._take(len(full) - self._holdback(full))

    def finish(self) -> str:
        """The rest of the text once generation ended (nothing is held back any more)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        n = 0
        while n < len(text) and text[len(text) - 1 - n] == "\ufffd":
            n += 1
        if n:
            return n
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    best = max(best, k)
                    break
        return best
