"""BlockManager and Sequence: paged KV bookkeeping, lookahead slots, prefix caching (CPU, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from medusa.decoding.block_manager import BlockManager
from medusa.kernels.tree_placement import row_slots
from medusa.decoding.sequence import FinishReason, Sequence, SequenceStatus

BS = 16


def _prefill(bm: BlockManager, seq: Sequence) -> int:
    """Schedule the whole uncomputed part, compute it, commit it; returns the tokens computed."""
    n = bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    bm.commit(seq, n)
    return n


# ----------------------------------------------------------------- Sequence


def test_sequence_counters_and_tokens():
    seq = Sequence("r", (1, 2, 3))
    seq.append_tokens([4, 5])
    assert seq.num_tokens == 5 and seq.all_token_ids == [1, 2, 3, 4, 5] and seq.last_token_id == 5
    assert seq.token_ids(1, 4) == [2, 3, 4] and seq.token_ids(3, 5) == [4, 5] and seq.token_ids(0, 2) == [1, 2]
    seq.num_computed_tokens = 17
    assert seq.num_blocks_needed(16) == 2 and seq.num_blocks_needed(16, extra=15) == 2
    assert seq.num_blocks_needed(16, extra=16) == 3
    assert seq.status is SequenceStatus.WAITING
    seq.finish("length")
    assert seq.is_finished and seq.finish_reason is FinishReason.LENGTH and seq.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence("empty", [])
    with pytest.raises(ValueError):
        seq.finish("tired")


# ------------------------------------------------------ allocation basics


def test_lookahead_reserved_then_released_on_commit():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", list(range(6)))
    assert bm.allocate(seq, 6) == 6 and len(seq.block_table) == 2
    seq.append_tokens([100])
    bm.commit(seq, 6)
    assert len(seq.block_table) == 2 and seq.num_computed_tokens == 6
    # decode step: the root plus a 9-node tree -> slots [6, 16): 4 blocks
    assert bm.allocate(seq, 1, num_lookahead=9) == 1 and len(seq.block_table) == 4
    seq.append_tokens([101, 102, 103])  # two tree tokens accepted, plus the next root
    bm.commit(seq, 3)  # root + 2 accepted -> 9 computed -> 3 blocks
    assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.check_invariants([seq])


def test_slot_mapping_matches_hand_computation():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", list(range(12)))
    seq.block_table = [7, 2, 5]
    slots = bm.slot_mapping(seq, 2, 7)  # token slots 2..8
    assert slots.tolist() == [30, 31, 8, 9, 10, 11, 20]
    assert bm.slot_mapping(seq, 0, 0).tolist() == []
    with pytest.raises(ValueError, match="allocate first"):
        bm.slot_mapping(seq, 10, 3)
    with pytest.raises(ValueError, match="start"):
        bm.slot_mapping(seq, -1, 1)


def test_batched_tables_and_device_slots_match_per_sequence():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b, c = Sequence("a", list(range(12))), Sequence("b", list(range(5))), Sequence("c", [1])
    a.block_table, b.block_table, c.block_table = [7, 2, 5], [9, 3], [11]
    a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens = 5, 4, 0
    tables = bm.block_tables([a, b, c], width=4)
    assert tables.dtype == np.int32 and tables.tolist() == [[7, 2, 5, 0], [9, 3, 0, 0], [11, 0, 0, 0]]
    assert bm.block_tables([a, b]).shape == (2, 3) and bm.block_tables([]).shape == (0, 0)
    # the decode step computes its slots on the device from the tables and each row's committed length
    starts = torch.tensor([s.num_computed_tokens for s in (a, b, c)])
    slots = row_slots(torch.from_numpy(tables), starts, 3, 4)
    assert slots.dtype == torch.long
    assert slots.tolist() == [bm.slot_mapping(s, s.num_computed_tokens, 3).tolist() for s in (a, b, c)]
    with pytest.raises(ValueError, match="'a' holds 3 blocks"):
        bm.block_tables([a, b], width=2)


def test_device_slots_match_slot_mapping_on_random_tables():
    g = torch.Generator().manual_seed(3)
    for block_size in (1, 4, 16):
        bm = BlockManager(num_blocks=64, block_size=block_size)
        seqs = [Sequence(str(i), [1]) for i in range(6)]
        count, least = 5, -(-6 // block_size)  # at least count + 1 slots per sequence
        for seq in seqs:
            held = int(torch.randint(least, least + 7, (1,), generator=g))
            seq.block_table = torch.randperm(64, generator=g)[:held].tolist()
        starts = [int(torch.randint(0, len(s.block_table) * block_size - count + 1, (1,), generator=g)) for s in seqs]
        tables = torch.from_numpy(bm.block_tables(seqs, width=least + 7))
        slots = row_slots(tables, torch.tensor(starts), count, block_size)
        assert slots.tolist() == [bm.slot_mapping(s, st, count).tolist() for s, st in zip(seqs, starts)]


def test_commit_keeps_the_blocks_a_scheduled_step_writes():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = Sequence("a", list(range(6)))
    bm.allocate(seq, 6)
    seq.num_computed_tokens = 5  # decoding: the last token is the pending root
    bm.allocate(seq, 1, num_lookahead=15)  # a 16-node tree: slots [5, 21), six blocks
    assert len(seq.block_table) == 6
    seq.append_tokens([7, 8])
    bm.commit(seq, 2, num_ahead=8)  # 7 computed, the next step's 8-node tree at [7, 15): four blocks stay
    assert seq.num_computed_tokens == 7 and len(seq.block_table) == 4
    bm.commit(seq, 0)
    assert len(seq.block_table) == 2
    with pytest.raises(ValueError, match="num_ahead must be an integer >= 0"):
        bm.commit(seq, 0, num_ahead=-1)
    bm.free(seq)
    bm.check_invariants([])


def test_counts_accept_numpy_integers_and_reject_bools():
    bm = BlockManager(num_blocks=np.int64(4), block_size=4)
    seq = Sequence("a", [1, 2, 3])
    assert bm.allocate(seq, np.int32(3)) == 3
    with pytest.raises(ValueError, match="num_accepted must be an integer >= 0, got True"):
        bm.commit(seq, True)
    with pytest.raises(ValueError, match="num_accepted must be an integer >= 0, got 2.0"):
        bm.commit(seq, 2.0)
    bm.commit(seq, np.int64(3))
    assert seq.num_computed_tokens == 3


def test_pool_exhaustion_fails_cleanly():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = Sequence("a", list(range(13))), Sequence("b", list(range(50, 60)))
    bm.commit(a, bm.allocate(a, 13))  # 4 blocks: the whole pool
    assert bm.usage == 1.0 and not bm.can_allocate(b, 1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 10)
    assert bm.try_allocate(b, 10) is None
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert not bm.can_allocate(a, 0, num_lookahead=4)  # a's 17th slot needs a fifth block
    with pytest.raises(RuntimeError):
        bm.allocate(a, 0, num_lookahead=4)
    assert len(a.block_table) == 4
    bm.check_invariants([a, b])
    bm.free(a)
    assert bm.can_allocate(b, 10) and bm.usage == 0.0
    assert bm.try_allocate(b, 10) == 10 and len(b.block_table) == 3
    bm.check_invariants([a, b])


def test_a_step_already_backed_takes_no_block_and_bad_counts_still_raise():
    """try_allocate's early return (a decoding sequence's usual step) changes nothing and checks what the
    full plan checks."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(6)))
    assert bm.try_allocate(a, 6, num_lookahead=2) == 6 and len(a.block_table) == 2  # slots 0..7
    bm.commit(a, 5)
    free, table = bm.num_free_blocks, list(a.block_table)
    assert bm.try_allocate(a, 1, num_lookahead=2) == 1  # slots 5..7: backed
    assert a.block_table == table and bm.num_free_blocks == free and a.num_computed_tokens == 5
    assert bm.try_allocate(a, 1, num_lookahead=3) == 1 and len(a.block_table) == 3  # slot 8: a new block
    for bad in ({"num_new_tokens": 2}, {"num_new_tokens": -1}, {"num_new_tokens": True},
                {"num_new_tokens": 1, "num_lookahead": -1}):
        with pytest.raises(ValueError):
            bm.try_allocate(a, **bad)
    bm.check_invariants([a])


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(seq, -1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.can_allocate(seq, 4)  # only 3 tokens are known
    with pytest.raises(ValueError, match="num_lookahead"):
        bm.allocate(seq, 1, num_lookahead=True)
    bm.allocate(seq, 3)
    with pytest.raises(ValueError, match="num_accepted"):
        bm.commit(seq, 5)  # past the allocated slots
    bm.allocate(seq, 0, num_lookahead=1)
    with pytest.raises(ValueError, match="append the accepted tokens"):
        bm.commit(seq, 4)  # slot exists but token 4 is unknown
    with pytest.raises(ValueError, match="num_accepted"):
        bm.commit(seq, -1)


def test_free_is_idempotent_and_resets_kv_counters():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence("a", list(range(9)))
    _prefill(bm, seq)
    bm.free(seq)
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and bm.num_free_blocks == 4
    assert not bm.ref_counts.any()
    bm.check_invariants([seq])


# ------------------------------------------------------------ prefix caching


def test_shared_prefix_blocks_are_shared_and_survive_one_free():
    bm = BlockManager(num_blocks=32, block_size=BS)
    prompt = list(range(1000, 1053))  # 3 full blocks + 5 tokens
    a, b = Sequence("a", prompt), Sequence("b", prompt)
    assert _prefill(bm, a) == 53 and a.num_cached_prefix_tokens == 0
    assert bm.cached_prefix_length(b) == 48
    assert bm.allocate(b, 53) == 5  # only the partial block is computed
    assert b.num_cached_prefix_tokens == 48 and b.num_computed_tokens == 48
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert bm.ref_counts[a.block_table[:3]].tolist() == [2, 2, 2]
    bm.commit(b, 5)
    bm.check_invariants([a, b])
    shared = list(b.block_table)
    bm.free(a)
    assert b.block_table == shared and bm.ref_counts[shared].tolist() == [1, 1, 1, 1]
    bm.check_invariants([b])
    bm.free(b)
    assert bm.num_free_blocks == 32 and not bm.ref_counts.any()
    c = Sequence("c", prompt + [7, 7])  # both freed: the cache still finds the prefix
    assert bm.allocate(c, c.num_tokens) == 7 and c.num_cached_prefix_tokens == 48
    assert c.block_table[:3] == shared[:3]
    bm.check_invariants([c])


def test_different_prompts_do_not_match_and_hashes_chain():
    bm = BlockManager(num_blocks=32, block_size=BS)
    prompt = list(range(1000, 1053))
    _prefill(bm, Sequence("a", prompt))
    other = Sequence("d", [5] + prompt[1:])  # differs in the first token only
    assert bm.allocate(other, other.num_tokens) == 53 and other.num_cached_prefix_tokens == 0
    second_differs = Sequence("e", prompt[:20] + [9] + prompt[21:])
    assert bm.allocate(second_differs, 53) == 37 and second_differs.num_cached_prefix_tokens == 16
    # block 2 alone equals a's block 2, but its parent differs: the chain must not match it
    shifted = Sequence("f", [1] * 16 + prompt[16:])
    assert bm.cached_prefix_length(shifted) == 0


def test_whole_prompt_cached_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(48))  # exactly 3 full blocks
    _prefill(bm, Sequence("a", prompt))
    b = Sequence("b", prompt)
    assert bm.cached_prefix_length(b) == 32
    assert bm.allocate(b, 48) == 16 and b.num_computed_tokens == 32 < b.num_tokens
    # a short first chunk caps the hit below the chunk's end
    c = Sequence("c", prompt)
    assert bm.allocate(c, 20) == 4 and c.num_cached_prefix_tokens == 16


