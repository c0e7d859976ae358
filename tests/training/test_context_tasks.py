"""Context-task prompts: builders, seeding, config checks, cache knobs, and self-distillation end to end."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from medusa.decoding.static_batch import generate_padded
from medusa.training import distill
from medusa.training.config import CONTEXT_TASK_KINDS, DataSection, load_config
from medusa.training.context_tasks import (
    CONTEXT_RULES, ContextPrompt, back_translation_prompts, build_context_prompts, clip_text, context_knobs,
    finished_text, first_sentence, is_short_question, kind_counts, written_questions,
)
from medusa.training.distill import distill_knobs, self_distill
from medusa.training.prompt_mix import gather_prompts
from test_data import write_jsonl
from tiny_models import tiny_decoder

SYSTEM = "Be brief."
EOS = [2]  # <|im_end|> of the conftest tokenizer
WORDS = ("river mountain garden window village teacher market harbor forest lantern bridge meadow "
         "castle orchard library station valley island kitchen tower").split()


def prose(i: int, words: int) -> str:
    """Text number i: `words` made-up words, all distinct (real prose is not degenerate), 8 to a sentence."""
    syllables = ("ba", "ko", "mi", "ru", "te", "lo", "sa", "ne", "vi", "du", "pa", "ge")
    made = ["".join(syllables[(i * 1000 + k) // 12 ** d % 12] for d in range(3)) for k in range(words)]
    return " ".join(" ".join(made[s:s + 8]).capitalize() + "." for s in range(0, words, 8))


def texts(num: int = 12, words: int = 96):
    users = [f"Tell me about the {WORDS[i]} please, in detail." for i in range(num)]
    return users, [prose(i, words) for i in range(num)]


def all_kinds(total: int) -> dict[str, int]:
    return kind_counts(total, CONTEXT_TASK_KINDS)


# ---- counts, texts --------------------------------------------------------------------------------


def test_kind_counts_share_the_total():
    counts = kind_counts(3000, CONTEXT_TASK_KINDS)
    assert counts == {"summarize": 750, "rag": 750, "translate": 375, "qa": 750, "translate_back": 375}
    assert kind_counts(10, ("rag", "qa", "summarize")) == {"rag": 4, "qa": 3, "summarize": 3}
    assert sum(kind_counts(7, CONTEXT_TASK_KINDS).values()) == 7


def test_sentences_questions_and_clipping(chat_tokenizer):
    assert first_sentence("The cat sat on the warm mat. Then it slept.") == "The cat sat on the warm mat."
    assert first_sentence("Sure! Here is a plan for you.") is None  # first sentence too short
    assert first_sentence("**Step 1:** mix the flour with the water.") is None  # markdown
    assert first_sentence("A list:\n- one two three four five six seven.") is None
    opening = "Paul lives in a flat on the fifth floor of a tower. How far does he walk?"
    assert first_sentence(opening, more_follows=True) == "Paul lives in a flat on the fifth floor of a tower."
    assert first_sentence("Select the longest sentence in the paragraph below.\n\nIt rains.", more_follows=True) is None
    assert is_short_question("Who played anna in once upon a time?")
    assert not is_short_question("James writes letters.  How many pages does he write?")  # two sentences
    assert not is_short_question("How many pages are in 3 books?")  # numbers: math
    assert not is_short_question("Write a poem about autumn leaves.")
    long = prose(0, 200)
    clipped = clip_text(chat_tokenizer, long, 300)  # one token per character
    assert long.startswith(clipped) and 150 < len(clipped) <= 300 and clipped.endswith(".")
    assert clip_text(chat_tokenizer, "Short.", 300) == "Short."


def test_finished_text_drops_unfinished_and_degenerate(chat_tokenizer):
    tok = chat_tokenizer

    def ids(text, end=True):
        return tok(text, add_special_tokens=False)["input_ids"] + (EOS if end else [])

    assert finished_text(tok, ids("Das Haus ist sehr alt."), EOS) == "Das Haus ist sehr alt."
    assert finished_text(tok, ids("Das Haus ist sehr alt.", end=False), EOS) is None
    assert finished_text(tok, ids("ja ja ja ja ja ja ja ja ja ja"), EOS) is None
    assert finished_text(tok, [], EOS) is None


# ---- builders ---------------------------------------------------------------------------------------


def test_rag_prompts_hold_the_answering_document_and_its_question(chat_tokenizer):
    users, answers = texts()
    prompts = build_context_prompts(chat_tokenizer, users, answers, {"rag": 30}, seed=0)
    assert len(prompts) == 30 and {p.kind for p in prompts} == {"rag"}
    positions = []
    for p in prompts:
        asked = [i for i, u in enumerate(users) if u in p.text]
        assert len(asked) == 1
        documents = re.split(r"(?:Document \[\d\] |Passage \d:\n)", p.text)[1:]
        assert users[asked[0]] in documents[-1]  # the question comes after the documents
        low, high = CONTEXT_RULES["rag_documents"]
        assert low <= len(documents) <= high
        found = [n for n, d in enumerate(documents) if d.startswith(answers[asked[0]][:100])]
        assert len(found) == 1  # exactly one document is the question's own answer
        positions.append(found[0])
        numbers = [int(a or b) for a, b in re.findall(r"Document \[(\d)\]|Passage (\d):", p.text)]
        assert numbers == list(range(1, len(documents) + 1))
    assert len(set(positions)) > 1  # shuffled: the answering document is not always first


def test_summarize_prompts_use_long_texts_only(chat_tokenizer):
    users, answers = texts()
    answers[0] = "A short answer of a few words only."
    prompts = build_context_prompts(chat_tokenizer, users, answers, {"summarize": 20}, seed=0)
    assert len(prompts) == 20
    for p in prompts:
        assert "ummar" in p.text or "TL;DR" in p.text
        assert "A short answer" not in p.text
        assert any(a[:60] in p.text for a in answers[1:])
        assert len(p.text) <= CONTEXT_RULES["passage_max_tokens"] + 80  # clipped (one token per character)
    assert any(p.text.startswith("Summarize: ") for p in prompts)  # Spec-Bench's own phrasing is among them


def test_translate_prompts_and_the_back_translation_pass(chat_tokenizer):
    users, answers = texts()
    first = build_context_prompts(chat_tokenizer, users, answers, {"translate": 40}, seed=0)
    sentences = {first_sentence(t) for t in answers} - {None}
    assert len(first) == 40
    for p in first:
        assert p.kind == "translate" and p.language in ("German", "French", "Spanish") and p.language in p.text
        assert any(s in p.text for s in sentences)
    assert Counter(p.language for p in first).most_common(1)[0][0] == "German"
    outputs = [f"Der Satz Nummer {i} ist jetzt auf Deutsch geschrieben." for i in range(len(first))]
    outputs[0], outputs[1] = None, None  # unfinished or degenerate: dropped
    outputs[2] += "\nIn German, the sentence translates to the above."  # a comment after the translation
    back = back_translation_prompts(first, outputs, count=100, seed=0)
    assert len(back) == len(first) - 2
    by_text = {text.split("\n")[0]: p.language for p, text in zip(first, outputs) if text}
    for p in back:
        assert p.kind == "translate_back" and ("to English" in p.text or "into English" in p.text)
        source = [t for t in by_text if p.text.endswith(t)]
        assert len(source) == 1 and by_text[source[0]] == p.language  # translated back from its own language
    commented = [p for p in back if "Nummer 2 ist" in p.text]
    assert len(commented) == 1 and commented[0].text.endswith("geschrieben.")  # only a translation's first line
    assert len(back_translation_prompts(first, outputs, count=5, seed=0)) == 5
    others = [ContextPrompt("qa", "Who is it?")]
    assert back_translation_prompts(others, ["Er ist es."], count=5, seed=0) == []  # only translations go back


def test_qa_prompts_reword_short_questions_and_never_copy_a_prompt(chat_tokenizer):
    users, answers = texts()
    users[:2] = ["who built the old stone bridge?", "What is 7 times 8?"]
    written = ["Where is the tallest tower?"]
    prompts = build_context_prompts(chat_tokenizer, users, answers, {"qa": 30}, seed=0, written=written)
    assert 0 < len(prompts) <= 2 * 5  # two usable questions x five templates, no duplicates
    assert len({p.text for p in prompts}) == len(prompts) and users[0] not in {p.text for p in prompts}
    for p in prompts:
        assert "old stone bridge" in p.text or "tallest tower" in p.text.lower()
        assert "7 times 8" not in p.text


def test_written_questions_keep_finished_short_questions(chat_tokenizer):
    tok = chat_tokenizer
    outputs = [" is the capital of Peru?", " is the capital of Peru?", " wrote", " was it. Then what?", " ?"]
    ids = [tok(o, add_special_tokens=False)["input_ids"] + EOS for o in outputs]
    ids[2] = ids[2][:-1]  # unfinished
    kept = written_questions(tok, ["What", "What", "Who", "When", "Why"], ids, EOS)
    assert kept == ["What is the capital of Peru?"]


def test_prompts_are_seeded_and_kinds_independent(chat_tokenizer):
    users, answers = texts()
    one = build_context_prompts(chat_tokenizer, users, answers, all_kinds(24), seed=0)
    assert [p.text for p in one] == [p.text for p in build_context_prompts(chat_tokenizer, users, answers,
                                                                           all_kinds(24), seed=0)]
    assert [p.text for p in one] != [p.text for p in build_context_prompts(chat_tokenizer, users, answers,
                                                                           all_kinds(24), seed=1)]
    rag_only = build_context_prompts(chat_tokenizer, users, answers, {"rag": all_kinds(24)["rag"]}, seed=0)
    assert [p.text for p in one if p.kind == "rag"] == [p.text for p in rag_only]


# ---- config and cache knobs -----------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("data.context_tasks=-1", "data.context_tasks must be >= 0"),
    ("data.context_tasks=lots", "data.context_tasks must be an int"),
    ("data.context_task_kinds=[rag, poems]", r"data.context_task_kinds: unknown kind\(s\) \['poems'\]"),
    ("data.context_task_kinds=[]", "data.context_task_kinds must list each kind once"),
    ("data.context_task_kinds=[rag, rag]", "data.context_task_kinds must list each kind once"),
    ("data.context_task_kinds=rag", "data.context_task_kinds must be a list"),
])
def test_bad_context_settings_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_context_config_forms_and_recipe():
    config = load_config(None, ["data.context_tasks=40", "data.context_task_kinds=[qa, rag]"])
    assert config.data.context_task_kinds == ("qa", "rag")
    from medusa.training.config import TrainConfig
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # train_config.json
    recipe = load_config("medusa1-smollm2-context")
    diverse = load_config("medusa1-smollm2-diverse")
    assert recipe.data.context_tasks == 3000 and recipe.data.context_task_kinds == CONTEXT_TASK_KINDS
    assert recipe.data.sources == diverse.data.sources and recipe.heads == diverse.heads
    # the diverse mix as measured with context tasks (session 5): 4000 self-written prompts, 7 epochs
    assert (recipe.data.self_prompts, recipe.train.epochs) == (4000, 7)


def test_context_knobs_only_when_on():
    base = DataSection(sources=["a.jsonl"])
    off_other_kinds = DataSection(sources=["a.jsonl"], context_task_kinds=["rag"])
    assert context_knobs(base) == {} and context_knobs(off_other_kinds) == {}
    assert distill_knobs(off_other_kinds) == distill_knobs(base)
    on = DataSection(sources=["a.jsonl"], context_tasks=100)
    assert distill_knobs(on) == distill_knobs(base)  # the shared (held-out) knobs never carry them
    knobs = [context_knobs(on), context_knobs(DataSection(sources=["a.jsonl"], context_tasks=200)),
             context_knobs(DataSection(sources=["a.jsonl"], context_tasks=100, context_task_kinds=["rag"]))]
    assert all(knobs[i] != knobs[j] for i in range(3) for j in range(i))
    assert knobs[0]["context_rules"] == CONTEXT_RULES and "Summarize: {passage}" in str(knobs[0])


# ---- end to end -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_model():
    return tiny_decoder(vocab=99, logit_scale=3, max_positions=2048)[0]  # room for ~1k-token prompts


def scripted_generation(tok, file_prompts: set[str], calls: Counter):
    """generate_padded for the tests: prose answers to the file prompts, German sentences to translate
    prompts, questions after a question word; the tiny model itself for everything else."""
    def fake(model_, prompts, max_new_tokens, sampling, eos_ids=(), generator=None):
        texts, rest = {}, []
        for row, prompt in enumerate(prompts):
            text = tok.decode(list(prompt))
            user = text.rsplit("<|im_start|>user\n", 1)[1]
            question_word = not text.endswith("<|im_start|>assistant\n")
            calls["rows"] += 1
            if question_word:
                calls["questions"] += 1
                texts[row] = f" is the {WORDS[calls['questions'] % len(WORDS)]} of the north?"
            elif user.split("<|im_end|>")[0] in file_prompts:
                texts[row] = prose(calls["rows"], 96)
            elif user.startswith(("Translate English to", "Translate the following sentence into")):
                texts[row] = f"Der {WORDS[calls['rows'] % len(WORDS)]} ist sehr alt und schon."
            else:
                rest.append(row)
        out = {row: tok(t, add_special_tokens=False)["input_ids"] + list(eos_ids) for row, t in texts.items()}
        if rest:
            calls["model_rows"] += len(rest)
            made = generate_padded(model_, [prompts[r] for r in rest], max_new_tokens, sampling, eos_ids, generator)
            out.update(zip(rest, made))
        return [out[row] for row in range(len(prompts))]
    return fake


def test_self_distill_adds_context_sequences_and_caches_them(long_model, chat_tokenizer, tmp_path, monkeypatch):
    tok = chat_tokenizer
    questions = [f"Tell me about the {w} please, in detail." for w in WORDS[:8]]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": q} for q in questions])
    monkeypatch.setattr(distill, "generate_padded", scripted_generation(tok, set(questions), Counter()))

    def run(**knobs):
        settings = DataSection(sources=[{"path": str(path), "samples_per_prompt": 0}], max_new_tokens=6,
                               holdout_fraction=0.25, distill_batch_size=5, **knobs)
        return self_distill(long_model, tok, gather_prompts(settings, 0), "tiny", settings, tmp_path / "c", 0,
                            SYSTEM, EOS)

    plain, held = run()
    manifest = json.loads((tmp_path / "c" / "train" / "manifest.json").read_text())
    assert set(manifest["settings"]) == {  # off: the manifest of before context tasks existed
        "followup_fraction", "holdout_fraction", "limit", "max_new_tokens", "sample_temperature",
        "samples_per_prompt", "self_prompts", "sources", "seed", "system_prompt", "split"}
    held_file = tmp_path / "c" / "heldout" / "sequences.safetensors"
    held_stamp = held_file.stat().st_mtime_ns

    calls = Counter()
    monkeypatch.setattr(distill, "generate_padded", scripted_generation(tok, set(questions), calls))
    train, held_again = run(context_tasks=16)
    assert len(plain) == 6 and len(train) == 6 + 16  # 4 summarize, 4 rag, 2 + 2 translate, 4 qa
    assert held_file.stat().st_mtime_ns == held_stamp and torch.equal(held_again.tokens, held.tokens)
    # the model answered the summaries, documents, questions and back-translations (not the scripted rest)
    assert calls["questions"] == 4 and calls["model_rows"] == 4 + 4 + 4 + 2
    users = [tok.decode(train[i][0][: train[i][1]].tolist()).rsplit("user\n", 1)[1] for i in range(6, 22)]
    back = [u for u in users if "to English" in u or "into English" in u]
    assert len(back) == 2 and all("Der " in u for u in back)  # stage B translates stage A's outputs
    assert max(len(train[i][0]) for i in range(6, 22)) > 400  # long contexts (one token per character)

    monkeypatch.setattr(distill, "generate_padded", lambda *a, **k: pytest.fail("generated despite the cache"))
    again, _ = run(context_tasks=16)
    assert torch.equal(again.tokens, train.tokens) and torch.equal(again.offsets, train.offsets)
