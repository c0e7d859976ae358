"""Incremental detokenisation with stop strings, for streaming.

Text is released only when it can no longer change: a trailing incomplete UTF-8
sequence (decoded as U+FFFD) is held back, and so is any suffix that could be
the start of a stop string.
"""

from __future__ import annotations

from typing import Any, Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.token_ids: list[int] = []
        self.text = ""  # text so far, cut at a stop string once one is seen
        self.released = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly releasable text. Sets `stopped` on a stop string."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop(text)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._holdback(text))

    def flush(self) -> str:
        """Release everything left (generation ended)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        delta, self.released = self.text[self.released:upto], upto
        return delta

    def _first_stop(self, text: str) -> int | None:
        # only the unreleased tail plus a stop's length can hold a new match
        start = max(0, self.released - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold
