"""A decode step's per-row logit changes in one pass: the contract of `row_changes_triton.py`.

Rows with logit_bias / allowed_token_ids and count penalties (repetition, presence, frequency) have their
logits changed on the device inside the step (`decoding/device_changes.py`). In PyTorch that is a dozen
passes over the step's [G, N, V] logits (a cast, a gathered bias row, the repetition's two branches, each
penalty's product and difference); on an H200 ~0.5 ms at 32 rows of a 20-node tree of 49,152 logits. The
Triton kernel reads each node's logits once, its row's tables once per program and writes float32 once.

Contract, with each row's tables broadcast over its N nodes (the host's arithmetic and order,
`logits_processing.penalize`): logits [G, N, V] (any float dtype) -> float32 [G, N, V]

    x = logits + bias[rows]                 where biased[g] > 0 (else x + 0, as the host adds)
    x = seen ? (x > 0 ? x / r : x * r) : x  seen = counts[rows] > 0 | prompt_seen[rows]; repeats only
    x = x - frequency * counts[rows] - presence * (counts[rows] > 0)

rows [G] long: each row's state row in the tables; bias [R, V] float32 or None; counts [R, V] float32 and
prompt_seen [R, V] bool, or None (no penalties); frequency, presence, repetition, biased [G] float32 (views of
a settings table are fine). A row with no bias, zero penalties and repetition 1 keeps its logits exactly.
The tree's own tokens (a node's path adds to its counts) are the caller's: `logits_processing.penalize_path_cells`.
"""

from __future__ import annotations

import torch

from medusa.kernels.dispatch import use_triton


def change_rows_reference(logits: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None,
                          counts: torch.Tensor | None, prompt_seen: torch.Tensor | None, frequency: torch.Tensor,
                          presence: torch.Tensor, repetition: torch.Tensor, biased: torch.Tensor,
                          repeats: bool) -> torch.Tensor:
    """The contract in PyTorch (the CPU path): every table gathered per row, then broadcast."""
    changed = logits.float()
    if bias is not None:
        changed = changed + torch.where(biased[:, None] > 0, bias[rows], 0.0)[:, None]  # x + 0 is x
    if counts is None:
        return changed.clone() if changed is logits else changed  # a new tensor, as the kernel's
    row_counts = counts[rows][:, None]  # [G, 1, V]
    seen = (row_counts > 0) | prompt_seen[rows][:, None] if repeats else None
    return count_penalized(changed, row_counts, seen, frequency, presence, repetition if repeats else None)


def count_penalized(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None, frequency: torch.Tensor,
                    presence: torch.Tensor, repetition: torch.Tensor | None) -> torch.Tensor:
    """[G, ...] float32 logits with counts and seen (None: no repetition penalty) broadcast to them: the
    repetition penalty on seen tokens, then frequency * count and presence where counted (vLLM's order). The
    penalties' arithmetic, shared by the host's rows and the device's, so both give the same bits."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    if seen is not None:
        penalty = repetition.view(shape)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return logits - frequency.view(shape) * counts - presence.view(shape) * (counts > 0).float()


def change_rows(logits: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor | None,
                prompt_seen: torch.Tensor | None, frequency: torch.Tensor, presence: torch.Tensor,
                repetition: torch.Tensor, biased: torch.Tensor, repeats: bool) -> torch.Tensor:
    """The contract: the Triton kernel on a GPU, the reference elsewhere."""
    _check(logits, rows, bias, counts, prompt_seen, (frequency, presence, repetition, biased))
    if use_triton(logits) and logits.numel():
        from medusa.kernels.row_changes_triton import change_rows_triton

        return change_rows_triton(logits, rows, bias, counts, prompt_seen, frequency, presence, repetition, biased,
                                  repeats)
    return change_rows_reference(logits, rows, bias, counts, prompt_seen, frequency, presence, repetition, biased,
                                 repeats)


def _check(logits, rows, bias, counts, prompt_seen, settings) -> None:
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"change_rows: logits must be float [G, N, V], got {logits.dtype} {tuple(logits.shape)}")
    groups, nodes, vocab = logits.shape
    if rows.shape != (groups,) or rows.dtype != torch.long:
        raise ValueError(f"change_rows: rows must be long [{groups}], got {rows.dtype} {tuple(rows.shape)}")
    if any(s.shape != (groups,) or s.dtype != torch.float32 for s in settings):
        raise ValueError(f"change_rows: frequency, presence, repetition and biased must be float32 [{groups}], "
                         f"got {[(s.dtype, tuple(s.shape)) for s in settings]}")
    if (counts is None) != (prompt_seen is None):
        raise ValueError("change_rows: counts and prompt_seen come together (both None: no penalties)")
    for name, table, dtype in (("bias", bias, torch.float32), ("counts", counts, torch.float32),
                               ("prompt_seen", prompt_seen, torch.bool)):
        if table is not None and (table.dim() != 2 or table.shape[1] != vocab or table.dtype != dtype
                                  or not table.is_contiguous()):
            raise ValueError(f"change_rows: {name} must be a contiguous {dtype} [R, {vocab}] table, got "
                             f"{table.dtype} {tuple(table.shape)}")
