"""Overlapped steps (EngineConfig.overlap): a decode step, plain or speculative, is launched before the
previous one's tokens are read back; the device places its tree after the tokens still in flight. On the CPU
nothing actually runs ahead, but the bookkeeping is the same as on a GPU: the host a step behind, blocks
backing the in-flight tokens, commits at read-back, rows finished or aborted in flight."""

import itertools
import time

import pytest

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.decoding.tree_policy import unmeasured_prior
from medusa.tree import TreeSpec
from engine_driver import count_launches, random_prompts, run_staggered, run_with_logprobs, single_thread
from tiny_models import tiny_decoder
from test_engine import batch1

VOCAB = 24


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def engine_for(model, heads, overlap, num_blocks=256, block_size=4, alternate=False, caching=True, apply_interval=1,
               trees=EngineConfig.trees, **sched):
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, overlap=overlap,
                          enable_prefix_caching=caching, scheduler=SchedulerConfig(**sched),
                          apply_interval=apply_interval, trees=trees)
    engine = LLMEngine(model, heads, config)
    if alternate:  # two plain steps, then a speculative one, its tree growing: tree sizes change mid-flight
        plain = TreeSpec.load("single")
        trees = [t for t in engine.scheduler.trees if t.num_nodes > 1]
        turns = itertools.count()
        engine.scheduler.policy = lambda n: trees[(k // 3) % len(trees)] if (k := next(turns)) % 3 == 2 else plain
    return engine


@pytest.mark.parametrize("mode", ["plain", "alternating-trees", "speculative"])
def test_overlapped_steps_equal_batch1_greedy_and_free_everything(tiny, mode):
    model, heads = tiny
    ps = random_prompts(10, VOCAB, 30, seed=1)
    max_tokens = [3 + 5 * (i % 5) for i in range(10)]
    engine = engine_for(model, None if mode == "plain" else heads, True, alternate=mode == "alternating-trees")
    launched = count_launches(engine)
    done = run_staggered(engine, ps, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert len(launched) > 10  # the steps did overlap
    assert (max(launched) > 1) == (mode != "plain") and (min(launched) == 1) == (mode != "speculative")
    for i, p in enumerate(ps):
        assert done[i].token_ids == batch1(model, p, max_tokens[i]), i
        assert done[i].finish_reason == "length"
    assert engine._inflight is None and not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()
    engine.blocks.check_invariants()


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "tree"])
def test_a_step_stays_in_flight_until_the_next_one_launches(tiny, speculative):
    """The host is a step behind: its counters and tokens stop at the last step read back, and the blocks
    back the in-flight step's most tokens too, since the next tree already sits past them on the device.
    A new request's first token too stays on the device until the step after its prefill is launched."""
    model, heads = tiny
    engine = engine_for(model, heads if speculative else None, True, block_size=2)
    tree = max(engine.scheduler.trees, key=lambda t: t.num_nodes)
    engine.scheduler.policy = lambda n: tree
    most = tree.max_depth + 1
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
    seq = engine.requests[rid].seq
    assert engine.step() == []  # prefill: the first token is drawn on the device, not read yet
    assert seq.output_token_ids == [] and engine._inflight is None and engine.has_unfinished()
    expected = batch1(model, [1, 2, 3], 40)
    first = engine.step()  # the first decode step is launched and left running; then the first token is read
    assert [o.new_token_ids for o in first] == [expected[:1]]
    assert engine._inflight is not None and seq.num_inflight_tokens == most
    assert seq.output_token_ids == expected[:1] and seq.num_computed_tokens == 3
    outs = engine.step()  # schedules and launches the next step, then reads the first one back
    got = outs[0].new_token_ids
    assert len(outs) == 1 and 1 <= len(got) <= most and outs[0].token_ids == expected[: 1 + len(got)]
    assert seq.num_inflight_tokens == most and seq.num_computed_tokens == 3 + len(got)
    # the next step's tree, placed after the tokens just read back, still has its blocks
    assert len(seq.block_table) * 2 >= seq.num_computed_tokens + tree.num_nodes
    while engine.has_unfinished():
        engine.step()
    assert seq.output_token_ids == expected and seq.num_inflight_tokens == 0


@pytest.mark.parametrize("heads_on", [False, True], ids=["plain", "alternating-trees"])
def test_overlap_keys_the_same_prefix_blocks_as_synchronous_steps(tiny, heads_on):
    """A block completed by an overlapped step is keyed when its tokens are read back: the prefix cache
    ends up holding the blocks it holds without overlap, under the same keys (a step launched past a
    request's end is never committed)."""
    model, heads = tiny
    ps = random_prompts(6, VOCAB, 30, seed=2)
    params = [SamplingParams(max_tokens=9 + 4 * i) for i in range(6)]
    caches = []
    for overlap in (False, True):
        engine = engine_for(model, heads if heads_on else None, overlap, alternate=heads_on)
        run_staggered(engine, ps, params, per_step=2)
        caches.append(set(engine.blocks._cached))
        engine.blocks.check_invariants()
    assert caches[0] == caches[1] and len(caches[0]) > 10
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


def test_first_tokens_read_a_step_late_stop_and_abort_as_synchronous_ones(tiny):
    """With overlap, an admitted greedy request's first token stays on the device until the next step is
    launched (an admission does not wait for the device). A request that stops at that token (its stop token,
    max_tokens=1) has a step launched for it already, which is dropped; one aborted before the token is
    read is never reported. Outputs, finish reasons and freed blocks are those of synchronous steps."""
    model, heads = tiny
    ps = random_prompts(9, VOCAB, 30, seed=13)
    firsts = [batch1(model, p, 1)[0] for p in ps]
    params = [SamplingParams(max_tokens=12, stop_token_ids=(firsts[i],)) if i % 3 == 0 else
              SamplingParams(max_tokens=1 if i % 3 == 1 else 12) for i in range(9)]
    for h in (None, heads):
        runs = [engine_for(model, h, overlap).generate(ps, params) for overlap in (False, True)]
        assert [(o.token_ids, o.finish_reason) for o in runs[1]] == [(o.token_ids, o.finish_reason) for o in runs[0]]
        assert runs[1][0].token_ids == [] and runs[1][0].finish_reason == "stop"
        assert runs[1][1].token_ids == firsts[1:2] and runs[1][1].finish_reason == "length"
    engine = engine_for(model, heads, True)
    ids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in ps[:3]]
    assert engine.step() == [] and len(engine._first_tokens) == 1  # three prefills, their first tokens pending
    assert engine.abort(ids[1])
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != ids[1]
            finals[out.request_id] = out.token_ids
    assert finals == {ids[0]: batch1(model, ps[0], 10), ids[2]: batch1(model, ps[2], 10)}
    assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()
    assert not engine._first_tokens and engine.runner.decode.rows_in_use == 0


