"""Logit changes the device makes alone inside a decode step: the count penalties (repetition, presence,
frequency) and the min_tokens ban of end tokens.

Before, a row with either took the host's path every step: its node targets from logits changed on the
host, a verdict written over the device's, and no overlapped steps for its whole batch. Neither needs the
host: a row's output counts live on the device ([R + 1, V] per state row, set at admission and advanced by
every step's emitted tokens, `record`), and so does how far a node is from the end of the ban (the host's
output count is uploaded with the step; the tokens of steps in flight are the row's root window). Rows the
host still decides (guides, bias, allowed tokens, bad words, choices) keep doing so (`engine._needs_host`).

Same arithmetic as the host's (`logits_processing.apply_count_penalties`), so both paths choose the same tokens;
rows without changes keep their logits exactly (zero penalties, repetition 1, no ban), so a step changes the
logits of all its rows at once, with no per-row selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.host_buffers import host_buffer, to_device, upload
from medusa.decoding.logits_processing import apply_count_penalties

MAX_BANNED = 8  # end tokens a row's min_tokens ban holds on the device; a request with more is the host's
FREQUENCY, PRESENCE, REPETITION, BAN_LEFT, BANNED = range(5)  # columns of a row's settings (banned: the rest)
SETTINGS = BANNED + MAX_BANNED


@dataclass(frozen=True)
class RowChanges:
    """One row's changes for a step. `ban_left`: its nodes whose output position, counted from the host's
    output count, is below this may not choose one of `banned` (the request's end tokens); <= 0: no ban."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    ban_left: int = 0
    banned: tuple[int, ...] = ()

    @property
    def penalized(self) -> bool:
        return self.frequency != 0 or self.presence != 0 or self.repetition != 1


class DeviceChanges:
    """The step's per-row change settings ([max_seqs] buffers, uploaded by `prepare`) and each state row's
    counts: counts [R + 1, V] float32 of its output tokens, the pending root included, and prompt_seen
    [R + 1, V] bool (the repetition penalty also counts prompt tokens). Those two are allocated at the first
    penalized admission: a server that never sees a penalty never pays their memory."""

    def __init__(self, max_seqs: int, vocab: int, device: torch.device) -> None:
        self.max_rows, self.vocab, self.device = max_seqs + 1, vocab, device
        # per batch row: frequency, presence, repetition, ban_left, then the banned ids, in one float32 row
        # (token ids < 2^24 are exact), so a step's settings go up in one copy from page-locked memory
        self._host = host_buffer((max_seqs, SETTINGS), torch.float32, device)
        self.settings = torch.zeros(max_seqs, SETTINGS, dtype=torch.float32, device=device)
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None

    def _allocate(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab, dtype=torch.float32, device=self.device)
            self.prompt_seen = torch.zeros(self.max_rows, self.vocab, dtype=torch.bool, device=self.device)

    def set_rows(self, rows: Sequence[int], outputs: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
                 roots: torch.Tensor) -> None:
        """Admitted penalized rows: their counts from their outputs before the root, and the root (roots [n]
        on the device: a first token the host may not have read yet); the prompt tokens a repetition penalty
        counts (empty for a row without one). Queued: waits for no step in flight."""
        self._allocate()
        at = to_device(list(rows), torch.long, self.device)
        self.counts[at] = 0.0
        self.prompt_seen[at] = False
        ids = [row * self.vocab + t for row, output in zip(rows, outputs) for t in output]
        if ids:
            flat = to_device(ids, torch.long, self.device)
            self.counts.view(-1).index_add_(0, flat, torch.ones(len(ids), device=self.device))
        self.counts.index_put_((at, roots), torch.ones(len(rows), device=self.device), accumulate=True)
        seen = [row * self.vocab + t for row, prompt in zip(rows, prompts) for t in prompt]
        if seen:
            self.prompt_seen.view(-1)[to_device(seen, torch.long, self.device)] = True

    def prepare(self, changes: Sequence[RowChanges | None], padded: int) -> bool:
        """Upload the step's settings (padding and unchanged rows: none) -> whether any row changes anything."""
        rows = list(changes) + [None] * (padded - len(changes))
        if not any(rows):
            return False
        if any(r is not None and r.penalized for r in rows) and self.counts is None:
            raise RuntimeError("a penalized row's counts were never set (DeviceChanges.set_rows at its admission)")
        self._allocate()  # a step of banned rows only still reads counts: zeros, times zero penalties
        host = self._host[:padded]  # the caller has waited for its last upload (`DecodeStep.prepare`)
        host[:] = 0.0
        host[:, REPETITION] = 1.0
        for i, r in enumerate(rows):
            if r is not None:
                host[i, :BANNED] = r.frequency, r.presence, r.repetition, r.ban_left if r.banned else 0
                if r.banned:  # padded with its first id: a repeated column writes the same value
                    host[i, BANNED:] = (list(r.banned) * MAX_BANNED)[:MAX_BANNED]
        upload(self.settings, host)
        return True

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, tree: DeviceTree, candidates: torch.Tensor,
              window: torch.Tensor) -> torch.Tensor:
        """logits [Bp * N, V] (raw, kept for logprobs); rows [Bp] state rows; candidates [Bp, N]; window [Bp]
        tokens each row's steps in flight emitted past the host's output count -> changed float32 [Bp, N, V]."""
        padded, n = candidates.shape
        settings = self.settings[:padded]
        changed = apply_count_penalties(logits.view(padded, n, -1), self.counts[rows][:, None],
                                        settings[:, FREQUENCY], settings[:, PRESENCE], settings[:, REPETITION],
                                        self.prompt_seen[rows][:, None], tree, candidates)
        early = (window[:, None] + tree.depths[None]) < settings[:, BAN_LEFT, None]  # [Bp, N]
        columns = settings[:, None, BANNED:].long().expand(-1, n, -1)  # [Bp, N, E]
        ends = changed.gather(2, columns).masked_fill(early[..., None], float("-inf"))
        return changed.scatter_(2, columns, ends)

    def record(self, rows: torch.Tensor, packed: torch.Tensor) -> None:
        """After a step: each row's emitted tokens (packed [Bp, D + 3]: count, D + 1 tokens, best) join its
        counts; the padding rows' go to the padding row, which no sequence reads."""
        tokens = packed[:, 1:-1]  # [Bp, D + 1]
        emitted = torch.arange(tokens.shape[1], device=tokens.device)[None] < packed[:, :1]
        self.counts.index_put_((rows[:, None].expand_as(tokens), tokens), emitted.float(), accumulate=True)
