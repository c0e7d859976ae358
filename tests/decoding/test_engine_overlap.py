"""Overlapped plain steps (EngineConfig.overlap): a plain step is launched before the previous one's tokens
are read back. On the CPU nothing actually runs ahead, but the bookkeeping is the same as on a GPU: PENDING
tokens, commits at launch, blocks keyed once their tokens are known, rows finished or aborted in flight."""

import itertools

import pytest

from medusa.decoding.engine import PENDING, EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.tree import TreeSpec
from engine_driver import random_prompts, run_staggered, single_thread
from tiny_models import tiny_decoder
from test_engine import batch1

VOCAB = 24


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def engine_for(model, heads, overlap, num_blocks=256, block_size=4, alternate=False, caching=True, **sched):
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, overlap=overlap,
                          enable_prefix_caching=caching, scheduler=SchedulerConfig(**sched))
    engine = LLMEngine(model, heads, config)
    if alternate:  # plain steps with a speculative one every third step: overlap starts and stops
        plain = TreeSpec.load("single")
        tree = next(t for t in engine.scheduler.trees if t.num_nodes > 1)
        turns = itertools.count()
        engine.scheduler.policy = lambda n: tree if next(turns) % 3 == 2 else plain
    return engine


def count_launches(engine):
    launched = []
    launch = engine._launch
    engine._launch = lambda seqs, tree: launched.append(len(seqs)) or launch(seqs, tree)
    return launched


@pytest.mark.parametrize("heads_on", [False, True], ids=["plain", "alternating-trees"])
def test_overlapped_steps_equal_batch1_greedy_and_free_everything(tiny, heads_on):
    model, heads = tiny
    ps = random_prompts(10, VOCAB, 30, seed=1)
    max_tokens = [3 + 5 * (i % 5) for i in range(10)]
    engine = engine_for(model, heads if heads_on else None, True, alternate=heads_on)
    launched = count_launches(engine)
    seen = []
    done = run_staggered(engine, ps, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert len(launched) > 10  # the plain steps did overlap
    for i, p in enumerate(ps):
        assert done[i].token_ids == batch1(model, p, max_tokens[i]), i
        assert done[i].finish_reason == "length"
        seen += done[i].token_ids
    assert PENDING not in seen
    assert engine._inflight is None and not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()
    engine.blocks.check_invariants()


def test_a_step_stays_in_flight_until_the_next_one_launches(tiny):
    model, _ = tiny
    engine = engine_for(model, None, True)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6))
    first = engine.step()  # prefill: the first token
    assert [o.new_token_ids for o in first] == [batch1(model, [1, 2, 3], 1)]
    assert engine.step() == []  # the first plain step is launched and left running
    assert engine._inflight is not None
    seq = engine.requests[rid].seq
    assert seq.output_token_ids[-1] == PENDING and engine.requests[rid].unresolved == 1
    outs = engine.step()  # launches the next step, then reads the first one back
    assert len(outs) == 1 and outs[0].new_token_ids == batch1(model, [1, 2, 3], 2)[1:]
    assert outs[0].token_ids == batch1(model, [1, 2, 3], 2) and engine.requests[rid].unresolved == 1


def test_overlap_keys_the_same_prefix_blocks_as_synchronous_steps(tiny):
    """A block completed by an overlapped step is keyed when its last token comes back: the prefix
    cache ends up holding the blocks it holds without overlap, under the same keys. At most one more per
    request: the step launched past a request's last token writes (and keys) its final root's KV, which a
    synchronous run never computes."""
    model, _ = tiny
    ps = random_prompts(6, VOCAB, 30, seed=2)
    params = [SamplingParams(max_tokens=9 + 4 * i) for i in range(6)]
    caches = []
    for overlap in (False, True):
        engine = engine_for(model, None, overlap)
        run_staggered(engine, ps, params, per_step=2)
        caches.append(set(engine.blocks._cached))
        engine.blocks.check_invariants()
    assert caches[0] <= caches[1] and len(caches[1] - caches[0]) <= len(ps) and len(caches[0]) > 10
    # and a later request sharing a finished one's text reuses its blocks
    engine = engine_for(model, None, True)
    first = engine.generate([ps[0]], SamplingParams(max_tokens=20))[0]
    rid = engine.add_request(ps[0] + first.token_ids[:16], SamplingParams(max_tokens=4))
    engine.step()
    assert engine.requests[rid].seq.num_cached_prefix_tokens >= len(ps[0]) + 12


def test_stops_seen_a_step_late_cut_the_output_where_they_happen(tiny):
    """The step after a stop token is already running when the stop is read back: its token is dropped."""
    model, heads = tiny
    ps = random_prompts(8, VOCAB, 30, seed=3)
    frees = [batch1(model, p, 16) for p in ps]
    params = [SamplingParams(max_tokens=16, stop_token_ids=(f[5],)) for f in frees]
    for overlap in (False, True):
        outs = engine_for(model, None, overlap).generate(ps, params)
        for out, free in zip(outs, frees):
            assert out.finish_reason == "stop" and out.token_ids == free[: free.index(free[5])]
    held = engine_for(model, heads, True, alternate=True).generate(
        ps, [SamplingParams(max_tokens=16, min_tokens=8, stop_token_ids=(f[5],)) for f in frees])
    synchronous = engine_for(model, heads, False, alternate=True).generate(
        ps, [SamplingParams(max_tokens=16, min_tokens=8, stop_token_ids=(f[5],)) for f in frees])
    assert [o.token_ids for o in held] == [o.token_ids for o in synchronous]


def test_preemption_and_aborts_with_steps_in_flight(tiny):
    model, _ = tiny
    ps = random_prompts(8, VOCAB, 30, seed=7)
    engine = engine_for(model, None, True, num_blocks=16, caching=False, max_num_batched_tokens=128)
    finished_waiting = []
    finish = engine.scheduler.finish

    def spy(seq):
        finished_waiting.append(seq in engine.scheduler.waiting)
        finish(seq)

    engine.scheduler.finish = spy
    done = run_staggered(engine, ps, [SamplingParams(max_tokens=24)] * 8)
    # one sequence was preempted by the schedule after its last step had launched, and that step's token
    # (read back afterwards) finished it while it waited for recompute
    assert any(finished_waiting)
    for i, p in enumerate(ps):
        assert done[i].token_ids == batch1(model, p, 24), i
    assert engine.blocks.num_free_blocks == 16 and not engine.blocks.ref_counts.any()
    assert not engine.scheduler.waiting and not engine.scheduler.running

    engine = engine_for(model, None, True)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30)) for p in ps[:4]]
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    assert engine.abort(ids[0]) and engine.abort(ids[2])
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id in (ids[1], ids[3])
            if out.finished:
                finals[out.request_id] = out.token_ids
    assert finals == {ids[1]: batch1(model, ps[1], 30), ids[3]: batch1(model, ps[3], 30)}
    assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()


def test_seeded_sampling_and_host_rows_are_unchanged_by_overlap(tiny):
    model, heads = tiny
    ps = random_prompts(5, VOCAB, 30, seed=5)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=4), SamplingParams(max_tokens=12, logprobs=1),
              SamplingParams(max_tokens=12, presence_penalty=0.5), SamplingParams(max_tokens=12),
              SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=9)]
    runs = [engine_for(model, h, o).generate(ps, params) for h in (None, heads) for o in (False, True)]
    tokens = [[o.token_ids for o in run] for run in runs]
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3]
