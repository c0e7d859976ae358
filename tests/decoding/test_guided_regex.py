"""guided_regex: the pattern's character DFA against Python's `re`, its token guide against a brute-force oracle, and
the engine with it (Medusa greedy equals a full-recompute reference; seeded sampling equals plain decoding)."""

import functools
import itertools
import random
import re
import warnings
from dataclasses import replace

import pytest
import torch

from medusa.attention import CausalAttention
from medusa.decoding.logits_processing import TokenRules
from medusa.decoding.regex_dfa import DEAD, compile_regex
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.token_guide import GuideProgress, RegexGuide, VocabTrie
from engine_driver import force_overlap, random_prompts, single_thread, without_policy
from tiny_models import tiny_decoder

# each pattern with texts it matches (random texts over ALPHABET are mostly misses)
PATTERNS = {r"\d{3}-\d{4}": ["555-0199", "٣٣٣-١٢٣٤"], r"(ab|cd)[0-9]{2}": ["ab01", "cd99"],
            r"[a-c]*b+": ["b", "acabbb"], r"(yes|no|maybe)": ["yes", "no", "maybe"], r"a.c": ["abc", "a c"],
            r"[^a]+x?": ["bx", "xx", "\n"], r"\w+@\w+\.com": ["a_1@b.com"], r"(a|b)*abb": ["abb", "babaabb"],
            r"x{2,3}y{0,2}": ["xx", "xxxyy"], r"(?:ab)?c|d": ["c", "abc", "d"], r"^h[ae]llo$": ["hello", "hallo"],
            r"\s*\{\s*\"a\"\s*:\s*-?\d+\s*\}": ['{"a": -12}', ' {\n"a":0 }'], r"[\]a-]+": ["]-a", "-"],
            r"a{,2}b": ["b", "aab"], r"(?P<w>[a-z]+)(, [a-z]+)*\.": ["a, bc, d.", "xyz."], r"\D\W\S": ["a ]", "_.0"],
            r"[\d\s]+": ["1 2\n3"], r"\x41\u00e9+": ["Aéé"], "é.ü": ["é ü", "ééü"], r"a+?b*?": ["a", "aabb"],
            r"[^\n]*\n": ["abc\n", "\n"]}
ALPHABET = "abcdxy019-@.,{}\" :\n_]Aéü "


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_dfa_accepts_what_python_re_fullmatches(pattern):
    dfa, expr, rng = compile_regex(pattern), re.compile(pattern), random.Random(pattern)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 10))) for _ in range(3000)]
    for match in PATTERNS[pattern]:  # each match, and every text one edit away from it
        texts += [match] + [match[:i] + c + match[i + 1:] for i in range(len(match)) for c in ALPHABET]
        texts += [match[:i] + match[i + 1:] for i in range(len(match))] + [match + c for c in ALPHABET]
    assert all(expr.fullmatch(m) for m in PATTERNS[pattern])
    for text in texts:
        assert dfa.accepts(dfa.walk(dfa.start, text)) == bool(expr.fullmatch(text)), text


@pytest.mark.parametrize("pattern", ["a(?=b)", r"(a)\1", "a*+", "a$b", "(?i)a", "[", r"\bfoo", "a^b", "", "a{3,2}",
                                     "a{2000}"])
def test_patterns_it_cannot_follow_are_refused_naming_guided_regex(pattern):
    with pytest.raises(ValueError, match="guided_regex"):
        compile_regex(pattern)
    with pytest.raises(ValueError, match="guided_regex"):
        SamplingParams(guided_regex=pattern)


@pytest.mark.parametrize("kwargs, message", [(dict(guided_choice=("a",)), "cannot both be set"),
                                             (dict(ignore_eos=True), "ignore_eos or min_tokens"),
                                             (dict(min_tokens=1), "ignore_eos or min_tokens")])
