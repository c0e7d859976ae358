"""Decide which tree nodes the base model accepts, for one sequence.

All three rules share one computation: every node gets a *target* token from
the base model's distribution at that node, a child is accepted when its token
passes the rule against its parent, and the deepest node whose whole ancestry
is accepted wins. The target token at the winning node becomes the next root,
so every step emits at least one token.

- greedy: targets are argmax; output identical to plain greedy decoding.
- lossless (sampling): targets are independent draws from the processed base
  distribution and a child is accepted iff its token equals its parent's draw,
  so every emitted token is a draw from the base model's own distribution,
  whatever the heads proposed.
- typical (Medusa's rule, opt-in): a child is accepted when the base gives its
  token probability above min(posterior_threshold, posterior_alpha * exp(-entropy)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.sampler import SamplingConfig, TokenSampler, target_probs

ACCEPTANCE_RULES = ("auto", "typical")


@dataclass(frozen=True)
class AcceptanceConfig:
    rule: str = "auto"  # auto: greedy at temperature 0, lossless sampling otherwise
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.rule not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance rule must be one of {ACCEPTANCE_RULES}, got {self.rule!r}")
        if not 0 < self.posterior_threshold <= 1 or not self.posterior_alpha > 0:
            raise ValueError("posterior_threshold must be in (0, 1] and posterior_alpha > 0")


@dataclass(frozen=True)
class Verdict:
    accepted: torch.Tensor  # [n] accepted node indices, root first, ascending depth
    next_token: torch.Tensor  # [] the target token at the deepest accepted node


def verify(tree: DeviceTree, candidates: torch.Tensor, logits: torch.Tensor, sampling: SamplingConfig,
           acceptance: AcceptanceConfig, sampler: TokenSampler | None = None, position: int = 0) -> Verdict:
    """candidates [N] tree tokens; logits [N, V] base logits at each node.

    position: the output index of the root's child (the token a plain step would
    produce next); node i's target is output number position + depth(i).
    """
    if sampling.greedy:
        targets = logits.argmax(-1)  # [N]
        child_ok = candidates[1:] == targets[tree.parents[1:]]
    else:
        targets = (sampler or TokenSampler(None))(logits, sampling, position + tree.depths)  # [N]
        if acceptance.rule == "typical":
            child_ok = _typical_ok(target_probs(logits, sampling), candidates, tree.parents, acceptance)
        else:
            child_ok = candidates[1:] == targets[tree.parents[1:]]
    best = deepest_accepted(tree, child_ok)
    accepted = tree.mask[best].nonzero().squeeze(-1)  # node order is depth order
    return Verdict(accepted=accepted, next_token=targets[best])


def deepest_accepted(tree: DeviceTree, child_ok: torch.Tensor) -> torch.Tensor:
    """child_ok [N-1] per-node test -> index of the deepest node whose ancestors all pass."""
    ok = torch.cat([child_ok.new_ones(1), child_ok])  # root always passes
    path_ok = ~(tree.mask & ~ok).any(-1)  # [N] every ancestor-or-self passes
    score = torch.where(path_ok, tree.depths, -1)
    return score.argmax()  # first (lowest index) among the deepest


def _typical_ok(probs: torch.Tensor, candidates: torch.Tensor, parents: torch.Tensor,
                acceptance: AcceptanceConfig) -> torch.Tensor:
    parent_probs = probs[parents[1:]]  # [N-1, V]
    entropy = -(parent_probs * torch.log(parent_probs + 1e-5)).sum(-1)
    threshold = torch.clamp(acceptance.posterior_alpha * torch.exp(-entropy), max=acceptance.posterior_threshold)
    return parent_probs.gather(-1, candidates[1:, None]).squeeze(-1) > threshold