@pytest.mark.parametrize("interval", [1, 3], ids=["apply-every-step", "apply-every-3"])
@pytest.mark.parametrize("heads_on", [False, True], ids=["plain", "trees"])
def test_short_blocks_read_the_step_back_before_preempting(tiny, heads_on, interval):
    """When the pool cannot back the in-flight tokens, the engine reads the step back (and applies the steps
    read back before it) and schedules again, preempting only then: no sequence loses its KV while a step
    still writes it."""
    model, heads = tiny
    ps = random_prompts(8, VOCAB, 30, seed=7)
    engine = engine_for(model, heads if heads_on else None, True, num_blocks=24, caching=False,
                        max_num_batched_tokens=128, apply_interval=interval)
    refused, preempted = [], []
    schedule = engine.scheduler.schedule

    def spy(preempt=True):
        plan = schedule(preempt=preempt)
        refused.append(plan is None)
        if plan is not None and plan.preempted:
            preempted.append(engine._inflight is None and not engine._pending)
        return plan

    engine.scheduler.schedule = spy
    done = run_staggered(engine, ps, [SamplingParams(max_tokens=24)] * 8)
    assert any(refused) and preempted and all(preempted)
    for i, p in enumerate(ps):
        assert done[i].token_ids == batch1(model, p, 24), i
    assert engine.blocks.num_free_blocks == 24 and not engine.blocks.ref_counts.any()
    assert not engine.scheduler.waiting and not engine.scheduler.running


