"""Prompt chunks padded to a token bucket (the inputs of the captured prefill graphs) give the
same hidden states and KV as the eager forward; the same padded path replays as a graph on a GPU."""

import numpy as np
import pytest
import torch

from engine_driver import random_prompts, run_staggered, single_thread
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.prefill_graphs import PrefillBatch, token_buckets
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from tiny_models import tiny_decoder

VOCAB = 24


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def test_token_buckets_cover_every_count_up_to_the_budget():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(10) == [10]
    for budget in (1, 17, 600, 3000):
        buckets = token_buckets(budget)
        assert buckets == sorted(set(buckets)) and buckets[-1] == budget


def test_padded_prefill_equals_eager(tiny):
    """Chunked prompts (a small token budget), several per step, some continuing a cached prefix; each in a
    forward of its own (test_mixed_steps.py checks those a decode step carries)."""
    model, heads = tiny
    config = EngineConfig(num_blocks=200, block_size=4, enable_prefix_caching=False, mixed_prompt_tokens=0,
                          scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6), cuda_graphs=False)
    engine = LLMEngine(model, heads, config)
    runner = engine.runner
    seen = {"batches": 0, "multi": 0, "continued": 0}

    def both(batch):
        before = runner.cache.k.clone()
        reference = runner.run_eager(batch).clone()
        after_eager = runner.cache.k.clone()
        runner.cache.k.copy_(before)
        padded = runner.prefill.run(batch)  # the static, padded path, eagerly on the CPU
        assert padded.shape == reference.shape
        torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.cache.k, after_eager, rtol=1e-5, atol=1e-5)  # same KV, nothing else
        seen["batches"] += 1
        seen["multi"] += batch.num_seqs > 1
        seen["continued"] += bool((batch.kv_lens > batch.query_start[1:] - batch.query_start[:-1]).any())
        return reference

    runner.run = both
    prompts = random_prompts(8, VOCAB, 40, seed=3)
    done = run_staggered(engine, prompts, [SamplingParams(max_tokens=4)] * len(prompts))
    assert len(done) == len(prompts)
    assert seen["batches"] >= 4 and seen["multi"] >= 1 and seen["continued"] >= 1


def test_batches_beyond_the_buckets_do_not_fit_the_graphs(tiny):
    """The runner sends them down the eager path instead."""
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4, cuda_graphs=False,
                                                  scheduler=SchedulerConfig(max_num_batched_tokens=16,
                                                                            max_num_seqs=2)))
    graphs = engine.runner.prefill
    assert graphs.buckets == [16] and not graphs.use_graphs
    ok = PrefillBatch(np.zeros(16, np.int64), np.arange(16), np.arange(16), np.zeros((2, 4), np.int32),
                      np.array([8, 8]), np.array([0, 8, 16]))
    assert graphs.fits(ok) and ok.starts == [0, 8] and ok.max_query_len == 8
    too_many_tokens = PrefillBatch(np.zeros(17, np.int64), np.arange(17), np.arange(17), np.zeros((1, 5), np.int32),
                                   np.array([17]), np.array([0, 17]))
    too_many_seqs = PrefillBatch(np.zeros(3, np.int64), np.arange(3), np.arange(3), np.zeros((3, 1), np.int32),
                                 np.array([1, 1, 1]), np.array([0, 1, 2, 3]))
    assert not graphs.fits(too_many_tokens) and not graphs.fits(too_many_seqs)


@pytest.mark.gpu
def test_prefill_graphs_equal_eager_on_the_gpu(default_model_dir):
    """Every prefill of a staggered run, replayed from its bucket's graph, against the eager forward."""
    from medusa.medusa_model import MedusaModel

    model = MedusaModel.from_pretrained(device="cuda", dtype=torch.float32)
    engine = model.engine()
    engine.mixed_prompt_tokens = 0  # every prompt chunk in a prefill forward of its own
    runner = engine.runner
    assert runner.prefill.use_graphs
    engine.warmup()
    replays, run = [], runner.run

    def both(batch):
        graphs, cache = runner.prefill, runner.cache
        eager = runner.run_eager(batch).clone()  # its own shapes: other tiles, so other TF32 roundings
        before = cache.k.clone()
        graphs.use_graphs = False
        padded = graphs.run(batch).clone()  # the padded inputs, eagerly
        padded_kv = cache.k.clone()
        graphs.use_graphs = True
        cache.k.copy_(before)
        replayed = run(batch)  # the graph path
        torch.testing.assert_close(replayed, padded, rtol=1e-5, atol=1e-5)
        # real slots only: the scratch slot past them takes padding rows' junk (NaN, say) in decode captures
        real = runner.decode.scratch_slot
        torch.testing.assert_close(cache.k[:, :real], padded_kv[:, :real], rtol=1e-5, atol=1e-5)
        assert (replayed - eager).abs().max() < 0.1  # the same forward up to rounding
        replays.append(batch.num_tokens)
        return replayed

    runner.run = both
    prompts = [model.encode([{"role": "user", "content": f"Question {i}: " + "why is the sky blue? " * i}])
               for i in range(1, 9)]
    done = run_staggered(engine, prompts, [SamplingParams(max_tokens=8)] * len(prompts))
    assert len(done) == len(prompts) and len(replays) >= 2
