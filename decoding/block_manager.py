"""Paged KV bookkeeping: which physical blocks hold which sequence's tokens.

The KV cache is a pool of `num_blocks` blocks of `block_size` token slots. A
sequence's `block_table` maps its logical blocks to physical ones, so token
slot p lives at physical slot `block_table[p // block_size] * block_size +
p % block_size`. This module only does the bookkeeping; the model runner owns
the tensors and writes KV at the slots `slot_mapping` gives it.

A Medusa step schedules 1 + tree_size tokens per decoding sequence: the root
(already known) plus the tree's proposals, backed by *lookahead* slots. After
verification only the accepted ones stay: `commit` advances the computed count
and returns the blocks that held rejected tree tokens at once.

Prefix caching: every FULL computed block gets a key (parent block's hash,
its tokens), chained from the first block, so equal prefixes give equal keys.
A sequence's first allocation shares the cached blocks that match its leading
full blocks (ref count + 1) instead of recomputing them. A freed block keeps
its key and stays findable until the free list hands it out again (lazy
eviction): the free list is ordered so worthless blocks (no key) are reused
first, then cached ones least recently freed first.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from typing import Iterable, Optional

import numpy as np

from medusa.decoding.sequence import Sequence

# (hash of the parent block's key or None for the first block, the block's token ids).
# The dict compares whole keys, so a 64-bit hash collision between two blocks' own
# tokens can never serve another prompt's KV; only the chained parent is by hash.
BlockKey = tuple[Optional[int], tuple[int, ...]]


def _check_count(name: str, value: object, minimum: int = 0) -> int:
    # Fast path: a plain int is by far the common case, and isinstance against the
    # numbers ABC costs about a microsecond, several times per sequence per step.
    if type(value) is int and value >= minimum:
        return value
    # bool is Integral, but True as a token count is certainly a bug
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """A pool of KV blocks with reference counts, a free list and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = _check_count("num_blocks", num_blocks, minimum=1)
        self.block_size = _check_count("block_size", block_size, minimum=1)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.ref_counts = np.zeros(self.num_blocks, dtype=np.int32)  # [num_blocks]
        # Free blocks in reuse order, front first. An OrderedDict rather than a deque:
        # a cache hit takes a free block out of the middle, O(1) here, O(n) for a deque.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._block_key: list[BlockKey | None] = [None] * self.num_blocks  # set on full computed blocks
        self._cached: dict[BlockKey, int] = {}  # key -> the block found for it

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached ones included: they are reusable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by prefix (in use or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_prefix_length(self, seq: Sequence) -> int:
        """Tokens a first allocation of `seq` would take from the cache, if scheduled to its end.

        0 once the sequence holds blocks. Lets a scheduler size a chunked
        prefill so the cached part is skipped rather than cut short.
        """
        if seq.block_table or not self.enable_prefix_caching:
            return 0
        return len(self._match_prefix(seq, seq.num_tokens - 1)) * self.block_size

    def slot_mapping(self, seq: Sequence, start: int, count: int) -> np.ndarray:
        """Physical slots [count] int64 of the sequence's token slots [start, start + count)."""
        _check_count("start", start)
        _check_count("count", count)
        capacity = len(seq.block_table) * self.block_size
        if start + count > capacity:
            raise ValueError(f"slots [{start}, {start + count}) of request {seq.request_id!r} exceed "
                             f"its {capacity} allocated slots; allocate first")
        positions = np.arange(start, start + count, dtype=np.int64)  # [count]
        table = np.asarray(seq.block_table, dtype=np.int64)  # [num_blocks_of_seq]
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def block_tables(self, seqs: list[Sequence], width: int | None = None) -> np.ndarray:
        """The sequences' block tables as rows of one [len(seqs), width] int32 array, padded with 0.
        width: None for the longest table."""
        width = max((len(s.block_table) for s in seqs), default=0) if width is None else width
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        self.write_tables(seqs, tables, [None] * len(seqs))
        return tables

    def write_tables(self, seqs: list[Sequence], out: np.ndarray, written: list) -> None:
        """Row i of `out` [>= len(seqs), width] := seqs[i]'s block table padded with 0, unless written[i] says
        the row already holds it: (sequence, its `table_version`), which is updated. A decode step keeps its
        rows from step to step, and a table changes about once per block_size tokens: rebuilding all 64 rows
        every step took 88 / 218 us at 16 / 128 blocks a row (2-core CPU)."""
        width = out.shape[1]
        for i, seq in enumerate(seqs):
            mark = written[i]
            if mark is not None and mark[0] is seq and mark[1] == seq.table_version:
                continue
            table = seq.block_table
            if len(table) > width:
                raise ValueError(f"request {seq.request_id!r} holds {len(table)} blocks, more than the {width} a "
                                 "row has")
            out[i, :len(table)] = table
            out[i, len(table):] = 0
            written[i] = (seq, seq.table_version)

    # -------------------------------------------------------------- allocation

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Whether `allocate` with the same arguments would succeed now."""
        hits, num_fresh = self._plan(seq, num_new_tokens, num_lookahead)
        return self._free_blocks_taken(hits, num_fresh) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> int:
        """Back token slots [0, computed + num_new_tokens + num_lookahead) of `seq` with blocks.

        The target end is fixed by the counters at call time. On the first
        allocation, cached full blocks of the sequence's leading tokens are
        shared and `num_computed_tokens` advances past them, at most to one
        token before the end of the scheduled tokens, so the step still has a
        query. Returns how many scheduled tokens the step must still compute
        (num_new_tokens minus the cache hit); the lookahead slots come on top.
        Raises RuntimeError when the pool is short (ask `can_allocate` first);
        nothing changes then.
        """
        hits, num_fresh = self._plan(seq, num_new_tokens, num_lookahead)
        taken = self._free_blocks_taken(hits, num_fresh)
        if taken > len(self._free):
            raise RuntimeError(f"out of KV blocks: request {seq.request_id!r} needs {taken} free blocks "
                               f"but {len(self._free)} of {self.num_blocks} are free (ask can_allocate first)")
        return self._take(seq, num_new_tokens, hits, num_fresh)

    def try_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> int | None:
        """`allocate` if the pool has room now, else None (and nothing changes).

        One plan where `can_allocate` then `allocate` make two: a scheduler
        does this for every running sequence every step, and most steps of a
        decoding sequence need no new block: those return at once.
        """
        if seq.block_table and type(num_new_tokens) is int and type(num_lookahead) is int:
            end = seq.num_computed_tokens + num_new_tokens
            if (0 <= num_new_tokens and 0 <= num_lookahead and end <= seq.num_tokens
                    and end + num_lookahead <= len(seq.block_table) * self.block_size):
                return num_new_tokens  # already backed (no prefix match once a sequence holds blocks)
        hits, num_fresh = self._plan(seq, num_new_tokens, num_lookahead)
        if self._free_blocks_taken(hits, num_fresh) > len(self._free):
            return None
        return self._take(seq, num_new_tokens, hits, num_fresh)

    def commit(self, seq: Sequence, num_accepted: int, num_ahead: int = 0) -> None:
        """Keep `num_accepted` more computed tokens; release blocks the rest needed.

        Call after the KV of the accepted tokens sits in slots [computed,
        computed + num_accepted) (the runner compacts accepted tree nodes there)
        and after appending the accepted tokens to the sequence: newly full
        blocks are keyed by their token ids. `num_ahead`: slots past the new end
        that a step already scheduled will write (its tree tokens; with steps
        launched before this one's tokens were read back): their blocks stay.
        """
        if not (type(num_accepted) is int and type(num_ahead) is int and num_accepted >= 0 and num_ahead >= 0):
            num_accepted = _check_count("num_accepted", num_accepted)  # the checks inline above: every row, every step
            num_ahead = _check_count("num_ahead", num_ahead)
        old = seq.num_computed_tokens
        new = old + num_accepted
        if new > len(seq.block_table) * self.block_size:
            self._check_backed(seq)  # which of the two is wrong: the counters before, or this commit
            raise ValueError(f"num_accepted={num_accepted} goes past the {len(seq.block_table) * self.block_size} "
                             f"slots allocated to request {seq.request_id!r} ({old} computed)")
        if new > seq.num_tokens:
            raise ValueError(f"num_accepted={num_accepted} goes past the {seq.num_tokens} known tokens of request "
                             f"{seq.request_id!r}; append the accepted tokens before commit")
        seq.num_computed_tokens = new
        keep = _ceil_div(new + num_ahead, self.block_size)
        if len(seq.block_table) > keep:  # rejected tree slots and unused lookahead
            seq.table_version += 1
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        first, last = old // self.block_size, new // self.block_size
        if self.enable_prefix_caching and first < last:  # most steps fill no block: skip the call and the hashing
            self._register_full_blocks(seq, first, last)

    def free(self, seq: Sequence) -> None:
        """Release all blocks of `seq`; its KV is gone, so num_computed_tokens drops to 0. Idempotent."""
        # tail first: a later block is only reachable through its prefix, so it should be evicted first
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.table_version += 1
        seq.num_computed_tokens = 0

    # ----------------------------------------------------------------- helpers

    def _check_backed(self, seq: Sequence) -> None:
        """The sequence's computed tokens must have slots: catches counters set by hand or stale tables."""
        if seq.num_computed_tokens > len(seq.block_table) * self.block_size:
            raise ValueError(f"request {seq.request_id!r} has {seq.num_computed_tokens} computed tokens but "
                             f"only {len(seq.block_table)} blocks of {self.block_size}")

    def _plan(self, seq: Sequence, num_new_tokens: int, num_lookahead: int) -> tuple[list[int], int]:
        """(cached blocks to share, fresh blocks to pop) for an allocation; changes nothing."""
        _check_count("num_new_tokens", num_new_tokens)
        _check_count("num_lookahead", num_lookahead)
        self._check_backed(seq)
        end = seq.num_computed_tokens + num_new_tokens
        if end > seq.num_tokens:
            raise ValueError(f"num_new_tokens={num_new_tokens} goes past the {seq.num_tokens} known tokens of "
                             f"request {seq.request_id!r} ({seq.num_computed_tokens} computed); "
                             "unknown (tree) tokens go in num_lookahead")
        hits: list[int] = []
        if self.enable_prefix_caching and seq.reads_prefix_cache and not seq.block_table:
            hits = self._match_prefix(seq, end - 1)  # leave >= 1 scheduled token to compute
        needed = _ceil_div(end + num_lookahead, self.block_size) - len(seq.block_table) - len(hits)
        return hits, max(needed, 0)

    def _take(self, seq: Sequence, num_new_tokens: int, hits: list[int], num_fresh: int) -> int:
        """Carry out a plan that fits the free list (see `allocate`)."""
        end = seq.num_computed_tokens + num_new_tokens
        seq.table_version += 1
        if not seq.block_table:  # first allocation: the hit (maybe none) is this life's cached prefix
            for block in hits:  # before any fresh block is popped, which could evict a hit
                self._share(block)
            seq.block_table.extend(hits)
            seq.num_cached_prefix_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        seq.block_table.extend(self._pop_free() for _ in range(num_fresh))
        return end - seq.num_computed_tokens

    def _free_blocks_taken(self, hits: list[int], num_fresh: int) -> int:
        # a hit on a cached but free block takes it off the free list as well
        if not hits:  # every decode step's case
            return num_fresh
        return num_fresh + sum(1 for block in hits if self.ref_counts[block] == 0)

    def _match_prefix(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Cached blocks equal to the sequence's leading full blocks, covering at most max_tokens."""
        hits: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(max(max_tokens, 0) // bs):
            key = (parent, tuple(seq.token_ids(i * bs, (i + 1) * bs)))
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
            parent = hash(key)
        return hits

    def _register_full_blocks(self, seq: Sequence, first: int, last: int) -> None:
        """Key the sequence's logical blocks [first, last), which just became full (first < last)."""
        bs, table = self.block_size, seq.block_table
        parent = hash(self._block_key[table[first - 1]]) if first > 0 else None
        for i in range(first, last):
            key = (parent, tuple(seq.token_ids(i * bs, (i + 1) * bs)))
            self._block_key[table[i]] = key  # kept even if a twin is already cached: later blocks chain on it
            self._cached.setdefault(key, table[i])
            parent = hash(key)

    def _share(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._block_key[block]
        if key is not None:  # lazy eviction: its cached content dies only now
            del self._cached[key]
            self._block_key[block] = None
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        refs = int(self.ref_counts[block])  # one NumPy scalar read, not three (every decode step frees blocks)
        if refs <= 0:
            raise RuntimeError(f"block {block} released more often than allocated")
        self.ref_counts[block] = refs - 1
        if refs > 1:
            return
        self._free[block] = None  # at the back: reused last
        key = self._block_key[block]
        if key is None or self._cached.get(key) != block:
            # partial, rejected or the twin of a cached block: nothing to find it by, reuse it first
            self._block_key[block] = None
            self._free.move_to_end(block, last=False)

    # -------------------------------------------------------------- invariants

    def check_invariants(self, sequences: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (for tests).

        With `sequences` (all that hold blocks), also check that the reference
        counts are exactly the block tables' and that, with prefix caching, a
        sequence's block is keyed iff it is full and computed.
        """
        refs = self.ref_counts
        if (refs < 0).any():
            raise AssertionError(f"negative reference counts at blocks {np.flatnonzero(refs < 0).tolist()}")
        is_free = np.zeros(self.num_blocks, dtype=bool)
        is_free[list(self._free)] = True
        if not np.array_equal(is_free, refs == 0):
            bad = np.flatnonzero(is_free != (refs == 0)).tolist()
            raise AssertionError(f"blocks {bad} are both referenced and free, or neither")
        for key, block in self._cached.items():
            if self._block_key[block] != key:
                raise AssertionError(f"cache entry for block {block} does not match the block's key")
        for block, key in enumerate(self._block_key):
            if key is not None and refs[block] == 0 and self._cached.get(key) != block:
                raise AssertionError(f"free block {block} keeps a key nothing finds it by")
        if not self.enable_prefix_caching and (self._cached or any(k is not None for k in self._block_key)):
            raise AssertionError("prefix caching is off but blocks are keyed")
        if sequences is not None:
            self._check_tables(list(sequences))

    def _check_tables(self, sequences: list[Sequence]) -> None:
        counts = np.zeros(self.num_blocks, dtype=np.int64)
        for seq in sequences:
            table = seq.block_table
            if len(set(table)) != len(table):
                raise AssertionError(f"request {seq.request_id!r} lists a block twice: {table}")
            np.add.at(counts, np.asarray(table, dtype=np.int64), 1)
            if seq.num_computed_tokens > len(table) * self.block_size:
                raise AssertionError(f"request {seq.request_id!r} has computed tokens without blocks")
            num_full = seq.num_computed_tokens // self.block_size
            for i, block in enumerate(table):
                keyed = self._block_key[block] is not None
                if keyed != (self.enable_prefix_caching and i < num_full):
                    raise AssertionError(f"block {i} of request {seq.request_id!r} is keyed={keyed} "
                                         f"with {seq.num_computed_tokens} computed tokens")
        if not np.array_equal(counts, self.ref_counts):
            bad = np.flatnonzero(counts != self.ref_counts).tolist()
            raise AssertionError(f"reference counts differ from the block tables at blocks {bad}")
