"""Readers for the Medusa-head checkpoint layouts found in the wild.

Every reader returns a `RawHeads`: a plain config dict (the input of
`HeadsConfig.from_dict`) and a state dict already renamed to `MedusaHeads`'
own keys. `medusa.heads` builds and shape-checks the module; this file only
finds files, reads tensors safely and renames them.

Layouts understood:

- ours: `config.json` with `"format": "medusa-heads"` + `heads.safetensors`.
- FasterDecoding/Medusa (Medusa-1, `medusa_lm_head.pt`, or
  `medusa_lm_head.safetensors` from `train_legacy.py`) and the same files as
  text-generation-inference reads them: bare keys `{head}.{layer}.linear.weight`,
  `{head}.{layer}.linear.bias` and, for per-head vocab projections,
  `{head}.{num_layers}.weight`. Without the last key (FasterDecoding's config
  `version: "2"`, TGI's `MedusaHeadV2`) the heads reuse the base lm_head.
  `config.json` holds `medusa_num_heads`, `medusa_num_layers`,
  `base_model_name_or_path`.
- Medusa-2 full models (base weights + heads in one HF checkpoint): the same
  keys under the `medusa_head.` prefix inside `model.safetensors`, its shards,
  or `pytorch_model.bin`.

FasterDecoding builds each head as `nn.Sequential(*([ResBlock(h)] * n), ...)`,
so its layers are one shared module and a checkpoint with n > 1 stores n equal
copies under `{head}.{layer}.*`; loading them as n independent blocks computes
the same function.

Pickles are only ever opened with `torch.load(..., weights_only=True)`:
loading a checkpoint never runs code from it.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

OUR_FORMAT = "medusa-heads"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
# Preference order: safetensors first, a pickle only when nothing else exists.
LEGACY_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
FULL_MODEL_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FULL_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
HEAD_PREFIX = "medusa_head."
PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


@dataclass(frozen=True)
class RawHeads:
    """Heads as read from disk, before the module is built."""

    config: dict[str, Any]  # input of HeadsConfig.from_dict
    state_dict: dict[str, torch.Tensor]  # MedusaHeads keys, CPU tensors
    source: str  # file the tensors came from, for error messages


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, with errors that name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_tensors(
    path: Path, keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """Read a .safetensors or pickled state dict onto the CPU, tensor by tensor.

    `keep` selects keys; for safetensors the others are never read, so pulling
    the heads out of a multi-GB base checkpoint stays cheap.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                return {k: f.get_tensor(k) for k in f.keys() if keep is None or keep(k)}
        except SafetensorError as e:
            raise ValueError(f"{path}: unreadable safetensors file ({e})") from e
    if path.suffix not in PICKLE_SUFFIXES:
        raise ValueError(f"{path}: unsupported weights file (want .safetensors or .pt/.bin)")
    state = _load_pickle(path)
    return {k: v for k, v in state.items() if keep is None or keep(k)}


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """torch.load restricted to tensors and containers: no code from the file runs."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{path}: refusing to load: not a plain tensor state dict "
            f"(torch.load with weights_only=True failed: {reason})"
        ) from e
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: key {key!r} is not a tensor entry of a state dict")
    return state


def read_heads(path: str | Path, vocab_size: int | None = None) -> RawHeads:
    """Find and read Medusa heads at `path` (a directory or a weights file).

    `vocab_size` is only needed for heads without their own vocab projection
    whose config does not state it.
    """
    p = Path(path)
    if p.is_file():
        return _read_file(p, vocab_size)
    if not p.is_dir():
        raise FileNotFoundError(
            f"{p}: no such file or directory (hub names are not resolved here: "
            f"download the repository first, e.g. huggingface_hub.snapshot_download)"
        )
    config = read_json(p / CONFIG_FILE) if (p / CONFIG_FILE).is_file() else {}
    if config.get("format") == OUR_FORMAT or (p / WEIGHTS_FILE).is_file():
        return _read_ours(p)
    for name in LEGACY_FILES:
        if (p / name).is_file():
            return convert_medusa_state(load_tensors(p / name), config, p / name, vocab_size)
    found = _read_full_model(p)
    if found is not None:
        state, source = found
        return convert_medusa_state(state, config, source, vocab_size, base_model=str(p))
    wanted = [WEIGHTS_FILE, *LEGACY_FILES, *FULL_MODEL_INDEXES, *FULL_MODEL_FILES]
    raise FileNotFoundError(f"{p}: no Medusa heads found; looked for {', '.join(wanted)}")


def _read_file(p: Path, vocab_size: int | None) -> RawHeads:
    """A bare weights file: config from its folder when there is one."""
    config_path = p.parent / CONFIG_FILE
    config = read_json(config_path) if config_path.is_file() else {}
    if p.name == WEIGHTS_FILE or config.get("format") == OUR_FORMAT:
        return _read_ours(p.parent, p)
    # Base checkpoints hold far more than the heads: keep only `medusa_head.*`
    # when the file has any (reading the key list first costs nothing).
    keep = _head_filter(p)
    return convert_medusa_state(load_tensors(p, keep), config, p, vocab_size)


def _head_filter(p: Path) -> Callable[[str], bool] | None:
    if p.suffix != ".safetensors":
        return None  # a pickle is read whole anyway; strip_prefix sorts it out
    try:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            keys = list(f.keys())
    except SafetensorError as e:
        raise ValueError(f"{p}: unreadable safetensors file ({e})") from e
    if any(k.startswith(HEAD_PREFIX) for k in keys):
        return lambda k: k.startswith(HEAD_PREFIX)
    return None


def _read_ours(directory: Path, weights: Path | None = None) -> RawHeads:
    weights = weights or directory / WEIGHTS_FILE
    config = read_json(directory / CONFIG_FILE)
    if config.get("format") != OUR_FORMAT:
        raise ValueError(
            f"{directory / CONFIG_FILE}: key 'format' is {config.get('format')!r}, "
            f"expected {OUR_FORMAT!r} next to {weights.name}"
        )
    return RawHeads(config=config, state_dict=load_tensors(weights), source=str(weights))


def _read_full_model(directory: Path) -> tuple[dict[str, torch.Tensor], Path] | None:
    """Medusa-2 style: heads stored as `medusa_head.*` inside the base checkpoint."""
    def keep(k: str) -> bool:
        return k.startswith(HEAD_PREFIX)

    for name in FULL_MODEL_INDEXES:
        index = directory / name
        if not index.is_file():
            continue
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: key 'weight_map' missing or not an object")
        shards = sorted({str(f) for k, f in weight_map.items() if keep(k)})
        if not shards:
            raise ValueError(f"{index}: no '{HEAD_PREFIX}*' tensors: a base model without Medusa heads?")
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_tensors(directory / shard, keep))
        return state, index
    for name in FULL_MODEL_FILES:
        if (directory / name).is_file():
            state = load_tensors(directory / name, keep)
            if not state:
                raise ValueError(
                    f"{directory / name}: no '{HEAD_PREFIX}*' tensors: a base model without Medusa heads?"
                )
            return state, directory / name
    return None


def strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep only `medusa_head.*` (prefix removed) when present, else all keys."""
    if any(k.startswith(HEAD_PREFIX) for k in state):
        return {k[len(HEAD_PREFIX):]: v for k, v in state.items() if k.startswith(HEAD_PREFIX)}
    return dict(state)


