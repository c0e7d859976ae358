"""The engine on a tiny model: batched Medusa equals batch-1 plain decoding; KV is always returned."""

import pytest
import torch

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.tree import TreeSpec
from engine_driver import force_overlap, random_prompts, run_staggered, single_thread
from tiny_models import tiny_decoder

VOCAB = 24


@pytest.fixture(autouse=True, params=[False, True, 3], ids=["sync", "overlap", "apply-every-3"])
def overlap(request, monkeypatch):
    return force_overlap(request, monkeypatch)


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def prompts(n, seed=0):
    return random_prompts(n, VOCAB, 40, seed)


def batch1(model, prompt, max_tokens):
    out = []
    for chunk in TreeDecoder(model, None, TreeSpec.load("single")).decode(prompt, max_tokens, SamplingConfig()):
        out += chunk
    return out[:max_tokens]


def make_engine(model, heads, **kw):
    sched = SchedulerConfig(**{k: kw.pop(k) for k in list(kw) if k in ("max_num_batched_tokens", "max_num_seqs",
                                                                        "max_tree_tokens")})
    return LLMEngine(model, heads, EngineConfig(scheduler=sched, **kw))


def staggered(engine, ps, max_tokens):
    return run_staggered(engine, ps, [SamplingParams(max_tokens=m) for m in max_tokens])


def test_batched_medusa_equals_batch1_plain_greedy(tiny):
    model, heads = tiny
    ps = prompts(12)
    max_tokens = [5 + 7 * (i % 4) for i in range(12)]
    engine = make_engine(model, heads, num_blocks=400, block_size=4, max_num_batched_tokens=512, max_tree_tokens=400)
    done = staggered(engine, ps, max_tokens)
    for i, p in enumerate(ps):
        assert done[i].token_ids == batch1(model, p, max_tokens[i]), i
        assert done[i].finish_reason == "length"
    drafted = sum(d.stats.drafted_tokens for d in done.values())
    accepted = sum(d.stats.accepted_tokens for d in done.values())
    assert drafted > 0 and accepted >= 5  # trees ran and drafts were accepted, so KV moves happened
    stats = engine.stats()
    assert stats.totals.drafted_tokens == drafted and stats.totals.accepted_tokens == accepted
    assert sum(stats.totals.accepted_per_depth) == accepted
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0.0
    assert engine.blocks.num_free_blocks == 400 and not engine.blocks.ref_counts.any()
    engine.blocks.check_invariants()


def test_preemption_keeps_outputs_and_frees_everything(tiny):
    model, heads = tiny
    ps = prompts(8, seed=1)
    max_tokens = [30] * 8
    engine = make_engine(model, heads, num_blocks=40, block_size=4, max_num_batched_tokens=128,
                         max_tree_tokens=64, enable_prefix_caching=False)
    preempted = []
    original = engine.scheduler.schedule

    def spy(**kwargs):
        out = original(**kwargs)
        if out is not None:  # None: blocks ran short while a step was in flight, and the engine reads it first
            preempted.extend(out.preempted)
        return out

    engine.scheduler.schedule = spy
    done = staggered(engine, ps, max_tokens)
    assert preempted, "the pool was meant to be too small"
    for i, p in enumerate(ps):
        assert done[i].token_ids == batch1(model, p, 30)
    assert engine.blocks.num_free_blocks == 40 and not engine.blocks.ref_counts.any()


def test_abort_mid_generation_frees_blocks(tiny):
    model, heads = tiny
    engine = make_engine(model, heads, num_blocks=64, block_size=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts(4, seed=2)]
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_free_blocks < 64
    for rid in ids[:2]:
        assert engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free_blocks == 64 and not engine.blocks.ref_counts.any()
    assert not engine.abort("no-such-request")


