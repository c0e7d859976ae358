"""The paged cache's CPU path: a step's writes and per-sequence plan are found once, used by every layer."""

import pytest
import torch

import medusa.decoding.paged_cache as paged_cache
from medusa.attention import CausalAttention
from medusa.decoding.paged_cache import PagedKVCache, StepMetadata
from tiny_models import tiny_decoder


def prompts_step(lengths: list[int], block_size: int, pad: int = 0) -> StepMetadata:
    """Prompts as causal chunks, each in its own blocks (every second one's reversed), then `pad` padding tokens."""
    tables, slots, start = [], [], 0
    for b, n in enumerate(lengths):
        blocks = list(range(start, start + -(-n // block_size)))
        blocks = blocks[::-1] if b % 2 else blocks
        start += len(blocks)
        tables.append(blocks)
        slots += [blocks[i // block_size] * block_size + i % block_size for i in range(n)]
    width = max(map(len, tables))
    tables = [t + [-1] * (width - len(t)) for t in tables]
    return StepMetadata(slot_mapping=torch.tensor(slots + [-1] * pad),
                        block_tables=torch.tensor(tables, dtype=torch.int32),
                        kv_lens=torch.tensor(lengths), query_start=torch.tensor([0] + lengths).cumsum(0),
                        causal=torch.ones(len(lengths), dtype=torch.int32),
                        step_bits=torch.zeros(sum(lengths) + pad, dtype=torch.long))


@pytest.mark.parametrize("lengths, pad", [([7, 10], 1), ([9], 0), ([9], 2)])
@torch.inference_mode()
def test_a_step_plans_once_and_equals_dense_attention(monkeypatch, lengths, pad):
    """Sequences in consecutive blocks (read as a slice of the pool) and in reversed ones (gathered), one
    sequence owning every row of the step, and padding rows."""
    (model, _), block_size = tiny_decoder(vocab=40, num_layers=3), 4
    plans = []
    real_plan = paged_cache.reference_plan
    monkeypatch.setattr(paged_cache, "reference_plan", lambda *a: plans.append(1) or real_plan(*a))
    cache = PagedKVCache(model.config, num_blocks=8, block_size=block_size, dtype=torch.float32,
                         device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 40, (n,), generator=g) for n in lengths]
    step = prompts_step(lengths, block_size, pad)
    flat = torch.cat(ids + [torch.zeros(pad, dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])
    hidden = cache.forward(model, flat, positions, step)
    assert plans == [1] and cache._plan is None  # one plan for all 3 layers, dropped after the step
    # each prompt equals the model run densely on it alone; the padding token wrote nothing
    for b, n in enumerate(lengths):
        s = sum(lengths[:b])
        dense = model(ids[b], torch.arange(n), CausalAttention())
        torch.testing.assert_close(hidden[s:s + n], dense, atol=1e-5, rtol=1e-5)
    written = step.slot_mapping[step.slot_mapping >= 0]
    unwritten = torch.ones(cache.k.shape[1], dtype=torch.bool)
    unwritten[written] = False
    assert cache.k[:, unwritten].abs().sum() == 0 and cache.v[:, unwritten].abs().sum() == 0