def test_guided_regex_refuses_what_would_keep_it_from_ending(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(guided_regex="a+", **kwargs)


# a vocabulary over "ab01" for the brute-force oracle
TOKENS = ["a", "b", "0", "1", "ab", "ba", "01", "b1", "aab", "10", "x"]  # "x" is in no pattern below
ORACLE_PATTERNS = [r"(ab|ba)+[01]{1,3}", r"a?b{1,3}0?", r"(a|b)*1", r"(ab|b1)(0|10)?", r"[ab]{2}[01]*",
                   r"[ab0]*1", r"a[^1]*1"]  # the last two: most characters loop (`RegexGuide._moves_by_loop`)


COMPLETIONS = ["".join(c) for n in range(5) for c in itertools.product("ab01", repeat=n)]


@functools.lru_cache(maxsize=None)
def viable(pattern, text):
    """Whether `text` begins a match: every oracle pattern completes a text that does within 4 characters."""
    expr = re.compile(pattern)
    return any(expr.fullmatch(text + rest) for rest in COMPLETIONS)


@pytest.mark.parametrize("pattern", ORACLE_PATTERNS)
def test_each_state_allows_the_tokens_that_keep_the_text_a_prefix_of_a_match(pattern):
    end = len(TOKENS)
    guide = RegexGuide(compile_regex(pattern), VocabTrie(TOKENS + [None]), [end])
    for n in range(5):
        for text in map("".join, itertools.product("ab01", repeat=n)):
            state = guide.dfa.walk(guide.start, text)
            if not viable(pattern, text):
                assert state == DEAD or not guide.allowed(state)[:end].any(), text
                continue
            want = {t for t, piece in enumerate(TOKENS) if viable(pattern, text + piece)}
            if re.fullmatch(pattern, text):
                want.add(end)
            assert set(guide.allowed(state).nonzero().flatten().tolist()) == want, text
            assert all(guide.advance(state, t) == guide.dfa.walk(state, TOKENS[t]) for t in want - {end})


def test_a_cursor_walks_only_the_tokens_appended_since_its_last_call():
    guide = RegexGuide(compile_regex(r"(ab|ba)+[01]{1,3}"), VocabTrie(TOKENS), [])
    cursor, text = GuideProgress(guide), []
    for token in [4, 5, 0, 1, 2]:  # ab ba a b 0
        text.append(token)
        assert cursor.state_after(text) == guide.dfa.walk(guide.start, "".join(TOKENS[t] for t in text))
    assert guide.dfa.accepts(cursor.state_after(text))
    assert cursor.state_after([]) == guide.start  # another output: from the start


# the engine, on a tiny random model whose 12 token ids are spelled TOKENS, then the end
VOCAB, END = 12, 11


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    return force_overlap(request, monkeypatch)


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def spelled_by_tokens(monkeypatch):
    """The tiny model has no tokenizer: its ids' texts are TOKENS, and END ends the output."""
    import medusa.decoding.engine as engine_module

    def rules(tokenizer, params, eos):
        guide = RegexGuide(compile_regex(params.guided_regex), VocabTrie(TOKENS + [None]), [END])
        return TokenRules(ends=(END,), guide=GuideProgress(guide))

    monkeypatch.setattr(engine_module, "token_rules", rules)


@torch.no_grad()
def reference_guided(model, prompt, pattern, max_tokens):
    """Greedy under the oracle, full recompute each step: the best token whose text keeps the output a prefix of a
    match, or END once it matches and END is best."""
    output, text = [], ""
    while len(output) < max_tokens:
        ids = torch.tensor(prompt + output)
        logits = model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention()))[-1]
        allowed = [t for t, piece in enumerate(TOKENS) if viable(pattern, text + piece)]
        allowed += [END] if re.fullmatch(pattern, text) else []
        token = max(allowed, key=lambda t: logits[t].item())
        output.append(token)
        if token == END:
            break
        text += TOKENS[token]
    return output