@pytest.mark.parametrize("filters", [{}, {"min_p": 0.15}, {"min_p": 0.05, "top_k": 6, "top_p": 0.9}])
def test_seeded_sampling_is_batch_invariant(tiny, filters):
    model, heads = tiny
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=11, **filters)
    alone = make_engine(model, heads).generate([[1, 2, 3]], params)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, min_p=0.1 * (s % 3)) for s in range(15)]
    batch = make_engine(model, heads).generate([[1, 2, 3]] + prompts(15, seed=3), [params] + others)
    assert batch[0].token_ids == alone
    # a seeded draw depends only on (seed, output position): plain decoding samples the same text
    plain = make_engine(model, None).generate([[1, 2, 3]], params)[0].token_ids
    assert plain == alone
    if filters:  # and the filters did something
        unfiltered = SamplingParams(max_tokens=20, temperature=1.0, seed=11)
        assert make_engine(model, None).generate([[1, 2, 3]], unfiltered)[0].token_ids != alone


def test_prefix_caching_shares_blocks_and_keeps_outputs(tiny):
    model, heads = tiny
    shared = prompts(1, seed=4)[0] * 3  # a long common prefix
    ps = [shared + [1, 2], shared + [3]]
    engine = make_engine(model, heads, num_blocks=128, block_size=4)
    first = engine.generate([ps[0]], SamplingParams(max_tokens=8))[0]
    rid = engine.add_request(ps[1], SamplingParams(max_tokens=8))
    engine.step()
    assert engine.requests[rid].seq.num_cached_prefix_tokens >= (len(shared) // 4) * 4 - 4
    while engine.has_unfinished():
        for out in engine.step():
            second = out
    assert first.token_ids == batch1(model, ps[0], 8) and second.token_ids == batch1(model, ps[1], 8)


def test_min_tokens_and_stop_token_ids(tiny):
    model, heads = tiny
    p = prompts(1, seed=5)[0]
    free = batch1(model, p, 12)
    stop = free[4]
    out = make_engine(model, heads).generate([p], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(stop)] and out.stop_reason == stop
    # min_tokens: the stop token may not be chosen before 6 outputs, at any tree node
    held = make_engine(model, heads).generate([p], SamplingParams(max_tokens=12, min_tokens=6,
                                                                  stop_token_ids=(stop,)))[0]
    assert stop not in held.token_ids[:6] and held.token_ids[:4] == free[:4]
    assert len(held.token_ids) >= 6 and held.stop_reason in (stop, None)  # a stop or the length
    assert (held.stop_reason is None) == (held.finish_reason == "length")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="output_kind must be 'delta' or 'final', got 'last'"):
        SamplingParams(output_kind="last")


def test_generate_takes_one_prompt_alone(tiny):
    """A string or a list of token ids alone is one prompt (vLLM's LLM.generate), not one per character/token."""
    model, heads = tiny
    p = prompts(1, seed=8)[0]
    params = SamplingParams(max_tokens=5)
    listed = make_engine(model, heads).generate([p], params)
    alone = make_engine(model, heads).generate(p, params)
    assert len(alone) == 1 and alone[0].token_ids == listed[0].token_ids


