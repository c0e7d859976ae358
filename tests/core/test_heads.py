"""Tests for medusa.heads: config, module, save/load and foreign checkpoint layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from medusa.heads import HeadsConfig, MedusaHeads, ResBlock

H, V = 8, 16


def _cfg(**kw) -> HeadsConfig:
    return HeadsConfig(**{"hidden_size": H, "vocab_size": V, **kw})


def _randomise(model: MedusaHeads, seed: int = 0) -> MedusaHeads:
    """Give every parameter (also the zero-initialised ones) random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _reference(model: MedusaHeads, x: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Per-head loop, straight from the definition."""
    out = []
    for k, head in enumerate(model.heads):
        h = x
        for block in head:
            h = h + F.silu(h @ block.linear.weight.T + block.linear.bias)
        kind = model.config.lm_head
        w = model.lm_heads[k] if kind == "full" else lm
        logits = h @ w.T
        if kind == "lora":
            logits = logits + h @ (model.lora_B[k] @ model.lora_A[k]).T
        out.append(logits)
    return torch.stack(out)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"num_heads": 0}, "num_heads"),
        ({"num_layers": 1.5}, "num_layers"),
        ({"lora_rank": True}, "lora_rank"),
        ({"lm_head": "tied"}, "lm_head"),
        ({"base_model": ""}, "base_model"),
        ({"tree": [[0, 0]]}, "tree"),  # missing parent [0]
        ({"tree": [[0], [0]]}, "tree"),  # duplicate
        ({"tree": [[0, 0, 0]], "num_heads": 2}, "tree"),  # deeper than the heads
        ({"tree": [[-1]]}, "tree"),
        ({"accuracies": [[0.5]]}, "accuracies"),  # 1 row for 4 heads
        ({"accuracies": [[1.5]] * 4}, "accuracies"),
    ],
)
def test_config_rejects_bad_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _cfg(**kw)


def test_config_dict_roundtrip_and_versioning():
    cfg = _cfg(num_heads=2, tree=[(0,), (1,), (0, 0)], accuracies=[[0.6, 0.8], [0.3, 0.5]], base_model="m")
    assert cfg.tree == [[0], [1], [0, 0]]  # stored as lists, JSON friendly
    d = cfg.to_dict()
    assert d["format"] == "medusa-heads" and d["version"] == 1
    assert HeadsConfig.from_dict(json.loads(json.dumps(d))) == cfg
    with pytest.warns(UserWarning, match="future_key"):
        assert HeadsConfig.from_dict({**d, "future_key": 1}) == cfg
    with pytest.raises(ValueError, match="format"):
        HeadsConfig.from_dict({**d, "format": "eagle"})
    with pytest.raises(ValueError, match="version"):
        HeadsConfig.from_dict({**d, "version": 99})


# ---------------------------------------------------------------- module


def test_fresh_resblock_and_shared_heads_start_as_identity_plus_bias():
    model = MedusaHeads(_cfg(num_heads=3, num_layers=1))
    x = torch.randn(2, 5, H)
    states = model.hidden_states(x)
    assert states.shape == (3, 2, 5, H)
    for k in range(3):
        linear = model.heads[k][0].linear
        bias = linear.bias.expand_as(x)  # [2, 5, H]
        assert torch.equal(linear(x), bias)  # W = 0 exactly, so W x + b == b bit for bit
        # silu on the broadcast bias: silu's SIMD and scalar-tail paths may
        # differ by an ulp, so evaluate it on the same shape as the module does.
        assert torch.equal(states[k], x + F.silu(bias.contiguous()))
    lm = torch.randn(V, H)
    assert torch.equal(model(x, lm), F.linear(states, lm))
    assert torch.count_nonzero(ResBlock(H).linear.weight) == 0


def test_heads_and_layers_do_not_share_parameters():
    model = MedusaHeads(_cfg(num_heads=3, num_layers=2))
    blocks = [b for head in model.heads for b in head]
    assert len({id(b) for b in blocks}) == 6
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(ptrs) == len(set(ptrs)) == 12
    # A loss on head 0 must move head 0 only.
    _randomise(model)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, H), torch.randn(V, H))[0].sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
    names = [n for n, _ in model.named_parameters()]
    assert all(c == n.startswith("heads.0.") for c, n in zip(changed, names)), list(zip(names, changed))


@pytest.mark.parametrize("kind", ["shared", "lora", "full"])
def test_forward_matches_per_head_reference(kind):
    model = _randomise(MedusaHeads(_cfg(num_heads=3, num_layers=2, lm_head=kind, lora_rank=2)))
    x, lm = torch.randn(2, 3, H), torch.randn(V, H)
    out = model(x, lm if kind != "full" else None)
    assert out.shape == (3, 2, 3, V)
    torch.testing.assert_close(out, _reference(model, x, lm))


@pytest.mark.parametrize("kind", ["shared", "lora", "full"])
def test_inference_batches_the_heads_and_follows_weight_changes(kind):
    """Without grad, each layer of all heads is one batched matmul: same logits, fresh after an update."""
    model = _randomise(MedusaHeads(_cfg(num_heads=3, num_layers=2, lm_head=kind, lora_rank=2)))
    x, lm = torch.randn(2, 3, H), torch.randn(V, H)
    lm = lm if kind != "full" else None
    with torch.no_grad():
        torch.testing.assert_close(model(x, lm), _reference(model, x, lm))
        model.heads[1][0].linear.weight.add_(0.5)  # in place: the stacked copy must be rebuilt
        model.heads[2][1].linear.bias.mul_(-1)
        torch.testing.assert_close(model(x, lm), _reference(model, x, lm))


def test_lora_starts_equal_to_shared_and_trains_only_its_head():
    model = MedusaHeads(_cfg(num_heads=2, lm_head="lora", lora_rank=4))
    assert model.lora_A.shape == (2, 4, H) and model.lora_B.shape == (2, V, 4)
    x, lm = torch.randn(3, H), torch.randn(V, H)
    torch.testing.assert_close(model(x, lm), F.linear(model.hidden_states(x), lm), rtol=0, atol=0)
    _randomise(model)
    model(x, lm)[1].sum().backward()
    assert torch.count_nonzero(model.lora_B.grad[0]) == 0 and torch.count_nonzero(model.lora_B.grad[1]) > 0


def test_init_full_lm_heads_copies_the_base():
    model = MedusaHeads(_cfg(num_heads=2, lm_head="full"))
    lm = torch.randn(V, H)
    model.init_full_lm_heads(lm)
    assert all(torch.equal(model.lm_heads[k], lm) for k in range(2))
    x = torch.randn(4, H)
    torch.testing.assert_close(model(x), F.linear(model.hidden_states(x), lm))
    with pytest.raises(ValueError, match="full"):
        MedusaHeads(_cfg()).init_full_lm_heads(lm)


def test_forward_input_errors():
    model = MedusaHeads(_cfg())
    with pytest.raises(ValueError, match="hidden_size"):
        model(torch.randn(2, H + 1), torch.randn(V, H))
    with pytest.raises(ValueError, match="lm_head_weight"):
        model(torch.randn(2, H))
    with pytest.raises(ValueError, match="lm_head_weight has shape"):
        model(torch.randn(2, H), torch.randn(V + 1, H))


# ---------------------------------------------------------------- root conditioning


def _root_reference(model: MedusaHeads, x: torch.Tensor, roots: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """By hand: each head's input is x + rms_normalised(lm[root]) @ root_proj[k]."""
    e = lm[roots]
    e = e / e.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    out = []
    for k, head in enumerate(model.heads):
        h = x + e @ model.root_proj[k]
        for block in head:
            h = h + F.silu(h @ block.linear.weight.T + block.linear.bias)
        out.append(h @ lm.T)
    return torch.stack(out)


def test_root_conditioned_heads_start_as_plain_heads_and_then_read_the_root():
    plain = _randomise(MedusaHeads(_cfg(num_heads=3, num_layers=2)))
    rooted = MedusaHeads(_cfg(num_heads=3, num_layers=2, condition_on_root=True))
    missing, unexpected = rooted.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["root_proj"] and not unexpected
    x, lm = torch.randn(2, 5, H), torch.randn(V, H)
    roots = torch.randint(0, V, (2, 5))
    torch.testing.assert_close(rooted(x, lm, roots=roots), plain(x, lm), rtol=0, atol=0)
    _randomise(rooted, seed=3)
    other = (roots + 1) % V
    assert not torch.allclose(rooted(x, lm, roots=roots), rooted(x, lm, roots=other))
    # training path (per-head modules) and inference path (batched) both match the definition
    torch.testing.assert_close(rooted(x, lm, roots=roots), _root_reference(rooted, x, roots, lm))
    with torch.no_grad():
        torch.testing.assert_close(rooted(x, lm, roots=roots), _root_reference(rooted, x, roots, lm))
    rooted(x, lm, roots=roots).sum().backward()
    assert torch.count_nonzero(rooted.root_proj.grad) > 0


def test_root_conditioned_heads_input_errors_and_roundtrip(tmp_path):
    model = _randomise(MedusaHeads(_cfg(num_heads=2, condition_on_root=True)))
    x, lm = torch.randn(3, H), torch.randn(V, H)
    with pytest.raises(ValueError, match="roots="):
        model(x, lm)
    with pytest.raises(ValueError, match="roots has shape"):
        model(x, lm, roots=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="condition_on_root"):
        _cfg(condition_on_root="yes")
    # plain heads ignore roots, so callers can always pass them
    plain = MedusaHeads(_cfg(num_heads=2))
    assert torch.equal(plain(x, lm, roots=torch.zeros(3, dtype=torch.long)), plain(x, lm))
    model.save_pretrained(tmp_path / "h")
    loaded = MedusaHeads.from_pretrained(tmp_path / "h")
    assert loaded.config.condition_on_root and torch.equal(loaded.root_proj, model.root_proj)
    roots = torch.tensor([1, 2, 3])
    assert torch.equal(loaded(x, lm, roots=roots), model(x, lm, roots=roots))


def test_chained_heads_start_as_rooted_heads_and_read_their_own_greedy_chain():
    rooted = _randomise(MedusaHeads(_cfg(num_heads=3, num_layers=2, condition_on_root=True)))
    chained = MedusaHeads(_cfg(num_heads=3, num_layers=2, condition_on_root=True, condition_on_chain=True))
    missing, _ = chained.load_state_dict(rooted.state_dict(), strict=False)
    assert missing == ["chain_proj"] and chained.chain_proj.shape == (3, H, H)  # pairs (1,0), (2,0), (2,1)
    x, lm, roots = torch.randn(2, 5, H), torch.randn(V, H), torch.randint(0, V, (2, 5))
    torch.testing.assert_close(chained(x, lm, roots=roots), rooted(x, lm, roots=roots), rtol=0, atol=1e-6)
    _randomise(chained, seed=4)
    with torch.no_grad():
        greedy = chained(x, lm, roots=roots)  # each head reads the earlier heads' top-1 tokens
        own_chain = greedy[:-1].argmax(-1).permute(1, 2, 0)  # [2, 5, K - 1]
        torch.testing.assert_close(chained(x, lm, roots=roots, chain=own_chain), greedy)
        other = chained(x, lm, roots=roots, chain=(own_chain + 1) % V)
    assert torch.equal(other[0], greedy[0]) and not torch.allclose(other[1:], greedy[1:])
    # the training path (with grad) computes the same, and trains every chain projection
    teacher = torch.randint(0, V, (2, 5, 2))
    with torch.no_grad():
        expected = chained(x, lm, roots=roots, chain=teacher)
    out = chained(x, lm, roots=roots, chain=teacher)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert all(torch.count_nonzero(chained.chain_proj.grad[i]) > 0 for i in range(3))


def test_chained_heads_errors_and_roundtrip(tmp_path):
    with pytest.raises(ValueError, match="needs condition_on_root"):
        _cfg(condition_on_chain=True)
    model = _randomise(MedusaHeads(_cfg(num_heads=3, condition_on_root=True, condition_on_chain=True)))
    x, lm, roots = torch.randn(4, H), torch.randn(V, H), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="chain has shape"):
        model(x, lm, roots=roots, chain=torch.zeros(4, 3, dtype=torch.long))
    model.save_pretrained(tmp_path / "h")
    loaded = MedusaHeads.from_pretrained(tmp_path / "h")
    assert loaded.config.condition_on_chain and torch.equal(loaded(x, lm, roots=roots), model(x, lm, roots=roots))