@pytest.mark.parametrize("pattern", [r"(ab|ba){1,3}[01]{1,2}", r"(a|b)*1", r"a?b{1,3}(0|10)?"])
def test_medusa_writes_what_greedy_under_the_oracle_does_and_sampling_what_plain_decoding_does(tiny, monkeypatch,
                                                                                               pattern, overlap):
    from medusa.decoding.engine import EngineConfig, LLMEngine

    model, heads = tiny
    spelled_by_tokens(monkeypatch)
    engine = lambda h: LLMEngine(model, h, EngineConfig(num_blocks=128, block_size=4))  # noqa: E731
    ps = random_prompts(6, VOCAB, 12, seed=3)
    params = SamplingParams(max_tokens=10, guided_regex=pattern, stop_token_ids=(END,))
    outs = engine(heads).generate(ps, params)
    for p, out in zip(ps, outs):
        want = reference_guided(model, p, pattern, 10)
        assert out.token_ids == [t for t in want if t != END], p
        text = "".join(TOKENS[t] for t in out.token_ids)
        assert re.fullmatch(pattern, text) if out.finish_reason == "stop" else viable(pattern, text)
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    assert any(o.finish_reason == "stop" for o in outs)
    sampled = replace(params, temperature=1.0, seed=7, n=2)
    medusa, plain = engine(heads).generate(ps, sampled), engine(None).generate(ps, sampled)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]
    for out in medusa:
        text = "".join(TOKENS[t] for t in out.token_ids)
        assert re.fullmatch(pattern, text) if out.finish_reason == "stop" else viable(pattern, text)


def test_the_default_tokenizer_spells_a_match_and_nothing_that_leaves_it(default_model_dir):
    from transformers import AutoTokenizer

    from medusa.decoding.engine_request import token_rules

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    rules = token_rules(tokenizer, SamplingParams(guided_regex=r"[A-Z][a-z]+, \d{3}-\d{4}\."), {2})
    guide, state = rules.guide.guide, rules.guide.guide.start
    for token in tokenizer.encode("Alice, 555-0199.", add_special_tokens=False):
        assert guide.allowed(state)[token]
        state = guide.advance(state, token)
    allowed = guide.allowed(state)
    assert allowed[2] and allowed.sum() == 1  # whole: only the end is left
    first = guide.allowed(guide.start).nonzero().flatten().tolist()
    texts = tokenizer.convert_ids_to_tokens(first)
    assert first and all(re.fullmatch(r"[A-Z][a-z]*(,( (\d{1,3})?)?)?", t) for t in texts), texts
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        token_rules(tokenizer, SamplingParams(guided_regex="a", allowed_token_ids=(5, 6)), {2})


def test_without_the_detokenizer_table_the_guide_still_reads_byte_level_pieces(default_model_dir, monkeypatch):
    """Where the detokenizer's byte table is refused (another tokenizers version decoded some id differently:
    session 38's GPU, whose guide found no token for a space and ended a phone number at "(228)"), the guide
    reads the vocabulary through GPT-2's byte alphabet: the same texts, never "Ġ" for a space."""
    from transformers import AutoTokenizer

    from medusa.decoding import byte_level
    from medusa.decoding.token_guide import token_texts

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    with_table = token_texts(tokenizer)
    monkeypatch.setattr(byte_level, "byte_table", lambda *a, **k: None)
    without = token_texts(tokenizer)
    space = tokenizer.encode("(228) 9", add_special_tokens=False)[5]
    assert without[space] == " " and without == with_table
    assert not any(text and "Ġ" in text for text in without)


def test_a_state_no_token_continues_is_reported():
    """A vocabulary that cannot spell the pattern's next character (here a space) leaves a row nothing but to
    end without a match: the guide warns, once, instead of failing quietly."""
    guide = RegexGuide(compile_regex("ab c"), VocabTrie(["a", "b", "c", None]), [3])
    state = guide.dfa.walk(guide.start, "ab")
    with pytest.warns(UserWarning, match="no token of the vocabulary continues the text"):
        assert not guide.allowed(state).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide.allowed(state)  # kept: no second warning
        assert guide.allowed(guide.start)[0]


@pytest.mark.slow
def test_the_default_model_answers_in_the_pattern_with_medusa_as_without(default_model_dir):
    from medusa.medusa_model import MedusaModel

    model = MedusaModel.from_pretrained(device="cpu")
    prompt = model.encode([{"role": "user", "content": "Give me a phone number for the bakery."}])
    params = SamplingParams(max_tokens=24, guided_regex=r"\(\d{3}\) \d{3}-\d{4}")
    medusa = without_policy(model.engine()).generate([prompt], params)[0]  # trees every step
    plain = model.engine(speculative=False).generate([prompt], params)[0]
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", medusa.text) and medusa.finish_reason == "stop"
    assert medusa.token_ids == plain.token_ids