def test_generate_refuses_to_run_over_requests_it_would_drop(tiny):
    """generate() steps the engine to the end: another caller's requests would finish inside it, their
    outputs lost. It says so, and runs once they are done."""
    model, heads = tiny
    engine = make_engine(model, heads)
    p = prompts(1, seed=9)[0]
    rid = engine.add_request(p, SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="1 sequence.s. added with add_request are unfinished"):
        engine.generate([p], SamplingParams(max_tokens=4))
    assert engine.abort(rid) and len(engine.generate([p], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_n_completions_and_logprobs(tiny):
    model, heads = tiny
    p = prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3, logprobs=2)
    outs = make_engine(model, heads).generate([p], params)
    assert [o.index for o in outs] == [0, 1, 2] and len({o.request_id for o in outs}) == 1
    single = make_engine(model, heads).generate([p], SamplingParams(max_tokens=10, temperature=1.0, seed=6))[0]
    assert outs[1].token_ids == single.token_ids  # completion i uses seed + i

    engine = make_engine(model, heads)
    rid = engine.add_request(p, SamplingParams(max_tokens=10, logprobs=3))
    logprobs, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            logprobs += out.new_logprobs
            tokens += out.new_token_ids
    assert [lp.token_id for lp in logprobs] == tokens == batch1(model, p, 10)
    # greedy: each chosen token is the most likely one, and its logprob matches the full forward
    ids = torch.tensor(p + tokens)
    from medusa.attention import CausalAttention
    with torch.no_grad():
        full = torch.log_softmax(model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention())), -1)
    for i, lp in enumerate(logprobs):
        assert lp.top[0][0] == lp.token_id and len(lp.top) == 3
        assert lp.logprob == pytest.approx(full[len(p) - 1 + i, lp.token_id].item(), abs=1e-4)
    assert engine.abort(rid) is False  # already finished
    # generate() reports a request once, finished: that output carries all of its tokens and logprobs
    once = make_engine(model, heads).generate([p], SamplingParams(max_tokens=10, logprobs=3))[0]
    assert once.new_token_ids == once.token_ids == tokens
    assert [(lp.token_id, lp.top) for lp in once.new_logprobs] == [(lp.token_id, lp.top) for lp in logprobs]


