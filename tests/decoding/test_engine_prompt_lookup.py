"""The engine with a prompt-lookup chain in its trees: same outputs as without, and the chain does accept."""

import pytest

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.tree import TreeSpec
from engine_driver import force_overlap, random_prompts, run_staggered, single_thread
from tiny_models import tiny_decoder

VOCAB = 24


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    return force_overlap(request, monkeypatch)


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def plain_greedy(model, prompt, max_tokens):
    out = []
    for chunk in TreeDecoder(model, None, TreeSpec.load("single")).decode(prompt, max_tokens, SamplingConfig()):
        out += chunk
    return out[:max_tokens]


def make_engine(model, heads, prompt_lookup, **kw):
    return LLMEngine(model, heads, EngineConfig(prompt_lookup=prompt_lookup, num_blocks=256, block_size=4,
                                                scheduler=SchedulerConfig(max_tree_tokens=400), **kw))


def mixed_prompts():
    """Mixed lengths; the last two repeat a phrase, so their text recurs from the start."""
    ps = random_prompts(6, VOCAB, 40, seed=30)
    return ps + [ps[0] * 3, [5, 9, 2, 7] * 6]


@pytest.mark.parametrize("lookup", [4, 7])  # 7: a chain deeper than the 4 heads
def test_greedy_outputs_equal_plain_greedy_and_the_lookup_chain_accepts(tiny, lookup):
    model, heads = tiny
    ps = mixed_prompts()
    max_tokens = [12 + 5 * (i % 4) for i in range(len(ps))]
    engine = make_engine(model, heads, lookup)
    assert all(t.lookup == lookup for t in engine.scheduler.trees if t.num_nodes > 1)
    assert max(t.max_depth for t in engine.scheduler.trees) == max(lookup, 4)
    done = run_staggered(engine, ps, [SamplingParams(max_tokens=m) for m in max_tokens])
    for i, p in enumerate(ps):
        assert done[i].token_ids == plain_greedy(model, p, max_tokens[i]), i
    for i in (len(ps) - 2, len(ps) - 1):  # the repeating prompts: their continuation is found earlier
        assert done[i].stats.accepted_from_lookup > 0, i
    totals = engine.stats().totals
    assert totals.accepted_from_lookup == sum(d.stats.accepted_from_lookup for d in done.values()) > 0
    assert totals.accepted_from_lookup <= totals.accepted_tokens == sum(totals.accepted_per_depth)
    assert len(totals.accepted_per_depth) == max(lookup, 4)
    assert any(name.endswith(f"+lookup{lookup}") for name in engine.stats().steps_per_tree)
    assert engine.blocks.num_free_blocks == 256 and not engine.blocks.ref_counts.any()


def test_lookup_off_keeps_the_plain_trees(tiny):
    model, heads = tiny
    engine = make_engine(model, heads, 0)
    assert all(t.lookup == 0 for t in engine.scheduler.trees)
    assert engine.runner.decode.max_lookup == 0 and engine.runner.decode.history.shape[1] == 1


def test_device_proposals_equal_the_host_index(tiny, monkeypatch):
    """Every lookup chain the device fills from its token history is what the host's NgramIndex proposes
    from the sequence's tokens at that step (the history follows prefill, trees, plain steps, restarts).
    With overlap the host is a step behind at launch, so each proposal is checked against the tokens the
    sequence ends up with, cut at the history's length then."""
    from medusa.decoding import decode_step
    from medusa.decoding.prompt_lookup import NgramIndex

    model, heads = tiny
    # a small pool (preemption, so restarts) and a small tree budget (plain steps at the larger batches)
    engine = LLMEngine(model, heads, EngineConfig(prompt_lookup=5, num_blocks=70, block_size=4,
                                                  scheduler=SchedulerConfig(max_tree_tokens=48)))
    preempted = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda **kw: (plan := schedule(**kw), plan and preempted.extend(plan.preempted))[0]
    seen = []  # (sequence, tokens in its history then, chain length, proposal)
    original = decode_step.ngram_lookup

    def spy(history, lengths, rows, length):
        proposals = original(history, lengths, rows, length)
        by_row = {r.row: r.seq for r in engine.requests.values() if r.row is not None}
        for row, known, proposal in zip(rows.tolist(), lengths[rows].tolist(), proposals.tolist()):
            if row in by_row:
                seen.append((by_row[row], known, length, proposal))
        return proposals

    monkeypatch.setattr(decode_step, "ngram_lookup", spy)
    ps = mixed_prompts()
    done = run_staggered(engine, ps, [SamplingParams(max_tokens=30)] * len(ps))
    # a step launched past a sequence's end saw tokens that were then cut: nothing to check it against
    checked = [proposal == NgramIndex(seq.all_token_ids[:known]).propose(length)
               for seq, known, length, proposal in seen if known <= seq.num_tokens]
    assert len(checked) > 12 and all(checked) and preempted
    assert {name.split("+")[0] for name in engine.stats().steps_per_tree} >= {"single", "tree-4"}
    for i, p in enumerate(ps):
        assert done[i].token_ids == plain_greedy(model, p, 30), i


