"""Attention over a paged KV cache for a mixed batch: prompt chunks and Medusa trees.

This file holds the plain PyTorch reference (also the CPU path). The Triton
kernel of the fast path must match it on random inputs.

Layout (flat, varlen, as the engine builds it each step):
- q [T, Hq, D]: this step's query tokens of all sequences, sequence after sequence;
  `query_start` [B + 1] gives each sequence's range (cu_seqlens).
- k_cache, v_cache [num_slots, Hkv, D]: every block's slots, slot = block * block_size + offset.
  This step's k/v are already written at their slots.
- block_tables [B, max_blocks] int32 (-1 padded); kv_lens [B]: KV tokens of each
  sequence including this step's (logical indices 0 .. kv_len - 1).
- The step's tokens are the last q_len logical entries. Each attends to every
  earlier entry, and among the step's own tokens to those its mask allows:
  causal for a prompt chunk, tree ancestors for a verification step, given as
  `step_bits` [T] int64 (bit j = may see step token j; at most 64 step tokens).
"""

from __future__ import annotations

import torch

from medusa.attention import attend


def kernel_pages(block_size: int) -> bool:
    """Whether the Triton kernel can walk pages of `block_size` slots: a power of two >= 16 (a key chunk
    holds whole pages, or a page whole chunks)."""
    return block_size >= 16 and not block_size & (block_size - 1)


def row_tile(max_query_len: int, group: int) -> int:
    """Rows of the Triton kernel's query tiles: 64 where a sequence's step tokens x query heads per KV
    head fill them (trees of 16+ nodes on 4-way grouped heads, prompt chunks), else 16 (a token per sequence)."""
    return 64 if max_query_len * group >= 64 else 16


def chunks_per_split(block_m: int, head_dim: int, fills_a_fifth: bool = True) -> int:
    """Key chunks (64 keys) a split walks at least where the host bounds a step's keys (`max_kv_len`):
    eight for 64-row tiles of heads of 128 whose programs before splitting already fill a fifth of the
    GPU (`fills_a_fifth`: their partial accumulators, [64, 128] floats a split, then cost more than the
    parallelism gains); one otherwise.

    Measured on an H200 (RESULTS.md, session 30: per call in a CUDA graph, tables 4096 keys wider): a
    64-node tree of the 8B shape at one sequence (32 programs) at 512 keys took 12.7 us with 2 splits,
    15.1 with 4 (what filling the GPU picks), 14.4 with 1; at 1024 keys 16.2 with 2, 17.2 with 4. A
    16-node tree there (8 programs) is fastest with 8-16 splits (9.5-9.9 us; 11.3 with 2).
    """
    return 8 if block_m >= 64 and head_dim >= 128 and fills_a_fifth else 1


def step_mask_from_bits(bits: torch.Tensor, q_len: int) -> torch.Tensor:
    """bits [q_len] int64 -> [q_len, q_len] bool."""
    j = torch.arange(q_len, device=bits.device)
    return ((bits[:, None] >> j[None, :]) & 1).bool()


def logical_to_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Physical slots of logical KV entries 0 .. length-1 of one sequence: [length]."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, kv_lens: torch.Tensor, query_start: torch.Tensor,
                              causal: torch.Tensor, step_bits: torch.Tensor, block_size: int,
                              scale: float | None = None) -> torch.Tensor:
    """-> out [T, Hq, D]; see the module docstring for the layout. causal [B] bool or int32 (1 = causal)."""
    plan = reference_plan(block_tables, kv_lens, query_start, causal, step_bits, block_size)
    return attend_planned(q, k_cache, v_cache, plan, scale)


# One sequence of a step: its query rows [start, end), its KV slots (a slice where its blocks are consecutive,
# else the slots [kv_len]) and its mask [q_len, kv_len].
SequencePlan = tuple[int, int, "slice | torch.Tensor", torch.Tensor]


def reference_plan(block_tables: torch.Tensor, kv_lens: torch.Tensor, query_start: torch.Tensor,
                   causal: torch.Tensor, step_bits: torch.Tensor, block_size: int) -> list[SequencePlan]:
    """What `attend_planned` needs of each sequence with query tokens: the same in every layer of a step, so
    the CPU path builds it once a step. Per layer, it and the gathers of K/V cost the default model's engine
    ~23 ms of a 113 ms plain step at one request on a 2-core CPU (90 ms with the plan once and slices)."""
    plan = []
    starts, lens = query_start.tolist(), kv_lens.tolist()
    for b in range(block_tables.shape[0]):
        s, e = starts[b], starts[b + 1]
        q_len, kv_len = e - s, lens[b]
        if q_len == 0:
            continue
        own = (torch.ones(q_len, q_len, dtype=torch.bool, device=block_tables.device).tril() if bool(causal[b])
               else step_mask_from_bits(step_bits[s:e], q_len))
        prefix = torch.ones(q_len, kv_len - q_len, dtype=torch.bool, device=block_tables.device)
        plan.append((s, e, _sequence_slots(block_tables[b], kv_len, block_size), torch.cat([prefix, own], dim=1)))
    return plan


def _sequence_slots(block_table: torch.Tensor, length: int, block_size: int) -> slice | torch.Tensor:
    """A slice of the pool where the sequence's blocks are consecutive (a view, no gather), else its slots."""
    blocks = block_table[:-(-length // block_size)].tolist()
    if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        return slice(blocks[0] * block_size, blocks[0] * block_size + length)
    return logical_to_slots(block_table, length, block_size)


def attend_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[SequencePlan],
                   scale: float | None = None) -> torch.Tensor:
    """Each planned sequence's queries over its K/V: q [T, Hq, D] -> out [T, Hq, D]."""
    if len(plan) == 1 and plan[0][:2] == (0, q.shape[0]):  # one sequence owns every row: no copy into `out`
        _, _, slots, mask = plan[0]
        return attend(q, k_cache[slots], v_cache[slots], mask, scale=scale)
    out = torch.empty_like(q)
    for s, e, slots, mask in plan:
        out[s:e] = attend(q[s:e], k_cache[slots], v_cache[slots], mask, scale=scale)
    return out


def write_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into their slots [T] (negative slot = padding, skipped)."""
    write_kv_planned(k_cache, v_cache, k, v, kv_writes(slot_mapping))


def kv_writes(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """slot_mapping [T] -> (the rows that are written [n], None where all T are; their slots [n])."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return None, slot_mapping
    rows = keep.nonzero().squeeze(1)
    return rows, slot_mapping[rows]


def write_kv_planned(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     writes: tuple[torch.Tensor | None, torch.Tensor]) -> None:
    """`write_kv_reference` with its rows and slots found already (`kv_writes`: once a step, not a layer)."""
    rows, slots = writes
    k_cache.index_copy_(0, slots, k if rows is None else k[rows])
    v_cache.index_copy_(0, slots, v if rows is None else v[rows])


def rope_write_kv_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k, then k and v into their cache slots: q [T, Hq, D] -> rotated q [T, Hq, D]."""
    from medusa.kernels.fused_ops import rotary_reference

    q, k = rotary_reference(positions, q, k, cos, sin)
    write_kv_reference(k_cache, v_cache, k, v, slot_mapping)
    return q


def move_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
    """Copy accepted tree tokens' KV [n] src -> dst; gathers first, so overlaps are safe."""
    k_cache[dst_slots] = k_cache[src_slots]
    v_cache[dst_slots] = v_cache[src_slots]