class _Letters:
    """A tokenizer stand-in: token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


def test_streamed_text_adds_up_to_the_decoded_tokens(tiny):
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(), tokenizer=_Letters())
    ps = prompts(4, seed=7)
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=30, stop=("b",)),
              SamplingParams(max_tokens=30, temperature=1.0, seed=2), SamplingParams(max_tokens=1)]
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(p, sp, request_id=str(i))
    streamed, final = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.new_text
            if out.finished:
                final[out.request_id] = out
    assert engine.totals.accepted_tokens > 0  # some steps emitted several tokens
    for rid, out in final.items():
        assert streamed[rid] == out.text == _Letters().decode(out.token_ids), rid
    assert "b" not in final["1"].text


def test_final_output_kind_decodes_the_text_once_at_the_end(tiny):
    """output_kind="final": no text until the finished output, which then carries all of it, equal to
    what streaming gives; a request with stop strings still detokenizes every step to find them."""
    model, heads = tiny
    ps = prompts(3, seed=7)

    def run(kind):
        engine = LLMEngine(model, heads, EngineConfig(), tokenizer=_Letters())
        params = [SamplingParams(max_tokens=30, output_kind=kind), SamplingParams(max_tokens=5, output_kind=kind),
                  SamplingParams(max_tokens=30, stop=("b",), output_kind=kind)]
        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(p, sp, request_id=str(i))
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
        return outs

    streamed, final = run("delta"), run("final")
    for rid in ("0", "1"):
        *early, last = final[rid]
        assert early and all(o.new_text == o.text == "" for o in early)
        assert last.finished and last.new_text == last.text == streamed[rid][-1].text != ""
        assert last.token_ids == streamed[rid][-1].token_ids
    assert "".join(o.new_text for o in final["2"]) == final["2"][-1].text == streamed["2"][-1].text
    assert any(o.new_text for o in final["2"][:-1]) and "b" not in final["2"][-1].text


def test_generate_builds_one_output_per_completion(tiny):
    """LLMEngine.generate reads only finished outputs, so step() builds none before a request ends;
    the results are what the step-by-step loop gives."""
    model, heads = tiny
    ps = prompts(3, seed=9)
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=1), SamplingParams(max_tokens=12, n=2,
                                                                                          temperature=1.0, seed=3)]
    engine = LLMEngine(model, heads, EngineConfig(), tokenizer=_Letters())
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(p, sp, request_id=str(i))
    looped = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                looped[out.request_id, out.index] = out
    built = []
    quiet = LLMEngine(model, heads, EngineConfig(), tokenizer=_Letters())
    output = quiet._output
    quiet._output = lambda request, new: built.append(request.seq.is_finished) or output(request, new)
    outs = quiet.generate(ps, params)
    assert built == [True] * 4 and len(outs) == 4
    assert [(o.token_ids, o.text) for o in outs] == [(looped[k].token_ids, looped[k].text)
                                                    for k in (("0", 0), ("1", 0), ("2", 0), ("2", 1))]


def test_every_output_keeps_the_tokens_it_was_made_with(tiny):
    """RequestOutput.token_ids is copied from the sequence only when read: read after the run, every
    output must still hold exactly the tokens emitted up to it, however the sequence grew since."""
    model, heads = tiny
    ps = prompts(6, seed=8)
    free = batch1(model, ps[0], 12)
    params = [SamplingParams(max_tokens=12, stop_token_ids=(free[6],)), SamplingParams(max_tokens=25),
              SamplingParams(max_tokens=3), SamplingParams(max_tokens=25, temperature=1.0, seed=1),
              SamplingParams(max_tokens=25, min_tokens=10), SamplingParams(max_tokens=1)]
    engine = make_engine(model, heads)
    ids = [engine.add_request(p, sp) for p, sp in zip(ps, params)]
    outputs = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.totals.accepted_tokens > 0  # some steps emitted several tokens
    per_depth = [0] * len(engine.totals.accepted_per_depth)
    for rid, outs in outputs.items():
        so_far = []
        for out in outs:
            so_far += out.new_token_ids
            assert out.token_ids == so_far, rid
        assert outs[-1].finished and not any(out.finished for out in outs[:-1])
        for depth, n in enumerate(outs[-1].stats.accepted_per_depth):
            per_depth[depth] += n
    assert outputs[ids[0]][-1].token_ids == free[:free.index(free[6])]  # cut at the stop token
    assert per_depth == engine.totals.accepted_per_depth  # the batch's count equals the sequences' counts


def test_prompts_admitted_together_start_as_they_would_alone(tiny):
    """Several prompts finish prefill in one step and get their first tokens in one batch (plain greedy
    from one argmax, the others through the host path): each output equals the request run alone."""
    model, heads = tiny
    ps = prompts(5, seed=21)
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, logprobs=2),
              SamplingParams(max_tokens=6, min_tokens=4), SamplingParams(max_tokens=6, temperature=0.9, seed=3),
              SamplingParams(max_tokens=6, presence_penalty=0.5)]
    alone = [make_engine(model, heads).generate([p], sp)[0] for p, sp in zip(ps, params)]
    together = make_engine(model, heads).generate(ps, params)
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids


def test_a_seeded_request_draws_the_same_tokens_beside_a_top_p_row(tiny):
    """A temperature-only step skips the top-k/top-p sorts (sampling kind SAMPLED); beside a top-p row
    the same request's step runs them (FILTERED): its tokens must not change."""
    model, heads = tiny
    ps = prompts(2, seed=5)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, seed=11)
    alone = make_engine(model, heads).generate([ps[0]], seeded)[0]
    beside = make_engine(model, heads).generate(ps, [seeded, SamplingParams(max_tokens=16, temperature=0.9,
                                                                            top_p=0.8, seed=2)])
    assert beside[0].token_ids == alone.token_ids


def engine_recording_captures(model, heads, monkeypatch, record):
    """A CPU engine standing in for a GPU's in warmup: graphs on, prefill captures skipped, each tree's step
    timed by its node count, and each decode-graph capture passed to record(tree, padded, sampling, propose,
    prompts) instead of made."""
    engine = make_engine(model, heads, max_num_seqs=4, max_num_batched_tokens=64)
    step = engine.runner.decode
    monkeypatch.setattr(step, "use_graphs", True)
    monkeypatch.setattr(engine.runner.prefill, "capture_all", lambda: None)
    monkeypatch.setattr(step, "time_step", lambda tree, padded, *args, **kwargs: 1e-4 * (10 + tree.num_nodes))
    monkeypatch.setattr(step, "capture", lambda tree, padded, sampling=False, propose=True, prompts=None:
                        record(tree, padded, sampling, propose, prompts))
    return engine