@dataclass(frozen=True)
class _Layout:
    num_heads: int
    num_layers: int
    full: bool  # each head has its own `{head}.{num_layers}.weight` [V, H]


def parse_layout(state: dict[str, torch.Tensor], source: Path) -> _Layout:
    """Infer heads / layers / lm-head kind from FasterDecoding-style keys."""
    layers: dict[int, dict[int, set[str]]] = {}  # head -> layer -> {"weight", "bias"}
    lm: dict[int, int] = {}  # head -> index of its vocab projection
    for key in state:
        m = _KEY.match(key)
        if m is None:
            raise ValueError(
                f"{source}: unexpected key {key!r}; expected '{{head}}.{{layer}}.linear.weight', "
                f"'{{head}}.{{layer}}.linear.bias' or '{{head}}.{{num_layers}}.weight'"
            )
        h, l, kind = int(m[1]), int(m[2]), m[3]
        if kind == "weight":
            if h in lm:
                raise ValueError(
                    f"{source}: head {h} has two vocab projections: '{h}.{lm[h]}.weight' and {key!r}"
                )
            lm[h] = l
        else:
            layers.setdefault(h, {}).setdefault(l, set()).add(kind.split(".")[1])
    heads = sorted(set(layers) | set(lm))
    if heads != list(range(len(heads))):
        raise ValueError(
            f"{source}: inconsistent heads: found head indices {heads}, expected 0..{len(heads) - 1}"
        )
    depth = {h: _check_head(h, layers.get(h, {}), lm.get(h), source) for h in heads}
    if len(set(depth.values())) != 1:
        raise ValueError(f"{source}: heads have different numbers of layers: {depth}")
    num_layers = depth[0]
    if lm and len(lm) != len(heads):
        missing = min(set(heads) - set(lm))
        raise ValueError(f"{source}: missing key '{missing}.{num_layers}.weight' (other heads have one)")
    return _Layout(num_heads=len(heads), num_layers=num_layers, full=bool(lm))


