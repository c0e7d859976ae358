"""logit_bias, allowed_token_ids, bad_words, repetition_penalty, presence_penalty and frequency_penalty on the
engine: applied along each tree node's own path, so Medusa with them equals plain decoding with them (greedy and
seeded sampling)."""

import itertools
from dataclasses import replace
from collections import Counter

import pytest
import torch

from medusa.attention import CausalAttention
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from engine_driver import force_overlap, random_prompts, single_thread
from tiny_models import tiny_decoder

VOCAB = 12  # small, so penalties bite often and the heads' drafts still get accepted
PENALTIES = [dict(frequency_penalty=0.7), dict(presence_penalty=0.9),
             dict(presence_penalty=0.4, frequency_penalty=0.3), dict(presence_penalty=-0.5),
             dict(frequency_penalty=-0.6), dict(presence_penalty=2.0, frequency_penalty=2.0),
             dict(repetition_penalty=1.8), dict(repetition_penalty=0.6), dict(logit_bias={3: 2.5, 7: -4.0}),
             dict(logit_bias={5: 1.5}, repetition_penalty=1.4, frequency_penalty=0.2),
             dict(allowed_token_ids=[2, 5, 7, 9]), dict(allowed_token_ids=[1, 4, 6, 8, 10], frequency_penalty=0.5)]


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    return force_overlap(request, monkeypatch)


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def prompts(n, seed=0):
    return random_prompts(n, VOCAB, 12, seed)


def penalized(logits, prompt, output, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
              logit_bias=None, allowed_token_ids=None, bad_word_ids=()):
    """vLLM's rules, written independently of the engine: the bias and the allowed tokens, then the repetition
    penalty over the prompt and the output, then OpenAI's presence / frequency penalties over the output only."""
    logits = logits.float().clone()
    for token, bias in (logit_bias or {}).items():
        logits[token] += bias
    if allowed_token_ids is not None:
        for token in range(logits.shape[-1]):
            if token not in allowed_token_ids:
                logits[token] = float("-inf")
    for word in bad_word_ids:  # its last token may not complete it
        if len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1:]) == tuple(word[:-1]):
            logits[word[-1]] = float("-inf")
    counts = torch.zeros(logits.shape[-1])
    for token in output:
        counts[token] += 1
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / repetition_penalty if logits[token] > 0 else logits[token] * repetition_penalty
    return logits - frequency_penalty * counts - presence_penalty * (counts > 0).float()


@torch.no_grad()
def reference_greedy(model, prompt, max_tokens, **penalties):
    """Batch 1, full recompute each step: no cache, no tree."""
    output = []
    for _ in range(max_tokens):
        ids = torch.tensor(prompt + output)
        logits = model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention()))[-1]
        output.append(int(penalized(logits, prompt, output, **penalties).argmax()))
    return output


def engine(model, heads):
    return LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4))


def test_medusa_greedy_with_penalties_equals_plain_greedy(tiny):
    model, heads = tiny
    ps = prompts(3)
    accepted = 0
    for penalties in PENALTIES:
        params = SamplingParams(max_tokens=16, **penalties)
        outs = engine(model, heads).generate(ps, params)  # batched, every row on the host path
        for p, out in zip(ps, outs):
            assert out.token_ids == reference_greedy(model, p, 16, **penalties), (penalties, p)
            accepted += out.stats.accepted_tokens
    assert accepted > 0  # drafts were accepted, so multi-token paths were penalized node by node


