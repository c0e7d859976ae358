"""Turn a step's prompt chunks into tensors and run the model; own the KV pool and the decode step.

Prompt chunks (prefill) are padded to a token bucket and replayed from CUDA
graphs on the GPU (`prefill_graphs.py`); a batch larger than the biggest bucket,
and everything on the CPU, runs eagerly with its own shapes. Decoding sequences
go through `DecodeStep` (static buffers, device-side verification, CUDA graphs on
the GPU). A step with both carries its prompt chunks in the decode step's forward
when they are few (`prompt_segment`): a prefill forward of their own would read
every weight again. The KV pool has one extra block at the end, never handed
out, that padding rows of a captured batch write into.
"""

from __future__ import annotations

import numpy as np
import torch

from medusa.decoding.block_manager import BlockManager
from medusa.decoding.decode_step import DecodeStep
from medusa.decoding.paged_cache import PagedKVCache, StepMetadata
from medusa.decoding.prefill_graphs import PrefillBatch, PrefillGraphs, PromptSegment
from medusa.decoding.scheduler import ScheduledSeq
from medusa.heads import MedusaHeads
from medusa.model import DecoderModel


class ModelRunner:
    def __init__(self, model: DecoderModel, heads: MedusaHeads | None, blocks: BlockManager, num_blocks: int,
                 max_seqs: int, max_model_len: int, max_tree: int, kmax: int, use_graphs: bool,
                 max_prefill_tokens: int = 2048, max_lookup: int = 0, steps_ahead: int = 1) -> None:
        self.model, self.blocks = model, blocks
        self.device = model.embed_tokens.weight.device
        self.cache = PagedKVCache(model.config, num_blocks + 1, blocks.block_size, model.embed_tokens.weight.dtype,
                                  self.device)
        # a step's tree may start past the tokens of the steps in flight or read back but not applied yet (up to
        # `steps_ahead`, each a tree's depth + 1 more), which the host's counters lag behind
        max_blocks_per_seq = -(-(max_model_len + (steps_ahead + 1) * max_tree) // blocks.block_size)
        self.decode = DecodeStep(model, heads, self.cache, num_blocks * blocks.block_size, max_seqs,
                                 max_blocks_per_seq, max_tree, kmax, use_graphs, max_lookup, steps_ahead)
        self.prefill = PrefillGraphs(model, self.cache, max_seqs, max_blocks_per_seq, max_prefill_tokens,
                                     self.decode.use_graphs, self.decode.pool)

    def prepare_prefill(self, items: list[ScheduledSeq]) -> PrefillBatch:
        """Prompt chunks, each causal over its own tokens and everything cached before them."""
        ids, positions, slots, kv_lens, tables = [], [], [], [], []
        for item in items:
            seq, n, start = item.seq, item.num_tokens, item.seq.num_computed_tokens
            slots.append(self.blocks.slot_mapping(seq, start, n))
            ids.append(np.asarray(seq.token_ids(start, start + n), dtype=np.int64))
            positions.append(np.arange(start, start + n, dtype=np.int64))
            kv_lens.append(start + n)
            tables.append(seq.block_table)
        table = np.full((len(tables), max(len(t) for t in tables)), -1, dtype=np.int32)
        for row, t in enumerate(tables):
            table[row, : len(t)] = t
        query_start = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int64)
        return PrefillBatch(np.concatenate(ids), np.concatenate(positions), np.concatenate(slots).astype(np.int64),
                            table, np.asarray(kv_lens, dtype=np.int64), query_start)

    def prompt_segment(self, batch: PrefillBatch, max_tokens: int) -> PromptSegment | None:
        """`batch` uploaded for the decode step to carry in its forward, if it has at most `max_tokens`
        tokens and fits the static inputs; else None (it runs in its own forward, `run`)."""
        if batch.num_tokens > max_tokens or not self.prefill.fits(batch):
            return None
        return self.prefill.segment(batch)

    @torch.inference_mode()
    def run(self, batch: PrefillBatch) -> torch.Tensor:
        """-> final hidden states [T, H] of every step token (valid until the next prefill)."""
        if self.prefill.use_graphs and self.prefill.fits(batch):
            return self.prefill.run(batch)
        return self.run_eager(batch)

    @torch.inference_mode()
    def run_eager(self, batch: PrefillBatch) -> torch.Tensor:
        """The same forward with the batch's own shapes, no padding, no graph."""
        as_t = lambda a, dtype=torch.long: torch.as_tensor(a, dtype=dtype, device=self.device)  # noqa: E731
        step = StepMetadata(
            slot_mapping=as_t(batch.slots), block_tables=as_t(batch.tables, torch.int32),
            kv_lens=as_t(batch.kv_lens), query_start=as_t(batch.query_start),
            causal=torch.ones(batch.num_seqs, dtype=torch.int32, device=self.device),
            step_bits=torch.zeros(batch.num_tokens, dtype=torch.long, device=self.device),
            max_query_len=batch.max_query_len)
        return self.cache.forward(self.model, as_t(batch.input_ids), as_t(batch.positions), step)
