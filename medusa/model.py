"""A compact decoder for the Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2).

Our own code, written for our engine: the caller passes explicit positions (tree
nodes share positions with their siblings) and an `AttentionBackend` that owns
the KV cache and the mask. Tokens may carry any leading shape: `[T]` for the
engine's flat layout, `[B, T]` for training.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from medusa.attention import AttentionBackend
from medusa.config import ModelConfig
from medusa.kernels import skinny_matmul
from medusa.kernels.dispatch import overlapped_launches
from medusa.kernels.skinny_matmul import SplitSums
from medusa.layers import FusedLinear, Linear, RMSNorm, norm_linear, silu_and_mul
from medusa.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, config.qkv_bias,
                                    split_sums=True)  # to RoPE and the KV write (summed by the paged cache's kernel)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias, split_sums=True)  # to the next norm

    def forward(self, qkv: torch.Tensor | SplitSums, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor | SplitSums:
        """qkv [..., T, (Hq + 2 Hkv) D]: qkv_proj's output, which the decoder layer computes together with the
        input norm -> o_proj's output [..., T, H]. Where a tree step's few rows cut K into slices, both are
        `SplitSums`: qkv's only for a backend with `rotate_and_attend` (the decoder layer decides), whose RoPE
        kernel adds it up; o_proj's for the post-attention norm."""
        fused = getattr(attn, "rotate_and_attend", None)  # a cache that applies RoPE as it stores k
        lead = qkv.shape[:-1]  # [..., T]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # column views, of the parts for SplitSums
        q = q.view(*lead, self.num_heads, self.head_dim)  # [..., T, Hq, D]
        k = k.view(*lead, self.num_kv_heads, self.head_dim)  # [..., T, Hkv, D]
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if fused is not None:
            out = fused(self.layer, q, k, v, positions, rotary)
        else:
            q, k = rotary(positions, q, k)
            out = attn(self.layer, q, k, v)  # [..., T, Hq, D]
        return self.o_proj(out.reshape(*lead, q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        # not cut into K slices for SiLU-and-mul to sum: on an H200 that made the 135M's tree steps 4-6% slower,
        # where qkv_proj's slices made them 4-7% faster (benchmarks/RESULTS.md, session 32)
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate": size, "up": size}, bias=False)
        self.down_proj = Linear(size, config.hidden_size, bias=False, split_sums=True)  # to the next norm

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor | SplitSums:
        """gate_up [..., T, 2I]: gate_up_proj's output, which the decoder layer computes together with the
        post-attention norm -> down_proj(silu(gate) * up) [..., T, H] (or `SplitSums`, as o_proj's)."""
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, rotary, attn):
        """x: the previous layer's output (before its residual add); residual: the stream so far (None at layer 0).

        Returns (this layer's MLP output, residual stream up to it); adding the
        two is fused into the next norm. Each norm runs with the projection after it
        (see `norm_linear`).
        """
        # only a backend that applies RoPE as it stores k (the paged cache) sums a QKV product left as SplitSums:
        # for the others, summing it apart would cost more launches than the slices save
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual,
                                    split_sums=hasattr(attn, "rotate_and_attend"))
        h = self.self_attn(qkv, positions, rotary, attn)
        gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, h, residual)
        return self.mlp(gate_up), residual


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm and lm_head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.widest_input = max(config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [..., T] -> final hidden states [..., T, H] (normed)."""
        x, residual = self.embed_tokens(input_ids), None
        # PDL where every matmul of the step takes a skinny kernel (kernels/pdl.py)
        ours = skinny_matmul.covers(input_ids.numel(), self.widest_input, self.embed_tokens.weight.element_size())
        with overlapped_launches(ours):
            for layer in self.layers:
                x, residual = layer(x, residual, positions, self.rotary, attn)
            return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]"""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors one at a time; refuse missing or unexpected ones."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue  # some checkpoints store inv_freq; we compute it
            name, shard = _to_our_name(hf_name)
            if name not in params:
                raise ValueError(f"unexpected tensor {hf_name!r} for a {self.config.model_type} model")
            param = params[name]
            tensor = tensor.to(param.dtype)
            if shard is not None:
                module_name, param_name = name.rsplit(".", 1)
                self.get_submodule(module_name).load_shard(shard, param_name, tensor)
                loaded.add(f"{name}:{shard}")
                continue
            if param.shape != tensor.shape:
                raise ValueError(f"tensor {hf_name!r}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(self._expected_tensors() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _expected_tensors(self) -> set[str]:
        expected = set()
        for name, module in self.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                if isinstance(module, FusedLinear):
                    expected.update(f"{full}:{shard}" for shard in module.shard_offsets)
                elif not (full == "lm_head.weight" and self.config.tie_word_embeddings):
                    expected.add(full)
        return expected


_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}


def _to_our_name(hf_name: str) -> tuple[str, str | None]:
    """'model.layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj.weight', 'k')."""
    name = hf_name.removeprefix("model.")
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), shard
    return name, None