def _check_head(h: int, layers: dict[int, set[str]], lm_index: int | None, source: Path) -> int:
    n = len(layers)
    for l in range(n):
        for part in ("weight", "bias"):
            if part not in layers.get(l, set()):
                raise ValueError(f"{source}: missing key '{h}.{l}.linear.{part}'")
    if lm_index is not None and lm_index != n:
        raise ValueError(
            f"{source}: key '{h}.{lm_index}.weight' should be '{h}.{n}.weight' (after {n} layers)"
        )
    return n


def convert_medusa_state(
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    source: Path,
    vocab_size: int | None,
    base_model: str | None = None,
) -> RawHeads:
    """FasterDecoding / TGI / Medusa-2 keys -> MedusaHeads keys and config."""
    state = strip_prefix(state)
    if not state:
        raise ValueError(f"{source}: no Medusa head tensors in the file")
    layout = parse_layout(state, source)
    _check_foreign_config(config, layout, source)
    hidden = _check_shapes(state, layout, source)
    ours = {
        f"heads.{h}.{l}.linear.{part}": state[f"{h}.{l}.linear.{part}"]
        for h in range(layout.num_heads)
        for l in range(layout.num_layers)
        for part in ("weight", "bias")
    }
    if layout.full:
        lm = [state[f"{h}.{layout.num_layers}.weight"] for h in range(layout.num_heads)]
        ours["lm_heads"] = torch.stack(lm)  # [num_heads, V, H]
        vocab_size = lm[0].shape[0]
    else:
        vocab_size = vocab_size or config.get("vocab_size")
        if vocab_size is None:
            raise ValueError(
                f"{source}: heads share the base lm_head, so vocab_size cannot be inferred: "
                f"pass vocab_size= or lm_head_weight="
            )
    base = config.get("base_model_name_or_path") or base_model
    return RawHeads(
        config={
            "hidden_size": hidden,
            "vocab_size": vocab_size,
            "num_heads": layout.num_heads,
            "num_layers": layout.num_layers,
            "lm_head": "full" if layout.full else "shared",
            "base_model": base,
        },
        state_dict=ours,
        source=str(source),
    )


def _check_shapes(state: dict[str, torch.Tensor], layout: _Layout, source: Path) -> int:
    """Check every tensor against H (from '0.0.linear.bias') and V; return H.

    Done here, not on our renamed keys, so errors name the key in the file.
    """
    bias = state["0.0.linear.bias"]
    if bias.dim() != 1:
        raise ValueError(
            f"{source}: key '0.0.linear.bias' has shape {tuple(bias.shape)}, expected [hidden_size]"
        )
    hidden = bias.shape[0]
    vocab = state[f"0.{layout.num_layers}.weight"].shape[0] if layout.full else None
    for h in range(layout.num_heads):
        expected = {f"{h}.{l}.linear.weight": (hidden, hidden) for l in range(layout.num_layers)}
        expected |= {f"{h}.{l}.linear.bias": (hidden,) for l in range(layout.num_layers)}
        if layout.full:
            expected[f"{h}.{layout.num_layers}.weight"] = (vocab, hidden)
        for key, shape in expected.items():
            found = tuple(state[key].shape)
            if found != shape:
                raise ValueError(f"{source}: key {key!r} has shape {found}, expected {shape}")
    return hidden


def _check_foreign_config(config: dict[str, Any], layout: _Layout, source: Path) -> None:
    """Cross-check `medusa_num_*` against the tensors; the tensors win."""
    where = source.parent / CONFIG_FILE
    layers = config.get("medusa_num_layers")
    if layers is not None and layers != layout.num_layers:
        raise ValueError(
            f"{where}: key 'medusa_num_layers' is {layers} "
            f"but {source} has {layout.num_layers} layers per head"
        )
    heads = config.get("medusa_num_heads")
    if heads is None:
        return
    if heads > layout.num_heads:
        raise ValueError(
            f"{where}: key 'medusa_num_heads' is {heads} but {source} has only {layout.num_heads} heads"
        )
    if heads < layout.num_heads:
        # FasterDecoding's own loader overrides such configs (published ones
        # say 2 heads for 5 trained ones), so load every head in the file.
        warnings.warn(
            f"{where}: 'medusa_num_heads' is {heads} but {source} holds "
            f"{layout.num_heads} heads; loading all of them",
            stacklevel=3,
        )
