"""The prompt-lookup n-gram index against a brute-force search, built at once and incrementally."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from medusa.decoding.prompt_lookup import NGRAM_SIZES, NgramIndex


def brute_force(tokens: list[int], length: int, sizes=NGRAM_SIZES) -> list[int]:
    """Rescan everything: the longest suffix (of `sizes`) with an earlier occurrence, its latest one."""
    for n in sorted(sizes, reverse=True):
        suffix = tokens[len(tokens) - n:]
        if len(tokens) <= n:
            continue
        # an occurrence ending before the last token, so a token follows it; latest first
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                out = []
                for j in range(length):  # past the end, the suffix's recurrence continues periodically
                    at = start + n + j
                    out.append(tokens[at] if at < len(tokens) else out[at - len(tokens)])
                return out
    return [tokens[-1] if tokens else 0] * length


def test_longest_match_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3]
    # (1, 2, 3) occurred at 0..2, followed by 7; (2, 3) more recently at 5..6, followed by 8
    assert NgramIndex(tokens).propose(3) == [7, 9, 2]
    assert NgramIndex(tokens, sizes=(2, 1)).propose(3) == [8, 1, 2]


def test_latest_occurrence_wins_and_a_match_near_the_end_continues_periodically():
    assert NgramIndex([5, 1, 2, 6, 1, 2, 4, 1, 2]).propose(2) == [4, 1]
    assert NgramIndex([3, 4, 3, 4]).propose(5) == [3, 4, 3, 4, 3]  # (3, 4) at 0..1: period 2
    assert NgramIndex([9, 9]).propose(3) == [9, 9, 9]


def test_no_match_pads_with_the_last_token():
    assert NgramIndex([1, 2, 3]).propose(4) == [3, 3, 3, 3]
    assert NgramIndex([]).propose(2) == [0, 0]
    assert NgramIndex([5]).propose(0) == []


def test_the_suffix_itself_is_not_a_match_until_a_token_follows_it():
    index = NgramIndex([1, 2, 3])
    assert index.propose(2) == [3, 3]
    index.extend([1, 2])  # (1, 2) occurred at 0..1, followed by 3
    assert index.propose(2) == [3, 1]


@pytest.mark.parametrize("seed", range(30))
def test_incremental_updates_match_a_rescan_every_step(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20])  # small vocabularies repeat a lot; larger ones rarely match
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
    index = NgramIndex(tokens)
    for _ in range(25):
        length = rng.randint(0, 6)
        assert index.propose(length) == brute_force(tokens, length), (tokens, length)
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]  # a step's accepted tokens + root
        tokens += new
        index.extend(new)
        assert len(index) == len(tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.integers(0, 8),
       st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True))
def test_any_tokens_and_sizes_match_the_brute_force(tokens, length, sizes):
    assert NgramIndex(tokens, sizes).propose(length) == brute_force(tokens, length, sizes)


def test_bad_sizes():
    with pytest.raises(ValueError, match="sizes"):
        NgramIndex([1], sizes=(0, 1))
