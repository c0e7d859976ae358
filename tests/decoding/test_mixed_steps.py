"""Mixed steps (EngineConfig.mixed_prompt_tokens): an engine step that decodes and prefills at once runs
its prompt chunks inside the decode step's forward. The outputs stay those of batch-1 greedy decoding, the
carried chunks give the same hidden states and KV as a prompt forward of their own, and the step runs
one forward where it ran two."""

import pytest
import torch

from engine_driver import random_prompts, run_staggered, single_thread
from medusa.decoding.engine import EngineConfig, LLMEngine, _fill_bucket
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import ScheduledSeq, SchedulerConfig
from medusa.decoding.sequence import Sequence
from test_engine import batch1
from tiny_models import tiny_decoder

VOCAB = 24


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def engine_for(model, heads, overlap: bool, mixed: int, budget: int = 2048) -> LLMEngine:
    config = EngineConfig(num_blocks=256, block_size=4, overlap=overlap, mixed_prompt_tokens=mixed,
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8))
    engine = LLMEngine(model, heads, config)
    engine.fill_buckets = True  # as on a GPU, where the graphs pad chunks to a bucket
    return engine


def count_forwards(engine) -> dict:
    """-> counts of model forwards ('forwards'), of those carrying prompt chunks ('mixed') and of
    engine steps ('steps'), kept up to date as the engine runs."""
    seen = {"forwards": 0, "mixed": 0, "steps": 0, "carried": []}
    cache, step, segment = engine.runner.cache, engine.step, engine.runner.prompt_segment
    forward = cache.forward

    def counted(model, ids, positions, meta):
        seen["forwards"] += 1
        return forward(model, ids, positions, meta)

    def carried(batch, max_tokens):
        prompts = segment(batch, max_tokens)
        seen["mixed"] += prompts is not None
        seen["carried"] += [batch.num_tokens] if prompts is not None else []
        return prompts

    cache.forward, engine.runner.prompt_segment = counted, carried
    engine.step = lambda: seen.__setitem__("steps", seen["steps"] + 1) or step()
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "tree"])
def test_mixed_steps_equal_batch1_greedy_in_one_forward_a_step(tiny, overlap, speculative):
    model, heads = tiny
    prompts = random_prompts(12, VOCAB, 30, seed=4)
    max_tokens = [4 + 3 * (i % 5) for i in range(12)]
    engine = engine_for(model, heads if speculative else None, overlap, mixed=512)
    seen = count_forwards(engine)
    done = run_staggered(engine, prompts, [SamplingParams(max_tokens=m) for m in max_tokens], per_step=1)
    for i, p in enumerate(prompts):
        assert done[i].token_ids == batch1(model, p, max_tokens[i]), i
    assert seen["mixed"] >= 8  # a prompt joined the batch at nearly every step
    assert seen["forwards"] <= seen["steps"]  # never a prompt forward beside the decode step's
    buckets = engine.runner.prefill.buckets
    assert all(n in buckets or n < buckets[0] for n in seen["carried"]) and 16 in seen["carried"]
    assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()
    engine.blocks.check_invariants()


@pytest.mark.parametrize("lookup", [0, 2], ids=["heads", "lookup"])
def test_mixed_steps_with_padded_batches_equal_batch1_greedy(tiny, lookup):
    """Batches padded to their graph bucket, as on a GPU: the padding rows' tree tokens lie between the real
    rows' and the prompt chunks' (on the GPU, before the fix, a prompt chunk took them in as its own)."""
    model, heads = tiny
    config = EngineConfig(num_blocks=256, block_size=4, overlap=True, prompt_lookup=lookup,
                          scheduler=SchedulerConfig(max_num_seqs=8))
    engine = LLMEngine(model, heads, config)
    engine.fill_buckets = True
    step = engine.runner.decode
    step.bucket = lambda batch: next(b for b in step.buckets if b >= batch)  # 1, 2, 4, 8 rows
    prepare, padded_steps = step.prepare, []

    def checked(seqs, *args, **kwargs):  # padding rows read block 0: any other is some sequence's
        padded = prepare(seqs, *args, **kwargs)
        assert not step.tables[len(seqs):padded].any() and (step.query_start[: padded + 1].diff() > 0).all()
        padded_steps.append(padded > len(seqs))
        return padded

    step.prepare = checked
    seen = count_forwards(engine)
    prompts = random_prompts(10, VOCAB, 30, seed=4)
    done = run_staggered(engine, prompts, [SamplingParams(max_tokens=10)] * 10, per_step=1)
    for i, p in enumerate(prompts):
        assert done[i].token_ids == batch1(model, p, 10), i
    assert seen["mixed"] >= 6 and sum(padded_steps) >= 5


