"""Training configuration: YAML recipes in configs/train/ plus command-line overrides.

Sections are frozen dataclasses that validate themselves; `load_config` merges
a recipe with `section.key=value` overrides, refusing unknown keys by name (a
typo must not silently train with a default).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from medusa.paths import RECIPES_DIR


# Prompt kinds built from the train split's own texts (training/context_tasks.py), after Spec-Bench's
# weakest categories: summarization, retrieval-augmented QA, German->English translation, short QA.
CONTEXT_TASK_KINDS = ("summarize", "rag", "translate", "qa")


def _require(key: str, value: Any, ok: bool, allowed: str) -> None:
    """A ValueError naming the dotted key, the value and what is allowed. `ok` is written as the allowed
    range (`0 < v`, not `not v <= 0`) so that NaN, which fails every comparison, is refused too."""
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")


def _positive(key: str, value: float) -> None:
    """A finite number > 0 (a rate or a weight: 0 would train nothing, inf would diverge at once)."""
    _require(key, value, 0 < value < math.inf, "a finite number > 0")


@dataclass(frozen=True)
class HeadsSection:
    num_heads: int = 4
    num_layers: int = 1
    lm_head: str = "shared"
    lora_rank: int = 16
    # heads also read the root token's embedding (medusa/heads.py): a fresh run's default; set false
    # for plain Medusa heads, which every other Medusa implementation can load
    condition_on_root: bool = True
    # head k also reads the tokens of heads 0..k-1's greedy chain (Hydra; medusa/heads.py); needs the root
    condition_on_chain: bool = False
    # trained heads to start from (a heads folder, or `shipped`: the default model's shipped heads): e.g.
    # Medusa-2 from Medusa-1 heads, the paper's two-stage recipe, so the heads' gradients into the LoRA
    # carry signal from the first step
    init_from: str | None = None

    def __post_init__(self) -> None:
        """The heads' own rules (HeadsConfig's), checked before hours of self-distillation rather than after."""
        from medusa.heads import HeadsConfig

        try:
            HeadsConfig(hidden_size=1, vocab_size=1, num_heads=self.num_heads, num_layers=self.num_layers,
                        lm_head=self.lm_head, lora_rank=self.lora_rank, condition_on_root=self.condition_on_root,
                        condition_on_chain=self.condition_on_chain)
        except ValueError as err:
            raise ValueError(str(err).replace("HeadsConfig.", "heads.")) from None


@dataclass(frozen=True)
class SourceSpec:
    """One prompt file and how much of it to use (a `data.sources` entry)."""

    path: str  # a path, or a file name looked up in ../shared/data when not found from the working directory
    max_prompts: int | None = None  # a seeded random subset of this many prompts; None: all of them
    samples_per_prompt: int | None = None  # sampled answers per train prompt; None: data.samples_per_prompt
    # {our name: the file's column}, e.g. {question: query} or {instruction: task, input: context}; None: the
    # first column named like a prompt kind (training/data.py, PROMPT_KINDS)
    columns: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.columns is not None:
            from medusa.training.data import check_columns  # data imports the cache, which is heavier

            check_columns(self.columns)
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError(f"path must be a non-empty string, got {self.path!r}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1 (or null for all), got {self.max_prompts}")
        if self.samples_per_prompt is not None and self.samples_per_prompt < 0:
            raise ValueError(f"samples_per_prompt must be >= 0, got {self.samples_per_prompt}")


@dataclass(frozen=True)
class DataSection:
    # None: GSM8K train + Self-Instruct from ../shared/data. Each entry is a file name / path, or a mapping
    # {path, max_prompts, samples_per_prompt}; both become SourceSpec here.
    sources: list[str | SourceSpec] | None = None
    limit: int | None = None  # first prompts read per source file (before max_prompts)
    max_new_tokens: int = 320
    # Sampled answers per train prompt besides the greedy one; a source's own setting overrides it;
    # self-written prompts use it.
    samples_per_prompt: int = 1
    sample_temperature: float = 0.7
    followup_fraction: float = 0.0  # share of train conversations given a generic 2nd user turn + 2nd answer
    self_prompts: int = 0  # user prompts the base model writes itself (sampled), each then answered greedily
    self_prompt_temperature: float = 1.0
    self_prompt_max_tokens: int = 128  # a user prompt not finished within this many tokens is dropped
    # Extra train prompts built from the train split's prompts and greedy answers (summaries, documents +
    # question, translations, short questions), each answered greedily; 0: none. Shared evenly by the kinds.
    context_tasks: int = 0
    context_task_kinds: tuple[str, ...] = CONTEXT_TASK_KINDS
    distill_batch_size: int = 256
    holdout_fraction: float = 0.02
    cache_dir: str | None = None  # None: <output_dir>/distill

    def __post_init__(self) -> None:
        if self.sources is not None:
            object.__setattr__(self, "sources", _parse_sources(self.sources))
            if not self.sources:
                raise ValueError("data.sources is empty: list at least one prompt file, or leave it out (null) "
                                 "for the default ones (GSM8K train and Self-Instruct)")
        for key in ("max_new_tokens", "distill_batch_size", "self_prompt_max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("samples_per_prompt", "self_prompts", "context_tasks"):
            if getattr(self, key) < 0:
                raise ValueError(f"data.{key} must be >= 0, got {getattr(self, key)}")
        if self.limit is not None and self.limit < 1:  # 0 would train on nothing
            raise ValueError(f"data.limit must be >= 1 (or null for every prompt), got {self.limit}")
        if not 0 <= self.holdout_fraction < 1:
            raise ValueError(f"data.holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if not 0 <= self.followup_fraction <= 1:
            raise ValueError(f"data.followup_fraction must be in [0, 1], got {self.followup_fraction}")
        if not self.sample_temperature >= 0:
            raise ValueError(f"data.sample_temperature must be >= 0, got {self.sample_temperature}")
        if not self.self_prompt_temperature > 0:  # greedy would write the same prompt every time
            raise ValueError(f"data.self_prompt_temperature must be > 0, got {self.self_prompt_temperature}")
        object.__setattr__(self, "context_task_kinds", _parse_context_kinds(self.context_task_kinds))


def _parse_context_kinds(kinds: Any) -> tuple[str, ...]:
    """A list of distinct CONTEXT_TASK_KINDS, as a tuple (YAML gives a list; equal configs compare equal)."""
    if isinstance(kinds, str) or not isinstance(kinds, (list, tuple)):
        raise ValueError(f"data.context_task_kinds must be a list of kinds ({', '.join(CONTEXT_TASK_KINDS)}), "
                         f"got {kinds!r}")
    unknown = [k for k in kinds if k not in CONTEXT_TASK_KINDS]
    if unknown:
        raise ValueError(f"data.context_task_kinds: unknown kind(s) {unknown}; known: {', '.join(CONTEXT_TASK_KINDS)}")
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"data.context_task_kinds must list each kind once and at least one, got {list(kinds)}")
    return tuple(kinds)


def _parse_sources(sources: Any) -> list[SourceSpec]:
    """Plain names and {path, max_prompts, samples_per_prompt, columns} mappings -> SourceSpecs, errors
    naming the entry."""
    if not isinstance(sources, (list, tuple)):
        raise ValueError(f"data.sources must be a list of file names or mappings, got {sources!r}")
    specs = []
    for i, item in enumerate(sources):
        where = f"data.sources[{i}]"
        if isinstance(item, SourceSpec):
            specs.append(item)
            continue
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, dict) or "path" not in item:
            raise ValueError(f"{where} must be a file name or a mapping with a 'path', got {item!r}")
        try:
            specs.append(_build(SourceSpec, item, where + "."))
        except ValueError as err:
            raise ValueError(err if where in str(err) else f"{where}: {err}") from None
    return specs


@dataclass(frozen=True)
class TrainSection:
    epochs: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    max_tokens_per_batch: int = 8192
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    decay: float = 0.8  # head k's loss weight is decay**k
    mixed_precision: str = "auto"  # auto: bf16 on a GPU, no on the CPU
    save_every: int = 500  # optimizer steps between checkpoints (0: only at the end)
    save_total_limit: int | None = None  # keep only the newest N checkpoints (null: keep all; HF's name)
    log_every: int = 10
    max_steps: int | None = None  # stop early (tests, quick runs)
    # share of each head's loss taken against the base's full next-token distribution rather than
    # the sampled token alone (0: hard targets only, the Medusa paper's Medusa-1)
    soft_targets: float = 0.0

    def __post_init__(self) -> None:
        _require("train.epochs", self.epochs, self.epochs >= 1, "an int >= 1")
        _positive("train.lr", self.lr)
        _require("train.weight_decay", self.weight_decay, 0 <= self.weight_decay < math.inf, "a finite number >= 0")
        # warmup_ratio 1 would leave no step at the full rate (the cosine starts where warmup ends)
        _require("train.warmup_ratio", self.warmup_ratio, 0 <= self.warmup_ratio < 1, "in [0, 1)")
        _require("train.max_tokens_per_batch", self.max_tokens_per_batch, self.max_tokens_per_batch >= 16,
                 "an int >= 16")
        _require("train.grad_accum", self.grad_accum, self.grad_accum >= 1, "an int >= 1")
        # clip_grad_norm_ zeroes every gradient at 0; .inf measures the norm without clipping
        _require("train.max_grad_norm", self.max_grad_norm, self.max_grad_norm > 0, "> 0 (.inf: no clipping)")
        # decay**k weights head k's loss: <= 0 would switch heads off or maximise their loss (negative weights)
        _positive("train.decay", self.decay)
        _require("train.save_every", self.save_every, self.save_every >= 0,
                 "an int >= 0 (optimizer steps between checkpoints; 0: only at the end)")
        _require("train.save_total_limit", self.save_total_limit,
                 self.save_total_limit is None or self.save_total_limit >= 1,
                 "an int >= 1 (checkpoints kept), or null to keep them all")
        # checked here, not at the first step: that comes after hours of self-distillation (a modulo by 0)
        _require("train.log_every", self.log_every, self.log_every >= 1, "an int >= 1 (optimizer steps between logs)")
        _require("train.max_steps", self.max_steps, self.max_steps is None or self.max_steps >= 0,
                 "an int >= 1, or 0 or null for no limit")
        _require("train.soft_targets", self.soft_targets, 0 <= self.soft_targets <= 1, "in [0, 1]")
        if self.mixed_precision not in ("auto", "bf16", "fp16", "no"):
            raise ValueError(f"train.mixed_precision must be auto, bf16, fp16 or no, got {self.mixed_precision!r}")


@dataclass(frozen=True)
class Medusa2Section:
    enabled: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    target_modules: list[str] = field(default_factory=lambda: ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    base_lr: float = 5e-5  # the heads keep train.lr, larger: they start from scratch
    heads_weight: float = 0.2  # lambda: total = KL(base) + lambda * heads loss
    heads_weight_warmup_steps: int = 200  # lambda ramps up from 0 so early head noise cannot move the base

    def __post_init__(self) -> None:
        """Checked even when disabled: a recipe that switches Medusa-2 on later should not hide a bad value."""
        _require("medusa2.lora_r", self.lora_r, self.lora_r >= 1, "an int >= 1 (the LoRA rank)")
        # the adapter's output is scaled by lora_alpha / lora_r: 0 would train an adapter that does nothing
        _require("medusa2.lora_alpha", self.lora_alpha, self.lora_alpha >= 1, "an int >= 1")
        modules = self.target_modules
        _require("medusa2.target_modules", modules, isinstance(modules, (list, tuple)) and len(modules) > 0
                 and all(isinstance(m, str) and m for m in modules), "a non-empty list of module names")
        _positive("medusa2.base_lr", self.base_lr)
        # 0 is allowed: KL to the base only, the heads frozen in effect
        _require("medusa2.heads_weight", self.heads_weight, 0 <= self.heads_weight < math.inf, "a finite number >= 0")
        _require("medusa2.heads_weight_warmup_steps", self.heads_weight_warmup_steps,
                 self.heads_weight_warmup_steps >= 0, "an int >= 0 (0: no ramp)")


@dataclass(frozen=True)
class EvalSection:
    tree_nodes: int = 64  # the searched tree saved with the heads
    max_rank: int = 10
    max_sequences: int = 200

    def __post_init__(self) -> None:
        from medusa.tree import MAX_NODES  # torch behind it: imported when a config is built, like heads'

        # checked here: the tree is searched after training, and a bad size there loses the run's heads
        _require("eval.tree_nodes", self.tree_nodes, 1 <= self.tree_nodes <= MAX_NODES,
                 f"an int in [1, {MAX_NODES}] (nodes of the searched tree, root included; the engine's limit)")
        _require("eval.max_rank", self.max_rank, self.max_rank >= 1, "an int >= 1")
        _require("eval.max_sequences", self.max_sequences, self.max_sequences >= 1, "an int >= 1")


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str = "out/medusa-heads"
    model: str | None = None  # None: the default model
    seed: int = 0
    heads: HeadsSection = field(default_factory=HeadsSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    medusa2: Medusa2Section = field(default_factory=Medusa2Section)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self) -> None:
        # numpy's generators refuse negative seeds, torch's take at most 64 bits (and distill adds a few)
        _require("seed", self.seed, 0 <= self.seed < 2**63, "an int in [0, 2**63)")
        # the searched tree can only hold the paths the measured ranks allow (TreeSpec.search's capacity)
        heads, rank = self.heads.num_heads, self.eval.max_rank
        capacity = sum(rank**depth for depth in range(heads + 1))
        if self.eval.tree_nodes > capacity:
            raise ValueError(f"eval.tree_nodes must be <= {capacity} for heads.num_heads={heads} and "
                             f"eval.max_rank={rank} (a tree of their top-{rank} paths), got {self.eval.tree_nodes}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return _build(cls, data, "")


def load_config(recipe: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """A recipe name (configs/train/<name>.yaml) or path, then `a.b=value` overrides (YAML-parsed values)."""
    data: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.suffix:
            path = RECIPES_DIR / f"{recipe}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
            raise FileNotFoundError(f"no training recipe {recipe!r}; named recipes: {', '.join(known)}")
        data = yaml.safe_load(path.read_text()) or {}
    return _with_overrides(data, overrides)


SAVED_CONFIG = "train_config.json"  # the effective config a run writes to its output_dir (training/pipeline.py)


def load_saved_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """A run's saved train_config.json, then `a.b=value` overrides. Its output_dir becomes the file's folder:
    the run may have started from another working directory, and its distillation cache is <output_dir>/distill."""
    path = Path(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a saved training config (a JSON mapping)")
    data["output_dir"] = str(path.parent)
    return _with_overrides(data, overrides)


def _with_overrides(data: dict[str, Any], overrides: list[str]) -> TrainConfig:
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like section.key=value")
        _set(data, key.split("."), yaml.safe_load(value))
    return TrainConfig.from_dict(data)


def _set(data: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        data = data.setdefault(key, {})
    data[keys[-1]] = value


def _build(cls, data: dict[str, Any], where: str):
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or 'root'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; "
                         f"known in {where or 'root'}: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        sub = fields[name].default_factory if fields[name].default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            value = _build(sub, value, f"{where}{name}.")
        else:
            value = _coerce(value, hints[name], where + name)
        kwargs[name] = value
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """YAML reads `3e-3` as a string and `1` as an int: bring scalars to the field's type."""
    options = typing.get_args(hint) or (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"config key {key} must not be null")
    for kind in (bool, int, float):
        if kind in options:
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"config key {key} must be true or false, got {value!r}")
            if kind is int:
                return _integer(value, key)
            try:
                return value if kind is bool else kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"config key {key} must be a {kind.__name__}, got {value!r}") from None
    return value


def _integer(value: Any, key: str) -> int:
    """12000, "12000" or "1.2e4" (YAML reads that as a string) -> 12000; 1.5, true or "many" -> an error, not 1."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)  # "12000": exact however large (a seed), where a float would round
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not number.is_integer():
        raise ValueError(f"config key {key} must be an int, got {value!r}")
    return int(number)