def test_plain_engine_with_penalties_equals_reference(tiny):
    model, _ = tiny
    p = prompts(1, seed=1)[0]
    for penalties in PENALTIES[:3] + PENALTIES[-4:]:
        params = SamplingParams(max_tokens=12, **penalties)
        out = engine(model, None).generate([p], params)[0]
        assert out.token_ids == reference_greedy(model, p, 12, **penalties), penalties
    # penalties change what is chosen, never the logprobs reported: those stay the raw model's
    medusa = engine(model, tiny[1])
    medusa.add_request(p, SamplingParams(max_tokens=12, frequency_penalty=1.5, logprobs=2))
    tokens, logprobs = [], []
    while medusa.has_unfinished():
        for out in medusa.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    assert tokens == reference_greedy(model, p, 12, frequency_penalty=1.5)
    ids = torch.tensor(p + tokens)
    with torch.no_grad():
        raw = torch.log_softmax(model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention())), -1)
    assert len(logprobs) == 12
    for i, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(raw[len(p) - 1 + i, lp.token_id].item(), abs=1e-4)
        assert lp.top[0][0] == int(raw[len(p) - 1 + i].argmax())
        assert lp.rank == 1 + int((raw[len(p) - 1 + i] > raw[len(p) - 1 + i, lp.token_id]).sum())
    assert any(lp.rank > 1 for lp in logprobs)  # a penalty overrode the raw favourite


def test_seeded_sampling_with_penalties_is_batch_invariant_and_lossless(tiny):
    model, heads = tiny
    p = [1, 2, 3]
    params = SamplingParams(max_tokens=32, temperature=0.6, seed=7, presence_penalty=1.5, frequency_penalty=0.5,
                            repetition_penalty=1.3, logit_bias={2: 1.0})
    alone_out = engine(model, heads).generate([p], params)[0]
    alone = alone_out.token_ids
    assert alone_out.stats.accepted_tokens > 0
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, frequency_penalty=0.5 * (s % 3))
              for s in range(6)]
    batch = engine(model, heads).generate([p] + prompts(6, seed=2), [params] + others)
    assert batch[0].token_ids == alone
    # a seeded draw depends only on (seed, output position) and the distribution there, so plain
    # decoding draws the same text exactly when every tree node saw its own path's penalties
    plain = engine(model, None).generate([p], params)[0].token_ids
    assert plain == alone
    unpenalized = engine(model, None).generate([p], SamplingParams(max_tokens=32, temperature=0.6, seed=7))[0]
    assert unpenalized.token_ids != alone  # the penalties did something


def test_seeded_sampling_with_allowed_tokens_draws_only_them_as_plain_decoding_does(tiny):
    model, heads = tiny
    allowed = [0, 3, 4, 8, 11]
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=3, allowed_token_ids=allowed)
    medusa = engine(model, heads).generate(prompts(4, seed=5), params)
    plain = engine(model, None).generate(prompts(4, seed=5), params)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]
    assert all(set(o.token_ids) <= set(allowed) for o in medusa) and sum(o.stats.accepted_tokens for o in medusa)


def words_as(monkeypatch, spelled, ends=()):
    """The tiny model has no tokenizer: bad words and choices are spelled by `spelled` {word: token sequences}."""
    import medusa.decoding.engine as engine_module
    from medusa.decoding.logits_processing import TokenRules

    def rules(tokenizer, params, eos):
        return TokenRules(tuple(ids for w in params.bad_words for ids in spelled[w]),
                          tuple(ids for c in params.guided_choice for ids in spelled[c]), tuple(ends))

    monkeypatch.setattr(engine_module, "token_rules", rules)


def test_bad_words_are_never_completed_and_medusa_writes_what_plain_decoding_does(tiny, monkeypatch):
    """The free greedy texts' commonest pairs of tokens, and one token, are banned as words: each tree node's ban
    comes from its own path, so Medusa greedy equals a full-recompute reference, and seeded sampling plain
    decoding."""
    model, heads = tiny
    ps = prompts(6, seed=4)
    pairs = Counter(pair for p in ps for pair in itertools.pairwise(reference_greedy(model, p, 16)))
    spelled = {"pairs": [pair for pair, _ in pairs.most_common(5)], "one": [(pairs.most_common(6)[-1][0][0],)]}
    words_as(monkeypatch, spelled)
    banned = spelled["pairs"] + spelled["one"]
    outs = engine(model, heads).generate(ps, SamplingParams(max_tokens=16, bad_words=("pairs", "one")))
    for p, out in zip(ps, outs):
        want = reference_greedy(model, p, 16, bad_word_ids=banned)
        assert out.token_ids == want, p
        assert all(tuple(want[i:i + len(word)]) != word for word in banned for i in range(len(want)))
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    sampled = SamplingParams(max_tokens=24, temperature=0.7, seed=5, bad_words=("pairs", "one"))
    medusa = engine(model, heads).generate(prompts(3, seed=6), sampled)
    plain = engine(model, None).generate(prompts(3, seed=6), sampled)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]