def test_generated_tokens_become_shareable_after_commit():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence("a", [1, 2, 3])
    _prefill(bm, a)
    a.append_tokens([9])  # the first sampled token: the next root
    for step in range(3):  # decode with a 3-node lookahead, accepting root + 1
        bm.allocate(a, 1, num_lookahead=3)
        a.append_tokens([10 + step, 20 + step])
        bm.commit(a, 2)
    assert a.num_computed_tokens == 9 and bm.num_cached_blocks == 2
    b = Sequence("b", a.all_token_ids[:9])  # two full blocks, prompt and output mixed
    assert bm.allocate(b, 9) == 1 and b.block_table[:2] == a.block_table[:2]
    bm.check_invariants([a, b])


def test_eviction_is_lazy_and_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = Sequence("a", list(range(5))), Sequence("b", list(range(100, 105)))
    _prefill(bm, a)
    _prefill(bm, b)
    bm.free(a)
    bm.free(b)  # free list: b's partial, a's partial (no key: reused first), a's full, b's full
    assert bm.num_cached_blocks == 2
    c = Sequence("c", list(range(200, 210)))  # needs 3 blocks: the 2 partial ones, then a's full one
    bm.allocate(c, 10)
    assert bm.num_cached_blocks == 1
    assert bm.cached_prefix_length(Sequence("a2", list(range(5)))) == 0
    assert bm.cached_prefix_length(Sequence("b2", list(range(100, 105)))) == 4
    bm.check_invariants([c])


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = Sequence("a", list(range(9))), Sequence("b", list(range(9)))
    _prefill(bm, a)
    assert bm.allocate(b, 9) == 9 and set(a.block_table).isdisjoint(b.block_table)
    assert bm.num_cached_blocks == 0 and bm.cached_prefix_length(b) == 0
    bm.check_invariants([a, b])