def test_forced_text_is_spelled_longest_entry_first_and_stops_where_matches_part():
    guide = RegexGuide(compile_regex(r"aab(0|1)ab01(a|b)"), VocabTrie(TOKENS), [])
    assert [TOKENS[t] for t in guide.forced_tokens(guide.start, 8)] == ["aab"]
    assert guide.forced_tokens(guide.start, 0) == ()
    after = guide.dfa.walk(guide.start, "aab1")
    assert [TOKENS[t] for t in guide.forced_tokens(after, 8)] == ["ab", "01"]
    assert guide.forced_tokens(guide.dfa.walk(guide.start, "aab"), 8) == ()  # 0 or 1: not forced
    assert guide.forced_tokens(guide.dfa.walk(after, "ab01a"), 8) == ()  # whole: the end may follow


def test_forced_tokens_on_the_lookup_chain_are_accepted_and_change_no_token(tiny, monkeypatch, overlap):
    """A guided row's forced text rides the tree's lookup chain: fewer steps, the same tokens (greedy and seeded)."""
    from medusa.decoding.engine import EngineConfig, LLMEngine

    model, heads = tiny
    spelled_by_tokens(monkeypatch)
    pattern = r"aab(0|1)ab01(a|b)10ab(0|1)aab1"
    engine = lambda: LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4, prompt_lookup=4))  # noqa: E731
    ps = random_prompts(4, VOCAB, 12, seed=5)
    for params in (SamplingParams(max_tokens=16, guided_regex=pattern, stop_token_ids=(END,)),
                   SamplingParams(max_tokens=16, guided_regex=pattern, stop_token_ids=(END,), temperature=1.0, seed=3)):
        forced = engine().generate(ps, params)
        with monkeypatch.context() as patched:
            patched.setattr(RegexGuide, "forced_tokens", lambda self, state, limit: ())
            free = engine().generate(ps, params)
        assert [o.token_ids for o in forced] == [o.token_ids for o in free]
        assert all(re.fullmatch(pattern, "".join(TOKENS[t] for t in o.token_ids)) for o in forced)
        assert sum(o.stats.steps for o in forced) < sum(o.stats.steps for o in free)
        assert sum(o.stats.accepted_from_lookup for o in forced) > sum(o.stats.accepted_from_lookup for o in free)


def test_forced_text_past_the_step_in_flight_is_laid_by_overlapped_steps(tiny, monkeypatch):
    """Forced runs longer than a step emits: a step launched before the previous one is read back lays the forced
    tokens from where that step ends (the device checks the tokens it emitted are the forced ones), so guided
    rows on a lookup tree overlap and still ride their forced text; the same tokens as without it."""
    from medusa.decoding.engine import EngineConfig, LLMEngine

    model, heads = tiny
    spelled_by_tokens(monkeypatch)
    pattern = r"aab01b1ba10ab(0|1)ba10b1aab01ab(a|b)b1ab10"
    launched = []
    launch = LLMEngine._launch
    monkeypatch.setattr(LLMEngine, "_launch", lambda self, *a, **k: launched.append(1) or launch(self, *a, **k))

    def run():
        engine = LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4, prompt_lookup=4))
        engine.overlap = True
        launched.clear()
        outs = engine.generate(random_prompts(3, VOCAB, 12, seed=8), params)
        return outs, len(launched)

    params = SamplingParams(max_tokens=30, guided_regex=pattern, stop_token_ids=(END,))
    forced, overlapped = run()
    with monkeypatch.context() as patched:
        patched.setattr(RegexGuide, "forced_tokens", lambda self, state, limit: ())
        free, _ = run()
    assert [o.token_ids for o in forced] == [o.token_ids for o in free]
    assert all(re.fullmatch(pattern, "".join(TOKENS[t] for t in o.token_ids)) for o in forced)
    assert overlapped >= max(o.stats.steps for o in forced) // 2  # half the steps or more overlap
    assert sum(o.stats.accepted_from_lookup for o in forced) >= sum(o.stats.accepted_from_lookup for o in free) + 6
    assert sum(o.stats.steps for o in forced) < sum(o.stats.steps for o in free)