@pytest.mark.parametrize("interval", [1, 3], ids=["apply-every-step", "apply-every-3"])
def test_aborts_with_steps_in_flight(tiny, interval):
    model, _ = tiny
    ps = random_prompts(8, VOCAB, 30, seed=7)
    engine = engine_for(model, None, True, apply_interval=interval)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30)) for p in ps[:4]]
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None and bool(engine._pending) == (interval == 3)  # read back, not applied
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
    runs = [engine_for(model, h, o, alternate=a).generate(ps, params)
            for h, a in ((None, False), (heads, False), (heads, True)) for o in (False, True)]
    tokens = [[o.token_ids for o in run] for run in runs]
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3] and tokens[4] == tokens[5]


def test_sampled_first_tokens_are_drawn_on_the_device_and_read_a_step_late(tiny):
    """Admitting seeded sampled requests (temperature, top-k, top-p; no host logic) no longer reads their
    first token at once: it is drawn on the device as a step draws its targets, the next step's draws start
    at output 1, and every token equals the synchronous engine's (which draws the first one on the host)."""
    model, heads = tiny
    ps = random_prompts(5, VOCAB, 30, seed=21)
    params = [SamplingParams(max_tokens=14, temperature=0.9, seed=31), SamplingParams(max_tokens=14),
              SamplingParams(max_tokens=14, temperature=1.2, top_k=6, seed=32),
              SamplingParams(max_tokens=14, temperature=0.7, top_p=0.8, seed=33),
              SamplingParams(max_tokens=14, temperature=1.1, min_p=0.1, seed=34)]
    for h, alternate in ((None, False), (heads, True)):
        engine = engine_for(model, h, True, alternate=alternate)
        ids = [engine.add_request(p, sp) for p, sp in zip(ps, params)]
        assert engine.step() == [] and len(engine._first_tokens) == 1  # no sync: all four first tokens pending
        assert all(engine.requests[rid].first_pending for rid in ids)
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                finals[out.request_id] = out.token_ids
        synchronous = engine_for(model, h, False, alternate=alternate).generate(ps, params)
        assert [finals[rid] for rid in ids] == [o.token_ids for o in synchronous]


def measured_everywhere(engine):
    """A measured policy at every batch size, so that steps get timed."""
    for tree in engine.scheduler.trees:
        engine.policy.add_prior(tree, unmeasured_prior(4))
        for bucket in range(1, 65):
            engine.policy.add_cost(bucket, tree, 1e-3)


def test_steps_sharing_their_time_with_a_prefill_teach_the_policy_nothing(tiny):
    """A prefill's device time (and the admission's sync) lands in the wall time of the decode step that runs
    after it: such steps are not timed. Synchronous steps are timed within their engine step; an overlapped
    one between the read-backs of the steps before it and of it, so it is read back one engine step later."""
    model, heads = tiny
    ps = random_prompts(12, VOCAB, 30, seed=11)
    for overlap in (False, True):
        engine = engine_for(model, heads, overlap)
        measured_everywhere(engine)
        steps, prefilled, timed = [], set(), []
        step, prepare, observe = engine.step, engine.runner.prepare_prefill, engine.policy.observe_step
        engine.step = lambda: steps.append(1) or step()
        # every prompt chunk, in a forward of its own or carried by the decode step's
        engine.runner.prepare_prefill = lambda items: prefilled.add(len(steps)) or prepare(items)
        engine.policy.observe_step = lambda *a, **kw: timed.append(len(steps)) or observe(*a, **kw)
        done = run_staggered(engine, ps, [SamplingParams(max_tokens=6 + 3 * (i % 4)) for i in range(12)], per_step=1)
        assert len(done) == 12 and len(prefilled) >= 12 and len(timed) > 10
        launched_in = [i - 1 for i in timed] if overlap else timed  # the engine step each timed step ran in
        assert not prefilled & set(launched_in), overlap