# ---------------------------------------------------------------- our format


@pytest.mark.parametrize("kind", ["shared", "lora", "full"])
def test_save_load_roundtrip(tmp_path, kind):
    cfg = _cfg(num_heads=3, num_layers=2, lm_head=kind, lora_rank=3, base_model="HuggingFaceTB/SmolLM2-135M",
               tree=[[0], [0, 0], [1]], accuracies=[[0.5, 0.7], [0.3, 0.4], [0.2, 0.3]])
    model = _randomise(MedusaHeads(cfg))
    model.save_pretrained(tmp_path / "heads")
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == ["config.json", "heads.safetensors"]
    loaded = MedusaHeads.from_pretrained(tmp_path / "heads")
    assert loaded.config == cfg
    x, lm = torch.randn(2, 4, H), torch.randn(V, H)
    assert torch.equal(loaded(x, lm), model(x, lm))
    # The bare weights file works too; dtype is applied on load.
    weights = tmp_path / "heads" / "heads.safetensors"
    half = MedusaHeads.from_pretrained(weights, dtype=torch.bfloat16, lm_head_weight=lm)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_our_format_errors_name_file_and_key(tmp_path):
    MedusaHeads(_cfg(num_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        MedusaHeads.from_pretrained(tmp_path, vocab_size=V + 1)
    with pytest.raises(ValueError, match="hidden_size"):
        MedusaHeads.from_pretrained(tmp_path, lm_head_weight=torch.randn(V, H + 1))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_heads": 3}))
    with pytest.raises(ValueError, match=r"heads\.safetensors.*missing key 'heads\.2\.0\.linear\.weight'"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": H * 2}))
    bad_shape = r"heads\.safetensors: key 'heads\.0\.0\.linear\.(weight|bias)' has shape"
    with pytest.raises(ValueError, match=bad_shape):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "lm_head": "tied"}))
    with pytest.raises(ValueError, match="lm_head"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        MedusaHeads.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        MedusaHeads.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.pt"):
        MedusaHeads.from_pretrained(tmp_path / "empty")


# ---------------------------------------------------------------- foreign formats


def _fd_state(num_heads: int, num_layers: int, full: bool, prefix: str = "", seed: int = 1) -> dict:
    """A state dict in FasterDecoding's `medusa_head` key layout."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for h in range(num_heads):
        for l in range(num_layers):
            state[f"{prefix}{h}.{l}.linear.weight"] = torch.randn(H, H, generator=g) * 0.3
            state[f"{prefix}{h}.{l}.linear.bias"] = torch.randn(H, generator=g)
        if full:
            state[f"{prefix}{h}.{num_layers}.weight"] = torch.randn(V, H, generator=g)
    return state


def _by_hand(
    state: dict, x: torch.Tensor, num_heads: int, num_layers: int, lm: torch.Tensor | None
) -> torch.Tensor:
    """lm_head_i(x + silu(W x + b)) chained over the layers, head by head."""
    out = []
    for h in range(num_heads):
        y = x
        for l in range(num_layers):
            y = y + F.silu(y @ state[f"{h}.{l}.linear.weight"].T + state[f"{h}.{l}.linear.bias"])
        w = lm if lm is not None else state[f"{h}.{num_layers}.weight"]
        out.append(y @ w.T)
    return torch.stack(out)


def _write_fd_dir(path: Path, state: dict, suffix: str, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    weights = path / f"medusa_lm_head{suffix}"
    if suffix == ".pt":
        torch.save(state, weights)
    else:
        save_file(state, str(weights))
    return weights


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fasterdecoding_full_heads_load(tmp_path, suffix):
    state = _fd_state(num_heads=3, num_layers=2, full=True)
    weights = _write_fd_dir(tmp_path / "fd", state, suffix, medusa_num_heads=3, medusa_num_layers=2,
                            base_model_name_or_path="lmsys/vicuna-7b-v1.3", transformers_version="4.32.0")
    x = torch.randn(2, 5, H)
    for path in (tmp_path / "fd", weights):  # the directory or the bare file
        heads = MedusaHeads.from_pretrained(path)
        cfg = heads.config
        shape = (cfg.num_heads, cfg.num_layers, cfg.lm_head, cfg.hidden_size, cfg.vocab_size)
        assert shape == (3, 2, "full", H, V)
        assert cfg.base_model == "lmsys/vicuna-7b-v1.3"
        torch.testing.assert_close(heads(x), _by_hand(state, x, 3, 2, None))


def test_fasterdecoding_bare_file_without_config(tmp_path):
    state = _fd_state(num_heads=2, num_layers=1, full=True)
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    heads = MedusaHeads.from_pretrained(tmp_path / "medusa_lm_head.pt")
    assert (heads.config.num_heads, heads.config.base_model) == (2, None)


def test_fasterdecoding_config_with_fewer_heads_warns_and_loads_all(tmp_path):
    # Published FasterDecoding configs say 2 heads for 5 trained ones; their
    # loader overrides the config, and so do we.
    _write_fd_dir(tmp_path, _fd_state(5, 1, True), ".pt", medusa_num_heads=2, medusa_num_layers=1)
    with pytest.warns(UserWarning, match="medusa_num_heads"):
        assert MedusaHeads.from_pretrained(tmp_path).config.num_heads == 5
    _write_fd_dir(tmp_path, _fd_state(5, 1, True), ".pt", medusa_num_heads=6, medusa_num_layers=1)
    with pytest.raises(ValueError, match="config.json: key 'medusa_num_heads' is 6"):
        MedusaHeads.from_pretrained(tmp_path)
    _write_fd_dir(tmp_path, _fd_state(5, 1, True), ".pt", medusa_num_heads=5, medusa_num_layers=2)
    with pytest.raises(ValueError, match="medusa_num_layers"):
        MedusaHeads.from_pretrained(tmp_path)


@pytest.mark.parametrize("layout", ["tgi_v2", "fasterdecoding_v2"])
def test_shared_lm_head_layouts_load(tmp_path, layout):
    # TGI's MedusaHeadV2 / FasterDecoding's config version "2": ResBlocks only,
    # the base lm_head does the vocab projection.
    state = _fd_state(num_heads=3, num_layers=1, full=False)
    suffix = ".safetensors" if layout == "tgi_v2" else ".pt"
    extra = {"version": "2"} if layout == "fasterdecoding_v2" else {}
    _write_fd_dir(tmp_path, state, suffix, medusa_num_heads=3, medusa_num_layers=1,
                  base_model_name_or_path="mistralai/Mistral-7B-Instruct-v0.2", **extra)
    lm = torch.randn(V, H)
    with pytest.raises(ValueError, match="vocab_size"):
        MedusaHeads.from_pretrained(tmp_path)  # nothing says how big the vocab is
    heads = MedusaHeads.from_pretrained(tmp_path, lm_head_weight=lm)
    assert (heads.config.lm_head, heads.config.num_heads, heads.config.vocab_size) == ("shared", 3, V)
    x = torch.randn(4, H)
    torch.testing.assert_close(heads(x, lm), _by_hand(state, x, 3, 1, lm))


def test_tgi_full_layout_loads(tmp_path):
    # TGI's MedusaHeadV1 reads medusa_lm_head.safetensors with `{i}.{n}.weight`.
    state = _fd_state(num_heads=2, num_layers=1, full=True)
    _write_fd_dir(tmp_path, state, ".safetensors", medusa_num_heads=2, medusa_num_layers=1,
                  base_model_name_or_path="lmsys/vicuna-7b-v1.3")
    x = torch.randn(3, H)
    torch.testing.assert_close(MedusaHeads.from_pretrained(tmp_path)(x), _by_hand(state, x, 2, 1, None))


@pytest.mark.parametrize("layout", ["single", "sharded", "pickle"])
def test_medusa2_full_model_checkpoint_loads(tmp_path, layout):
    # Medusa-2 saves the whole model: heads sit under `medusa_head.` next to the base.
    heads_state = _fd_state(num_heads=2, num_layers=1, full=True, prefix="medusa_head.")
    base_state = {"model.embed_tokens.weight": torch.randn(V, H), "lm_head.weight": torch.randn(V, H)}
    config = {"model_type": "llama", "hidden_size": H, "vocab_size": V,
              "medusa_num_heads": 2, "medusa_num_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if layout == "sharded":
        save_file(base_state, str(tmp_path / "model-00001-of-00002.safetensors"))
        save_file(heads_state, str(tmp_path / "model-00002-of-00002.safetensors"))
        weight_map = {k: "model-00001-of-00002.safetensors" for k in base_state}
        weight_map |= {k: "model-00002-of-00002.safetensors" for k in heads_state}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    elif layout == "pickle":
        torch.save({**base_state, **heads_state}, tmp_path / "pytorch_model.bin")
    else:
        save_file({**base_state, **heads_state}, str(tmp_path / "model.safetensors"))
    heads = MedusaHeads.from_pretrained(tmp_path)
    assert heads.config.base_model == str(tmp_path)
    plain = {k.removeprefix("medusa_head."): v for k, v in heads_state.items()}
    x = torch.randn(3, H)
    torch.testing.assert_close(heads(x), _by_hand(plain, x, 2, 1, None))


def test_base_model_without_heads_is_rejected(tmp_path):
    save_file({"model.embed_tokens.weight": torch.randn(V, H)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="medusa_head"):
        MedusaHeads.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("1.0.linear.bias"), r"missing key '1\.0\.linear\.bias'"),
        (lambda s: s.pop("1.1.weight"), r"missing key '1\.1\.weight'"),
        (lambda s: s.update({"1.1.weight": torch.randn(V + 1, H)}), r"key '1\.1\.weight' has shape"),
        (lambda s: s.update({"0.0.linear.weight": torch.randn(H, H + 1)}),
         r"key '0\.0\.linear\.weight' has shape \(8, 9\), expected \(8, 8\)"),
        (lambda s: s.update({"3.0.linear.weight": torch.randn(H, H)}),
         r"inconsistent heads: found head indices \[0, 1, 3\]"),
        (lambda s: s.update({"0.0.lora.weight": torch.randn(H)}), r"unexpected key '0\.0\.lora\.weight'"),
    ],
)
def test_foreign_errors_name_file_and_key(tmp_path, edit, message):
    state = _fd_state(num_heads=2, num_layers=1, full=True)
    edit(state)
    _write_fd_dir(tmp_path, state, ".pt", medusa_num_layers=1)
    with pytest.raises(ValueError, match=message) as info:
        MedusaHeads.from_pretrained(tmp_path)
    assert "medusa_lm_head.pt" in str(info.value)


def test_malicious_pickle_is_rejected_without_running(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # what a hostile checkpoint would carry
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    state = _fd_state(num_heads=1, num_layers=1, full=True)
    torch.save({**state, "0.0.linear.bias": Payload()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="refusing to load"):
        MedusaHeads.from_pretrained(tmp_path)
    assert not marker.exists()