def test_a_model_vocabulary_padded_past_the_tokenizers_never_writes_the_padding():
    from medusa.decoding.logits_processing import penalize

    guide = RegexGuide(compile_regex(r"(ab)+"), VocabTrie(TOKENS), [3])
    rules = TokenRules(ends=(3,), guide=GuideProgress(guide))
    logits = torch.zeros(1, len(TOKENS) + 5)
    logits[0, len(TOKENS):] = 9.0  # padding rows the tokenizer has no token for
    masked = penalize(SamplingParams(guided_regex=r"(ab)+"), [4], logits, rules=rules)
    assert masked.shape == logits.shape and torch.isneginf(masked[0, len(TOKENS):]).all()
    assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == {0, 4, 3}  # "a", "ab", the end


def test_guides_applied_to_many_rows_at_once_equal_each_row_penalized_alone():
    """The engine's batched guide path (`follow_guides`) against `penalize` row by row, on a tree with lookup
    nodes: rows with different patterns, outputs, candidates and ends; fresh random logits per row."""
    from medusa.decoding.device_tree import DeviceTree
    from medusa.decoding.logits_processing import follow_guides, penalize
    from medusa.tree import TreeSpec

    tree = DeviceTree.from_spec(TreeSpec.load("tree-16").with_lookup(3), torch.device("cpu"))
    n, vocab, rng = tree.num_nodes, len(TOKENS) + 3, random.Random(0)  # two ends and a padding row
    cases = [(r"(ab|ba)+[01]{1,3}", [4], (11,)), (r"a*b?x", [], (12,)), (r"[01]+", [2, 3, 2], (11, 12)),
             (r"(ab)+", [4, 4], (11,))]
    rules, outputs, rows = [], [], []
    for pattern, output, ends in cases:
        guide = RegexGuide(compile_regex(pattern), VocabTrie(TOKENS + [None, None]), list(ends))
        rules.append(TokenRules(ends=ends, guide=GuideProgress(guide)))
        outputs.append(output)
        rows.append(torch.tensor([rng.randrange(len(TOKENS)) for _ in range(n)]))
    logits = torch.randn(len(cases), n, vocab, dtype=torch.bfloat16)
    logits[1, :, len(TOKENS):] = float("-inf")  # row 1 may not end: its nodes the guide allows only an end are stuck
    batched = follow_guides(logits, rules, outputs, tree, torch.stack(rows))
    for i, (pattern, output, _) in enumerate(cases):
        alone = penalize(SamplingParams(guided_regex=pattern), output, logits[i], tree, rows[i], rules=rules[i])
        assert batched.dtype == alone.dtype == torch.float32
        assert torch.equal(batched[i], alone), pattern
    assert torch.isfinite(batched[1, :, 12]).any()  # row 1's stuck nodes may end, though its logits banned it


def test_a_node_its_guide_leaves_nothing_may_end_with_its_own_ends():
    from medusa.decoding.logits_processing import _mask_by_guides

    guide = RegexGuide(compile_regex(r"ab"), VocabTrie(TOKENS + [None, None]), [11, 12])
    after_a = guide.advance(guide.start, 0)
    logits = torch.randn(3, len(TOKENS) + 2)
    logits[:, 1] = float("-inf")  # "b", the one token the guide allows after "a", is banned by another rule
    masked = _mask_by_guides(logits, [guide] * 3, [after_a, after_a, guide.start], [(11,), (11, 12), (12,)])
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [11]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [11, 12]
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [0, 4]  # "a", "ab": not stuck, no end yet


def test_a_guide_that_drops_old_states_gives_the_same_moves(monkeypatch):
    import medusa.decoding.token_guide as token_guide

    pattern, texts = r"(ab|ba){1,3}[01]{1,2}", ["", "ab", "abba", "abbaab", "abba0", "ba01"]
    kept = RegexGuide(compile_regex(pattern), VocabTrie(TOKENS), [])
    want = [kept.allowed(kept.dfa.walk(kept.start, text)) for text in texts]
    assert len(kept._next) == len(texts)
    monkeypatch.setattr(token_guide, "MAX_STATES", 2)
    dropping = RegexGuide(compile_regex(pattern), VocabTrie(TOKENS), [])
    for text, mask in zip(texts * 2, want * 2):
        assert torch.equal(dropping.allowed(dropping.dfa.walk(dropping.start, text)), mask), text
    assert len(dropping._next) <= 2


