"""Training configuration: YAML recipes in configs/train/ plus command-line overrides.

Sections are frozen dataclasses that validate themselves; `load_config` merges
a recipe with `section.key=value` overrides, refusing unknown keys by name (a
typo must not silently train with a default).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

RECIPES_DIR = Path(__file__).resolve().parent.parent / "configs" / "train"

# Prompt kinds built from the train split's own texts (training/context_tasks.py), after Spec-Bench's
# weakest categories: summarization, retrieval-augmented QA, German->English translation, short QA.
CONTEXT_TASK_KINDS = ("summarize", "rag", "translate", "qa")


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
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"data.limit must be >= 0 (or null), got {self.limit}")
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
    log_every: int = 10
    max_steps: int | None = None  # stop early (tests, quick runs)
    # share of each head's loss taken against the base's full next-token distribution rather than
    # the sampled token alone (0: hard targets only, the Medusa paper's Medusa-1)
    soft_targets: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.lr <= 0 or self.grad_accum < 1 or self.max_tokens_per_batch < 16:
            raise ValueError("train: epochs >= 1, lr > 0, grad_accum >= 1, max_tokens_per_batch >= 16")
        if not 0 <= self.soft_targets <= 1:
            raise ValueError(f"train.soft_targets must be in [0, 1], got {self.soft_targets}")
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


@dataclass(frozen=True)
class EvalSection:
    tree_nodes: int = 64  # the searched tree saved with the heads
    max_rank: int = 10
    max_sequences: int = 200


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
