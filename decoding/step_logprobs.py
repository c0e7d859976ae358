"""Logprobs of the tokens a decode step emits, computed on the device right after the step and read back
with it, so that requests asking for logprobs keep the device's verdicts and overlapped steps.

The step's emitted tokens are its accepted path's drafts, then the next root: token d came from the raw
logits at the path's node of depth d (the root first). Those logits rows are gathered for every depth of
the rows that ask (a row's tokens past its count are junk, and their entries are never read), turned into
log-probabilities, and each token's logprob, its rank and the k most likely alternatives are queued for
the host. An admitted row's first token, drawn on the device when nothing needs the host, gets its logprobs
the same way from its raw logits. The logits are the base model's raw ones (no temperature, penalties or
min_tokens ban), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.host_buffers import PendingCopy, copy_to_host, to_device
from medusa.decoding.outputs import TokenLogprob


@dataclass
class _Group:
    """The rows asking for the same number k of alternatives, and their copies on the way to the host."""

    rows: list[int]  # batch rows, in the order of the copies' first dimension
    k: int
    chosen: PendingCopy  # [R, D + 1] float: each emitted token's logprob
    rank: PendingCopy  # [R, D + 1] long
    top_ids: PendingCopy | None  # [R, D + 1, k] long, best first (None for k = 0)
    top_values: PendingCopy | None  # [R, D + 1, k] float


class StepLogprobs:
    """What `queue_step_logprobs` / `queue_first_logprobs` queued, read once the tokens are on the host."""

    def __init__(self, groups: list[_Group]) -> None:
        self._groups = groups

    def read(self, emitted: list[tuple[int, list[int]]]) -> dict[int, list[TokenLogprob]]:
        """emitted: each batch row's (count, tokens) as read back -> {batch row: a TokenLogprob for each of its
        first `count` tokens} for the rows that asked."""
        noted = {}
        for group in self._groups:
            chosen, rank = group.chosen.tolist(), group.rank.tolist()
            ids = group.top_ids.tolist() if group.top_ids is not None else None
            values = group.top_values.tolist() if group.top_values is not None else None
            for r, row in enumerate(group.rows):
                count, tokens = emitted[row]
                noted[row] = [TokenLogprob(tokens[d], chosen[r][d],
                                           list(zip(ids[r][d], values[r][d])) if ids is not None else [], rank[r][d])
                              for d in range(count)]
        return noted


def queue_step_logprobs(tree: DeviceTree, logits: torch.Tensor, packed: torch.Tensor,
                        asks: dict[int, int]) -> StepLogprobs | None:
    """logits [Bp * N, V]: a decode step's raw logits, node-major per row; packed [B, D + 3] on the device: (count,
    D + 1 tokens, best node) per row; asks: {batch row: k} for the rows that want logprobs -> their logprobs,
    queued for the host (None if no row asks)."""
    n, depth = tree.num_nodes, packed.shape[1] - 2  # depth = D + 1 tokens a row may emit

    def gather(at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mine = packed[at]  # [R, D + 3]
        return tree.paths[mine[:, -1]] + at[:, None] * n, mine[:, 1:1 + depth]  # [R, D + 1] each
    return _queue(logits, asks, gather)


def queue_first_logprobs(logits: torch.Tensor, tokens: torch.Tensor, asks: dict[int, int]) -> StepLogprobs | None:
    """logits [f, V]: admitted rows' raw logits for their first output token, tokens [f] on the device (drawn
    there); asks: {row: k} -> their logprobs, queued for the host (None if no row asks)."""
    return _queue(logits, asks, lambda at: (at[:, None], tokens[at][:, None]))


def _queue(logits: torch.Tensor, asks: dict[int, int], gather) -> StepLogprobs | None:
    """One group of copies per distinct k: top-k's order among equal values may depend on k, and a request's
    alternatives must not depend on what else is in the batch. gather(rows [R] on the device) -> (logits rows
    [R, W], tokens [R, W]): the logits row each of a row's W possible tokens came from, and the token."""
    if not asks:
        return None
    groups = []
    for k in sorted(set(asks.values())):
        rows = [row for row, wanted in asks.items() if wanted == k]
        at, tokens = gather(to_device(rows, torch.long, logits.device))
        logp = torch.log_softmax(logits[at.flatten()].float(), -1)  # [R * W, V]
        chosen = logp.gather(1, tokens.flatten()[:, None])  # [R * W, 1]
        rank = (logp > chosen).sum(-1) + 1
        top = logp.topk(k, dim=-1) if k else None
        shape = tuple(at.shape)
        groups.append(_Group(rows, k, copy_to_host(chosen.view(shape)), copy_to_host(rank.view(shape)),
                             copy_to_host(top.indices.view(*shape, k)) if top is not None else None,
                             copy_to_host(top.values.view(*shape, k)) if top is not None else None))
    return StepLogprobs(groups)
