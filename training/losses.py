"""Training losses: per-head cross-entropy with decay (Medusa-1; optionally against the base's
soft distribution too), KL distillation (Medusa-2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class HeadLoss:
    loss: torch.Tensor  # [] sum over heads of decay**k * CE_k
    per_head_ce: torch.Tensor  # [K] detached
    per_head_top1: torch.Tensor  # [K] detached accuracy on the valid targets
    num_targets: torch.Tensor  # [K] how many positions each head was scored on


def head_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int):
    """Head k at position t predicts token t + k + 2 (head 0 guesses one past the base's next token).

    input_ids, loss_mask [B, T] -> targets [K, B, T] (0 where invalid), valid [K, B, T] bool.
    """
    batch, length = input_ids.shape
    targets = input_ids.new_zeros(num_heads, batch, length)
    valid = torch.zeros(num_heads, batch, length, dtype=torch.bool, device=input_ids.device)
    for k in range(num_heads):
        shift = k + 2
        if shift < length:
            targets[k, :, : length - shift] = input_ids[:, shift:]
            valid[k, :, : length - shift] = loss_mask[:, shift:]
    return targets, valid


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The root each position's heads read: token t + 1, [..., T] -> [..., T].

    The last position has none; it gets the first token, and no head target there is valid
    (head k's target t + k + 2 is past the end).
    """
    return torch.roll(input_ids, -1, dims=-1)


def chain_tokens(input_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The chain chained heads read in training: tokens t+2..t+K, [..., T] -> [..., T, K - 1].

    Positions near the end wrap around; no head target that reads a wrapped token is valid.
    """
    return torch.stack([torch.roll(input_ids, -(2 + j), dims=-1) for j in range(num_heads - 1)], dim=-1)


def medusa_loss(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                decay: float = 0.8, base_logits: torch.Tensor | None = None, soft_weight: float = 0.0) -> HeadLoss:
    """head_logits [K, B, T, V]; loss only where the target is a response token.

    With soft_weight > 0, each head's loss mixes in (that share) the cross-entropy against the
    base model's own distribution for its target token, base_logits [B, T, V] (see soft_head_ce).
    """
    num_heads = head_logits.shape[0]
    targets, valid = head_targets(input_ids, loss_mask, num_heads)
    ce = F.cross_entropy(head_logits.float().flatten(0, 2), targets.flatten(), reduction="none")
    ce = ce.view_as(targets) * valid
    counts = valid.sum((1, 2))  # [K]
    per_head = ce.sum((1, 2)) / counts.clamp(min=1)
    if soft_weight > 0:
        if base_logits is None:
            raise ValueError("soft_weight > 0 needs the base model's logits (base_logits)")
        per_head = (1 - soft_weight) * per_head + soft_weight * soft_head_ce(head_logits, base_logits, valid)
    weights = decay ** torch.arange(num_heads, device=ce.device, dtype=ce.dtype)
    with torch.no_grad():
        hits = (head_logits.argmax(-1) == targets) & valid
        top1 = hits.sum((1, 2)) / counts.clamp(min=1)
    return HeadLoss((weights * per_head).sum(), per_head.detach(), top1.float(), counts)


def soft_head_ce(head_logits: torch.Tensor, base_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-head cross-entropy [K] against the base's distribution, averaged where `valid` [K, B, T].

    Head k at position t predicts token t + k + 2, which the base predicts at position t + k + 1:
    that distribution is the soft target. On self-distilled data its argmax is the hard target,
    and the rest of it says which runner-up tokens a tree's top-k candidates should hold.
    """
    length = head_logits.shape[2]
    teacher = F.softmax(base_logits.float(), -1)  # [B, T, V]
    out = []
    for k in range(head_logits.shape[0]):
        span = length - (k + 1)  # head positions with a teacher position inside the sequence
        student = F.log_softmax(head_logits[k, :, :span].float(), -1)  # [B, span, V]
        ce = -(teacher[:, k + 1:] * student).sum(-1)  # [B, span]
        mask = valid[k, :, :span]
        out.append((ce * mask).sum() / mask.sum().clamp(min=1))
    return torch.stack(out)


def kl_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per token, averaged over mask [B, T]; logits [B, T, V]."""
    teacher = F.log_softmax(teacher_logits.float(), -1)
    student = F.log_softmax(student_logits.float(), -1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)  # [B, T]
    return (kl * mask).sum() / mask.sum().clamp(min=1)
