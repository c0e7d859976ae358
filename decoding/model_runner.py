"""Turn a step's prompt chunks into tensors and run the model; own the KV pool and the decode step.

Prompt chunks (prefill) run eagerly with their own shapes; decoding sequences
go through `DecodeStep` (static buffers, device-side verification, CUDA graphs
on the GPU). The KV pool has one extra block at the end, never handed out,
that padding rows of a captured batch write into.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from medusa.decoding.block_manager import BlockManager
from medusa.decoding.decode_step import DecodeStep
from medusa.decoding.paged_cache import PagedKVCache, StepMetadata
from medusa.decoding.scheduler import ScheduledSeq
from medusa.heads import MedusaHeads
from medusa.model import DecoderModel


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: StepMetadata
    starts: list[int]  # where each scheduled sequence's tokens begin in the flat batch


class ModelRunner:
    def __init__(self, model: DecoderModel, heads: MedusaHeads | None, blocks: BlockManager, num_blocks: int,
                 max_seqs: int, max_model_len: int, max_tree: int, kmax: int, use_graphs: bool) -> None:
        self.model, self.blocks = model, blocks
        self.device = model.embed_tokens.weight.device
        self.cache = PagedKVCache(model.config, num_blocks + 1, blocks.block_size, model.embed_tokens.weight.dtype,
                                  self.device)
        max_blocks_per_seq = -(-(max_model_len + max_tree) // blocks.block_size)
        self.decode = DecodeStep(model, heads, self.cache, num_blocks * blocks.block_size, max_seqs,
                                 max_blocks_per_seq, max_tree, kmax, use_graphs)

    def prepare_prefill(self, items: list[ScheduledSeq]) -> StepInputs:
        """Prompt chunks, each causal over its own tokens and everything cached before them."""
        ids, positions, slots, kv_lens, tables, starts = [], [], [], [], [], []
        offset = 0
        for item in items:
            seq, n, start = item.seq, item.num_tokens, item.seq.num_computed_tokens
            starts.append(offset)
            slots.append(self.blocks.slot_mapping(seq, start, n))
            ids.append(np.asarray(seq.token_ids(start, start + n), dtype=np.int64))
            positions.append(np.arange(start, start + n, dtype=np.int64))
            kv_lens.append(start + n)
            tables.append(seq.block_table)
            offset += n
        starts.append(offset)
        table = np.full((len(tables), max(len(t) for t in tables)), -1, dtype=np.int32)
        for row, t in enumerate(tables):
            table[row, : len(t)] = t
        as_t = lambda a, dtype=torch.long: torch.as_tensor(a, dtype=dtype, device=self.device)  # noqa: E731
        metadata = StepMetadata(
            slot_mapping=as_t(np.concatenate(slots)), block_tables=as_t(table, torch.int32),
            kv_lens=as_t(kv_lens), query_start=as_t(starts), causal=as_t([True] * len(items), torch.bool),
            step_bits=torch.zeros(offset, dtype=torch.long, device=self.device),
            max_query_len=max(len(i) for i in ids))
        return StepInputs(as_t(np.concatenate(ids)), as_t(np.concatenate(positions)), metadata, starts[:-1])

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """-> final hidden states [T, H] of every step token."""
        self.cache.step = inputs.metadata
        try:
            return self.model(inputs.input_ids, inputs.positions, self.cache)
        finally:
            self.cache.step = None
