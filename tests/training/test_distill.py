"""Self-distillation on a tiny random model: sample counts, follow-up turns and their masks, self-prompts, cache."""

from __future__ import annotations

import pytest
import torch

from medusa.decoding.static_batch import generate_padded
from medusa.training import distill
from medusa.training.config import DataSection
from medusa.training.data import batches
from medusa.training.distill import self_distill, split_prompts, write_self_prompts
from medusa.training.prompt_mix import FOLLOWUPS, gather_prompts, is_degenerate, open_user_turn_ids
from test_data import write_jsonl
from tiny_models import tiny_decoder

SYSTEM = "Be brief."
EOS = [2]  # <|im_end|> of the conftest tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_decoder(vocab=99, logit_scale=3, max_positions=512)[0]


def data_section(tmp_path, **knobs) -> DataSection:
    math = write_jsonl(tmp_path / "math.jsonl", [{"question": f"{i} + {i} = ?"} for i in range(8)])
    tasks = write_jsonl(tmp_path / "tasks.jsonl",
                        [{"prompt": f"Write {w}."} for w in ("a poem", "a list", "a joke", "code")])
    settings = dict(max_new_tokens=6, holdout_fraction=0.25, distill_batch_size=5)
    return DataSection(sources=[{"path": str(math), "samples_per_prompt": 0},
                                {"path": str(tasks), "samples_per_prompt": 2}], **{**settings, **knobs})


def run(model, tok, tmp_path, settings: DataSection):
    pool = gather_prompts(settings, seed=0)
    return pool, self_distill(model, tok, pool, "tiny", settings, tmp_path / "cache", 0, SYSTEM, EOS)


def no_generation(*args, **kwargs):
    raise AssertionError("generated although the cache should have been used")


def test_samples_followups_masks_and_cache(model, chat_tokenizer, tmp_path, monkeypatch, caplog):
    tok = chat_tokenizer
    settings = data_section(tmp_path, followup_fraction=0.5)
    with caplog.at_level("INFO", logger="medusa.training.distill"):
        pool, (train, held) = run(model, tok, tmp_path, settings)
    train_idx, held_idx = split_prompts(12, 0.25, 0)
    sampled = sum(pool.samples[i] for i in train_idx)
    # said before generating: how much it will write, and how to write less
    assert (f"self-distilling 9 train prompts (9 greedy + {sampled} sampled answers + 4 follow-up turns) and 3 "
            "held-out prompts (greedy), up to 6 new tokens each, in batches of 5") in caplog.text
    assert "data.limit" in caplog.text
    assert len(held) == 3 and held.loss_mask is None  # held-out: one greedy single-turn answer each
    assert len(train) == 9 + sum(pool.samples[i] for i in train_idx)  # greedy + per-source samples
    two_turn = [i for i in range(len(train)) if tok.decode(train[i][0].tolist()).count("<|im_start|>user") == 2]
    assert len(two_turn) == round(9 * 0.5) and max(two_turn) < 9  # only greedy answers get a follow-up
    for i in two_turn:
        ids, prompt_len = train[i]
        mask = train.row_loss_mask(i, len(ids))
        assert not mask[:prompt_len].any() and mask[prompt_len] and mask[-1]  # first and second answers
        gap = torch.nonzero(~mask[prompt_len:]).flatten() + prompt_len  # the follow-up user turn
        assert len(gap) and bool((gap.diff() == 1).all())  # one contiguous untrained run
        user_turn = tok.decode(ids[gap].tolist())
        assert user_turn.endswith("<|im_start|>assistant\n") and any(f in user_turn for f in FOLLOWUPS)
    for batch in batches(train, 4096, seed=0, epoch=0):
        for row, i in enumerate(batch.indices.tolist()):
            n = int(batch.lengths[row])
            assert torch.equal(batch.loss_mask[row, :n], train.row_loss_mask(i, n))

    monkeypatch.setattr(distill, "generate_padded", no_generation)
    _, (again, held_again) = run(model, tok, tmp_path, settings)  # equal settings: the cache
    assert torch.equal(again.tokens, train.tokens) and torch.equal(again.loss_mask, train.loss_mask)
    with pytest.raises(AssertionError, match="generated"):
        run(model, tok, tmp_path, data_section(tmp_path, followup_fraction=0.25))  # changed knob: regenerate
    monkeypatch.setattr(distill, "generate_padded", generate_padded)
    _, (single, _) = run(model, tok, tmp_path, data_section(tmp_path))
    assert single.loss_mask is None and len(single) == len(train)