def test_forced_chain_starts_where_the_step_in_flight_ends_and_only_on_its_forced_tokens():
    """`DecodeStep._forced_chain` on hand-made buffers: row 0's step in flight emitted 2 tokens, the forced ones
    (its chain: forced tokens 2..); row 1 emitted others (a spelling of its own: n-gram proposals kept); row 2
    nothing in flight (forced tokens from the first; past them, proposals); row 3 no forced text."""
    from types import SimpleNamespace

    from medusa.decoding.decode_step import DecodeStep

    history = torch.tensor([[9, 9, 5, 6, 0, 0, 0, 0], [9, 9, 5, 7, 0, 0, 0, 0], [9, 9, 9, 0, 0, 0, 0, 0],
                            [9, 9, 9, 0, 0, 0, 0, 0]])
    step = SimpleNamespace(device=torch.device("cpu"), history=history, history_len=torch.tensor([4, 4, 3, 3]),
                           forced=torch.tensor([[5, 6, 1, 2, 3, 4], [5, 6, 1, 2, 3, 4], [1, 2, 0, 0, 0, 0],
                                                [0, 0, 0, 0, 0, 0]]),
                           forced_len=torch.tensor([6, 6, 2, 0]))
    lookup = torch.full((4, 3), 8)
    chain = DecodeStep._forced_chain(step, lookup, torch.arange(4), torch.tensor([2, 2, 0, 0]))
    assert chain.tolist() == [[1, 2, 3], [8, 8, 8], [1, 2, 8], [8, 8, 8]]


def test_candidates_copied_ahead_of_part_one_are_the_steps_own(tiny, monkeypatch, overlap):
    """Guided rows walk their guides from the candidates `DecodeStep.candidates_to_host` makes before part 1 runs
    (so the walk overlaps the forward); they must be the very tokens part 1 verifies, forced chains included,
    and the host must not read part 1's own."""
    from medusa.decoding.decode_step import DecodeStep
    from medusa.decoding.engine import EngineConfig, LLMEngine

    model, heads = tiny
    spelled_by_tokens(monkeypatch)
    copied, compared = [], []
    ahead, forward = DecodeStep.candidates_to_host, DecodeStep.forward

    def candidates_to_host(self, tree, padded):
        copied.append(ahead(self, tree, padded))
        return copied[-1]

    def checked_forward(self, tree, padded):
        part1 = forward(self, tree, padded)
        if copied:
            compared.append(torch.equal(copied.pop().host, part1.candidates))
        return part1

    import medusa.decoding.logits_processing as processing

    follow, walked_from_copies = processing.follow_guides, []

    def follow_guides(*args):
        walked_from_copies.append(args[-1] is not None)  # the host tokens, not part 1's candidates read back
        return follow(*args)

    monkeypatch.setattr(DecodeStep, "candidates_to_host", candidates_to_host)
    monkeypatch.setattr(DecodeStep, "forward", checked_forward)
    monkeypatch.setattr(processing, "follow_guides", follow_guides)
    pattern = r"aab01b1ba10ab(0|1)ba10b1aab01ab(a|b)b1ab10"
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4, prompt_lookup=4))
    params = SamplingParams(max_tokens=30, guided_regex=pattern, stop_token_ids=(END,))
    outs = engine.generate(random_prompts(3, VOCAB, 12, seed=8), params)
    assert all(re.fullmatch(pattern, "".join(TOKENS[t] for t in o.token_ids)) for o in outs)
    assert len(compared) >= 5 and all(compared)
    assert len(walked_from_copies) >= 5 and all(walked_from_copies)


