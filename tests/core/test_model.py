"""Our decoder gives the same logits as transformers' own model (fp32, max abs diff < 1e-3)."""

import pytest
import torch
from safetensors.torch import save_file

from medusa.attention import CausalAttention
from medusa.config import ModelConfig
from medusa.loading import load_base_model

from tiny_models import FAMILIES, TINY, save_tiny_hf_model


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[-1]).expand_as(ids)
    attn = CausalAttention(model.config.sliding_window, positions)
    return model.compute_logits(model(ids, positions, attn))


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_logits_match_transformers(kind, tmp_path):
    hf = save_tiny_hf_model(kind, tmp_path)
    ours = load_base_model(tmp_path, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = our_logits(ours, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-3
    # a single unbatched sequence gives the same answer as row 0 of the batch
    with torch.no_grad():
        flat = our_logits(ours, ids[0])
    assert (flat - got[0]).abs().max().item() < 1e-4


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="llama, mistral, qwen2"):
        ModelConfig.from_hf_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_scaling_is_refused():
    config = {**TINY, "model_type": "llama", "num_hidden_layers": 1, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict(config)


def test_missing_tensor_is_named(tmp_path):
    save_tiny_hf_model("llama", tmp_path)
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 tensors.*layers.1.mlp.gate_up_proj.weight:up"):
        load_base_model(tmp_path, device="cpu")