def test_the_held_out_split_alone_is_distilled_for_eval(model, chat_tokenizer, tmp_path, monkeypatch, caplog):
    """medusa-train eval reads only the held-out split: train=False answers its prompts alone (the train split's
    answers are most of the generation), the same sequences a full run caches."""
    settings = data_section(tmp_path)
    pool = gather_prompts(settings, seed=0)
    with caplog.at_level("INFO", logger="medusa.training.distill"):
        train, held = self_distill(model, chat_tokenizer, pool, "tiny", settings, tmp_path / "alone", 0, SYSTEM,
                                   EOS, train=False)
    assert "self-distilling 3 held-out prompts (greedy)" in caplog.text
    assert train is None and len(held) == 3 and not (tmp_path / "alone" / "train").exists()
    _, (_, full_held) = run(model, chat_tokenizer, tmp_path, settings)
    assert torch.equal(held.tokens, full_held.tokens)
    monkeypatch.setattr(distill, "generate_padded", no_generation)
    train, again = self_distill(model, chat_tokenizer, pool, "tiny", settings, tmp_path / "cache", 0, SYSTEM, EOS,
                                train=False)  # cached: nothing generated, the train split not read
    assert train is None and torch.equal(again.tokens, held.tokens)


def test_eval_answers_only_the_held_out_prompts_it_measures(model, chat_tokenizer, tmp_path, monkeypatch, caplog):
    """eval.max_sequences=N: without a full held-out cache only the first N held-out prompts are answered (the
    first N of the full split: batches of similar length, so the same greedy answers), cached apart; a full
    held-out split, once cached, is read instead."""
    settings = data_section(tmp_path)
    pool = gather_prompts(settings, seed=0)
    with caplog.at_level("INFO", logger="medusa.training.distill"):
        train, held = self_distill(model, chat_tokenizer, pool, "tiny", settings, tmp_path / "cache", 0, SYSTEM,
                                   EOS, train=False, heldout_limit=2)
    assert "self-distilling 2 held-out prompts (greedy)" in caplog.text
    assert train is None and len(held) == 2
    assert (tmp_path / "cache" / "heldout-first-2").is_dir() and not (tmp_path / "cache" / "heldout").exists()
    monkeypatch.setattr(distill, "generate_padded", no_generation)
    _, again = self_distill(model, chat_tokenizer, pool, "tiny", settings, tmp_path / "cache", 0, SYSTEM, EOS,
                            train=False, heldout_limit=2)  # cached: nothing generated
    assert torch.equal(again.tokens, held.tokens)
    monkeypatch.setattr(distill, "generate_padded", generate_padded)
    _, (_, full) = run(model, chat_tokenizer, tmp_path, settings)
    assert len(full) == 3 and torch.equal(full.select(range(2)).tokens, held.tokens)
    monkeypatch.setattr(distill, "generate_padded", no_generation)
    _, whole = self_distill(model, chat_tokenizer, pool, "tiny", settings, tmp_path / "cache", 0, SYSTEM, EOS,
                            train=False, heldout_limit=1)  # the full split is cached: no new answers for N=1
    assert len(whole) == 3


def test_self_prompts_join_the_pool_and_are_cached(model, chat_tokenizer, tmp_path, monkeypatch):
    tok = chat_tokenizer
    prefix = open_user_turn_ids(tok, SYSTEM)
    written = ["How do I bake bread at home?", "ok", "Plan a week of dinners.", "how do i bake bread at home?",
               "Explain rainbows to me.", "Tell tell tell tell tell tell tell tell me"]
    script = [tok(t, add_special_tokens=False)["input_ids"] + EOS for t in written]
    calls = {"prompts": 0}

    def fake(model_, prompts, max_new_tokens, sampling, eos_ids=(), generator=None):
        if sampling.temperature == 1.0:  # the self-prompting pass: every row starts from the open user turn
            assert all(list(p) == prefix for p in prompts) and max_new_tokens == 40
            calls["prompts"] += len(prompts)
            return [script.pop(0) for _ in prompts]
        return generate_padded(model_, prompts, max_new_tokens, sampling, eos_ids, generator)

    monkeypatch.setattr(distill, "generate_padded", fake)
    settings = data_section(tmp_path, self_prompts=6, self_prompt_max_tokens=40, holdout_fraction=0.0)
    pool, (train, held) = run(model, tok, tmp_path, settings)
    assert calls["prompts"] == 6 and len(held) == 0
    kept = ["How do I bake bread at home?", "Plan a week of dinners.", "Explain rainbows to me."]
    user_texts = [tok.decode(train[i][0][: train[i][1]].tolist()) for i in range(len(train))]
    for text in kept:
        assert sum(f"user\n{text}<|im_end|>" in u for u in user_texts) == 2  # greedy + data.samples_per_prompt=1
    assert len(train) == 12 + 3 + sum(pool.samples) + 3  # file prompts + self-prompts, greedy + sampled

    # A changed answer knob regenerates the answers but reuses the written prompts.
    _, (other, _) = run(model, tok, tmp_path, data_section(tmp_path, self_prompts=6, self_prompt_max_tokens=40,
                                                            holdout_fraction=0.0, max_new_tokens=4))
    assert calls["prompts"] == 6 and len(other) == len(train)


def test_self_prompts_from_the_real_generator(model, chat_tokenizer, tmp_path):
    settings = DataSection(self_prompts=8, self_prompt_max_tokens=12, distill_batch_size=8)
    convs = write_self_prompts(model, chat_tokenizer, "tiny", settings, tmp_path, 0, SYSTEM, EOS)
    assert len(convs) <= 8 and all(not is_degenerate(c[0]["content"]) for c in convs)
    assert (tmp_path / "self_prompts" / "manifest.json").is_file()
