"""The server's KV cache size when the user gives none: a share of free GPU memory, capped by use."""

import argparse

import pytest
import torch

from medusa.config import ModelConfig
from medusa.decoding.kv_budget import CPU_BLOCKS, auto_num_blocks, blocks_for_memory, kv_block_bytes
from medusa.decoding.server import cli

SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_block_bytes_count_k_and_v_of_every_layer():
    assert kv_block_bytes(SMOLLM2, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2  # 368,640
    assert kv_block_bytes(SMOLLM2, 16, torch.float32) == 2 * kv_block_bytes(SMOLLM2, 16, torch.bfloat16)


def test_blocks_fill_the_share_of_free_memory_up_to_what_the_sequences_can_use():
    block = kv_block_bytes(SMOLLM2, 16, torch.bfloat16)
    # 1 GiB at 40%: memory is the limit
    assert blocks_for_memory(2**30, 0.4, block, 64, 8192, 16) == int(2**30 * 0.4) // block
    # 100 GiB: 64 sequences of 8192 tokens + a 64-node tree each are all it can use
    assert blocks_for_memory(100 * 2**30, 0.4, block, 64, 8192, 16) == 64 * (8192 + 64) // 16
    assert blocks_for_memory(10, 0.5, block, 64, 8192, 16) == 1  # never zero: the engine needs a block
    with pytest.raises(ValueError, match=r"share of free device memory .* \(0, 1\], got 1.5"):
        blocks_for_memory(2**30, 1.5, block, 64, 8192, 16)


def test_on_the_cpu_the_pool_stays_small():
    class Model:
        base = torch.nn.Module()

    Model.base.embed_tokens = torch.nn.Embedding(4, 2)
    assert auto_num_blocks(Model(), 0.4, 64, 16) == CPU_BLOCKS


@pytest.mark.parametrize("flag,value,message", [("--gpu-memory-utilization", "0", r"\(0, 1\], got 0.0"),
                                                ("--num-kv-blocks", "0", "--num-kv-blocks must be >= 1"),
                                                ("--apply-interval", "0", "--apply-interval and --num-kv-blocks must"),
                                                ("--port", "-5", r"--port must be in \[0, 65535\], got -5")])
def test_serve_names_a_bad_memory_setting(flag, value, message):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        cli.serve(parser.parse_args([flag, value]))


def test_serve_offers_only_block_sizes_the_kernels_page():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args(["--block-size", "64"]).block_size == 64
    assert parser.parse_args([]).block_size == 16
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "24"])
