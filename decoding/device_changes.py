"""Logit changes the device makes alone, inside a decode step and for an admission's first token: logit_bias
and allowed_token_ids, the count penalties (repetition, presence, frequency) and the min_tokens ban of end tokens.

Before, a row with any of them took the host's path every step: its node targets from logits changed on the
host, a verdict written over the device's, and no overlapped steps for its whole batch. None needs the host:
a row's bias and output counts live on the device ([R + 1, V] per state row, set at admission; counts advanced
by every step's emitted tokens, `record`), and so does how far a node is from the end of the ban (the host's
output count is uploaded with the step; the tokens of steps in flight are the row's root window). Rows the
host still decides (guides, bad words, guided choices) keep doing so (`engine._needs_host`).

The host's order and arithmetic (`logits_processing.penalize`, `kernels.row_changes`), so both paths choose
the same tokens; rows without changes keep their logits exactly (no bias, zero penalties, repetition 1, no
ban), so a step changes the logits of all its rows at once, with no per-row selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.host_buffers import host_buffer, to_device, upload
from medusa.decoding.logits_processing import path_columns, penalize_path_cells
from medusa.kernels.row_changes import change_rows

MAX_BANNED = 8  # end tokens a row's min_tokens ban holds on the device; a request with more is the host's
FREQUENCY, PRESENCE, REPETITION, BAN_LEFT, BIASED, BANNED = range(6)  # a row's settings (banned: the rest)
SETTINGS = BANNED + MAX_BANNED
# what a step changes (part of its graphs' key): nothing; bias, presence / frequency and bans; those and the
# repetition penalty, whose pass over the logits costs as much as all the others (skipped where no row has one)
UNCHANGED, CHANGED, REPEATED = 0, 1, 2


@dataclass(frozen=True)
class RowChanges:
    """One row's changes for a step. `ban_left`: its nodes whose output position, counted from the host's
    output count, is below this may not choose one of `banned` (the request's end tokens); <= 0: no ban.
    `biased`: its state row's logit bias applies (logit_bias, allowed_token_ids: `DeviceChanges.set_rows`)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    ban_left: int = 0
    banned: tuple[int, ...] = ()
    biased: bool = False

    @property
    def penalized(self) -> bool:
        return self.frequency != 0 or self.presence != 0 or self.repetition != 1

    @staticmethod
    def kind(changes: Sequence[RowChanges | None]) -> int:
        """What rows with these changes change together: UNCHANGED, CHANGED or REPEATED."""
        if not any(changes):
            return UNCHANGED
        return REPEATED if any(r is not None and r.repetition != 1 for r in changes) else CHANGED

    def settings(self) -> list[float]:
        """Its row of settings (SETTINGS floats; token ids below 2^24 are exact in float32)."""
        banned = (list(self.banned) * MAX_BANNED)[:MAX_BANNED] if self.banned else [0] * MAX_BANNED
        # a short list of ends is padded with its first id: a repeated column writes the same value
        return [self.frequency, self.presence, self.repetition, self.ban_left if self.banned else 0,
                float(self.biased)] + banned


NONE = RowChanges().settings()


class DeviceChanges:
    """The step's per-row settings ([max_seqs, SETTINGS], uploaded by `prepare`) and per state row:
    counts [R + 1, V] float32 of its output tokens, the pending root included, and prompt_seen [R + 1, V] bool
    (the repetition penalty also counts prompt tokens); bias [R + 1, V] float32 (logit_bias, -inf outside
    allowed_token_ids). Each is allocated at the first admission that needs it: a server that never sees a
    penalty or a bias never pays their memory, and its steps skip them (`layout`, part of a graph's key)."""

    def __init__(self, max_seqs: int, vocab: int, device: torch.device) -> None:
        self.max_rows, self.vocab, self.device = max_seqs + 1, vocab, device
        self._host = host_buffer((max_seqs, SETTINGS), torch.float32, device)  # one upload a step
        self.settings = torch.zeros(max_seqs, SETTINGS, dtype=torch.float32, device=device)
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    @property
    def layout(self) -> tuple[bool, bool]:
        """Which per-row tables exist (counts, bias): a step's changes read those."""
        return self.counts is not None, self.bias is not None

    def _rows_of(self, table: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.max_rows, self.vocab, dtype=dtype, device=self.device) if table is None else table

    def set_rows(self, rows: Sequence[int], outputs: Sequence[Sequence[int] | None],
                 prompts: Sequence[Sequence[int]], biases: Sequence[Sequence[tuple[int, float]] | None],
                 allowed: Sequence[Sequence[int] | None]) -> None:
        """Admitted rows, before their first token: a penalized row's counts from its outputs before the root
        (None: not penalized; `add_roots` adds the root once drawn) and the prompt tokens a repetition penalty
        counts (else empty); a biased row's bias, (token, bias) pairs and/or the only tokens allowed (None:
        none). Queued: waits for no step in flight."""
        penalized = [k for k, output in enumerate(outputs) if output is not None]
        if penalized:
            self.counts = self._rows_of(self.counts, torch.float32)
            self.prompt_seen = self._rows_of(self.prompt_seen, torch.bool)
            at = to_device([rows[k] for k in penalized], torch.long, self.device)
            self.counts[at] = 0.0
            self.prompt_seen[at] = False
            self._mark(self.counts, [(rows[k], t) for k in penalized for t in outputs[k]], 1.0, accumulate=True)
            self._mark(self.prompt_seen, [(rows[k], t) for k in penalized for t in prompts[k]], True)
        biased = [k for k in range(len(rows)) if biases[k] is not None or allowed[k] is not None]
        if biased:
            self.bias = self._rows_of(self.bias, torch.float32)
            for k in biased:  # rare, and each row's own values: one at a time
                self.bias[rows[k]] = self._bias_row(biases[k] or (), allowed[k])

    def _mark(self, table: torch.Tensor, cells: list[tuple[int, int]], value, accumulate: bool = False) -> None:
        if cells:
            flat = to_device([row * self.vocab + t for row, t in cells], torch.long, self.device)
            table.view(-1).index_put_((flat,), torch.full((len(cells),), value, dtype=table.dtype,
                                                          device=self.device), accumulate=accumulate)

    def _bias_row(self, pairs: Sequence[tuple[int, float]], allowed: Sequence[int] | None) -> torch.Tensor:
        """[V] float32: each pair's bias (0 elsewhere), -inf outside `allowed` (the host's order: bias, then
        everything not allowed out)."""
        row = torch.zeros(self.vocab, dtype=torch.float32)
        if pairs:
            ids, values = zip(*pairs)
            row[list(ids)] = torch.tensor(values, dtype=torch.float32)
        if allowed is not None:
            kept = torch.full((self.vocab,), float("-inf"))
            kept[list(allowed)] = row[list(allowed)]
            row = kept
        return to_device(row.numpy(), torch.float32, self.device)

    def add_roots(self, rows: Sequence[int], roots: torch.Tensor) -> None:
        """Penalized rows' roots (roots [n] on the device: first tokens the host may not have read yet)."""
        if rows:
            at = to_device(list(rows), torch.long, self.device)
            self.counts.index_put_((at, roots), torch.ones(len(rows), device=self.device), accumulate=True)

    def prepare(self, changes: Sequence[RowChanges | None], padded: int) -> int:
        """Upload the step's settings (padding and unchanged rows: none) -> what the step changes (UNCHANGED,
        CHANGED, REPEATED)."""
        kind = RowChanges.kind(changes)
        if kind == UNCHANGED:
            return kind
        if any(r is not None and r.penalized for r in changes) and self.counts is None:
            raise RuntimeError("a penalized row's counts were never set (DeviceChanges.set_rows at its admission)")
        host = self._host[:padded]  # the caller has waited for its last upload (`DecodeStep.prepare`)
        host[:] = NONE
        for i, r in enumerate(changes):
            if r is not None:
                host[i] = r.settings()
        upload(self.settings, host)
        if self.device.type == "cuda" and self.counts is not None:
            # one kernel makes both at about the same cost (`kernels.row_changes`; a repetition of 1 changes
            # nothing): one graph kind instead of two, which a server would otherwise capture mid-run
            kind = REPEATED
        return kind

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, tree: DeviceTree, candidates: torch.Tensor,
              window: torch.Tensor, kind: int = REPEATED) -> torch.Tensor:
        """A step's: logits [Bp * N, V] (raw, kept for logprobs); rows [Bp] state rows; candidates [Bp, N];
        window [Bp] tokens each row's steps in flight emitted past the host's output count; kind: `prepare`'s
        -> changed float32 [Bp, N, V]."""
        padded, n = candidates.shape
        return self._change(logits.view(padded, n, -1), self.settings[:padded], rows, tree, candidates, window,
                            kind == REPEATED)

    def first(self, logits: torch.Tensor, rows: Sequence[int], changes: Sequence[RowChanges | None]) -> torch.Tensor:
        """Admitted rows' first tokens: logits [f, V] of rows `rows` (set by `set_rows`, no root yet) -> changed
        float32 [f, V]. Their settings go up with them (a step in flight may still read the step's)."""
        settings = to_device([(r.settings() if r is not None else NONE) for r in changes], torch.float32,
                             self.device)
        at = to_device(list(rows), torch.long, self.device)
        window = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        repeats = RowChanges.kind(changes) == REPEATED
        return self._change(logits[:, None], settings, at, None, None, window, repeats)[:, 0]

    def _change(self, logits: torch.Tensor, settings: torch.Tensor, rows: torch.Tensor, tree: DeviceTree | None,
                candidates: torch.Tensor | None, window: torch.Tensor, repeats: bool) -> torch.Tensor:
        """logits [G, N, V] at `tree`'s nodes (None: N = 1, the root) -> the host's changes in its order
        (`penalize`): bias, then count penalties, then the min_tokens ban. repeats=False: no row has a
        repetition penalty. Each row's bias and counts in one pass (`kernels.row_changes`), then the cells of
        the tree's own tokens again with each node's path counted, then the ban."""
        changed = change_rows(logits, rows, self.bias, self.counts, self.prompt_seen, settings[:, FREQUENCY],
                              settings[:, PRESENCE], settings[:, REPETITION], settings[:, BIASED], repeats)
        if self.counts is not None and tree is not None and logits.shape[1] > 1:
            changed = self._penalize_paths(changed, logits, settings, rows, tree, candidates, repeats)
        depths = tree.depths if tree is not None else torch.zeros(1, dtype=torch.long, device=logits.device)
        early = (window[:, None] + depths[None]) < settings[:, BAN_LEFT, None]  # [G, N]
        columns = settings[:, None, BANNED:].long().expand(-1, changed.shape[1], -1)  # [G, N, E]
        ends = changed.gather(2, columns).masked_fill(early[..., None], float("-inf"))
        return changed.scatter_(2, columns, ends)

    def _penalize_paths(self, changed: torch.Tensor, logits: torch.Tensor, settings: torch.Tensor,
                        rows: torch.Tensor, tree: DeviceTree, candidates: torch.Tensor, repeats: bool) -> torch.Tensor:
        """`penalize_path_cells` on the device's tables: only the [G, N, N] cells of the tree's tokens are read."""
        columns = path_columns(candidates)  # [G, N, N]
        at = rows[:, None, None]
        cell_logits = logits.gather(2, columns).float()
        if self.bias is not None:  # as the row pass adds it: x + 0 where a row is not biased
            cell_logits = cell_logits + torch.where(settings[:, BIASED, None, None] > 0, self.bias[at, columns], 0.0)
        cell_counts = self.counts[at, columns]
        cell_seen = (cell_counts > 0) | self.prompt_seen[at, columns] if repeats else None
        return penalize_path_cells(changed, cell_logits, cell_counts, cell_seen, settings[:, FREQUENCY],
                                   settings[:, PRESENCE], settings[:, REPETITION] if repeats else None, tree,
                                   candidates)

    def record(self, rows: torch.Tensor, packed: torch.Tensor) -> None:
        """After a step: each row's emitted tokens (packed [Bp, D + 3]: count, D + 1 tokens, best) join its
        counts (where counts exist); the padding rows' go to the padding row, which no sequence reads."""
        if self.counts is None:
            return
        tokens = packed[:, 1:-1]  # [Bp, D + 1]
        emitted = torch.arange(tokens.shape[1], device=tokens.device)[None] < packed[:, :1]
        self.counts.index_put_((rows[:, None].expand_as(tokens), tokens), emitted.float(), accumulate=True)