def test_steps_that_capture_a_graph_teach_the_policy_nothing(tiny):
    """A graph captured at first use (43-79 ms for the default model on an H200) is no step cost: a synchronous
    step that captures is not timed, nor, overlapped, the step it captures in and the one in flight before it (read
    back after the capture). Here every step "captures" (the counter moves in each forward), so none is timed;
    without captures the same traffic is timed."""
    model, heads = tiny
    ps = random_prompts(12, VOCAB, 30, seed=11)
    for overlap in (False, True):
        timings = {}
        for capturing in (False, True):
            engine = engine_for(model, heads, overlap)
            measured_everywhere(engine)
            timed, observe, forward = [], engine.policy.observe_step, engine._forward
            engine.policy.observe_step = lambda *a, **kw: timed.append(a) or observe(*a, **kw)

            def capture_then_forward(*args, forward=forward, decode=engine.runner.decode, capturing=capturing):
                decode.capture_seconds += 0.05 * capturing
                return forward(*args)

            engine._forward = capture_then_forward
            done = run_staggered(engine, ps, [SamplingParams(max_tokens=6 + 3 * (i % 4)) for i in range(12)],
                                 per_step=1)
            assert len(done) == 12
            timings[capturing] = len(timed)
        assert timings[False] > 10 and timings[True] == 0, (overlap, timings)


def test_steps_applied_together_are_timed_one_by_one(tiny):
    """With apply_interval=4 the policy is told each timed step's cost, as when every step is applied, not only
    groups of four steps none of which shared its time with a prefill: at 32 requests on the H200, admissions
    every other step left it a quarter of the timings (session 35). Each cost is a step's share of the wall time."""
    model, heads = tiny
    ps = random_prompts(48, VOCAB, 30, seed=11)
    counts = {}
    for interval in (1, 4):  # a closed loop of 8: requests finish, and others are admitted, at most steps
        engine = engine_for(model, heads, True, apply_interval=interval, max_num_seqs=8)
        measured_everywhere(engine)
        seconds, observe = [], engine.policy.observe_step
        engine.policy.observe_step = lambda *a, **kw: seconds.append(a[2]) or observe(*a, **kw)
        start = time.perf_counter()
        done = run_staggered(engine, ps, [SamplingParams(max_tokens=8 + 3 * (i % 5)) for i in range(48)], per_step=48)
        assert len(done) == 48 and min(seconds) > 0 and sum(seconds) < time.perf_counter() - start
        counts[interval] = len(seconds)
    assert counts[1] > 10 and counts[4] >= 0.75 * counts[1], counts


def fixed_tree_engine(model, heads, interval, trees=EngineConfig.trees):
    """Every step verifies the largest tree, whatever the batch: each row's acceptances are then its own."""
    engine = engine_for(model, heads, True, apply_interval=interval, trees=trees)
    tree = max(engine.scheduler.trees, key=lambda t: t.num_nodes)
    engine.scheduler.policy = lambda n: tree
    return engine


