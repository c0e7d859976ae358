"""Decide which sequences run this step and how many tokens each computes.

Tokens, not phases: a prompt chunk costs its length, a decoding sequence costs
1 + tree size (its tree is verified in the same forward). Decoding sequences go
first (they hold users' streams), then unfinished prompt chunks, then new
requests in arrival order, all under `max_num_batched_tokens` and
`max_num_seqs`. When blocks run out, the newest running sequence is preempted:
its blocks are freed and it re-enters the queue to be recomputed later.

A decoding sequence whose last step is still running on the device (launched
before its tokens were read back) gets blocks for the tokens that step may
still add as well (`Sequence.num_inflight_tokens`): the device places the new
tree after them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

from medusa.decoding.block_manager import BlockManager
from medusa.decoding.sequence import Sequence, SequenceStatus
from medusa.tree import TreeSpec


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # Tree tokens allowed per step over all decoding sequences: the verification
    # cost stays near a plain step's while batch x tree size is under this, so
    # larger batches get smaller trees, down to the single node.
    max_tree_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")


class ScheduledSeq(NamedTuple):  # a tuple, not a frozen dataclass: one per running sequence per step, made 2x faster
    seq: Sequence
    num_tokens: int  # tokens this step computes for the sequence
    is_prefill: bool


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    tree: TreeSpec  # the tree every decoding sequence verifies this step
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def prefill_target(seq: Sequence) -> int:
    """Tokens whose KV must exist before the sequence decodes: all but a pending root."""
    return seq.num_tokens - (1 if seq.output_token_ids else 0)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, trees: list[TreeSpec]) -> None:
        self.config, self.blocks = config, blocks
        self.trees = sorted(trees, key=lambda t: t.num_nodes) or [TreeSpec()]
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # batch size -> tree, measured by the engine on the device (LLMEngine.warmup); the policy itself, or
        # its answer for a batch size it did not measure, None: the token budget picks
        self.policy: Callable[[int], TreeSpec | None] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.blocks.free(seq)
                    return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """Drop a finished sequence and free its blocks."""
        self.running.remove(seq)
        self.blocks.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def tree_for(self, num_decoding: int) -> TreeSpec:
        """The measured policy's tree, else the largest tree whose tokens for all decoding sequences fit the budget.

        Either way the tree fits the step's token budget: a decoding sequence whose
        tree never fits would never be scheduled again.
        """
        budget = self.config.max_num_batched_tokens
        if self.policy is not None and num_decoding > 0:
            tree = self.policy(num_decoding)
            if tree is not None and tree.num_nodes <= budget:
                return tree
        limit = min(self.config.max_tree_tokens, budget)
        fitting = [t for t in self.trees if t.num_nodes * num_decoding <= limit]
        return fitting[-1] if fitting else self.trees[0]

    def schedule(self, preempt: bool = True) -> SchedulerOutput | None:
        """This step's plan. preempt=False (a step is in flight): None, rather than preempting, when the
        blocks run short; the caller reads the step back and schedules again. Blocks allocated before
        that stay with their sequences (the next commit releases what they do not need)."""
        budget = self.config.max_num_batched_tokens
        targets = [prefill_target(s) for s in self.running]  # computed per sequence once, used twice
        ends = [s.num_computed_tokens + s.num_inflight_tokens for s, t in zip(self.running, targets)
                if s.num_computed_tokens >= t]  # decoding sequences' slots in use before their trees
        tree = self._fitting(self.tree_for(len(ends)), max(ends, default=0))
        num_nodes = tree.num_nodes
        scheduled, preempted = [], []
        for seq, target in zip(list(self.running), targets):
            if preempted and seq in preempted:  # preempted earlier in this loop (a list scan only then)
                continue
            is_prefill = seq.num_computed_tokens < target
            need = min(target - seq.num_computed_tokens, budget) if is_prefill else num_nodes
            if need <= 0 or need > budget:
                continue
            # a decoding sequence computes its root (known: 1; 0 while only the device has a new request's
            # first token, `LLMEngine._start_decoding`) and its tree's other nodes, past its steps in flight
            count = need if is_prefill else seq.num_tokens - seq.num_computed_tokens
            lookahead = 0 if is_prefill else need - count + seq.num_inflight_tokens
            if not preempt:
                if self.blocks.try_allocate(seq, count, lookahead) is None:
                    return None
            elif not self._allocate_making_room(seq, count, lookahead, preempted):
                break
            scheduled.append(ScheduledSeq(seq, need, is_prefill))
            budget -= need
        if not preempted:  # memory is short: admitting now would only thrash
            self._admit(scheduled, budget)
        return SchedulerOutput(scheduled, tree, preempted)

    def _fitting(self, tree: TreeSpec, longest: int) -> TreeSpec:
        """`tree`, or the largest smaller one that the whole pool can back for the longest decoding
        sequence (`longest` slots before its tree): otherwise preemption would free every other
        sequence, then that one, and it would never run again. The single node always fits."""
        size = self.blocks.block_size
        fits = lambda t: -(-(longest + t.num_nodes) // size) <= self.blocks.num_blocks  # noqa: E731
        if fits(tree):
            return tree
        smaller = [t for t in self.trees if t.num_nodes <= tree.num_nodes and fits(t)]
        return smaller[-1] if smaller else self.trees[0]

    def _allocate_making_room(self, seq: Sequence, count: int, lookahead: int, preempted: list[Sequence]) -> bool:
        """Allocate for `seq`, preempting the newest running sequences until it fits; False if `seq` itself went."""
        while self.blocks.try_allocate(seq, count, lookahead) is None:
            victim = self.running[-1]
            self.running.remove(victim)
            self.blocks.free(victim)
            victim.status = SequenceStatus.WAITING
            self.waiting.appendleft(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            chunk = min(prefill_target(seq) - seq.num_computed_tokens, budget)
            to_compute = self.blocks.try_allocate(seq, chunk)
            if to_compute is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, to_compute, True))
            budget -= to_compute
