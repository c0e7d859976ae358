"""Tiny random Hugging Face models of each supported family, saved as checkpoints."""

import torch
import transformers
from safetensors.torch import save_file

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3-rope": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "llama-linear-rope-bias": (transformers.LlamaConfig, dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True)),
    "llama-tied-mha": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, head_dim=16)),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=8, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
}


def save_tiny_hf_model(kind: str, folder, seed: int = 0):
    config_cls, extra = FAMILIES[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # biases default to zero: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"))
    return hf


def tiny_decoder(vocab: int = 24, num_layers: int = 2, logit_scale: float = 1.0, max_positions: int = 512,
                 num_heads: int = 0, heads_std: float = 0.3, seed: int = 0, condition_on_root: bool = False,
                 condition_on_chain: bool = False):
    """A random 32-wide Llama of our own code, plus random Medusa heads when num_heads > 0.

    logit_scale sharpens the next-token distribution (random weights give
    near-uniform ones); heads_std makes the heads' proposals sometimes right.
    """
    from medusa.config import ModelConfig
    from medusa.heads import HeadsConfig, MedusaHeads
    from medusa.model import DecoderModel

    torch.manual_seed(seed)
    config = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8,
                         max_position_embeddings=max_positions)
    model = DecoderModel(config).eval()
    heads = MedusaHeads(HeadsConfig(hidden_size=32, vocab_size=vocab, num_heads=num_heads,
                                    condition_on_root=condition_on_root or condition_on_chain,
                                    condition_on_chain=condition_on_chain)).eval() if num_heads else None
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        for p in heads.parameters() if heads is not None else ():
            p.normal_(0, heads_std)
    return model, heads