def test_tokens_applied_every_three_steps_are_those_of_every_step(tiny):
    """EngineConfig.apply_interval=3: read-back steps wait until three have gathered, then each sequence's
    tokens of all of them are appended at once (step by step where a stop token, min_tokens or max_tokens may
    end it among them). Outputs, finish reasons, each request's statistics (every step recorded as it ran,
    none after its stop) and the freed pool equal those of applying every step; outputs come only from the
    applying steps, each with the tokens of up to three steps."""
    model, heads = tiny
    ps = random_prompts(10, VOCAB, 30, seed=41)
    frees = [batch1(model, p, 20) for p in ps]
    params = [SamplingParams(max_tokens=20, stop_token_ids=(f[7],)) if i % 3 == 0 else
              SamplingParams(max_tokens=2 + 2 * i) if i % 3 == 1 else
              SamplingParams(max_tokens=20, min_tokens=10, stop_token_ids=(f[4],)) for i, f in enumerate(frees)]
    finals, gathered, reporting = {}, {}, {}
    for interval in (1, 3):
        engine = fixed_tree_engine(model, heads, interval)
        sizes = gathered[interval] = []
        apply = engine._apply_pending
        engine._apply_pending = lambda *a: sizes.append(len(engine._pending)) or apply(*a)
        ids = [engine.add_request(p, sp) for p, sp in zip(ps, params)]
        done, steps_reporting = {}, 0
        while engine.has_unfinished():
            outs = engine.step()
            steps_reporting += any(out.new_token_ids for out in outs)
            done.update({out.request_id: out for out in outs if out.finished})
        finals[interval] = [done[rid] for rid in ids]
        reporting[interval] = steps_reporting
        assert not engine._pending and engine._inflight is None
        assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()
        engine.blocks.check_invariants()
    every, third = finals[1], finals[3]
    for i, (a, b) in enumerate(zip(every, third)):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), i
        assert b.stats == a.stats, i  # the same steps, each with what it accepted
    assert every[1].finish_reason == "length" and every[0].finish_reason == "stop"
    assert len(every[2].token_ids) >= 10 and frees[2][4] not in every[2].token_ids[:10]  # banned until min_tokens
    assert max(gathered[3]) == 3 and set(gathered[1]) == {1}
    assert reporting[3] < reporting[1]


def test_sampled_rows_gathered_over_three_steps_draw_as_every_step(tiny):
    """Seeded sampled rows on the device gather like greedy ones: each row's uniforms are uploaded from the
    host's output count for as many steps as may be read back but not applied, so every draw keys the same
    (seed, position) noise and the tokens equal those of applying every step. A chain verifies as many tokens
    a step as it has nodes, the most a tree of its size can move a row ahead."""
    model, heads = tiny
    ps = random_prompts(6, VOCAB, 30, seed=43)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.9, seed=50 + i, top_k=8 if i == 3 else 0)
              if i % 2 else SamplingParams(max_tokens=10 + 3 * i) for i in range(6)]
    runs = []
    for interval in (1, 3):
        engine = fixed_tree_engine(model, heads, interval, trees=("single", "chain-4"))
        largest = max(t.num_nodes for t in engine.scheduler.trees)
        assert engine.runner.decode.uniforms.shape[1] == (interval + 1) * largest
        sizes, reaches = [], []
        apply, row_sampling = engine._apply_pending, engine._row_sampling
        engine._apply_pending = lambda *a: sizes.append(len(engine._pending)) or apply(*a)

        def sampling(request, tree):  # the furthest column a draw of this row's step can read
            if tree is not None and not request.sampling.greedy:
                reaches.append(request.seq.num_inflight_tokens + tree.spec.max_depth + 1)
            return row_sampling(request, tree)

        engine._row_sampling = sampling
        runs.append([o.token_ids for o in engine.generate(ps, params)])
        assert max(sizes) == interval
        assert max(reaches) == (interval + 1) * largest <= engine.runner.decode.uniforms.shape[1]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("interval", [1, 3], ids=["apply-every-step", "apply-every-3"])
