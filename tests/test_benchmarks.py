"""The benchmark scripts' --quick modes run on the CPU, so they cannot break silently."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(script: str, out: Path, *extra: str) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
                   check=True, cwd=ROOT, timeout=600)
    return json.loads((out / "results.json").read_text())


def test_spec_bench_quick(default_model_dir, tmp_path):
    results = run("spec_bench.py", tmp_path, "--hf-per-category", "1")
    overall = results["overall"]
    assert overall["questions"] == 4 and overall["plain_tok_s"] > 0 and overall["medusa_tok_s"] > 0
    assert overall["mean_accepted_length"] >= 1.0 and overall["hf_tok_s"] > 0
    assert overall["identical_greedy_turns"] == overall["turns"]  # float32 on the CPU: exact
    assert len(results["categories"]) == 4


def test_kernels_quick(tmp_path):
    results = run("kernels.py", tmp_path)
    assert [r["context"] for r in results["attention"]] == [64, 128]
    assert {(r["batch"], r["tree_tokens"]) for r in results["steps"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(r["seconds"] > 0 for r in results["steps"])