def test_warmup_captures_sampled_steps_graphs_when_asked(tiny, monkeypatch):
    """The graph calls warmup makes, on a CPU standing in for a GPU: with sampling=True, every (batch bucket,
    tree) whose greedy graphs it captures for prompt chunks also gets its sampled graphs, with and without
    prompt chunks (a server's requests sample by default: those graphs would be captured mid-run), and
    every other tree timed at a bucket its sampled graph without prompts (the bucket's trials run it)."""
    model, heads = tiny
    captured = {}
    for sampling in (False, True):
        calls = []
        engine = engine_recording_captures(model, heads, monkeypatch, lambda tree, padded, sampling, propose, prompts:
                                           calls.append((padded, tree.spec.label, sampling,
                                                         prompts.num_tokens if prompts else 0,
                                                         propose or tree.num_nodes > 1)))
        chosen = engine.warmup(sampling=sampling)
        captured[sampling] = calls
    greedy, both = set(captured[False]), set(captured[True])
    assert greedy and all(not sampled and tokens > 0 for _, _, sampled, tokens, _ in greedy)  # the mixed graphs
    assert set(chosen) == {b for b, *_ in greedy}  # every timed bucket
    for b in chosen:  # of the trees each bucket tries before it decides (a capture mid-run stalls a level)
        assert {t for bb, t, *_ in greedy if bb == b} == {tree.label for tree in engine.policy.trial_trees(b)}
    trials = {(b, tree.label, True, 0, True) for b in chosen for tree in engine.policy.step_cost[b] if tree.num_nodes > 1}
    assert len({t for b, t, *_ in trials}) > len({t for b, t, *_ in greedy if t != "single"})  # more trees than run first
    assert both == (greedy | {(b, t, True, n, p) for b, t, _, n, p in greedy}
                    | {(b, t, True, 0, p) for b, t, _, _, p in greedy} | trials)
    assert len(captured[True]) == len(both)  # each graph once
    # plain steps run the heads until a bucket settles on plain decoding, then not: both graphs of each shape
    plain = engine.policy.plain[1].label
    assert {p for b, t, *_, p in both if b == 1 and t == plain} == {True, False}


def test_warmup_captures_the_mixed_graphs_of_every_tree_a_bucket_tries(tiny, monkeypatch):
    """Not only the first choice's and the plain step's: a first run at 32 requests on an H100 captured 9 mixed
    graphs of the trees it tried (0.60 s of a 3 s level). Here the policy says each bucket tries every tree."""
    from medusa.decoding.tree_policy import TreePolicy

    model, heads = tiny
    calls = []
    engine = engine_recording_captures(model, heads, monkeypatch, lambda tree, padded, sampling, propose, prompts:
                                       calls.append((padded, tree.spec.label, prompts is not None)))
    monkeypatch.setattr(TreePolicy, "trial_trees", lambda self, bucket: list(self.step_cost[bucket]))
    chosen = engine.warmup()
    for b in chosen:
        assert {t for bb, t, mixed in calls if bb == b and mixed} == {t.label for t in engine.policy.step_cost[b]}