def test_step_tables_rewrite_only_changed_rows_yet_match_the_block_manager(tiny, interval):
    """A decode step's host block tables keep the rows whose sequence and table are those of the last step
    (`Sequence.table_version`) and rewrite the others: after every step's prepare they equal the block
    manager's tables, through admissions, finishes, preemptions (a pool too small for the load) and steps
    that release rejected tree blocks and take new ones."""
    model, heads = tiny
    ps = random_prompts(10, VOCAB, 30, seed=17)
    engine = engine_for(model, heads, True, num_blocks=40, alternate=True, apply_interval=interval,
                        max_num_batched_tokens=128)
    step, blocks = engine.runner.decode, engine.blocks
    prepare, kept, preempted = step.prepare, [], []
    free = blocks.free
    blocks.free = lambda seq: preempted.append(seq.is_finished is False and bool(seq.block_table)) or free(seq)

    def checked(seqs, *args, **kwargs):
        before = list(step._table_rows[:len(seqs)])
        padded = prepare(seqs, *args, **kwargs)
        assert (step._host_tables[:len(seqs)] == blocks.block_tables(seqs, step.tables.shape[1])).all()
        assert not step._host_tables[len(seqs):padded].any()
        kept.extend(a is b for a, b in zip(before, step._table_rows))
        return padded

    step.prepare = checked
    done = run_staggered(engine, ps, [SamplingParams(max_tokens=20)] * 10)
    for i, p in enumerate(ps):
        assert done[i].token_ids == batch1(model, p, 20), i
    assert any(preempted) and 0.2 < sum(kept) / len(kept) < 1  # rows were kept, and rewritten


@pytest.mark.parametrize("interval", [1, 3])
def test_logprobs_rows_overlap_and_report_what_the_synchronous_plain_engine_does(tiny, interval):
    """Requests asking for logprobs take the device's verdicts and overlapped steps (each step's logprobs are
    queued on the device with it, and their first token's at admission): greedy and seeded sampled ones, k = 0,
    1 and 3 in one batch, one cut by a stop token mid-step. Tokens, logprobs, ranks and alternatives equal the
    synchronous plain engine's."""
    model, heads = tiny
    ps = random_prompts(6, VOCAB, 30, seed=8)
    stop = batch1(model, ps[4], 20)[7]
    params = [SamplingParams(max_tokens=16, logprobs=1), SamplingParams(max_tokens=16, logprobs=3),
              SamplingParams(max_tokens=16, temperature=0.9, seed=3, logprobs=0),
              SamplingParams(max_tokens=16, temperature=1.1, top_k=6, seed=4, logprobs=3),
              SamplingParams(max_tokens=20, logprobs=2, stop_token_ids=[stop]),
              SamplingParams(max_tokens=16)]
    reference = run_with_logprobs(engine_for(model, None, False), ps, params)
    admitting = engine_for(model, heads, True, apply_interval=interval)
    for p, sp in zip(ps, params):
        admitting.add_request(p, sp)
    assert admitting.step() == [] and len(admitting._first_tokens) == 1  # first tokens, logprobs too: no read
    engine = engine_for(model, heads, True, apply_interval=interval)
    launched = count_launches(engine)
    outs = run_with_logprobs(engine, ps, params)
    assert len(launched) > 5 and max(launched) > 1  # speculative steps, overlapped, with the logprobs rows
    for (tokens, logprobs, reason), (want, want_logprobs, want_reason), sp in zip(outs, reference, params):
        assert (tokens, reason) == (want, want_reason)
        if sp.logprobs is None:
            assert logprobs is None
            continue
        assert [lp.token_id for lp in logprobs] == tokens
        for got, expected in zip(logprobs, want_logprobs, strict=True):
            assert (got.token_id, got.rank, [t for t, _ in got.top]) == (expected.token_id, expected.rank,
                                                                            [t for t, _ in expected.top])
            assert got.logprob == pytest.approx(expected.logprob, abs=1e-5) and len(got.top) == sp.logprobs
    assert outs[4][2] == "stop" and len(outs[4][0]) < 20
    assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()
