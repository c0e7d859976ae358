"""Run by test_multiprocess.py under `torchrun --nproc_per_node 2`: a few Medusa-2 steps on a tiny
model, then each process saves its heads and LoRA weights, so the test can check they agree."""

import sys

import torch

from medusa.training.config import load_config
from medusa.training.trainer import Trainer
from test_trainer import patterned_data, tiny_base


def main(out: str) -> None:
    config = load_config(None, [f"output_dir={out}", "train.max_tokens_per_batch=128", "train.epochs=2",
                                "train.lr=2e-2", "train.save_every=0", "train.log_every=1", "heads.num_heads=2",
                                "medusa2.enabled=true", "medusa2.lora_r=4", "medusa2.base_lr=5e-2"])
    trainer = Trainer(config, tiny_base(), patterned_data())
    trainer.train()
    acc = trainer.accelerator
    lora = {k: v.detach().cpu() for k, v in trainer.base.state_dict().items() if "lora_" in k}
    heads = {k: v.detach().cpu() for k, v in trainer.unwrapped_heads().state_dict().items()}
    lrs = [(h["step"], h["lr"]) for h in trainer.state.history]
    torch.save({"lora": lora, "heads": heads, "steps": trainer.state.step, "processes": acc.num_processes,
                "lrs": lrs, "total_steps": trainer.total_steps},
               f"{out}/rank{acc.process_index}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
