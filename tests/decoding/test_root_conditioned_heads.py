"""Heads that read the root token (and the chained ones, which also read the earlier heads' top-1
tokens), in both decoders: outputs stay plain greedy, and the engine feeds the
heads the same root the batch-1 decoder does (after prefill and after every step), so a request
accepts exactly as many drafts in a batch as alone."""

from __future__ import annotations

import pytest

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.verifier import SamplingConfig
from medusa.tree import TreeSpec
from engine_driver import random_prompts, single_thread
from tiny_models import tiny_decoder

VOCAB = 24
TOKENS = 24


@pytest.fixture(scope="module", params=["root", "chain"])
def tiny(request):
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=3, heads_std=0.5, condition_on_root=True,
                           condition_on_chain=request.param == "chain")


def alone(model, heads, prompt, tree):
    decoder, out = TreeDecoder(model, heads, TreeSpec.load(tree)), []
    for chunk in decoder.decode(prompt, TOKENS, SamplingConfig()):
        out += chunk
    return out[:TOKENS], decoder.stats.accepted_lengths


def test_root_conditioned_heads_keep_greedy_outputs_and_accept_the_same_in_a_batch(tiny):
    model, heads = tiny
    assert heads.config.condition_on_root
    ps = random_prompts(6, VOCAB, 30, seed=5)
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=300, block_size=4, trees=("tree-8",)))
    done = engine.generate(ps, SamplingParams(max_tokens=TOKENS))
    accepted = 0
    for i, p in enumerate(ps):
        plain, _ = alone(model, None, p, "single")
        tokens, lengths = alone(model, heads, p, "tree-8")
        assert tokens == plain and done[i].token_ids == plain, i
        # the last step may overshoot max_tokens alone; drafts accepted before it must agree
        assert done[i].stats.accepted_tokens == sum(n - 1 for n in lengths[:done[i].stats.steps]), i
        accepted += done[i].stats.accepted_tokens
    assert accepted > 0  # drafts were accepted, so the roots reached the heads


def test_the_batch1_decoder_gives_the_heads_the_root_it_emits_next(tiny):
    """Every heads call gets, as its root, the first token the next step emits (prefill included)."""
    model, heads = tiny
    seen, forward = [], heads.forward

    def spy(hidden, lm_head_weight=None, roots=None):
        seen.append(int(roots))
        return forward(hidden, lm_head_weight, roots=roots)

    heads.forward = spy
    try:
        decoder, steps = TreeDecoder(model, heads, TreeSpec.load("tree-8")), []
        for chunk in decoder.decode(random_prompts(1, VOCAB, 30, seed=8)[0], TOKENS, SamplingConfig()):
            steps.append(chunk)
    finally:
        del heads.forward
    assert len(seen) == len(steps) + 1  # prefill and every step; the last one's proposals go unused
    assert seen[:-1] == [chunk[0] for chunk in steps]
