"""Medusa-2: LoRA base + heads train together; the saved adapter merges into the base exactly."""

import copy

import torch

from medusa.adapter import merge_lora
from medusa.attention import CausalAttention
from medusa.training.cli import heads_on_their_base
from medusa.training.config import load_config
from medusa.training.pipeline import save_adapter
from medusa.training.trainer import Trainer
from test_trainer import patterned_data, tiny_base


def test_medusa2_trains_heads_and_adapter_and_merges(tmp_path):
    config = load_config(None, [f"output_dir={tmp_path}", "train.max_tokens_per_batch=256", "train.log_every=1",
                                "train.lr=2e-2", "heads.num_heads=2", "train.epochs=6", "train.save_every=0",
                                "medusa2.enabled=true", "medusa2.base_lr=1e-2", "medusa2.heads_weight_warmup_steps=5",
                                "medusa2.lora_r=4", "medusa2.target_modules=[qkv_proj,down_proj]"])
    base = tiny_base()
    original = copy.deepcopy(base)
    trainer = Trainer(config, base, patterned_data())
    state = trainer.train()
    first, last = state.history[0], state.history[-1]
    assert first["kl"] < 1e-6  # LoRA B starts at zero: the student is the teacher
    assert last["heads_loss"] < 0.8 * first["heads_loss"]
    assert last["kl"] > 0  # the adapter moved, under the KL's leash
    lora = [n for n, p in trainer.base.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)

    save_adapter(trainer.base, tmp_path)
    trainer.unwrapped_heads().save_pretrained(tmp_path)
    pristine = copy.deepcopy(original)
    assert merge_lora(original, tmp_path) == 2 * original.config.num_layers
    ids = torch.randint(48, (2, 16))
    pos = torch.arange(16).expand_as(ids)
    with torch.no_grad():
        expected = trainer.base(ids, pos, CausalAttention())
        got = original(ids, pos, CausalAttention())
    assert (got - expected).abs().max() < 1e-4

    # medusa-train eval measures Medusa-2 heads on the base they were trained with: the adapter merged in
    heads = heads_on_their_base(pristine, str(tmp_path))
    with torch.no_grad():
        assert (pristine(ids, pos, CausalAttention()) - expected).abs().max() < 1e-4
    assert heads.config.num_heads == 2 and next(heads.parameters()).dtype == torch.float32
