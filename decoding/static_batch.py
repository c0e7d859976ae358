"""Plain batched generation on a padded, contiguous KV cache.

The simplest fast way to let the base model write many answers at once (self-
distillation, reference outputs for tests and benchmarks): prompts are
left-padded so every row appends its next token at the same slot, and one
forward per step serves the whole batch. No speculation here; the paged engine
with continuous batching is the serving path.
"""

from __future__ import annotations

from typing import Sequence

import torch

from medusa.attention import attend
from medusa.decoding.sampler import SamplingConfig, sample, target_probs
from medusa.model import DecoderModel


# Keys attended per step are rounded up to this many slots (the extra ones are masked out). The
# attention backend (cuDNN SDPA on the H200) plans once per shape, and a plan costs far more than the
# step: a key length growing by one every step made every step of a fresh batch width a new plan.
KEY_BUCKET = 256


class PaddedKVCache:
    """k, v [num_layers, B, S, Hkv, D]; `valid` [B, S] marks real (non-pad) slots."""

    def __init__(self, model: DecoderModel, batch: int, max_len: int) -> None:
        c, w = model.config, model.embed_tokens.weight
        shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)
        self.k = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.v = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=w.device)
        self.length = 0
        self._step, self._keys, self._mask = 0, 0, None

    def begin(self, valid: torch.Tensor) -> None:
        """valid [B, T] for this step's tokens; builds the [B, 1, T, S] mask, S = keys rounded up to KEY_BUCKET."""
        t = valid.shape[1]
        self.valid[:, self.length:self.length + t] = valid
        s = min(self.valid.shape[1], -(-(self.length + t) // KEY_BUCKET) * KEY_BUCKET)
        keys = self.valid[:, :s]  # [B, S]; slots not yet written are False
        causal = torch.ones(t, s, dtype=torch.bool, device=valid.device).tril(self.length)
        mask = causal & keys[:, None, :]  # [B, T, S]
        # a pad query attends to itself so its row stays finite (NaN would leak through values)
        mask[:, :, self.length:self.length + t] |= torch.eye(t, dtype=torch.bool, device=valid.device)
        self._step, self._keys, self._mask = t, s, mask[:, None]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]"""
        end = self.length + self._step
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return attend(q, self.k[layer, :, :self._keys], self.v[layer, :, :self._keys], mask=self._mask)

    def advance(self) -> None:
        self.length += self._step


@torch.inference_mode()
def generate_padded(model: DecoderModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    sampling: SamplingConfig, eos_ids: Sequence[int] = (),
                    generator: torch.Generator | None = None) -> list[list[int]]:
    """Continue every prompt in one batch; each answer ends with its EOS token if one was produced."""
    device = model.embed_tokens.weight.device
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(batch, width, dtype=torch.long, device=device)
    valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):  # left padding: every row ends at the same slot
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), device=device)
        valid[row, width - len(prompt):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # [B, P]
    cache = PaddedKVCache(model, batch, width + max_new_tokens)
    eos = torch.tensor(list(eos_ids) or [-1], device=device)
    out = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    next_pos = positions[:, -1]
    for step in range(max_new_tokens):
        cache.begin(valid)
        hidden = model(ids, positions, cache)[:, -1]  # [B, H]
        cache.advance()
        logits = model.compute_logits(hidden)
        token = logits.argmax(-1) if sampling.greedy else sample(target_probs(logits, sampling), generator)
        out[:, step] = token
        done |= torch.isin(token, eos)
        if step % 16 == 15 and bool(done.all()):  # a host sync only every 16 steps
            break
        next_pos = next_pos + 1
        ids, positions = token[:, None], next_pos[:, None]
        valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
    return [_cut_at_eos(row, set(eos_ids)) for row in out[:, : step + 1].tolist()]


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
