"""`medusa-train`: its help examples work, and `eval` takes its data settings from the run it measures."""

import argparse
import dataclasses
import json
import re

import pytest

from medusa.training import cli, pipeline
from medusa.training.config import RECIPES_DIR, load_config, load_saved_config
from medusa.tree import TreeSpec, available_trees


def test_help_examples_name_trees_that_exist():
    trees = re.findall(r"--tree (\S+)", cli.__doc__)
    assert trees
    for name in trees:
        assert TreeSpec.load(name).num_nodes >= 1


def saved_run(tmp_path, *overrides):
    """A run folder as `medusa-train train` leaves it: train_config.json beside heads/ (written from elsewhere)."""
    run = tmp_path / "run1"
    run.mkdir()
    config = load_config(None, ["output_dir=out/somewhere-else", *overrides])
    (run / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return run


def eval_args(heads, config=None, overrides=()):
    return argparse.Namespace(heads=str(heads), config=config, overrides=list(overrides))


def test_eval_reads_the_runs_saved_config(tmp_path, capsys):
    run = saved_run(tmp_path, "eval.max_sequences=7", "data.holdout_fraction=0.25", "data.sources=[a.jsonl]")
    config = cli.eval_config(eval_args(run / "heads", overrides=["eval.max_rank=3"]))
    assert (config.eval.max_sequences, config.data.holdout_fraction, config.eval.max_rank) == (7, 0.25, 3)
    assert [s.path for s in config.data.sources] == ["a.jsonl"]
    assert config.output_dir == str(run)  # so its cache, <output_dir>/distill, is found from any directory
    err = capsys.readouterr().err
    assert "train_config.json" in err and str(run / "distill" / "heldout") in err and "no --config" not in err


def test_eval_config_option_wins_over_the_saved_one(tmp_path):
    run = saved_run(tmp_path, "eval.max_sequences=7")
    config = cli.eval_config(eval_args(run / "heads", config="medusa1-smollm2"))
    assert config.eval.max_sequences == load_config("medusa1-smollm2").eval.max_sequences


def test_eval_without_any_config_says_what_it_will_distil_before_loading(tmp_path, monkeypatch, capsys):
    def stop(*args, **kwargs):
        raise ValueError("stopped before loading the model")

    monkeypatch.setattr(pipeline, "load_base", stop)
    assert cli.main(["eval", "--heads", str(tmp_path / "heads")]) == 2
    err = capsys.readouterr().err
    assert err.index("no --config") < err.index("stopped before loading")
    assert "self-distils the first 200 held-out prompts" in err and "data.cache_dir" in err


def test_eval_refuses_a_bad_override_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "load_base", lambda *a, **k: pytest.fail("loaded the model before the check"))
    assert cli.main(["eval", "--heads", str(saved_run(tmp_path) / "heads"), "eval.tree_nodes=0"]) == 2
    assert "eval.tree_nodes must be" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipe_survives_its_saved_round_trip(tmp_path, recipe):
    config = load_config(recipe)
    (tmp_path / "train_config.json").write_text(json.dumps(config.to_dict()))
    assert load_saved_config(tmp_path / "train_config.json") == dataclasses.replace(config, output_dir=str(tmp_path))


def fake_training(monkeypatch, tree: TreeSpec):
    """run_training replaced by one that leaves a searched tree with the heads, as the real one does."""
    calls = []

    def run(config, resume=False, tree_name=None, overwrite=False):
        calls.append(tree_name)
        heads = pipeline.Path(config.output_dir) / "heads"
        heads.mkdir(parents=True, exist_ok=True)
        TreeSpec(tree.paths, name=tree_name).save(heads / "tree.json")
        return {"top1": [0.5]}

    monkeypatch.setattr(pipeline, "run_training", run)
    return calls


