"""Tree verification for a whole batch on the device, with no host round trip.

Every decoding sequence of a step verifies the same tree (the scheduler picks
one per step), so candidates, targets and verdicts are [B, N] tensors and the
whole step (propose -> forward -> verify -> compact KV -> propose next) is a
fixed sequence of kernels that a CUDA graph can replay. Greedy rows are
decided here; rows that need host logic (sampling, min_tokens, logprobs) get
their verdict from `verifier.verify` and write it into the same buffers.
"""

from __future__ import annotations

import torch

from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.sampler import filter_cutoffs
from medusa.kernels.gumbel_sample import gumbel_argmax


def build_candidates(tree: DeviceTree, roots: torch.Tensor, topk: torch.Tensor | None,
                     lookup: torch.Tensor | None = None) -> torch.Tensor:
    """roots [B]; topk [B, K, kmax] the heads' top tokens; lookup [B, >= L] n-gram proposals for
    the tree's L lookup nodes -> candidates [B, N]: root, head nodes, lookup nodes."""
    if tree.num_nodes == 1:
        return roots[:, None]
    parts = [roots[:, None], topk[:, tree.head_index, tree.ranks]]  # [B, 1], [B, Nh]
    if tree.num_lookup:
        if lookup is None:
            raise ValueError(f"tree {tree.spec.name!r} has {tree.num_lookup} prompt-lookup nodes: pass their tokens")
        parts.append(lookup[:, : tree.num_lookup])  # [B, L]
    return torch.cat(parts, dim=1)


def greedy_verdict(tree: DeviceTree, candidates: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """candidates, targets [B, N] (targets = argmax at each node) -> deepest accepted node [B]."""
    child_ok = candidates[:, 1:] == targets[:, tree.parents[1:]]  # [B, N - 1]
    ok = torch.cat([torch.ones_like(child_ok[:, :1]), child_ok], dim=1)  # [B, N], root always passes
    path_ok = ~(tree.mask[None] & ~ok[:, None, :]).any(-1)  # [B, N]: every ancestor-or-self passes
    score = torch.where(path_ok, tree.depths[None], -1)
    return score.argmax(-1)  # first (lowest index) among the deepest, like the batch-1 verifier


def emitted_tokens(tree: DeviceTree, candidates: torch.Tensor, best: torch.Tensor,
                   next_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (count [B], tokens [B, D + 1]): the accepted drafts then the next root; entries past count are junk."""
    count = tree.depths[best] + 1  # [B]
    path = tree.paths[best]  # [B, D + 1]
    drafts = candidates.gather(1, path[:, 1:])  # [B, D] accepted draft tokens, then junk
    tokens = torch.cat([drafts, best.new_zeros(best.shape[0], 1)], dim=1)
    tokens.scatter_(1, (count - 1)[:, None], next_token[:, None])
    return count, tokens


def compaction_slots(tree: DeviceTree, slots: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [B, N] of the step's tokens -> (src, dst) [B * (D + 1)] moving the accepted path's KV down.

    The node at depth d of the path moves to the step's d-th slot. Moves past the
    path, and the root's, have src == dst and copy a slot onto itself.
    """
    path = tree.paths[best]  # [B, D + 1]
    dst = slots[:, : path.shape[1]]
    src = slots.gather(1, path)
    keep = torch.arange(path.shape[1], device=slots.device)[None] <= tree.depths[best][:, None]
    return torch.where(keep, src, dst).flatten(), dst.flatten()


def sampled_targets(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniforms: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """Each node's target drawn from its row's processed distribution by the Gumbel-max trick.

    logits [B, N, V]; temperature, top_p, min_p [B] float; top_k [B] long (0 = off);
    uniforms [B, N] float64 in [0, 1), each keying its node's noise. Row by row this
    is exactly the seeded `TokenSampler` draw, so a seeded request gets the same
    tokens here as on the host path.
    filtered=False: no row has min-p, top-k or top-p (the caller knows), so the sort that finds
    their cutoffs is skipped; a row without filters draws the same token either way.
    """
    batch, n, vocab = logits.shape
    flat = logits.reshape(batch * n, vocab)
    per_node = lambda t: t[:, None].expand(batch, n).reshape(-1)  # noqa: E731  [B] -> [B * N]
    temperature = per_node(temperature.float())
    if filtered:
        cutoff = filter_cutoffs(flat, temperature, per_node(top_k), per_node(top_p), per_node(min_p))
    else:
        cutoff = torch.full((batch * n,), float("-inf"), device=logits.device)
    return gumbel_argmax(flat, temperature, cutoff, uniforms.reshape(-1)).view(batch, n)
