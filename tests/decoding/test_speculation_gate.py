"""The batch-1 decoder's speculation gate: plain steps where speculation loses on the clock,
one speculative step now and then, and greedy outputs that never change."""

from __future__ import annotations

import pytest

from medusa.decoding.generator import TreeDecoder
from medusa.decoding.speculation_gate import REVISIT_STEPS, TRIAL_STEPS, WINDOW, SpeculationGate
from medusa.decoding.tree_policy import MARGIN
from medusa.decoding.verifier import SamplingConfig
from medusa.tree import TreeSpec
from engine_driver import random_prompts, single_thread
from tiny_models import tiny_decoder

VOCAB = 24


def run_trials(gate, spec_seconds, spec_tokens, plain_seconds):
    kinds = []
    for _ in range(2 * TRIAL_STEPS):
        speculative = gate.speculate()
        kinds.append(speculative)
        gate.observe(speculative, spec_seconds if speculative else plain_seconds, spec_tokens if speculative else 1)
    return kinds


def test_trials_then_the_faster_kind_on_the_clock():
    losing = SpeculationGate()  # 1.5 tokens for 2x a plain step's time
    assert run_trials(losing, 2.0, 2, 1.0) == [True] * TRIAL_STEPS + [False] * TRIAL_STEPS
    assert not losing.speculate()
    winning = SpeculationGate(expected_length=2.0)  # 2 tokens for 1.5x, as predicted
    run_trials(winning, 1.5, 2, 1.0)
    assert winning.speculate()


def test_the_heads_prediction_outweighs_a_few_unlucky_trial_steps_but_not_a_window_of_them():
    from medusa.decoding.speculation_gate import PRIOR_STEPS

    predicted, unpredicted = SpeculationGate(expected_length=2.0), SpeculationGate()
    for gate in (predicted, unpredicted):  # an answer's first words: 1 token per step, at 1.3x the cost
        run_trials(gate, 1.3, 1, 1.0)
    assert predicted.tokens_per_step() == (2.0 * PRIOR_STEPS + TRIAL_STEPS) / (PRIOR_STEPS + TRIAL_STEPS)
    assert predicted.speculate() and not unpredicted.speculate()
    for _ in range(WINDOW):
        predicted.observe(True, 1.3, 1)
    assert not predicted.speculate()


def test_speculation_must_win_by_the_margin():
    for gain, speculates in ((1.05, False), (1.15, True)):  # speculation's tokens per second over plain's
        gate = SpeculationGate()
        run_trials(gate, 1.0 / gain, 1, 1.0)
        assert 1.05 < MARGIN < 1.15 and gate.speculate() is speculates


def test_a_long_plain_run_gives_speculation_one_step_and_text_the_heads_know_wins_it_back():
    gate = SpeculationGate()
    run_trials(gate, 2.0, 1, 1.0)  # ends with TRIAL_STEPS plain steps, the start of the plain run
    for _ in range(REVISIT_STEPS - TRIAL_STEPS - 1):
        assert not gate.speculate()
        gate.observe(False, 1.0, 1)
    gate.observe(False, 1.0, 1)
    assert gate.speculate()  # the revisit
    for _ in range(WINDOW):  # the text turned easy: every revisit step now accepts 4 tokens
        gate.observe(True, 2.0, 4)
    assert gate.speculate()


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=3, heads_std=0.5)


class ScriptedGate(SpeculationGate):
    """Speculates on the steps listed, plain otherwise; records what it observed."""

    def __init__(self, speculative_steps):
        super().__init__()
        self.plan, self.seen = set(speculative_steps), []

    def speculate(self):
        return len(self.seen) in self.plan

    def observe(self, speculative, seconds, emitted):
        self.seen.append((speculative, emitted))


def decode(decoder, prompt, tokens=40, sampling=SamplingConfig()):
    out = []
    for chunk in decoder.decode(prompt, tokens, sampling):
        out += chunk
    return out[:tokens]


def test_gated_greedy_decoding_is_plain_greedy_whichever_steps_speculate(tiny):
    model, heads = tiny
    plain = TreeDecoder(model, None, TreeSpec.load("single"))
    for prompt in random_prompts(3, VOCAB, 12, seed=3):
        want = decode(plain, prompt)
        gate = ScriptedGate({0, 1, 2, 9, 10, 11, 12, 20})  # speculative, then plain, back and forth
        decoder = TreeDecoder(model, heads, TreeSpec.load("tree-16"), gate=gate)
        assert decode(decoder, prompt) == want
        kinds = [speculative for speculative, _ in gate.seen]
        assert kinds[:4] == [True, True, True, False] and kinds[9:13] == [True] * 4
        assert all(emitted == 1 for speculative, emitted in gate.seen if not speculative)
        assert any(emitted > 1 for speculative, emitted in gate.seen if speculative)  # the heads still accept
        assert decoder.stats.accepted_lengths == [emitted for _, emitted in gate.seen]


def test_sampling_ignores_the_gate(tiny):
    """A seeded sampling run must draw the same way every time, so it never switches trees."""
    model, heads = tiny
    gate = ScriptedGate(set())  # would always say plain
    decoder = TreeDecoder(model, heads, TreeSpec.load("tree-16"), gate=gate)
    decode(decoder, random_prompts(1, VOCAB, 12, seed=4)[0], sampling=SamplingConfig(temperature=0.8, seed=1))
    assert gate.seen == [] and max(decoder.stats.accepted_lengths) > 1
