"""head_accuracy.py and sampled_acceptance.py: the heads' acceptance, greedy and sampled."""

import json
import subprocess
import sys

import pytest
from bench_scripts import ROOT, run

pytestmark = pytest.mark.slow


def test_head_accuracy_quick(default_model_dir, tmp_path):
    """Scores the shipped heads per category on the base's cached greedy turns; a second run reuses them."""
    results = run("head_accuracy.py", tmp_path)
    (scored,) = results["heads"].values()
    overall = scored["overall"]
    assert results["settings"]["questions"] == 4 and len(scored["categories"]) == 4
    assert overall["turns"] == sum(c["turns"] for c in scored["categories"].values()) >= 4
    assert overall["targets"] == sum(c["targets"] for c in scored["categories"].values()) > 0
    assert all(0 <= a <= b <= 1 for a, b in zip(overall["top1"], overall["top5"])) and len(overall["top1"]) == 4
    assert 1.0 <= overall["accepted_length"] <= 5.0 and scored["tree_nodes"] == 64
    turns = tmp_path / "turns.json"
    turns.write_text(turns.read_text().replace('"ids": [', '"ids": [0, '))  # a marked cache: reused, not remade
    again = run("head_accuracy.py", tmp_path)["heads"]
    assert next(iter(again.values()))["overall"]["targets"] > overall["targets"]


def test_head_accuracy_rejects_unusable_heads_before_generating(tmp_path):
    heads = tmp_path / "m2"
    heads.mkdir()
    (heads / "adapter.safetensors").write_bytes(b"")
    for path, message in ((tmp_path / "none", "no heads at"), (heads, "holds a Medusa-2 LoRA adapter")):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "head_accuracy.py"), "--quick", "--out",
                               str(tmp_path / "out"), "--heads", str(path)], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value, message", [("--per-category", "0", "--per-category must be >= 1, got 0"),
                                                  ("--max-tokens", "0", "--max-tokens must be >= 1, got 0"),
                                                  ("--temperature", "0", "--temperature must be > 0")])
def test_sampled_acceptance_rejects_bad_settings_before_loading(tmp_path, flag, value, message):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampled_acceptance.py"), "--out",
                           str(tmp_path / "out.json"), flag, value], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_sampled_acceptance_on_a_pinned_tree_keeps_the_outputs(default_model_dir, tmp_path):
    """Coupled proposals change what a step proposes, never what it emits: on the CPU in float32 every output
    is the same; with --pin-tree every step of both runs verifies the heads' own tree."""
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampled_acceptance.py"), "--out", str(out),
                    "--pin-tree", "--quick"], check=True, cwd=ROOT, timeout=600)
    results = json.loads(out.read_text())
    assert results["pinned_tree"] and results["identical_outputs"] == results["prompts"] == 4
    from medusa.medusa_model import CPU_PROMPT_LOOKUP

    for name in ("independent", "coupled"):  # the heads' own tree with the CPU's default lookup chain
        assert list(results[name]["steps_per_tree"]) == [f"heads+lookup{CPU_PROMPT_LOOKUP}"], results[name]
        assert results[name]["tokens_per_step"] >= 1.0