# ------------------------------------------------------- randomized property


class BlockManagerMachine(RuleBasedStateMachine):
    """Random add / allocate (with lookahead) / commit / preempt / finish over many sequences.

    A fake KV pool (one token id per slot) stands in for the model: allocation
    writes garbage into the new slots (a forward writes tree tokens there), and
    commit writes the accepted tokens (the runner's compaction). Every live
    sequence's computed slots must then read back its own tokens: a block
    handed out while still shared or cached would be caught.
    """

    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 64), caching=st.booleans())
    def setup(self, block_size: int, num_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.kv = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.live: list[Sequence] = []
        self.pending: dict[str, tuple[int, int]] = {}  # request id -> (end of scheduled tokens, lookahead)
        self.next_id = 0

    @rule(base=st.integers(0, 2), shared=st.sampled_from([0, 3, 8, 20, 40]),
          tail=st.lists(st.integers(0, 2), max_size=12))
    def add(self, base: int, shared: int, tail: list[int]) -> None:
        prompt = [base * 7 + i % 5 for i in range(shared)] + tail  # a few common prefixes, tiny alphabet
        if prompt:
            self.live.append(Sequence(f"r{self.next_id}", prompt))
            self.next_id += 1

    def _idle(self) -> list[Sequence]:
        return [s for s in self.live if s.request_id not in self.pending]

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self._idle()))
        remaining = seq.num_tokens - seq.num_computed_tokens
        num_new = data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)))  # all, or a chunk
        lookahead = data.draw(st.integers(0, 12))
        end = seq.num_computed_tokens + num_new
        if not self.bm.can_allocate(seq, num_new, lookahead):
            before = (list(seq.block_table), seq.num_computed_tokens, self.bm.num_free_blocks)
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq, num_new, lookahead)
            assert (seq.block_table, seq.num_computed_tokens, self.bm.num_free_blocks) == before
            return
        first = not seq.block_table
        to_compute = self.bm.allocate(seq, num_new, lookahead)
        assert 1 <= to_compute == end - seq.num_computed_tokens
        assert seq.num_computed_tokens % self.bm.block_size == 0 or not first
        assert len(seq.block_table) == -(-(end + lookahead) // self.bm.block_size)
        start = seq.num_computed_tokens
        self.kv[self.bm.slot_mapping(seq, start, end + lookahead - start)] = -2  # the forward's writes
        self.pending[seq.request_id] = (end, lookahead)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in self.live if s.request_id in self.pending]))
        end, lookahead = self.pending.pop(seq.request_id)
        old = seq.num_computed_tokens
        accepted = data.draw(st.integers(0, end + lookahead - old))
        # the engine appends accepted tree tokens and the next root before committing
        missing = max(0, old + accepted + 1 - seq.num_tokens)
        seq.append_tokens(data.draw(st.lists(st.integers(0, 2), min_size=missing, max_size=missing)))
        self.kv[self.bm.slot_mapping(seq, old, accepted)] = seq.token_ids(old, old + accepted)
        self.bm.commit(seq, accepted)
        assert len(seq.block_table) == -(-seq.num_computed_tokens // self.bm.block_size)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finish=st.booleans())
    def free(self, data: st.DataObject, finish: bool) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq)
        self.pending.pop(seq.request_id, None)
        if finish:
            self.live.remove(seq)  # else preempted: it waits and recomputes (prompt + output) later
        assert seq.block_table == [] and seq.num_computed_tokens == 0

    @invariant()
    def bookkeeping_holds(self) -> None:
        self.bm.check_invariants(self.live)
        for seq in self.live:
            n = seq.num_computed_tokens
            assert self.kv[self.bm.slot_mapping(seq, 0, n)].tolist() == seq.token_ids(0, n)
            if seq.request_id not in self.pending:
                assert len(seq.block_table) == -(-n // self.bm.block_size)

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_blocks and not self.bm.ref_counts.any()


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_block_manager_random_interleavings = BlockManagerMachine.TestCase
