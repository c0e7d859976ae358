"""A step's verdict and what follows from it, per row: the contract of `tree_accept_triton.py`.

After the tree's forward, a decode step decides each row's deepest accepted node
(`verdict`) and then emits the accepted tokens, appends them to the row's lookup
history, works out which KV slots move down and advances the row's root and
committed length (`accept`). As PyTorch ops (`decoding/batch_verify.py`) these
are most of the 59 small kernels that an H200 trace of the default model's
batch-1 tree step showed between the forward and the heads, 136 us of a ~1 ms
step (benchmarks/RESULTS.md, session 17); the Triton kernels are one launch
each, one program per row. On an H200 (RESULTS.md, session 18) the graph engine's GPU tests pass
through them and a batch-1 Medusa step of the default model took 1.15 against 1.18 ms.

verdict: candidates, targets [B, N] long -> best [B] = `batch_verify.greedy_verdict`,
    next [B] = targets[b, best[b]] (written into the caller's buffers).
accept: for batch row b (state row r = rows[b]) with count = depths[best] + 1,
    packed[b] = (count, tokens[0..D], best), tokens = the accepted drafts then next
        (`batch_verify.emitted_tokens`; entries past count are 0 or drafts: junk);
    src, dst [B * (D + 1)] = `batch_verify.compaction_slots`;
    roots[r] = next; row_base[r] += count (0 for the padding row);
    with a history: history[r, len + j] = tokens[j] for j < count (other writes go to
    the spare last column), history_len[r] = min(len + count, spare) (0 for the padding row).
Padding rows all name the padding row: their writes there are junk, by design.
"""

from __future__ import annotations

import torch

from medusa.decoding.batch_verify import compaction_slots, emitted_tokens, greedy_verdict
from medusa.decoding.device_tree import DeviceTree
from medusa.kernels.dispatch import use_triton


def verdict(tree: DeviceTree, candidates: torch.Tensor, targets: torch.Tensor, best: torch.Tensor,
            next_tokens: torch.Tensor) -> None:
    """Writes best [B] and next_tokens [B]: the Triton kernel on a GPU for trees of <= 64 nodes."""
    if use_triton(candidates) and tree.bits is not None:
        from medusa.kernels.tree_accept_triton import verdict_triton

        return verdict_triton(tree, candidates, targets, best, next_tokens)
    return verdict_reference(tree, candidates, targets, best, next_tokens)


def verdict_reference(tree: DeviceTree, candidates: torch.Tensor, targets: torch.Tensor, best: torch.Tensor,
                      next_tokens: torch.Tensor) -> None:
    found = greedy_verdict(tree, candidates, targets)
    best.copy_(found)
    next_tokens.copy_(targets.gather(1, found[:, None]).squeeze(1))


def accept(tree: DeviceTree, candidates: torch.Tensor, best: torch.Tensor, next_tokens: torch.Tensor,
           slots: torch.Tensor, rows: torch.Tensor, roots: torch.Tensor, row_base: torch.Tensor, padding_row: int,
           history: torch.Tensor | None = None, history_len: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates, slots [B, N]; best, next_tokens, rows [B]; roots, row_base [R + 1] and history
    [R + 1, W + 1], history_len [R + 1] (or None) updated in place -> (packed [B, D + 3], src, dst)."""
    if use_triton(candidates):
        from medusa.kernels.tree_accept_triton import accept_triton

        return accept_triton(tree, candidates, best, next_tokens, slots, rows, roots, row_base, padding_row,
                             history, history_len)
    return accept_reference(tree, candidates, best, next_tokens, slots, rows, roots, row_base, padding_row,
                            history, history_len)


def accept_reference(tree: DeviceTree, candidates: torch.Tensor, best: torch.Tensor, next_tokens: torch.Tensor,
                     slots: torch.Tensor, rows: torch.Tensor, roots: torch.Tensor, row_base: torch.Tensor,
                     padding_row: int, history: torch.Tensor | None = None,
                     history_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's contract in PyTorch ops (the CPU path); same arguments as `accept`."""
    count, tokens = emitted_tokens(tree, candidates, best, next_tokens)
    if history is not None:
        spare = history.shape[1] - 1
        lengths = history_len[rows]  # [B]
        steps = torch.arange(tokens.shape[1], device=tokens.device)[None]  # [1, D + 1]
        columns = torch.where(steps < count[:, None], lengths[:, None] + steps, spare).clamp(max=spare)
        history[rows[:, None], columns] = tokens
        history_len[rows] = (lengths + count).clamp(max=spare)
        history_len[padding_row].zero_()  # padding rows then scan nothing for their (unused) proposals
    src, dst = compaction_slots(tree, slots, best)
    roots[rows] = next_tokens
    row_base[rows] += count  # real rows are distinct; the padding row (repeated) is reset next
    # zero_() on a view, not `= 0`: assigning a Python number copies it from the host, which a graph
    # capture refuses
    row_base[padding_row].zero_()
    return torch.cat([count[:, None], tokens, best[:, None]], dim=1), src, dst