def test_host_verified_rows_give_the_same_tokens_with_and_without_lookup(tiny):
    """Logprobs, min_tokens and penalties are decided on the host, which gets the lookup nodes too."""
    model, heads = tiny
    ps = mixed_prompts()[-4:]
    params = [SamplingParams(max_tokens=20, logprobs=2), SamplingParams(max_tokens=20, min_tokens=15),
              SamplingParams(max_tokens=20, presence_penalty=0.3, frequency_penalty=0.2),
              SamplingParams(max_tokens=20, temperature=0.8, seed=4, logprobs=1)]
    without = make_engine(model, heads, 0).generate(ps, params)
    engine = make_engine(model, heads, 5)
    with_lookup = engine.generate(ps, params)
    for a, b in zip(without, with_lookup):
        assert a.token_ids == b.token_ids
    assert engine.totals.accepted_from_lookup > 0


def test_seeded_sampling_is_batch_invariant_with_lookup(tiny):
    model, heads = tiny
    repeating = [3, 1, 4, 1, 5] * 5
    params = SamplingParams(max_tokens=25, temperature=0.7, seed=11)
    alone = make_engine(model, heads, 4).generate([repeating], params)[0].token_ids
    others = [SamplingParams(max_tokens=25, temperature=1.0, seed=s) for s in range(7)]
    batch = make_engine(model, heads, 4).generate([repeating] + random_prompts(7, VOCAB, 40, seed=3),
                                                  [params] + others)
    assert batch[0].token_ids == alone
    # a seeded draw depends only on (seed, output position): plain decoding samples the same text
    assert make_engine(model, None, 4).generate([repeating], params)[0].token_ids == alone


@pytest.mark.parametrize("repeats", [False, True])
def test_the_batch1_decoder_fills_lookup_chains_from_its_own_index(tiny, repeats):
    """TreeDecoder proposes the chain from prompt + output like the engine: plain greedy output, and on a
    prompt whose continuation repeats it, steps that emit more than the heads' 4 deep tree could."""
    model, heads = tiny
    p = [5, 9, 2, 7] * 6 if repeats else random_prompts(1, VOCAB, 40, seed=31)[0]
    decoder = TreeDecoder(model, heads, TreeSpec.load("tree-8").with_lookup(6))
    out = []
    for chunk in decoder.decode(p, 30, SamplingConfig()):
        out += chunk
    assert out[:30] == plain_greedy(model, p, 30)
    if repeats:
        assert max(decoder.stats.accepted_lengths) > 1 + 4  # past the heads: the chain was accepted


def test_medusa_model_default_lookup_is_shorter_on_a_cpu(tiny):
    import torch

    from medusa.medusa_model import CPU_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP, MedusaModel, default_prompt_lookup

    model, heads = tiny
    assert default_prompt_lookup(torch.device("cuda")) == DEFAULT_PROMPT_LOOKUP > CPU_PROMPT_LOOKUP > 0
    assert default_prompt_lookup("cpu") == CPU_PROMPT_LOOKUP  # every tree node costs compute on a CPU
    assert MedusaModel(model, None, heads).prompt_lookup == CPU_PROMPT_LOOKUP  # this model is on the CPU
    medusa = MedusaModel(model, None, heads, prompt_lookup=3)
    assert medusa.decoder("tree-8").tree.num_lookup == 3  # the batch-1 decoder gets the chain too
    assert medusa.decoder("single").tree.num_lookup == 0


