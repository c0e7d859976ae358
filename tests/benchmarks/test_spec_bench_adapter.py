"""spec_bench.py with a Medusa-2 heads folder and --pin-tree (its own file: each spec_bench run
costs CI about a minute, and pytest-xdist spreads files, not tests)."""

import json

import pytest
from bench_scripts import run

pytestmark = pytest.mark.slow


def test_spec_bench_reports_adapter_drift_and_pins_the_heads_tree(default_model_dir, tmp_path):
    """A Medusa-2 heads folder with a LoRA whose B is zero changes nothing: full agreement, identical turns.
    --pin-tree runs only the heads' own tree (one spec_bench run checks both)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from medusa import default_model

    heads = tmp_path / "heads"
    shutil.copytree(default_model.default_heads_path(), heads)
    name = "layers.0.mlp.down_proj"
    save_file({f"{name}.lora_A.weight": torch.randn(4, 1536), f"{name}.lora_B.weight": torch.zeros(576, 4)},
              str(heads / "adapter.safetensors"))
    (heads / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["down_proj"]}))
    results = run("spec_bench.py", tmp_path / "out", "--heads", str(heads), "--pin-tree", "--prompt-lookup", "0")
    drift, overall = results["overall"]["adapter_drift"], results["overall"]
    assert drift["tokens"] > 0 and drift["token_agreement"] == 1.0
    assert drift["identical_turns"] == drift["turns"] >= 4
    assert results["pinned_tree"] and results["tree_nodes"] == 64 and results["candidate_trees"] == ["heads"]
    assert overall["decode_steps_per_tree"] == {"heads": overall["medusa_steps"]} and overall["medusa_steps"] > 0
    assert overall["identical_greedy_turns"] == overall["turns"]
