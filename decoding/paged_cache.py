"""The engine's KV cache: one pool of paged slots per layer, and the per-step metadata.

`PagedKVCache` is the `AttentionBackend` the model calls during an engine step:
it writes this step's k/v at the slots the block manager assigned and attends
over each sequence's pages. The attention itself comes from `medusa.kernels`
(PyTorch reference on the CPU; the Triton kernel plugs in behind the same call).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from medusa.config import ModelConfig
from medusa.kernels.dispatch import use_triton
from medusa.kernels.kv_move import move_kv
from medusa.kernels.paged_attention import (attend_planned, kernel_pages, kv_writes, reference_plan,
                                            write_kv_planned)
from medusa.kernels.skinny_matmul import SplitSums


@dataclass(frozen=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [T] long, where each step token's k/v go
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    kv_lens: torch.Tensor  # [B] KV entries per sequence after this step's writes
    query_start: torch.Tensor  # [B + 1] cu_seqlens of the step tokens
    # [B] int32 (bool accepted): 1 = prompt chunk (causal), 0 = tree (step_bits). int32 is what the
    # kernel reads: a bool tensor would be cast in every layer, one more launch per layer per step.
    causal: torch.Tensor
    step_bits: torch.Tensor  # [T] int64 ancestor bits within the sequence's step tokens
    max_query_len: int = 64  # host-side bound on any sequence's step tokens (sizes the kernel grid)
    # host-side bound on any sequence's keys after the step, None: the tables' width. It only sets how many
    # programs split each sequence's keys (a longer sequence is still attended in full, by fewer of them)
    max_kv_len: int | None = None

    def __post_init__(self) -> None:
        t, b = self.slot_mapping.shape[0], self.block_tables.shape[0]
        if self.step_bits.shape[0] != t or self.query_start.shape[0] != b + 1 or self.kv_lens.shape[0] != b:
            raise ValueError(f"inconsistent step metadata: {t} tokens, {b} sequences")


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.step: StepMetadata | None = None
        # other page sizes take the reference
        self.use_triton = device.type == "cuda" and _triton_available() and kernel_pages(block_size)
        # layer -> TMA descriptors of its K/V pools (pages >= 64 keys), None where TMA does not fit; decided once
        self._descriptors: dict[int, tuple | None] = {}
        self._plan: tuple | None = None  # the reference's writes and per-sequence plan, built once a step

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor, step: StepMetadata) -> torch.Tensor:
        """model(input_ids, positions) [T] over this cache with `step`'s slots and masks -> hidden [T, H]."""
        self.step, self._plan = step, None
        try:
            return model(input_ids, positions, self)
        finally:
            self.step, self._plan = None, None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]"""
        s = self.step
        if not self.use_triton:
            return self._reference(layer, q, k, v)
        from medusa.kernels.paged_attention_triton import write_kv_triton

        write_kv_triton(self.k[layer], self.v[layer], k, v, s.slot_mapping)
        return self._attend_triton(layer, q.contiguous())

    def rotate_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, rotary) -> torch.Tensor:
        """RoPE, KV write and attention; on the Triton path RoPE and the KV write are one kernel
        (one launch per layer fewer). q [T, Hq, D], k/v [T, Hkv, D] un-rotated -> [T, Hq, D]; all three may be
        views of a QKV product left as `SplitSums`, which the kernel adds up as it loads them."""
        split = isinstance(q, SplitSums)
        if not (self.use_triton and use_triton(*(t.parts if split else t for t in (q, k, v)))):
            if split:
                q, k, v = q.total(), k.total(), v.total()
            q, k = rotary(positions, q, k)
            return self(layer, q, k, v)
        from medusa.kernels.paged_attention_triton import rope_write_kv_triton

        q = rope_write_kv_triton(positions, q, k, v, rotary.cos, rotary.sin, self.k[layer], self.v[layer],
                                 self.step.slot_mapping)
        return self._attend_triton(layer, q)

    def _attend_triton(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The Triton kernel over this layer's pages; the step's k/v are already in their slots."""
        from medusa.kernels.paged_attention_triton import bulk_copies_fit, page_descriptors, paged_attention_triton

        s, k, v = self.step, self.k[layer], self.v[layer]
        if layer not in self._descriptors:  # built once: eager calls would pay each time
            self._descriptors[layer] = page_descriptors(k, v) if bulk_copies_fit(q, k, v, self.block_size) else None
        return paged_attention_triton(q, k, v, s.block_tables, s.kv_lens, s.query_start, s.causal, s.step_bits,
                                      self.block_size, s.max_query_len, max_kv_len=s.max_kv_len,
                                      descriptors=self._descriptors.get(layer))

    def _reference(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The PyTorch path: the step's slots and masks are the same in every layer, so they are found once."""
        s = self.step
        if self._plan is None:
            self._plan = (kv_writes(s.slot_mapping), reference_plan(s.block_tables, s.kv_lens, s.query_start,
                                                                    s.causal, s.step_bits, self.block_size))
        writes, plan = self._plan
        write_kv_planned(self.k[layer], self.v[layer], k, v, writes)
        return attend_planned(q, self.k[layer], self.v[layer], plan)

    def move_all(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, moves_per_row: int | None = None) -> None:
        """KV rows src -> dst [n] int64 in every layer (graph-safe: no host sync); on a GPU one launch
        for rows of up to `kv_move.MAX_MOVES_PER_ROW` moves, else the PyTorch reference's four kernels.

        The moves are rows of `moves_per_row` consecutive entries, each row gathering all its reads
        before its writes, so a dst may be another move's src of the same row; no row may read a slot
        that another row writes (the decode step's rows have disjoint slots, padding rows only copy the
        scratch slot onto itself). None, the default, makes all n moves one row: any overlap is safe.
        """
        move_kv(self.k, self.v, src_slots, dst_slots, moves_per_row)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