@torch.no_grad()
def reference_choice(model, prompt, choices, end):
    """Greedy among the choices, full recompute each step: the best allowed next token until a choice is whole
    and `end` beats its continuations (or none is left)."""
    output = []
    while True:
        ids = torch.tensor(prompt + output)
        logits = model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention()))[-1]
        nexts = {c[len(output)] for c in choices if len(c) > len(output) and list(c[:len(output)]) == output}
        if not nexts or tuple(output) in choices:
            nexts.add(end)
        token = max(nexts, key=lambda t: logits[t].item())
        if token == end:
            return output
        output.append(token)


def test_guided_choice_writes_one_choice_then_ends_as_plain_decoding_does(tiny, monkeypatch):
    """Choices sharing prefixes (and one a prefix of another): every node may write only a next token of a choice
    its path is a prefix of, or the end once its path is a whole choice."""
    model, heads = tiny
    end = 11
    spelled = {"a": [(3, 5, 7, 2)], "b": [(3, 5)], "c": [(4, 9, 9, 1, 6)], "d": [(8,)], "e": [(6, 6, 6, 6, 6, 6)]}
    words_as(monkeypatch, spelled, ends=(end,))
    choices = {ids for spellings in spelled.values() for ids in spellings}
    ps = prompts(8, seed=9)
    params = SamplingParams(max_tokens=12, guided_choice=tuple(spelled), stop_token_ids=(end,))
    outs = engine(model, heads).generate(ps, params)
    for p, out in zip(ps, outs):
        assert tuple(out.token_ids) in choices and out.finish_reason == "stop"
        assert out.token_ids == reference_choice(model, p, choices, end), p
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the model's own preference picked among them
    sampled = replace(params, temperature=1.0, seed=3)
    medusa = engine(model, heads).generate(ps, sampled)
    plain = engine(model, None).generate(ps, sampled)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]
    assert all(tuple(o.token_ids) in choices for o in medusa)


@pytest.mark.parametrize("kwargs", [dict(ignore_eos=True), dict(min_tokens=2)])
def test_guided_choice_refuses_what_would_keep_it_from_ending(kwargs):
    with pytest.raises(ValueError, match="cannot be combined with ignore_eos or min_tokens"):
        SamplingParams(guided_choice=("yes", "no"), **kwargs)


def test_token_rules_spell_bad_words_alone_and_after_a_space_and_choices_as_written(default_model_dir):
    from transformers import AutoTokenizer

    from medusa.decoding.engine_request import token_rules

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    rules = token_rules(tokenizer, SamplingParams(bad_words=("hello world",), guided_choice=("yes", "no")), {2})
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert set(rules.bad_words) == {encode("hello world"), encode(" hello world")}
    assert set(rules.choices) == {encode("yes"), encode("no")} and rules.ends == (2,)
    with pytest.raises(ValueError, match="need the engine's tokenizer"):
        token_rules(None, SamplingParams(bad_words=("x",)), {2})
    with pytest.raises(ValueError, match="needs an end-of-sequence token"):
        token_rules(tokenizer, SamplingParams(guided_choice=("x",)), set())


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.01, -3, float("nan"), "1"])
def test_penalty_validation_names_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    assert getattr(SamplingParams(**{name: -2}), name) == -2.0