def test_tree_name_saves_a_named_tree_that_loads_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEDUSA_TREES_DIR", str(tmp_path / "trees"))
    calls = fake_training(monkeypatch, TreeSpec.load("tree-8"))
    argv = ["train", "--tree-name", "mine-8", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(argv) == 0
    assert (tmp_path / "trees" / "mine-8.json").is_file() and "mine-8" in available_trees()
    assert TreeSpec.load("mine-8").paths == TreeSpec.load("tree-8").paths
    assert cli.main(argv) == 2 and len(calls) == 1  # the second run stops before training: nothing overwritten
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tree-32", "../escape", "sub/dir", "x.json", ""])
def test_tree_name_taken_or_not_a_file_stem_fails_before_training(tmp_path, monkeypatch, capsys, name):
    monkeypatch.setenv("MEDUSA_TREES_DIR", str(tmp_path / "trees"))
    calls = fake_training(monkeypatch, TreeSpec.load("tree-8"))
    assert cli.main(["train", "--tree-name", name, f"output_dir={tmp_path / 'run'}"]) == 2
    assert calls == [] and repr(name) in capsys.readouterr().err
    assert TreeSpec.load("tree-32").num_nodes == 32  # the shipped tree is untouched


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_missing_prompt_file_fails_before_loading_and_names_it(tmp_path, monkeypatch, capsys, command):
    monkeypatch.setattr(pipeline, "load_base", lambda *a, **k: pytest.fail("loaded the model before the check"))
    missing = tmp_path / "nowhere.jsonl"
    if command == "train":
        argv = ["train", f"output_dir={tmp_path / 'run'}", f"data.sources=[{missing}]"]
    else:
        argv = ["eval", "--heads", str(saved_run(tmp_path, f"data.sources=[{missing}]") / "heads")]
    assert cli.main(argv) == 2
    assert str(missing) in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_without_the_default_prompt_files_the_error_says_how_to_give_them(tmp_path, monkeypatch):
    from medusa.training import data

    monkeypatch.setattr(data, "DEFAULT_SOURCES", (tmp_path / "gsm8k_train.jsonl",))
    with pytest.raises(FileNotFoundError, match=r"MEDUSA_DATA_DIR.*data\.sources="):
        data.default_sources()


def test_resume_with_settings_the_checkpoint_cannot_take_fails_before_loading(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step-0000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    common = [f"output_dir={run}", "data.sources=[gsm8k_train.jsonl]"]
    (checkpoint / "train_config.json").write_text(json.dumps(load_config(None, common).to_dict()))
    monkeypatch.setattr(pipeline, "latest_checkpoint", lambda output: checkpoint)
    for fine in (["train.max_steps=9", "train.epochs=5", f"data.cache_dir={tmp_path}"], []):
        pipeline.check_resumable(load_config(None, common + fine), checkpoint)  # no error
    monkeypatch.setattr(pipeline, "load_base", lambda *a, **k: pytest.fail("loaded the model before the check"))
    argv = ["train", "--resume", *common, "heads.num_layers=2", "data.max_new_tokens=16"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "heads.num_layers: 1 -> 2" in err and "data.max_new_tokens: 320 -> 16" in err


def test_a_fresh_run_over_an_earlier_one_is_refused_unless_overwrite(tmp_path, monkeypatch, capsys):
    stop = ValueError("stopped at the model load")
    monkeypatch.setattr(pipeline, "load_base", lambda *a, **k: (_ for _ in ()).throw(stop))
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000004").mkdir(parents=True)
    (run / "heads").mkdir()
    (run / "heads" / "heads.safetensors").write_bytes(b"earlier")
    argv = ["train", f"output_dir={run}", "data.sources=[gsm8k_train.jsonl]"]
    assert cli.main(argv) == 2
    assert "holds an earlier run (heads, checkpoints)" in capsys.readouterr().err
    assert (run / "checkpoints" / "step-0000004").is_dir()  # nothing touched
    assert cli.main([*argv, "--overwrite", "--resume"]) == 2 and "give one" in capsys.readouterr().err
    assert cli.main([*argv, "--overwrite"]) == 2 and "stopped at the model load" in capsys.readouterr().err
    assert not (run / "checkpoints").exists()  # the earlier run's checkpoints went, so --resume cannot pick them


def test_ctrl_c_says_what_was_kept_without_a_traceback(tmp_path, monkeypatch, capsys):
    def interrupted(config, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_training", interrupted)
    run = tmp_path / "run"
    assert cli.main(["train", f"output_dir={run}"]) == 130
    assert "no checkpoint was saved yet" in capsys.readouterr().err
    (run / "checkpoints" / "step-0000004").mkdir(parents=True)
    (run / "checkpoints" / "step-0000004" / "trainer_state.json").write_text("{}")
    assert cli.main(["train", f"output_dir={run}"]) == 130
    err = capsys.readouterr().err
    assert "step-0000004" in err and "--resume" in err and "Traceback" not in err


def test_eval_refuses_a_tree_deeper_than_the_heads_reach(tmp_path, monkeypatch, capsys):
    """A tree of depth 4 on 2 heads was an IndexError deep in the accepted-length count; an unknown tree fails
    before the model loads."""
    from test_data import write_jsonl
    from tiny_models import tiny_decoder

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"question": "a"}])
    run = saved_run(tmp_path, f"data.sources=[{prompts}]")
    base, heads = tiny_decoder(num_heads=2)
    heads.save_pretrained(run / "heads")
    monkeypatch.setattr(pipeline, "load_base", lambda *a, **k: pytest.fail("loaded the model before the check"))
    assert cli.main(["eval", "--heads", str(run / "heads"), "--tree", "no-such-tree"]) == 2
    assert "no-such-tree" in capsys.readouterr().err
    monkeypatch.setattr(pipeline, "load_base", lambda *a, **k: (base, None, "tiny", None, [2]))
    assert cli.main(["eval", "--heads", str(run / "heads"), "--tree", "chain-4"]) == 2
    assert "--tree chain-4: path" in (err := capsys.readouterr().err) and "at most 2 deep" in err
