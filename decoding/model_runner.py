"""Turn a scheduled step into tensors, run the model, and compact accepted KV.

This is the PyTorch reference path (any device, eager). The fast path keeps
the same `prepare` / `run` / `compact` contract with static buffers, Triton
kernels and CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from medusa.decoding.block_manager import BlockManager
from medusa.decoding.paged_cache import PagedKVCache, StepMetadata
from medusa.decoding.scheduler import SchedulerOutput
from medusa.model import DecoderModel


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: StepMetadata
    starts: list[int]  # where each scheduled sequence's tokens begin in the flat batch


class ModelRunner:
    def __init__(self, model: DecoderModel, blocks: BlockManager, num_blocks: int) -> None:
        self.model, self.blocks = model, blocks
        self.device = model.embed_tokens.weight.device
        self.cache = PagedKVCache(model.config, num_blocks, blocks.block_size, model.embed_tokens.weight.dtype,
                                  self.device)

    def prepare(self, out: SchedulerOutput, candidates: dict) -> StepInputs:
        """candidates: request_id -> [N] tree tokens for each decoding sequence."""
        tree = out.tree
        ids, positions, slots, bits, causal, kv_lens, tables, starts = [], [], [], [], [], [], [], []
        offset = 0
        for item in out.scheduled:
            seq, n, start = item.seq, item.num_tokens, item.seq.num_computed_tokens
            starts.append(offset)
            slots.append(self.blocks.slot_mapping(seq, start, n))
            if item.is_prefill:
                ids.append(np.asarray(seq.token_ids(start, start + n), dtype=np.int64))
                positions.append(np.arange(start, start + n, dtype=np.int64))
                bits.append(np.zeros(n, dtype=np.int64))
            else:
                ids.append(candidates[seq.request_id].cpu().numpy())
                positions.append(start + tree.depths.numpy())
                bits.append(tree.ancestor_bits.numpy())
            causal.append(item.is_prefill)
            kv_lens.append(start + n)
            tables.append(seq.block_table)
            offset += n
        starts.append(offset)
        width = max(len(t) for t in tables)
        table = np.full((len(tables), width), -1, dtype=np.int32)
        for row, t in enumerate(tables):
            table[row, : len(t)] = t
        as_t = lambda a, dtype=torch.long: torch.as_tensor(a, dtype=dtype, device=self.device)  # noqa: E731
        metadata = StepMetadata(
            slot_mapping=as_t(np.concatenate(slots)), block_tables=as_t(table, torch.int32),
            kv_lens=as_t(kv_lens), query_start=as_t(starts), causal=as_t(causal, torch.bool),
            step_bits=as_t(np.concatenate(bits)), max_query_len=max(len(i) for i in ids))
        return StepInputs(as_t(np.concatenate(ids)), as_t(np.concatenate(positions)), metadata, starts[:-1])

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """-> final hidden states [T, H] of every step token."""
        self.cache.step = inputs.metadata
        try:
            return self.model(inputs.input_ids, inputs.positions, self.cache)
        finally:
            self.cache.step = None

    def compact(self, seq, num_step_tokens: int, accepted: torch.Tensor) -> None:
        """Move accepted tree nodes' KV (node indices [n], ascending) to consecutive slots."""
        start = seq.num_computed_tokens
        step_slots = self.blocks.slot_mapping(seq, start, num_step_tokens)
        src = step_slots[accepted.cpu().numpy()]
        dst = step_slots[: len(src)]
        moved = src != dst
        if moved.any():
            self.cache.move(torch.as_tensor(src[moved], device=self.device),
                            torch.as_tensor(dst[moved], device=self.device))
