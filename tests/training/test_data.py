"""Tests for medusa.training.data (prompt sources, Sequences, batches) and distill_cache."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest
import torch

from medusa.training.data import (
    DATA_DIR,
    DEFAULT_SOURCES,
    Sequences,
    batch_plan,
    batches,
    default_sources,
    load_conversations,
)
from medusa.training.distill_cache import KEPT_VERSIONS, load_cached, manifest_fingerprint, manifest_for, save_cached

SETTINGS = {"max_new_tokens": 64, "temperature": 0.0, "samples_per_prompt": 1, "seed": 0}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def random_sequences(n: int, seed: int = 0, max_len: int = 90) -> Sequences:
    rng = random.Random(seed)
    seqs, prompts = [], []
    for _ in range(n):
        prompt_len = rng.randint(0, 30)
        length = rng.randint(max(1, prompt_len), prompt_len + max_len)
        seqs.append([rng.randrange(1, 1000) for _ in range(length)])
        prompts.append(prompt_len)
    return Sequences.from_lists(seqs, prompts)


# ---- prompt sources -------------------------------------------------------------------


def test_messages_keep_up_to_last_user_turn(tmp_path):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    rows = [{"messages": conv}, {"messages": conv[:2]}, {"messages": [{"role": "assistant", "content": "x"}]}]
    got = load_conversations(write_jsonl(tmp_path / "m.jsonl", rows))
    assert got == [conv[:4], conv[:2]]  # the assistant-only row has no prompt: skipped


def test_turns_question_prompt(tmp_path):
    turns = write_jsonl(tmp_path / "t.jsonl", [{"turns": ["first", "second"], "question": "ignored"}])
    assert load_conversations(turns) == [user("first")]  # turns outranks question
    question = write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?", "answer": "Because."}])
    assert load_conversations(question) == [user("Why?")]
    prompt = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi", "completion": "hi"}])
    assert load_conversations(prompt) == [user("Say hi")]


def test_instruction_with_input_and_instances(tmp_path):
    path = write_jsonl(tmp_path / "i.jsonl", [{"instruction": "Translate.", "input": "Hallo"},
                                              {"instruction": "Tell a joke.", "input": ""}])
    assert load_conversations(path) == [user("Translate.\n\nHallo"), user("Tell a joke.")]
    # Self-Instruct layout: one prompt per distinct non-empty instance input (3 instances -> 2 prompts).
    path = write_jsonl(tmp_path / "s.jsonl", [
        {"instruction": "Sort these.", "instances": [{"input": "b, a", "output": "a, b"}, {"input": "z", "output": "z"},
                                                     {"input": " z ", "output": "z"}]},
        {"instruction": "Name a fruit.", "instances": [{"input": "", "output": "apple"}]},
        {"instruction": "Count.", "instances": [{"input": "", "output": "0"}, {"input": "1 2", "output": "2"}]},
    ])
    expanded = [user("Sort these.\n\nb, a"), user("Sort these.\n\nz"), user("Name a fruit."), user("Count.\n\n1 2")]
    assert load_conversations(path) == expanded
    assert load_conversations(path, limit=3) == expanded[:3]  # limit counts prompts, not rows


def test_parquet_and_explicit_columns(tmp_path):
    import datasets

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_dict({"q": ["one", "two"], "instr": ["Do", "Go"], "ctx": ["x", ""],
                                "prompt": ["p1", "p2"]}).to_parquet(str(path))
    assert load_conversations(path) == [user("p1"), user("p2")]  # auto-detected
    assert load_conversations(path, columns={"prompt": "q"}) == [user("one"), user("two")]
    got = load_conversations(path, columns={"instruction": "instr", "input": "ctx"})
    assert got == [user("Do\n\nx"), user("Go")]
    conv = write_jsonl(tmp_path / "c.jsonl", [{"conv": [{"role": "user", "content": "a"},
                                                        {"role": "assistant", "content": "b"}]}])
    assert load_conversations(conv, columns={"messages": "conv"}) == [user("a")]
    with pytest.raises(ValueError, match="nope"):
        load_conversations(path, columns={"prompt": "nope"})
    with pytest.raises(ValueError, match="exactly one prompt kind"):
        load_conversations(path, columns={"prompt": "q", "question": "q"})


def test_empty_prompts_skipped_and_limit(tmp_path, caplog):
    rows = [{"question": q} for q in ["a", "", "  ", "b", None, "c", "d"]]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="medusa.training.data"):
        assert load_conversations(path) == [user(q) for q in "abcd"]
    warnings = [r for r in caplog.records if "empty prompt" in r.getMessage()]
    assert len(warnings) == 1 and "3 row" in warnings[0].getMessage()
    assert load_conversations(path, limit=2) == [user("a"), user("b")]
    assert load_conversations(path, limit=0) == []


def test_an_empty_file_or_one_of_empty_prompts_is_refused_by_name(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: the file is empty"):
        load_conversations(empty)
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"question": q} for q in ["", "  "]])
    with pytest.raises(ValueError, match="blank.jsonl: no prompts: every one of its 2 row"):
        load_conversations(blank)


def test_unknown_columns_missing_file_and_spec_bench(tmp_path):
    path = write_jsonl(tmp_path / "weird.jsonl", [{"text": "hi", "label": 1}])
    with pytest.raises(ValueError, match="weird.jsonl") as err:
        load_conversations(path)
    assert "text" in str(err.value) and "instruction" in str(err.value)
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_conversations(tmp_path / "absent.jsonl")
    for name in ("spec_bench.jsonl", "My_Spec_Bench_copy.parquet", "Spec-Bench.jsonl"):
        bench = write_jsonl(tmp_path / name, [{"turns": ["q"]}])
        with pytest.raises(ValueError, match="never train on it"):
            load_conversations(bench)
    with pytest.raises(ValueError, match="never train on it"):
        load_conversations(DATA_DIR / "spec_bench.jsonl")


def test_default_sources_load():
    beside_repo = Path(__file__).resolve().parents[3] / "shared" / "data"
    assert DATA_DIR == Path(os.environ.get("MEDUSA_DATA_DIR") or beside_repo)  # the env var overrides
    assert default_sources() == list(DEFAULT_SOURCES)
    gsm8k, seed_tasks, user_oriented = (load_conversations(p) for p in DEFAULT_SOURCES)
    assert len(gsm8k) == 7473 and gsm8k[0][0]["content"].startswith("Natalia sold clips")
    for convs in (seed_tasks, user_oriented):
        assert len(convs) > 100
        assert all(len(c) == 1 and c[0]["role"] == "user" and c[0]["content"].strip() for c in convs)
        assert any("\n\n" in c[0]["content"] for c in convs)  # instance inputs were appended
    assert "\n\n" in user_oriented[0][0]["content"]  # first task has a non-empty input


# ---- Sequences ---------------------------------------------------------------------------


def test_sequences_basics_select_and_split():
    seqs = Sequences.from_lists([[5, 6, 7], [1, 2], [9]], [1, 2, 0])
    assert len(seqs) == 3 and seqs.num_tokens == 6 and seqs.num_response_tokens == 2 + 0 + 1
    ids, prompt_len = seqs[1]
    assert ids.dtype == torch.int64 and ids.tolist() == [1, 2] and prompt_len == 2
    assert seqs[-1][0].tolist() == [9]
    sub = seqs.select([2, 0])
    assert [sub[i][0].tolist() for i in range(2)] == [[9], [5, 6, 7]] and sub.prompt_lengths.tolist() == [0, 1]
    with pytest.raises(ValueError):
        Sequences.from_lists([[1, 2]], [3])  # prompt longer than the sequence
    with pytest.raises(IndexError):
        seqs[3]

    # Two samples per prompt: a prompt's samples land on the same side of the split.
    many = Sequences.from_lists([[p, p, s] for p in range(1, 41) for s in (100, 200)], [2] * 80)
    train, held = many.split(0.25, seed=3)
    assert len(train) + len(held) == 80 and len(held) == 20
    held_prompts = {held[i][0][0].item() for i in range(len(held))}
    assert held_prompts.isdisjoint({train[i][0][0].item() for i in range(len(train))})
    again = many.split(0.25, seed=3)[1]
    assert torch.equal(again.tokens, held.tokens)
    assert not torch.equal(many.split(0.25, seed=4)[1].tokens, held.tokens)
    assert len(many.split(0.0, seed=0)[1]) == 0


def test_sequences_loss_mask_survives_select_split_and_cache(tmp_path):
    # Sequence 0 is two-turn: prompt [1, 2], answer [3], user turn [4, 5], answer [6]; 1 and 2 are one-turn.
    seqs = Sequences.from_lists([[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11]], [2, 1, 1],
                                [[False, False, True, False, False, True], None, None])
    assert seqs.loss_mask.tolist() == [0, 0, 1, 0, 0, 1, 0, 1, 1, 0, 1]
    assert seqs.num_response_tokens == 2 + 2 + 1
    assert seqs.row_loss_mask(0, 4).tolist() == [False, False, True, False]  # truncated rows too
    sub = seqs.select([2, 0])
    assert sub.loss_mask.tolist() == [0, 1, 0, 0, 1, 0, 0, 1]
    (batch,) = batches(seqs, 64, seed=0, epoch=0)
    for row, i in enumerate(batch.indices.tolist()):
        assert batch.loss_mask[row].tolist()[: len(seqs[i][0])] == seqs.row_loss_mask(i, len(seqs[i][0])).tolist()
    source = write_jsonl(tmp_path / "p.jsonl", [{"question": "a"}])
    manifest = manifest_for("m", [source], SETTINGS, num_conversations=1)
    save_cached(tmp_path / "cache", manifest, seqs)
    assert torch.equal(load_cached(tmp_path / "cache", manifest).loss_mask, seqs.loss_mask)
    assert Sequences.from_lists([[1, 2]], [1], [None]).loss_mask is None  # no explicit mask: none stored
    with pytest.raises(ValueError, match="one entry per token"):
        Sequences.from_lists([[1, 2]], [1], [[True]])


# ---- cache --------------------------------------------------------------------------------


def test_earlier_cache_versions_are_kept_up_to_a_limit(tmp_path):
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"question": "a"}])
    cache = tmp_path / "cache" / "train"
    manifests = [manifest_for("m", [source], {"max_new_tokens": n}, num_conversations=1) for n in range(6)]
    for n, manifest in enumerate(manifests):
        save_cached(cache, manifest, random_sequences(n + 1, seed=n))
    kept = sorted(p.name for p in cache.parent.iterdir())
    assert len(kept) == 1 + KEPT_VERSIONS  # the current one, and the newest earlier ones
    for n, manifest in enumerate(manifests):
        loaded = load_cached(cache, manifest)
        assert (loaded is not None) == (n >= len(manifests) - 1 - KEPT_VERSIONS)
        assert loaded is None or len(loaded) == n + 1


def test_cache_round_trip_and_mismatch(tmp_path, caplog):
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"question": "a"}, {"question": "b"}])
    manifest = manifest_for("some/model", [source], SETTINGS, num_conversations=2)
    cache = tmp_path / "cache"
    assert load_cached(cache, manifest) is None  # nothing there yet
    seqs = random_sequences(25)
    save_cached(cache, manifest, seqs)
    assert sorted(p.name for p in cache.iterdir()) == ["manifest.json", "sequences.safetensors"]
    loaded = load_cached(cache, manifest_for("some/model", [source], dict(SETTINGS), num_conversations=2))
    assert loaded is not None
    for name in ("tokens", "offsets", "prompt_lengths"):
        assert torch.equal(getattr(loaded, name), getattr(seqs, name))

    with caplog.at_level(logging.INFO, logger="medusa.training.distill_cache"):
        hot = manifest_for("some/model", [source], {**SETTINGS, "temperature": 0.7}, num_conversations=2)
        assert load_cached(cache, hot) is None
        assert load_cached(cache, manifest_for("other/model", [source], SETTINGS, num_conversations=2)) is None
        source.write_text(source.read_text().replace('"a"', '"A"'))  # same size, new bytes
        assert load_cached(cache, manifest_for("some/model", [source], SETTINGS, num_conversations=2)) is None
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "settings.temperature differs" in messages and "model differs" in messages
    assert "prompt files differ (prompts.jsonl)" in messages

    # Overwriting replaces the old cache atomically, keeps it as an earlier version, and leaves no temp dirs.
    new_manifest = manifest_for("some/model", [source], SETTINGS, num_conversations=2)
    save_cached(cache, new_manifest, random_sequences(3, seed=1))
    assert len(load_cached(cache, new_manifest)) == 3
    earlier = f"cache@{manifest_fingerprint(manifest)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", earlier, "prompts.jsonl"]
    source.write_text(source.read_text().replace('"A"', '"a"'))  # back to the first prompts: their data returns
    assert torch.equal(load_cached(cache, manifest).tokens, seqs.tokens)
    source.write_text(source.read_text().replace('"a"', '"A"'))
    with pytest.raises(ValueError, match="not a distillation cache"):
        save_cached(tmp_path, new_manifest, seqs)  # tmp_path holds prompts.jsonl: refuse
    with pytest.raises(ValueError, match="JSON"):
        manifest_for("m", [source], {"seed": object()})
    assert load_cached(cache, manifest_for("some/model", [source], SETTINGS, num_conversations=3)) is None
    assert load_cached(cache, manifest_for("some/model", [source], SETTINGS)) is None  # count unknown != 2


# ---- batches --------------------------------------------------------------------------------


def all_batches(seqs: Sequences, max_tokens: int, seed: int, epoch: int, skip: int = 0) -> list:
    return list(batches(seqs, max_tokens, seed=seed, epoch=epoch, skip=skip))


def test_batches_budget_coverage_and_mask():
    seqs = random_sequences(600, max_len=200)
    max_tokens = 128  # below the longest sequences: some get truncated
    got = all_batches(seqs, max_tokens, seed=0, epoch=0)
    seen = torch.cat([b.indices for b in got]).sort().values
    assert torch.equal(seen, torch.arange(len(seqs)))  # every sequence exactly once
    padded = 0
    for b in got:
        rows, width = b.input_ids.shape
        assert rows * width <= max_tokens and width == int(b.lengths.max())
        padded += rows * width
        for row, i in enumerate(b.indices.tolist()):
            ids, prompt_len = seqs[i]
            length = min(len(ids), max_tokens)
            assert b.lengths[row] == length
            assert torch.equal(b.input_ids[row, :length], ids[:length])
            assert not b.input_ids[row, length:].any()  # right-padded with 0
            expected = torch.zeros(width, dtype=torch.bool)
            expected[prompt_len:length] = True
            assert torch.equal(b.loss_mask[row], expected)
    assert padded < 1.2 * sum(int(b.lengths.sum()) for b in got)  # length bucketing keeps padding small


def test_batches_deterministic_per_epoch_and_resumable():
    seqs = random_sequences(400)
    first = all_batches(seqs, 256, seed=7, epoch=0)
    again = all_batches(seqs, 256, seed=7, epoch=0)
    assert len(first) == len(again)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, again))
    order = lambda bs: torch.cat([b.indices for b in bs]).tolist()  # noqa: E731
    assert order(all_batches(seqs, 256, seed=7, epoch=1)) != order(first)
    assert order(all_batches(seqs, 256, seed=8, epoch=0)) != order(first)
    resumed = all_batches(seqs, 256, seed=7, epoch=0, skip=5)
    assert len(resumed) == len(first) - 5
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.indices, b.indices)
               for a, b in zip(resumed, first[5:]))
    assert all_batches(seqs, 256, seed=7, epoch=0, skip=len(first)) == []
    with pytest.raises(ValueError, match="skip"):
        batches(seqs, 256, seed=7, epoch=0, skip=len(first) + 1)
    assert len(batch_plan(seqs, 256, seed=7, epoch=0)) == len(first)


def test_model_fingerprint_changes_with_the_weights_not_the_path(tmp_path):
    """Retrained weights saved under the same path must not reuse answers the old ones wrote."""
    from medusa.training.distill_cache import model_fingerprint

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 10_000)  # past 2 MiB: head and tail read
    (folder / "README.md").write_text("not read")
    first = model_fingerprint(folder)
    (folder / "README.md").write_text("still not read")
    moved = tmp_path / "elsewhere"
    folder.rename(moved)
    assert model_fingerprint(moved) == first
    weights = bytearray((moved / "model.safetensors").read_bytes())
    weights[-5] ^= 1  # the last MiB changes
    (moved / "model.safetensors").write_bytes(bytes(weights))
    assert model_fingerprint(moved) != first


def test_distill_model_key_fingerprints_the_default_models_file(tmp_path, monkeypatch):
    """`$MEDUSA_DEFAULT_GGUF` may point the default model at another file: its answers are not the old file's."""
    from medusa.training.pipeline import distill_model_key

    gguf = tmp_path / "default.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv("MEDUSA_DEFAULT_GGUF", str(gguf))
    first = distill_model_key("SmolLM2-135M-Instruct", None)
    assert first.startswith("SmolLM2-135M-Instruct@")
    gguf.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert distill_model_key("SmolLM2-135M-Instruct", None) != first
