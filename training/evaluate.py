"""Head accuracy and the accepted length a tree would reach, measured on held-out data.

Greedy Medusa decoding reproduces the base model's greedy text, and the heads'
proposals at a position depend only on the prefix. So on a greedy self-distilled
sequence, the tokens each step accepts can be computed exactly, for every
possible root position at once, from the heads' top-k at each position: no
decoding loop needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.attention import CausalAttention
from medusa.heads import MedusaHeads
from medusa.model import DecoderModel
from medusa.tree import TreeSpec
from medusa.training.losses import next_tokens


@dataclass
class EvalResult:
    accuracies: list[list[float]]  # [K][R]: P(head k's rank-r token is right)
    accepted_lengths: list[int]  # per simulated step, over all sequences
    num_targets: int

    def topk_accuracy(self, k: int) -> list[float]:
        return [sum(row[:k]) for row in self.accuracies]

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)


@torch.inference_mode()
def head_topk(model: DecoderModel, heads: MedusaHeads, ids: torch.Tensor, k: int, begin: int = 0) -> torch.Tensor:
    """ids [B, T] -> top-k token ids of every head at every position [B, T, K, k].

    Positions before `begin` get -1 (no token): the heads' vocabulary-wide logits are most of the cost,
    and nothing scores positions that far inside a prompt (see `first_scored_position`).
    """
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = model(ids, positions, CausalAttention())  # [B, T, H]
    logits = heads(hidden[:, begin:], model.lm_head.weight, roots=next_tokens(ids)[:, begin:])  # [K, B, T-begin, V]
    topk = logits.topk(k, dim=-1).indices.permute(1, 2, 0, 3)  # [B, T-begin, K, k]
    return torch.nn.functional.pad(topk, (0, 0, 0, 0, begin, 0), value=-1)


def first_scored_position(loss_mask: torch.Tensor, num_heads: int) -> int:
    """The earliest position any row's scoring reads: head k at position t predicts token t + k + 2, so a
    row whose response starts at s needs positions from s - num_heads - 1 on (the walk's first root, s,
    reads s - 1). loss_mask [B, T] is False past each row's length; a row without response tokens gives 0."""
    starts = loss_mask.long().argmax(dim=1)  # [B] each row's first response position
    return max(0, int(starts.min()) - num_heads - 1) if starts.numel() else 0


def rank_hits(topk: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """topk [T, K, R] for one sequence ids [T] -> hits [K, R] counts where rank r was the target."""
    length, num_heads, _ = topk.shape
    hits = torch.zeros(num_heads, topk.shape[2], dtype=torch.long)
    for k in range(num_heads):
        shift = k + 2
        if shift >= length:
            continue
        target = ids[shift:]  # token t + k + 2 for t in [0, T - shift)
        ok = valid[shift:]
        hits[k] += ((topk[: length - shift, k] == target[:, None]) & ok[:, None]).sum(0).cpu()
    return hits


def accepted_length_per_root(topk: torch.Tensor, ids: torch.Tensor, tree: TreeSpec) -> torch.Tensor:
    """For every root index r (token ids[r] is the root, heads read position r-1): tokens one step emits.

    topk [T, K, R]; ids [T] -> [T] (entry 0 meaningless: a root needs a position before it).
    """
    length = ids.shape[0]
    depths = tree.depths.to(ids.device)
    if tree.num_nodes == 1:
        return torch.ones(length, dtype=torch.long, device=ids.device)
    heads_idx, ranks = tree.head_index[1:].to(ids.device), tree.ranks[1:].to(ids.device)
    prev = torch.arange(length, device=ids.device).sub(1).clamp(min=0)
    node_tokens = topk[prev][:, heads_idx, ranks]  # [T, N-1]
    want_at = torch.arange(length, device=ids.device)[:, None] + depths[1:]  # [T, N-1]
    in_range = want_at < length
    wanted = ids[want_at.clamp(max=length - 1)]
    ok = torch.cat([torch.ones(length, 1, dtype=torch.bool, device=ids.device), (node_tokens == wanted) & in_range], 1)
    mask = tree.attention_mask.to(ids.device)  # [N, N]
    path_ok = ~((~ok)[:, None, :] & mask[None]).any(-1)  # [T, N]
    return (torch.where(path_ok, depths, -1).max(-1).values + 1)


def walk(accepted_per_root: torch.Tensor, start: int) -> list[int]:
    """Follow the decoding steps from the first generated token: r -> r + accepted[r]."""
    lengths, r, table = [], start, accepted_per_root.tolist()
    while r < len(table):
        step = min(table[r], len(table) - r)
        lengths.append(step)
        r += step
    return lengths


def evaluate_heads(model: DecoderModel, heads: MedusaHeads, batches, tree: TreeSpec | None = None,
                   max_rank: int = 10) -> EvalResult:
    """Per-head rank accuracies and (with a tree) simulated accepted lengths over `batches`.

    `batches` yields objects with input_ids [B, T], loss_mask [B, T] (response
    tokens) and lengths [B], as `medusa.training.data.batches` makes them.
    """
    device = model.embed_tokens.weight.device
    hits = torch.zeros(heads.config.num_heads, max_rank, dtype=torch.long)
    targets, accepted = 0, []
    for batch in batches:
        ids = batch.input_ids.to(device)
        begin = first_scored_position(batch.loss_mask, heads.config.num_heads)
        topk = head_topk(model, heads, ids, max_rank, begin)  # [B, T, K, R]
        for row in range(ids.shape[0]):
            n = int(batch.lengths[row])
            seq, valid = ids[row, :n], batch.loss_mask[row, :n].to(device)
            hits += rank_hits(topk[row, :n], seq, valid)
            targets += int(valid[2:].sum())  # head 0 is scored from position 0 on
            if tree is not None:
                start = int(valid.long().argmax())  # first response token
                accepted += walk(accepted_length_per_root(topk[row, :n], seq, tree), start)
    accuracies = (hits.double() / max(targets, 1)).tolist()
    return EvalResult(accuracies=accuracies, accepted_lengths=accepted, num_targets=targets)
