"""One request's state inside the paged engine.

A `Sequence` is deliberately mutable and plain: the scheduler, the block
manager and the engine update its counters every step. Token ids live in two
lists (prompt, output); the KV side is described by two counters and a block
table:

    all_token_ids:  [ prompt ............ | output ........ ]
    KV in cache:    [ num_computed_tokens ...........)        the rest is not computed yet
    from the cache: [ num_cached_prefix_tokens )              shared with earlier requests

The last known token (the next root of a Medusa tree) is normally not computed
yet: its KV is written by the step that verifies the tree grown from it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Iterable


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks (new, or preempted and freed)
    RUNNING = "running"  # scheduled; holds blocks
    FINISHED = "finished"  # done; see Sequence.finish_reason


class FinishReason(str, enum.Enum):
    """Why a sequence finished; the values are the OpenAI `finish_reason` strings (plus abort)."""

    STOP = "stop"  # EOS or a stop string / token
    LENGTH = "length"  # max_tokens or the model's context reached
    ABORT = "abort"  # cancelled by the client or the engine


@dataclass(eq=False, slots=True)  # eq=False: identity equality/hash, so sequences can key dicts and sets
class Sequence:
    """A request's tokens, KV counters and block table.

    num_computed_tokens: tokens (from the start of `all_token_ids`) whose KV is
        in the cache, counting the shared prefix. Advances when a step commits
        its accepted tokens; drops to 0 when the blocks are freed (preemption).
    num_cached_prefix_tokens: how many of those came from the prefix cache on
        the latest first allocation (whole blocks, never the whole sequence);
        reported to clients as cached prompt tokens. Kept after `free` as a stat.
    block_table: physical block ids; logical block i holds token slots
        [i * block_size, (i + 1) * block_size).
    num_inflight_tokens: the most tokens that decode steps launched but not yet read back may
        add (their trees' depths + 1). The device already places the next tree past them, so the
        blocks must back them; the counters and token lists above lag them until the read-back.
    table_version: bumped by the BlockManager whenever `block_table` changes, so a decode step's
        input tables rewrite only the rows whose tables did.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prefix_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_inflight_tokens: int = 0
    table_version: int = 0
    reads_prefix_cache: bool = True  # False: its prompt is computed whole (its own full blocks are still shared)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        # copy, as Python ints: the caller's list must not alias our state, and tensor
        # elements would hash by identity (silently defeating prefix caching)
        self.prompt_token_ids = list(map(int, self.prompt_token_ids))
        self.output_token_ids = list(map(int, self.output_token_ids))
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of request {self.request_id!r} is empty; a step needs a query token")
        if not 0 <= self.num_computed_tokens <= self.num_tokens:
            raise ValueError(f"num_computed_tokens={self.num_computed_tokens} is outside [0, {self.num_tokens}]")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list, prompt then output (use `token_ids` for a slice without the copy of everything)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the two lists first."""
        prompt, num_prompt = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return prompt[start:] + self.output_token_ids[:end - num_prompt]

    def num_blocks_needed(self, block_size: int, extra: int = 0) -> int:
        """Blocks that back the computed tokens plus `extra` more slots: ceil((computed + extra) / block_size)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if extra < 0:
            raise ValueError(f"extra must be >= 0, got {extra}")
        return -(-(self.num_computed_tokens + extra) // block_size)

    def append_tokens(self, token_ids: Iterable[int]) -> None:
        """Add generated tokens. Call before `BlockManager.commit`, which hashes full blocks by their tokens."""
        self.output_token_ids.extend(map(int, token_ids))

    def finish(self, reason: FinishReason | str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = FinishReason(reason)  # a str like "stop" works; an unknown one raises ValueError