def test_penalties_change_the_greedy_output():
    """Each rule bites on this tiny model (else the equality tests above would prove nothing for it)."""
    model, _ = tiny_decoder(VOCAB, logit_scale=3, num_heads=4)
    p = prompts(1, seed=3)[0]
    plain = reference_greedy(model, p, 16)
    for penalties in PENALTIES:
        assert reference_greedy(model, p, 16, **penalties) != plain, penalties


@pytest.mark.parametrize("kwargs,message", [
    (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(repetition_penalty="2"), "repetition_penalty"),
    (dict(logit_bias={1: 101}), r"logit_bias values must be numbers in \[-100, 100\]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"), (dict(logit_bias={"3": 1.0}), "logit_bias keys"),
    (dict(logit_bias=[(2, 1.0), (2, 3.0)]), "logit_bias names a token twice"),
    (dict(logit_bias=5), "logit_bias must map"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids must be"), (dict(allowed_token_ids="12"), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    (dict(bad_words="word"), "bad_words must be a list of non-blank strings"), (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"), (dict(guided_choice=["a", ""]), "guided_choice must be a list of non-empty"),
    (dict(guided_choice="ab"), "guided_choice"),
])
def test_bias_and_repetition_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_is_kept_as_sorted_pairs():
    params = SamplingParams(logit_bias={9: -1, 2: 0.5})
    assert params.logit_bias == ((2, 0.5), (9, -1.0)) and params.has_penalties and hash(params)
    assert SamplingParams(repetition_penalty=1).has_penalties is False
    allowed = SamplingParams(allowed_token_ids=[9, 2, 9])
    assert allowed.allowed_token_ids == (2, 9) and allowed.has_penalties and hash(allowed)


def test_changes_made_for_many_rows_at_once_equal_each_row_penalized_alone():
    """The engine's batched path (`batch_changes`: a guide, then count penalties, over G rows at once) against
    `penalize` row by row, on a tree with lookup nodes: rows with different penalties (none too), outputs,
    prompts, candidates, one guided; fresh random logits per row."""
    from medusa.decoding.device_tree import DeviceTree
    from medusa.decoding.logits_processing import TokenRules, batch_changes, penalize
    from medusa.decoding.regex_dfa import compile_regex
    from medusa.decoding.token_guide import GuideProgress, RegexGuide, VocabTrie
    from medusa.tree import TreeSpec

    tree = DeviceTree.from_spec(TreeSpec.load("tree-16").with_lookup(3), torch.device("cpu"))
    n, gen = tree.num_nodes, torch.Generator().manual_seed(0)
    kinds = [dict(presence_penalty=0.4, frequency_penalty=0.3), dict(repetition_penalty=1.8), dict(),
             dict(repetition_penalty=0.6, presence_penalty=-0.5), dict(frequency_penalty=1.1)]
    texts = [chr(97 + t) for t in range(VOCAB - 1)] + [None]  # token t spells a letter; the last is the end
    guide = RegexGuide(compile_regex("[a-f]+"), VocabTrie(texts), [VOCAB - 1])
    params, rules, outputs, prompts_ = [], [], [], []
    for g, kind in enumerate(kinds):
        guided = g == 2 or g == 4
        params.append(SamplingParams(guided_regex="[a-f]+" if guided else None, **kind))
        rules.append(TokenRules(ends=(VOCAB - 1,), guide=GuideProgress(guide)) if guided else TokenRules())
        outputs.append(torch.randint(0, 6 if guided else VOCAB, (3 + g,), generator=gen).tolist())
        prompts_.append(torch.randint(0, VOCAB, (5,), generator=gen).tolist())
    candidates = torch.randint(0, VOCAB, (len(kinds), n), generator=gen)
    logits = torch.randn(len(kinds), n, VOCAB, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    together = batch_changes(logits, params, rules, outputs, prompts_, tree, candidates)
    for g in range(len(kinds)):
        alone = penalize(params[g], outputs[g], logits[g], tree, candidates[g], prompts_[g], rules[g])
        assert together.dtype == torch.float32 and torch.equal(together[g], alone.float()), kinds[g]
    assert not torch.equal(together[0], logits[0].float())  # penalties did apply
