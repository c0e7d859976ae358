"""How many KV blocks an engine gets when the user does not say: sized from device memory.

On a GPU the paged KV cache is the memory that decides how many sequences run at
once, so, as vLLM does with `gpu_memory_utilization`, the server takes a share
of what the device has free after loading the weights, capped at what
`max_num_seqs` sequences of the full context could ever use. The CPU keeps a
small fixed pool (tests and demos).
"""

from __future__ import annotations

import math

import torch

from medusa.config import ModelConfig

CPU_BLOCKS = 512
MAX_TREE_NODES = 64  # a decoding sequence's lookahead slots: at most one tree (the kernels' limit)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V, every layer, block_size tokens of num_kv_heads x head_dim."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def blocks_for_memory(free_bytes: int, share: float, block_bytes: int, max_num_seqs: int, max_model_len: int,
                      block_size: int) -> int:
    """Blocks that fit `share` of `free_bytes`, but no more than max_num_seqs sequences of
    max_model_len tokens, each with a tree's lookahead slots, can use; at least 1."""
    if not 0 < share <= 1:
        raise ValueError(f"the share of free device memory for the KV cache must be in (0, 1], got {share}")
    fit = int(free_bytes * share) // block_bytes
    useful = max_num_seqs * math.ceil((max_model_len + MAX_TREE_NODES) / block_size)
    return max(1, min(fit, useful))


def auto_num_blocks(model, share: float, max_num_seqs: int, block_size: int) -> int:
    """The engine's block count on the model's device (see the module docstring)."""
    weight = model.base.embed_tokens.weight  # the device and dtype the cache will have
    if weight.device.type != "cuda":
        return CPU_BLOCKS
    free, _ = torch.cuda.mem_get_info(weight.device)
    return blocks_for_memory(free, share, kv_block_bytes(model.base.config, block_size, weight.dtype),
                             max_num_seqs, model.base.config.max_position_embeddings, block_size)