def test_masks_gathered_from_the_table_equal_each_states_own(monkeypatch):
    """`RegexGuide.masks`: many nodes' masks in one gather from a table of the states' masks, which grows as states
    come and starts over past MAX_STATES; two guides' rows mixed in one step (`_guide_masks`)."""
    from medusa.decoding import token_guide
    from medusa.decoding.logits_processing import _guide_masks

    monkeypatch.setattr(token_guide, "MAX_STATES", 40)
    guide = RegexGuide(compile_regex(r"[ab]{0,40}1"), VocabTrie(TOKENS), [3])  # a state a length: 42 of them
    other = RegexGuide(compile_regex(r"(0|1)+b"), VocabTrie(TOKENS), [3])
    states = [guide.dfa.walk(guide.start, "ab" * 20 + "1")] + [guide.dfa.walk(guide.start, "a" * k) for k in range(41)]
    assert len(set(states)) == 42
    sizes = []
    for round_ in range(5):  # repeats, new states, a table that grows, then (40 rows at most) starts over
        picks = [states[(i + 8 * round_) % len(states)] for i in range(14)] + [states[0]] * 3
        want = torch.stack([guide.allowed(state) for state in picks])
        assert torch.equal(guide.masks(picks), want)
        sizes.append(len(guide._tables[torch.device("cpu")].rows))
    assert sizes == [14, 22, 30, 38, 14]
    mixed = [guide, other, guide, other, other]
    at = [states[1], other.dfa.walk(other.start, "01"), states[0], other.start, other.dfa.walk(other.start, "1")]
    want = torch.stack([g.allowed(state) for g, state in zip(mixed, at)])
    assert torch.equal(_guide_masks(mixed, at, torch.device("cpu")), want)


def test_guide_states_built_in_a_step_are_no_cost_the_tree_policy_is_told(tiny, monkeypatch, overlap):
    """A guide state is built once (its moves, mask, forced text) and kept: the policy times steps by a clock that
    leaves those builds out, as it leaves out graph captures. A guided tree walks every node's state, so its trial
    steps, among the first of a level, met many new ones; charged them, trees stayed off (session 44). Here each
    state costs 60 ms more to build: told by the wall clock, the policy sees those steps; by its own, none."""
    import time
    import medusa.decoding.engine as engine_module
    from medusa.decoding import token_guide
    from medusa.decoding.engine import EngineConfig, LLMEngine
    from test_engine_overlap import measured_everywhere

    model, heads = tiny
    spelled_by_tokens(monkeypatch)  # a fresh guide a request: its states are built in its steps
    walk = token_guide._ClassWalk.run
    monkeypatch.setattr(token_guide._ClassWalk, "run", lambda self, *a: time.sleep(0.06) or walk(self, *a))
    params = SamplingParams(max_tokens=8, guided_regex=r"(ab|ba){1,3}[01]{1,2}", stop_token_ids=(END,))

    def slowest_charge():
        engine = LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4))
        measured_everywhere(engine)
        seconds, observe = [], engine.policy.observe_step
        engine.policy.observe_step = lambda *a, **kw: seconds.append(a[2]) or observe(*a, **kw)
        built = token_guide.build_seconds()
        engine.generate(random_prompts(4, VOCAB, 12, seed=3), params)
        assert token_guide.build_seconds() - built >= 0.06 * 8 and len(seconds) >= 4
        return max(seconds)

    with monkeypatch.context() as patched:
        patched.setattr(engine_module, "cost_clock", time.perf_counter)
        by_wall = slowest_charge()
    assert by_wall >= 0.06 > slowest_charge()


@pytest.mark.parametrize("pattern", [r'"[ab01 ]{0,40}"x?', r"(ab|ba)+[01]{1,3}", r"[^x]*x", r"a{3}b{2,5}(0|1)*"])
def test_every_text_walked_at_once_reaches_what_its_own_walk_through_the_dfa_does(pattern):
    """`_ClassWalk.run` walks all texts together, longest first, the dead ones on in DEAD's row; each reached
    state equals the text's own character walk. Texts of 1-12 characters (past the early exit every 4th one),
    empty and None texts, every state a counted string reaches."""
    from medusa.decoding.token_guide import _ClassWalk

    rng = random.Random(pattern)
    texts = ["".join(rng.choice('ab01" x') for _ in range(rng.randint(1, 12))) for _ in range(600)] + ["", None]
    dfa, trie = compile_regex(pattern), VocabTrie(texts)
    walk, states, seen = _ClassWalk(dfa, trie), [dfa.start], {dfa.start}
    while states and len(seen) < 80:  # the states the alphabet reaches, breadth first
        state = states.pop(0)
        for char in 'ab01" x':
            after = dfa.step(state, char)
            if after != DEAD and after not in seen:
                seen.add(after)
                states.append(after)
    for state in sorted(seen):
        want = [dfa.walk(state, text) if text else DEAD for text in texts]
        assert walk.run(state, len(texts)).tolist() == want, state
