"""Several training processes (`torchrun` / `accelerate launch`), run here as two CPU processes over gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medusa.training.trainer import cosine_factor

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_medusa2_processes_keep_one_adapter_and_one_set_of_heads(tmp_path):
    """Each process trains on other batches; the heads (DDP) and the LoRA (averaged by hand) stay equal."""
    torchrun(str(HERE / "ddp_worker.py"), str(tmp_path), cwd=tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["processes"] for r in ranks] == [2, 2] and ranks[0]["steps"] == ranks[1]["steps"] > 0
    for part in ("lora", "heads"):
        a, b = ranks[0][part], ranks[1][part]
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), f"{part} differ between processes"
    # the schedule runs over the steps each process takes (it reached 0 halfway through before), head and LoRA groups
    total, warmup = ranks[0]["total_steps"], int(0.05 * ranks[0]["total_steps"])
    assert [step for step, _ in ranks[0]["lrs"]] == list(range(1, total + 1)) and total >= 4
    for step, lr in ranks[0]["lrs"]:
        assert lr == pytest.approx(2e-2 * cosine_factor(step, warmup, total)), step
    trained = [v for k, v in ranks[0]["lora"].items() if "lora_B" in k]
    assert any(v.abs().sum() > 0 for v in trained)  # B starts at zero: the adapter did learn


def test_medusa_train_runs_unchanged_under_torchrun(tmp_path, chat_tokenizer):
    """`torchrun -m medusa.training.cli train` on two processes: main distils, both train, main saves."""
    from tiny_models import save_tiny_hf_model

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_tiny_hf_model("llama", model_dir)
    chat_tokenizer.save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"Say {w} twice."}) + "\n"
                               for w in ("yes", "no", "maybe", "hello", "cats", "dogs", "red", "blue", "one", "two")))
    out = tmp_path / "run"
    torchrun("-m", "medusa.training.cli", "train", f"model={model_dir}", f"output_dir={out}",
             f"data.sources=[{prompts}]", "data.max_new_tokens=8", "data.distill_batch_size=4",
             "data.samples_per_prompt=0", "data.holdout_fraction=0.2", "train.epochs=2",
             "train.max_tokens_per_batch=64", "heads.num_heads=2", "eval.tree_nodes=4", "eval.max_sequences=4",
             cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["distill_sequences"] == 8 and summary["steps"] > 0
    assert (out / "heads" / "heads.safetensors").is_file() and (out / "heads" / "tree.json").is_file()
    assert sorted(p.name for p in (out / "distill").iterdir()) == ["heldout", "train"]