def test_warmup_times_each_buckets_trees_in_interleaved_rounds_and_keeps_the_fastest(tiny, monkeypatch):
    """Timed once each, one after the other, a drift of the GPU's speed lands on some trees only; each
    tree's first timing here comes out slow, and the policy must see its fastest round."""
    from medusa.decoding.warmup import TIMING_ROUNDS

    model, heads = tiny
    engine = make_engine(model, heads, max_num_seqs=1)
    step, calls = engine.runner.decode, []
    monkeypatch.setattr(step, "use_graphs", True)
    monkeypatch.setattr(engine.runner.prefill, "capture_all", lambda: None)
    monkeypatch.setattr(step, "capture", lambda *args, **kwargs: None)
    base = lambda tree, propose: 1e-4 * (10 + tree.spec.num_nodes) + (2e-4 if propose else 0.0)  # noqa: E731

    def time_step(tree, padded, context, num_blocks, repeats=5, propose=True):
        slow = (tree.spec.label, propose) not in [c[1:] for c in calls]
        calls.append((padded, tree.spec.label, propose))
        return base(tree, propose) + (1e-3 if slow else 0.0)

    monkeypatch.setattr(step, "time_step", time_step)
    engine.warmup()
    trees = engine.scheduler.trees
    one_round = [(1, t.label, p) for t in trees for p in ((False, True) if t.num_nodes == 1 else (True,))]
    assert calls == one_round * TIMING_ROUNDS and TIMING_ROUNDS >= 2
    policy = engine.policy
    for tree in trees:
        assert policy.step_cost[1][tree] == base(engine._device_tree(tree), tree.num_nodes > 1)
    assert abs(policy.heads_cost[1] - 2e-4) < 1e-12


def test_warmup_rejects_a_batch_limit_below_one(tiny):
    model, heads = tiny
    engine = make_engine(model, heads)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        engine.warmup(max_batch=0)
    assert set(engine.warmup(max_batch=1)) == {1}  # a CPU times its trees eagerly at bucket 1 only


def test_a_request_that_asks_for_no_speculation_is_refused_by_a_speculating_engine(tiny):
    model, heads = tiny
    engine = make_engine(model, heads)
    with pytest.raises(ValueError, match=r"speculative=False.*MedusaModel.engine\(speculative=False\)"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, speculative=False))
    assert not engine.has_unfinished()  # nothing was queued
    plain = make_engine(model, None)  # an engine without heads runs it, and ignores speculative=True
    outs = plain.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=4, speculative=s) for s in (False, True)])
    assert [o.token_ids for o in outs] == [batch1(model, [1, 2, 3], 4), batch1(model, [4, 5], 4)]


def test_a_sampled_rows_head_proposals_are_drawn_with_the_noise_of_their_positions(tiny):
    """Coupled proposals: head k of a sampled row ranks its logits / T plus the Gumbel noise of output
    position (next root's target + k), so a head whose logits were the base's would propose exactly the
    token the base then draws there (`sampled_targets`); a greedy row keeps its heads' most likely tokens."""
    from medusa.decoding.batch_verify import sampled_targets
    from medusa.kernels.top_k import top_k_indices

    model, heads = tiny
    step = make_engine(model, heads).runner.decode
    g = torch.Generator().manual_seed(8)
    step.uniforms[:2] = torch.rand(2, step.uniforms.shape[1], generator=g, dtype=torch.float64)
    step.temperature[:2] = torch.tensor([0.8, 1.0])
    step.sampled[:2] = torch.tensor([True, False])
    head_logits = torch.randn(step.num_heads, 2, VOCAB, generator=g) * 3  # [K, Bp, V]
    top = top_k_indices(head_logits, step.kmax)
    got = step._coupled_proposals(head_logits, top, torch.tensor([3, 5]))
    assert got.shape == top.shape and torch.equal(got[:, 1], top[:, 1])  # the greedy row
    for k in range(step.num_heads):
        drawn = sampled_targets(head_logits[k, :1, None], step.temperature[:1], torch.zeros(1, dtype=torch.long),
                                torch.ones(1), torch.zeros(1), step.uniforms[:1, 3 + k, None])
        assert got[k, 0, 0] == drawn[0, 0], k
    assert not torch.equal(got[:, 0], top[:, 0])  # the noise moved some proposals
