"""Prompt lookup (n-gram speculation, as vLLM's `ngram` method): guess the next tokens by copying.

Where the output copies its input (summaries, answers quoting retrieved text,
names and numbers kept in a translation, code edits) the tokens that followed
the latest earlier occurrence of the sequence's last few tokens are a good guess
for what comes next, and one the Medusa heads, which see only the last hidden
state, rarely make. The engine puts the guess on a chain of lookup nodes in
every speculative tree (`TreeSpec.lookup`); verification is unchanged, so
outputs are too, whatever the guess.

`NgramIndex` keeps, per request, where each n-gram of its tokens (prompt +
output, the pending root last) most recently occurred, updated as tokens arrive
(O(new tokens) per step, no rescans). `propose` tries the last 3 tokens, then 2,
then 1: a longer match is more specific, a shorter one still often right (a
rare name's first token usually continues as it did before). The newest
occurrence wins because recent text (the current paragraph, the last turn) is
the likeliest to be copied.
"""

from __future__ import annotations

from typing import Iterable, Sequence

NGRAM_SIZES = (3, 2, 1)  # tried longest first
BULK_TOKENS = 16  # more new tokens than this (a prompt) are indexed in bulk


class NgramIndex:
    """One request's tokens and, for each n-gram of them, where its latest occurrence that has a
    token after it ends. The sequence's own suffix is indexed only once a token follows it, so a
    match is always an earlier occurrence."""

    def __init__(self, tokens: Iterable[int] = (), sizes: Sequence[int] = NGRAM_SIZES) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"n-gram sizes must be >= 1, got {tuple(sizes)}")
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        self.tokens: list[int] = []
        # n-gram (a tuple; lengths differ, so sizes share one dict) -> position of the token after it
        self._follower: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Iterable[int]) -> None:
        """Append tokens; every n-gram that a new token follows now points at it."""
        tokens, follower = self.tokens, self._follower
        old = len(tokens)
        tokens.extend(map(int, new_tokens))
        end = len(tokens)
        if end - old > BULK_TOKENS:
            self._index_bulk(old, end)
            return
        for at in range(old, end):  # a step's few tokens: plain loops beat building zips
            for n in self.sizes:
                if at >= n:
                    follower[tuple(tokens[at - n:at])] = at

    def _index_bulk(self, old: int, end: int) -> None:
        """Index the followers at positions old..end-1 with C-level zips (a prompt: ~1 ms per 1k tokens)."""
        tokens = self.tokens
        for n in self.sizes:
            first = max(old, n)  # positions first..end-1 follow the n tokens before them
            if first < end:
                grams = zip(*(tokens[first - n + k: end - n + k] for k in range(n)))
                self._follower.update(zip(grams, range(first, end)))  # in order, so the latest wins

    def propose(self, length: int) -> list[int]:
        """`length` guessed tokens after the current last one: those after the latest earlier
        occurrence of the longest matching suffix. A match too near the end is continued
        periodically (the suffix recurring every `period` tokens suggests the text does too);
        with no match, the last token repeated (any token is safe: verification decides)."""
        tokens = self.tokens
        for n in self.sizes:
            if len(tokens) > n:
                start = self._follower.get(tuple(tokens[-n:]))
                if start is not None:
                    return _continue_from(tokens, start, length)
        return [tokens[-1] if tokens else 0] * length


def _continue_from(tokens: list[int], start: int, length: int) -> list[int]:
    """tokens[start:start + length], extended past the end with period len(tokens) - start."""
    out = tokens[start:start + length]
    period = len(tokens) - start
    while len(out) < length:
        out.append(out[len(out) - period])
    return out
