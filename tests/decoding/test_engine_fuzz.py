"""Randomized engine runs on the tiny model: every feature at once, where the other files test one each.

Each seed draws an engine config (pool size, block size, batch caps, prefix caching, prompt lookup, overlap,
apply interval) and a request mix (max/min tokens, stop ids, penalties, bias, logprobs, seeded sampling with
filters, guided regexes), submits it a few requests a step with some aborted midway, and checks that every
finished request equals the same request run alone on a plain engine (seeded sampling draws the same tokens
with or without heads), that a guided output that ended matches its pattern, that streamed tokens add up to the
final output, and that the pool ends all free.
Session 49 ran 750 such seeds outside the suite (300 of them: 2,580 requests, 239 aborted, 1,223
preemptions, 15,674 tree steps) and found nothing. The checks do fail on a broken engine: with
the host's guide verdicts switched off, or a step's tokens cut to 3, 4 or 3 of the 8 seeds here fail.
"""

import random
import re

import pytest

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.logits_processing import TokenRules
from medusa.decoding.regex_dfa import compile_regex
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.decoding.token_guide import GuideProgress, RegexGuide, VocabTrie
from engine_driver import single_thread
from tiny_models import tiny_decoder

VOCAB = 24
# the tiny model's ids spelled, for guided requests; END (23) ends a guided output
TOKENS = ["a", "b", "0", "1", "ab", "ba", "01", "b1", "aab", "10", "x", "y", "aa", "bb", "00", "11", "a0", "b0",
          "1a", "0b", "xy", "yx", "z"]
END = 23
PATTERNS = [r"(ab|ba)+[01]{1,3}", r"a?b{1,3}0?", r"(a|b)*1", r"[ab]{2}[01]*", r"x(y|z)*"]


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


@pytest.fixture(autouse=True)
def spelled(monkeypatch):
    """Guided requests' rules over TOKENS (the tiny model has no tokenizer); others' as usual."""
    import medusa.decoding.engine as engine_module

    usual = engine_module.token_rules

    def rules(tokenizer, params, eos):
        if params.guided_regex is None:
            return usual(tokenizer, params, eos)
        guide = RegexGuide(compile_regex(params.guided_regex), VocabTrie(TOKENS + [None]), [END])
        return TokenRules(ends=(END,), guide=GuideProgress(guide))

    monkeypatch.setattr(engine_module, "token_rules", rules)


def random_params(rng: random.Random) -> SamplingParams:
    kw = {"max_tokens": rng.randint(1, 40)}
    maybe = lambda p: rng.random() < p  # noqa: E731
    if maybe(0.4):
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if maybe(0.4):
        kw["stop_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 3))
    if maybe(0.3):
        kw["presence_penalty"] = rng.choice([-0.5, 0.4, 1.2])
    if maybe(0.3):
        kw["frequency_penalty"] = rng.choice([-0.3, 0.5, 1.0])
    if maybe(0.2):
        kw["repetition_penalty"] = rng.choice([0.7, 1.3, 1.8])
    if maybe(0.2):
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-5.0, 2.0, 4.0])}
    if maybe(0.2):
        kw["logprobs"] = rng.randint(0, 3)
    if maybe(0.2):
        kw.update(guided_regex=rng.choice(PATTERNS), stop_token_ids=[END])
        kw.pop("min_tokens", None)  # refused with a guide
    if maybe(0.3):
        kw.update(temperature=rng.choice([0.5, 0.9, 1.3]), seed=rng.randrange(10**6))
        kw.update({"top_k": rng.randint(2, 10)} if maybe(0.4) else {})
        kw.update({"top_p": rng.choice([0.5, 0.9])} if maybe(0.4) else {})
    return SamplingParams(**kw)


def random_engine(rng: random.Random) -> tuple[EngineConfig, bool]:
    block = rng.choice([4, 16])
    config = EngineConfig(
        num_blocks=rng.choice([10, 16, 24, 48, 400]) * (4 if block == 4 else 1), block_size=block,
        enable_prefix_caching=rng.random() < 0.5, prompt_lookup=rng.choice([0, 0, 3]),
        apply_interval=rng.choice([1, 1, 3]),
        scheduler=SchedulerConfig(max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=rng.choice([64, 128, 512])))
    return config, config.apply_interval > 1 or rng.random() < 0.5


def engine_of(model, heads, config, overlap) -> LLMEngine:
    engine = LLMEngine(model, heads, config)
    engine.overlap = overlap
    return engine


def run(engine, prompts, params, rng) -> tuple[dict, set, dict]:
    """A few requests a step, some aborted -> ({index: final output}, aborted, {index: streamed tokens})."""
    pending, ids, done, aborted, streamed = list(range(len(prompts))), {}, {}, set(), {}
    abort_at = {i: rng.randint(0, 30) for i in pending if rng.random() < 0.15}
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                ids[engine.add_request(prompts[i], params[i])] = i
        for rid, i in ids.items():
            if abort_at.get(i) == step and i not in done and engine.abort(rid):
                aborted.add(i)
        for out in engine.step():
            i = ids[out.request_id]
            streamed[i] = streamed.get(i, []) + out.new_token_ids
            if out.finished:
                done[i] = out
        step += 1
        assert step < 5000, "no progress"
    return done, aborted, streamed


def alone(model, config, overlap, prompt, params):
    engine = engine_of(model, None, config, overlap)
    engine.add_request(prompt, params)
    finished = []
    while engine.has_unfinished():
        finished += [out for out in engine.step() if out.finished]
    return finished[0]


@pytest.mark.parametrize("seed", range(8))
def test_random_mixes_match_each_request_alone_on_a_plain_engine(tiny, seed):
    model, heads = tiny
    rng = random.Random(seed)
    config, overlap = random_engine(rng)
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 40))]
    prompts = [(shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
               for _ in range(rng.randint(3, 14))]
    params = [random_params(rng) for _ in prompts]
    engine = engine_of(model, heads, config, overlap)
    done, aborted, streamed = run(engine, prompts, params, rng)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if i in aborted:
            continue
        want = alone(model, config, overlap, prompt, sp)
        assert (done[i].token_ids, done[i].finish_reason) == (want.token_ids, want.finish_reason), (i, sp)
        assert streamed[i] == done[i].token_ids
        if sp.guided_regex is not None and done[i].finish_reason == "stop":  # ended by the guide's END
            assert re.fullmatch(sp.guided_regex, "".join(TOKENS[t] for t in done[i].token_ids)), (i, sp)
    assert engine.blocks.num_free_blocks == config.num_blocks and not engine.blocks.ref_counts.any()
    engine.blocks.check_invariants()