def test_chunks_over_the_limit_get_a_forward_of_their_own(tiny):
    model, heads = tiny
    prompts = random_prompts(6, VOCAB, 30, seed=5)
    prompts = [p + [1] * (12 - len(p)) if len(p) < 12 else p for p in prompts]  # every prompt over 8 tokens
    engine = engine_for(model, heads, False, mixed=8)
    seen = count_forwards(engine)
    done = run_staggered(engine, prompts, [SamplingParams(max_tokens=6)] * 6, per_step=1)
    assert seen["mixed"] == 0 and seen["forwards"] > seen["steps"]  # two forwards where a prompt joined
    for i, p in enumerate(prompts):
        assert done[i].token_ids == batch1(model, p, 6), i


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "tree"])
def test_carried_chunks_give_the_hidden_states_and_kv_of_their_own_forward(tiny, speculative):
    """Chunked prompts (a 10-token budget), some continuing a cached prefix, under a decoding batch: the
    carried chunks' hidden states and KV equal those of the eager prompt forward from the same cache."""
    model, heads = tiny
    engine = engine_for(model, heads if speculative else None, False, mixed=512, budget=10)
    runner, checked = engine.runner, []
    forward = engine._forward

    def compared(seqs, tree, prompts):
        if prompts is None:
            return forward(seqs, tree, prompts)
        batch = runner.prepare_prefill([item for item in plans[-1].scheduled if item.is_prefill])
        k, v = runner.cache.k.clone(), runner.cache.v.clone()
        alone = runner.run_eager(batch).clone()
        k_alone, v_alone = runner.cache.k.clone(), runner.cache.v.clone()
        runner.cache.k.copy_(k), runner.cache.v.copy_(v)
        forwarded = forward(seqs, tree, prompts)
        part1 = forwarded[3]  # (requests, padded, propose, part 1, ...)
        torch.testing.assert_close(part1.prompt_hidden, alone, rtol=1e-5, atol=1e-5)
        slots = torch.as_tensor(batch.slots)
        torch.testing.assert_close(runner.cache.k[:, slots], k_alone[:, slots], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.cache.v[:, slots], v_alone[:, slots], rtol=1e-5, atol=1e-5)
        chunk_lens = batch.query_start[1:] - batch.query_start[:-1]
        checked.append((batch.num_seqs, bool((batch.kv_lens > chunk_lens).any())))  # a chunk after a cached one
        return forwarded

    plans, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *a, **kw: plans.append(plan := schedule(*a, **kw)) or plan
    engine._forward = compared
    prompts = random_prompts(8, VOCAB, 30, seed=6)
    done = run_staggered(engine, prompts, [SamplingParams(max_tokens=5)] * 8, per_step=1)
    assert len(done) == 8 and len(checked) >= 5 and any(continued for _, continued in checked)
    for i, p in enumerate(prompts):
        assert done[i].token_ids == batch1(model, p, 5), i


def test_chunks_are_not_cut_where_nothing_pads_them(tiny):
    """Eagerly (the CPU) a carried chunk runs at its own length: a cut would only delay the prompt's rest."""
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=256, block_size=4))
    assert not engine.fill_buckets
    seen = count_forwards(engine)
    prompts = [p + [1] * max(0, 20 - len(p)) for p in random_prompts(6, VOCAB, 30, seed=8)]  # 20-29 tokens
    run_staggered(engine, prompts, [SamplingParams(max_tokens=6)] * 6, per_step=1)
    assert seen["mixed"] >= 4 and all(n >= 20 for n in seen["carried"])  # whole prompts, never cut to 16


def chunks(*sizes):
    return [ScheduledSeq(Sequence(f"r{i}", [1] * n), n, True) for i, n in enumerate(sizes)]


def test_chunks_are_cut_to_fill_a_bucket_newest_first():
    buckets = [16, 32, 64, 128, 256, 512]
    sizes = lambda items: [(item.seq.request_id, item.num_tokens) for item in items]  # noqa: E731
    assert sizes(_fill_bucket(chunks(100, 40, 10), buckets, 512)) == [("r0", 100), ("r1", 28)]  # 150 -> 128
    assert sizes(_fill_bucket(chunks(300), buckets, 512)) == [("r0", 256)]
    assert sizes(_fill_bucket(chunks(20, 12), buckets, 512)) == [("r0", 20), ("r1", 12)]  # a bucket already
    assert sizes(_fill_bucket(chunks(9), buckets, 512)) == [("r0", 9)]  # under the smallest: padded
    assert sizes(_fill_bucket(chunks(600), buckets, 512)) == [("r0", 600)]  # a forward of its own
    assert sizes(_fill_bucket(chunks(200, 100), buckets, 256)) == [("r0", 200), ("r1", 100)]  # over the limit


def test_mixed_prompt_tokens_must_be_a_count():
    with pytest.raises(ValueError, match="mixed_prompt_tokens"):
        EngineConfig(mixed_prompt_tokens=-1)


def test_overwritten_inputs_come_back_even_after_an_error():
    from medusa.decoding.host_buffers import overwritten

    slots, lens, tables = torch.arange(4), torch.arange(3), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="capture failed"):
        with overwritten([(slots, -1), (lens, 0)], kept=(tables,)):
            assert slots.tolist() == [-1] * 4 and lens.tolist() == [0] * 3
            tables.zero_()
            raise RuntimeError("capture failed")
    assert slots.tolist() == [0, 1, 2, 3] and lens.tolist() == [0, 1, 2] and tables.tolist() == [[1, 1], [1, 1]]