@pytest.mark.parametrize("bad", [-1, 63, 100, 2.5, True])
def test_bad_prompt_lookup_is_refused(bad):
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(prompt_lookup=bad)


def test_trees_cut_to_fit_64_nodes_are_kept_once(tiny):
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(prompt_lookup=62, trees=("single", "tree-4", "tree-8")))
    trees = engine.scheduler.trees
    assert [t.num_nodes for t in trees] == [1, 64]  # both keep one head node beside the chain
    assert trees[1].paths == ((0,),) and trees[1].max_depth == 62


@pytest.mark.parametrize("lookup", [0, 8])
def test_trees_reaching_past_the_context_at_its_end(lookup):
    """A request may fill the whole context; its last steps' deeper nodes sit past the RoPE table."""
    with single_thread():
        model, heads = tiny_decoder(VOCAB, logit_scale=3, num_heads=4, max_positions=64)
    prompt = [1, 2, 3, 4] * 10
    engine = make_engine(model, heads, lookup)
    assert engine.max_model_len == 64
    out = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert out.token_ids == plain_greedy(model, prompt, 24) and out.finish_reason == "length"


def test_medusa_model_passes_prompt_lookup_to_its_engines(tiny):
    from medusa.medusa_model import MedusaModel

    model, heads = tiny
    medusa = MedusaModel(model, None, heads, prompt_lookup=3)
    assert medusa.engine_config().prompt_lookup == 3
    assert all(t.lookup == 3 for t in medusa.engine().scheduler.trees if t.num_nodes > 1)
    with pytest.raises(ValueError, match="prompt_lookup"):
        MedusaModel(model, None, heads, prompt_lookup=-2)


@pytest.mark.parametrize("lookup", [0, 4])
def test_searched_candidates_fill_their_step_tokens(tiny, lookup, monkeypatch):
    """Heads with measured accuracies get searched trees that, with the lookup chain, carry exactly
    STEP_TOKENS tokens a step (16 of them fill one tensor-core tile), then the heads' own tree."""
    from dataclasses import replace

    from medusa.medusa_model import STEP_TOKENS, MedusaModel

    model, heads = tiny
    accuracies = [[0.6, 0.1, 0.05], [0.35, 0.1, 0.05], [0.25, 0.08, 0.04], [0.2, 0.06, 0.03]]
    monkeypatch.setattr(heads, "config", replace(heads.config, accuracies=accuracies))
    medusa = MedusaModel(model, None, heads, prompt_lookup=lookup)
    trees = medusa.engine_config().trees
    searched = [t for t in trees if isinstance(t, TreeSpec) and t.label.startswith("searched-")]
    assert [t.num_nodes + lookup for t in searched] == list(STEP_TOKENS)
    assert [t.label for t in searched] == [f"searched-{n - lookup}" for n in STEP_TOKENS]
    assert trees[0] == "single" and trees[-1] == TreeSpec.load("tree-64")  # no own tree: the largest named one


def test_a_models_engine_trees_fit_heads_shallower_than_the_named_trees():
    """Two heads with measured accuracies and no tree of their own: the largest named tree (four deep) is left
    out of the model's engine config, which the engine would refuse (it drops only its own default trees)."""
    from dataclasses import replace

    from medusa.medusa_model import MedusaModel

    model, heads = tiny_decoder(VOCAB, logit_scale=3, num_heads=2)
    heads.config = replace(heads.config, accuracies=[[0.6, 0.1, 0.05], [0.35, 0.1, 0.05]], tree=None)
    config = MedusaModel(model, None, heads, prompt_lookup=0).engine_config()
    engine = LLMEngine(model, heads, config)
    assert "tree-64" not in [t.label for t in engine.scheduler.trees]
    assert all(t.head_depth <= 2 for t in engine.scheduler.trees)
