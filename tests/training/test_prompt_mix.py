"""The prompt mix: data.sources config forms, per-source caps and samples, follow-up turns, self-prompt rules."""

from __future__ import annotations

import pytest

from medusa.chat import chat_prompt_ids
from medusa.training.config import DataSection, SourceSpec, TrainConfig, load_config
from medusa.training.data import DATA_DIR, resolve_source
from medusa.training.distill import distill_knobs
from medusa.training.prompt_mix import (
    FOLLOWUPS, followup_prompt, gather_prompts, is_degenerate, open_user_turn_ids, pick_followups,
    select_self_prompts,
)
from test_data import write_jsonl


def prompt_files(tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", [{"question": f"What is {i} + {i}?"} for i in range(40)])
    tasks = write_jsonl(tmp_path / "si.jsonl", [
        {"instruction": "Sort.", "instances": [{"input": "b a", "output": ""}, {"input": "d c", "output": ""}]},
        {"instruction": "Tell a joke.", "instances": [{"input": "", "output": ""}]},
    ])
    return questions, tasks


# ---- config -------------------------------------------------------------------------------------


def test_old_plain_list_and_new_mapping_forms():
    old = load_config(None, ["data.sources=[a.jsonl,b.jsonl]"]).data
    assert old.sources == [SourceSpec("a.jsonl"), SourceSpec("b.jsonl")]
    new = load_config(None, ["data.sources=[{path: a.jsonl}, b.jsonl]"]).data
    assert new.sources == old.sources and distill_knobs(new) == distill_knobs(old)  # same cache
    mixed = load_config(None, ["data.sources=[{path: a.jsonl, max_prompts: 5, samples_per_prompt: 2}]"]).data
    assert mixed.sources == [SourceSpec("a.jsonl", max_prompts=5, samples_per_prompt=2)]
    config = load_config(None, ["data.sources=[{path: a.jsonl, max_prompts: 5}]", "data.followup_fraction=0.3"])
    assert TrainConfig.from_dict(config.to_dict()) == config  # train_config.json round trip
    assert load_config("medusa1-smollm2").data.sources is None  # the shipped recipe still loads
    diverse = load_config("medusa1-smollm2-diverse")
    assert diverse.data.sources[0] == SourceSpec("gsm8k_train.jsonl", max_prompts=2500, samples_per_prompt=0)
    assert diverse.data.self_prompts == 12000 and diverse.data.followup_fraction == 0.3
    assert (diverse.heads.num_layers, diverse.train.epochs, diverse.train.lr) == (2, 4, 2e-3)


@pytest.mark.parametrize("override, message", [
    ("data.sources=a.jsonl", "data.sources must be a list"),
    ("data.sources=[{max_prompts: 3}]", r"data.sources\[0\] must be a file name or a mapping"),
    ("data.sources=[a.jsonl, {path: b.jsonl, max_prompts: 0}]", r"data.sources\[1\]: max_prompts must be >= 1"),
    ("data.sources=[{path: b, samples_per_prompt: -1}]", r"data.sources\[0\]: samples_per_prompt"),
    ("data.sources=[{path: b, samples_per_prompt: many}]", r"data.sources\[0\].samples_per_prompt"),
    ("data.sources=[{path: b, max_prompt: 3}]", r"data.sources\[0\].max_prompt\b"),
    ("data.sources=[{path: ''}]", r"data.sources\[0\]: path"),
    ("data.followup_fraction=1.5", "data.followup_fraction"),
    ("data.self_prompts=-1", "data.self_prompts"),
    ("data.self_prompt_temperature=0", "data.self_prompt_temperature"),
    ("data.self_prompt_max_tokens=0", "data.self_prompt_max_tokens"),
    ("data.samples_per_prompt=-2", "data.samples_per_prompt"),
    ("data.limit=-1", "data.limit"),
    ("data.limit=0", "data.limit must be >= 1"),
    ("data.sources=[{path: b, columns: {questoin: query}}]", r"data.sources\[0\]: columns=.*exactly one prompt kind"),
    ("data.sources=[{path: b, columns: {question: q, input: c}}]", r"data.sources\[0\]: input/instances only go"),
    ("data.sources=[{path: b, columns: query}]", r"data.sources\[0\]: columns='query' must map"),
    ("data.sources=[{path: b, columns: {question: ''}}]", r"data.sources\[0\]: columns=.*must map"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_manifest_knobs_follow_the_settings():
    base = DataSection(sources=["a.jsonl"])
    assert distill_knobs(base) == distill_knobs(DataSection(sources=[{"path": "a.jsonl"}]))
    assert distill_knobs(base) == distill_knobs(DataSection(sources=["a.jsonl"], distill_batch_size=7))
    # self-prompt knobs only count when self-prompting is on
    assert distill_knobs(base) == distill_knobs(DataSection(sources=["a.jsonl"], self_prompt_temperature=0.5))
    changed = [DataSection(sources=[{"path": "a.jsonl", "max_prompts": 3}]),
               DataSection(sources=[{"path": "a.jsonl", "samples_per_prompt": 3}]),
               DataSection(sources=["a.jsonl"], followup_fraction=0.2),
               DataSection(sources=["a.jsonl"], self_prompts=10),
               DataSection(sources=["a.jsonl"], max_new_tokens=10)]
    knobs = [distill_knobs(base)] + [distill_knobs(d) for d in changed]
    assert all(knobs[i] != knobs[j] for i in range(len(knobs)) for j in range(i))
    on = DataSection(sources=["a.jsonl"], self_prompts=10)
    assert distill_knobs(on) != distill_knobs(DataSection(sources=["a.jsonl"], self_prompts=10,
                                                          self_prompt_temperature=0.5))
    assert distill_knobs(DataSection(followup_fraction=0.2))["followups"] == list(FOLLOWUPS)


# ---- gathering --------------------------------------------------------------------------------


def test_cap_is_reproducible_and_samples_are_per_source(tmp_path):
    questions, tasks = prompt_files(tmp_path)
    data = DataSection(sources=[{"path": str(questions), "max_prompts": 10, "samples_per_prompt": 0},
                                str(tasks)], samples_per_prompt=3)
    pool = gather_prompts(data, seed=0)
    assert len(pool.conversations) == 10 + 3  # 2 Self-Instruct inputs of "Sort." + the bare joke task
    assert pool.samples == [0] * 10 + [3] * 3
    assert pool.sources == [questions, tasks]
    capped = [c[0]["content"] for c in pool.conversations[:10]]
    numbers = [int(text.split()[2]) for text in capped]
    assert numbers == sorted(numbers)  # file order kept
    assert capped == [c[0]["content"] for c in gather_prompts(data, seed=0).conversations[:10]]
    assert capped != [c[0]["content"] for c in gather_prompts(data, seed=1).conversations[:10]]
    # another source in front does not change this source's subset
    alone = gather_prompts(DataSection(sources=[{"path": str(tasks)}, {"path": str(questions), "max_prompts": 10}]),
                           seed=0)
    assert [c[0]["content"] for c in alone.conversations[3:]] == capped
    uncapped = gather_prompts(DataSection(sources=[{"path": str(questions), "max_prompts": 100}]), seed=0)
    assert len(uncapped.conversations) == 40 and uncapped.samples == [1] * 40  # default samples_per_prompt


def test_a_recipe_maps_a_file_s_own_column_names(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"query": f"Why {i}?", "note": "x"} for i in range(3)])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  sources:\n    - path: {path}\n      columns: {{question: query}}\n")
    data = load_config(recipe).data
    assert data.sources == [SourceSpec(str(path), columns={"question": "query"})]
    pool = gather_prompts(data, seed=0)
    assert [c[0]["content"] for c in pool.conversations] == ["Why 0?", "Why 1?", "Why 2?"]
    with pytest.raises(ValueError, match="mine.jsonl: no prompt column; it has .'note', 'query'."):
        gather_prompts(DataSection(sources=[str(path)]), seed=0)  # without the mapping: the file is named
    with pytest.raises(ValueError, match=r"columns \['quest'\] not in the file"):
        gather_prompts(DataSection(sources=[{"path": str(path), "columns": {"question": "quest"}}]), seed=0)
    # the mapping is part of the distillation cache's key; a source without one keeps its old key
    plain = distill_knobs(DataSection(sources=[str(path)]))
    assert plain["sources"] == [{"path": str(path), "max_prompts": None, "samples_per_prompt": None}]
    assert distill_knobs(data) != plain


def test_bare_names_resolve_in_the_shared_data_dir(tmp_path, monkeypatch):
    assert resolve_source("gsm8k_train.jsonl") == DATA_DIR / "gsm8k_train.jsonl"
    assert resolve_source("nowhere.jsonl").name == "nowhere.jsonl"  # left alone: the loader says it is missing
    local = write_jsonl(tmp_path / "gsm8k_train.jsonl", [{"question": "local"}])
    monkeypatch.chdir(tmp_path)
    assert resolve_source("gsm8k_train.jsonl") == local.relative_to(tmp_path)  # the working directory wins
    with pytest.raises(ValueError, match="never train on it"):
        gather_prompts(DataSection(sources=["spec_bench.jsonl"]), seed=0)


# ---- follow-up turns ------------------------------------------------------------------------------


def test_pick_followups_fraction_and_seed():
    picked = pick_followups(100, 0.3, seed=0)
    assert len(picked) == 30 and all(0 <= i < 100 for i in picked)
    assert set(picked.values()) <= set(FOLLOWUPS) and len(set(picked.values())) > 5
    assert picked == pick_followups(100, 0.3, seed=0) and picked != pick_followups(100, 0.3, seed=1)
    assert pick_followups(10, 0.0, seed=0) == {} and len(pick_followups(10, 1.0, seed=0)) == 10


def test_followup_prompt_masks_only_the_first_answer(chat_tokenizer):
    tok = chat_tokenizer
    conversation = [{"role": "user", "content": "Name a colour."}]
    prompt = chat_prompt_ids(tok, conversation, "Be brief.")
    answer = tok("Blue, like the sky.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids, mask = followup_prompt(tok, conversation, prompt, answer, "Give another example.", "Be brief.")
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
                               "<|im_start|>assistant\nBlue, like the sky.<|im_end|>\n"
                               "<|im_start|>user\nGive another example.<|im_end|>\n<|im_start|>assistant\n")
    assert len(mask) == len(ids)
    trained = [i for i, m in enumerate(mask) if m]
    assert trained == list(range(len(prompt), len(prompt) + len(answer)))  # the answer and its end-of-turn
    assert [ids[i] for i in trained] == answer


# ---- self-prompting rules ---------------------------------------------------------------------------


def test_open_user_turn(chat_tokenizer):
    ids = open_user_turn_ids(chat_tokenizer, "Be brief.")
    assert chat_tokenizer.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert chat_tokenizer.decode(open_user_turn_ids(chat_tokenizer, None)) == "<|im_start|>user\n"


def test_self_prompt_drop_rules(chat_tokenizer):
    tok = chat_tokenizer
    eos = tok.eos_token_id

    def ids(text, end=True):
        return tok(text, add_special_tokens=False)["input_ids"] + ([eos] if end else [])

    good = ["How do I bake bread at home?", "Write a haiku about autumn leaves."]
    outputs = [ids(good[0]), ids("Hi there"), ids("How do I bake   BREAD at home?"),  # too short, duplicate
               ids("Plan a trip to Rome for me.", end=False),  # unfinished: no end-of-turn
               ids("the cat the cat the cat the cat the cat the cat"),  # looping words
               ids("Tell me hahahahahahahahahahaha now"),  # looping characters
               ids(good[1]), []]
    kept = select_self_prompts(tok, outputs, [eos])
    assert [tok.decode(k) for k in kept] == good
    assert not is_degenerate("What is 1000000 + 2000000?") and not is_degenerate("Is it 3 . . . or 4?")
