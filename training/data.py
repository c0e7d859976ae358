"""Prompt sources and token batches for training Medusa heads.

Prompts come from local JSONL / JSON / Parquet files, read through `datasets`
(never from a hub), and become OpenAI-style conversations ending with a user
turn: the base model writes the answer (self-distillation), so any answer in
the file is dropped. Generated token sequences live in `Sequences` (flat
tensors, cached on disk by `distill_cache`; both re-exported here) and
`batches` cuts them into padded, token-budgeted `Batch`es in a deterministic,
resumable order.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch

from medusa.chat import validate_messages

from .distill_cache import Sequences, load_cached, manifest_for, save_cached

__all__ = [
    "DATA_DIR", "DEFAULT_SOURCES", "Batch", "Sequences", "batch_plan", "batches", "default_sources",
    "load_cached", "load_conversations", "manifest_for", "resolve_source", "save_cached",
]

logger = logging.getLogger(__name__)

Conversation = list[dict[str, str]]

# ../shared/data next to the repository (a source checkout's; $MEDUSA_DATA_DIR elsewhere): the prompt sources
# listed in SOURCES.md.
DATA_DIR = Path(os.environ.get("MEDUSA_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")
DEFAULT_SOURCES: tuple[Path, ...] = tuple(
    DATA_DIR / name
    for name in ("gsm8k_train.jsonl", "self_instruct_seed_tasks.jsonl", "self_instruct_user_oriented.jsonl")
)

# Prompt columns in auto-detection order; "input"/"instances" only refine "instruction".
PROMPT_KINDS = ("messages", "turns", "question", "instruction", "prompt")
INSTRUCTION_EXTRAS = ("input", "instances")
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def default_sources() -> list[Path]:
    """The default training prompt files that exist; raise if none do."""
    found = [path for path in DEFAULT_SOURCES if path.is_file()]
    if not found:
        raise FileNotFoundError(
            f"none of the default prompt sources exist in {DATA_DIR} "
            f"(expected {', '.join(p.name for p in DEFAULT_SOURCES)}): set $MEDUSA_DATA_DIR to the folder that "
            f"holds them, or name prompt files with data.sources=[a.jsonl,b.jsonl]"
        )
    return found


def resolve_source(path: str | Path) -> Path:
    """A prompt file path; a relative one missing from the working directory is looked up in DATA_DIR.

    So recipes can name the shared files (`gsm8k_train.jsonl`) wherever the job runs.
    """
    path = Path(path)
    if not path.is_absolute() and not path.exists() and (DATA_DIR / path).is_file():
        return DATA_DIR / path
    return path


def load_conversations(
    path: str | Path, columns: Mapping[str, str] | None = None, limit: int | None = None
) -> list[Conversation]:
    """Read one prompt file into conversations that end with a user message.

    `columns` maps our names (one of PROMPT_KINDS, plus "input"/"instances"
    with "instruction") to the file's column names; without it the first
    PROMPT_KINDS column present is used. Rows with empty prompts are skipped.
    A Self-Instruct row (instruction + instances) gives one prompt per
    distinct non-empty instance input; every other row gives one prompt.
    `limit` caps the conversations returned.
    """
    path = Path(path)
    _refuse_eval_set(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not path.read_bytes().strip():  # datasets fails on it with a bare StopIteration
        raise ValueError(f"{path}: the file is empty: no prompts")
    table = _read_table(path)
    kind, mapping = _resolve_columns(table.column_names, columns, path)
    conversations: list[Conversation] = []
    skipped = 0
    for row_index, row in enumerate(table.select_columns(sorted(set(mapping.values()))).to_list()):
        if limit is not None and len(conversations) >= limit:
            break
        try:
            found = _row_to_conversations(kind, row, mapping)
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"{path}: row {row_index} ({kind!r} column): {err}") from err
        skipped += not found
        conversations += found
    if skipped:
        logger.warning("%s: skipped %d row(s) with an empty prompt", path, skipped)
    if not conversations and limit != 0:
        raise ValueError(f"{path}: no prompts: every one of its {skipped} row(s) read has an empty {kind!r}")
    return conversations[:limit]


def _refuse_eval_set(path: Path) -> None:
    # Any spelling of the name (spec_bench, Spec-Bench, specbench) is refused.
    if "specbench" in re.sub(r"[-_ .]", "", path.name.lower()):
        raise ValueError(f"{path}: Spec-Bench is the evaluation set; never train on it")


def _read_table(path: Path) -> Any:
    """The file as a `datasets.Dataset`, parsed in memory with a throwaway cache."""
    import datasets  # training-only dependency; keep `import medusa.training.data` light

    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"{path}: unsupported prompt file type; use one of {sorted(_BUILDERS)}")
    bars_were_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        # A temporary cache_dir: nothing lands in the user's HF cache, nothing stale is reused.
        with tempfile.TemporaryDirectory(prefix="medusa-prompts-") as cache_dir:
            return datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache_dir, keep_in_memory=True
            )
    except (ValueError, TypeError, datasets.exceptions.DatasetsError) as err:
        # datasets wraps the arrow parse error; its cause says what is wrong with the file.
        raise ValueError(f"{path}: could not be parsed as {builder}: {err.__cause__ or err}") from err
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


_ACCEPTED = f"accepted: {', '.join(PROMPT_KINDS)} (instruction may add {' / '.join(INSTRUCTION_EXTRAS)})"


def check_columns(columns: Mapping[str, str]) -> str:
    """The prompt kind a column mapping {our name: the file's column} names, or a ValueError saying what is
    wrong with it (checked before any file is read: a recipe's `data.sources[i].columns` too)."""
    if not isinstance(columns, Mapping) or not all(isinstance(c, str) and c.strip() for c in columns.values()):
        raise ValueError(f"columns={columns!r} must map our names to the file's column names, "
                         f"e.g. {{'question': 'query'}}; {_ACCEPTED}")
    kinds = [k for k in columns if k in PROMPT_KINDS]
    unknown = [k for k in columns if k not in PROMPT_KINDS and k not in INSTRUCTION_EXTRAS]
    if unknown or len(kinds) != 1:
        raise ValueError(f"columns={dict(columns)!r} must name exactly one prompt kind; {_ACCEPTED}")
    if kinds[0] != "instruction" and any(k in columns for k in INSTRUCTION_EXTRAS):
        raise ValueError(f"{'/'.join(INSTRUCTION_EXTRAS)} only go with 'instruction', not {kinds[0]!r}")
    return kinds[0]


def _resolve_columns(
    available: Sequence[str], columns: Mapping[str, str] | None, path: Path
) -> tuple[str, dict[str, str]]:
    """(prompt kind, {our name: file column}) for this file."""
    if columns is None:
        kind = next((k for k in PROMPT_KINDS if k in available), None)
        if kind is None:
            raise ValueError(f"{path}: no prompt column; it has {sorted(available)}; {_ACCEPTED}")
        mapping = {kind: kind}
    else:
        kind, mapping = check_columns(columns), dict(columns)
        missing = [c for c in mapping.values() if c not in available]
        if missing:
            raise ValueError(f"{path}: columns {missing} not in the file; it has {sorted(available)}")
    if kind == "instruction":  # extras not named explicitly fall back to their usual names
        for extra in INSTRUCTION_EXTRAS:
            if extra not in mapping and extra in available:
                mapping[extra] = extra
    return kind, mapping


def _row_to_conversations(kind: str, row: dict[str, Any], mapping: dict[str, str]) -> list[Conversation]:
    """One row -> its prompts (messages ending with the user turn); [] for an empty prompt."""
    value = row[mapping[kind]]
    if kind == "messages":
        conversation = _from_messages(value)
        return [conversation] if conversation is not None else []
    if kind == "turns":
        turns = [value] if isinstance(value, str) else list(value or [])
        texts = [_text(turns[0])] if turns else []
    elif kind == "instruction":
        texts = _instruction_texts(value, row, mapping)
    else:  # question, prompt
        texts = [_text(value)]
    return [[{"role": "user", "content": text}] for text in texts if text.strip()]


def _from_messages(value: Any) -> Conversation | None:
    # Keep everything up to the last user turn: the answer after it is regenerated.
    messages = list(value or [])
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"),
                    default=None)
    if last_user is None:
        return None
    kept = validate_messages(messages[: last_user + 1])
    return kept if kept[-1]["content"].strip() else None


def _instruction_texts(instruction: Any, row: dict[str, Any], mapping: dict[str, str]) -> list[str]:
    """Instruction + "\n\n" + input, once per non-empty input; the bare instruction when there is none.

    The input comes from the `input` column (one prompt per row), else from
    each distinct `instances[].input` (the Self-Instruct layout: one task
    with several instances becomes several prompts, more diverse data).
    """
    text = _text(instruction).strip()
    if not text:
        return []
    if "input" in mapping:
        extras = [_text(row[mapping["input"]])]
    elif "instances" in mapping:
        extras = [_text(x.get("input")) for x in row[mapping["instances"]] or [] if isinstance(x, dict)]
    else:
        extras = []
    extras = list(dict.fromkeys(e.strip() for e in extras if e and e.strip()))  # distinct, in file order
    return [f"{text}\n\n{extra}" for extra in extras] or [text]


def _text(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}: {value!r:.80}")
    return value


@dataclass(frozen=True, eq=False)
class Batch:
    """Right-padded training batch; loss only on response tokens."""

    input_ids: torch.Tensor  # [B, T] int64, padded with 0
    loss_mask: torch.Tensor  # [B, T] bool, True on response tokens (prompt_len <= position < length, minus
    # later user turns when the Sequences carry a loss_mask)
    lengths: torch.Tensor  # [B] int64 tokens per row (after truncation to max_tokens)
    indices: torch.Tensor  # [B] int64 which sequences of the source `Sequences`

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        if self.loss_mask.shape != (b, t) or self.lengths.shape != (b,) or self.indices.shape != (b,):
            raise ValueError(f"Batch shapes disagree: input_ids {tuple(self.input_ids.shape)}, loss_mask "
                             f"{tuple(self.loss_mask.shape)}, lengths {tuple(self.lengths.shape)}, "
                             f"indices {tuple(self.indices.shape)}")
        if self.input_ids.dtype != torch.int64 or self.loss_mask.dtype != torch.bool:
            raise ValueError("input_ids must be int64 and loss_mask bool")

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def batch_plan(sequences: Sequences, max_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Which sequences form each batch of this epoch (cheap: only lengths are read).

    Shuffle by (seed, epoch), then within windows of ~100 batches sort by
    length so rows of one batch have similar lengths (little padding), pack
    greedily under rows * max_len <= max_tokens, and shuffle the batch order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got {seed}, {epoch}")
    lengths = np.minimum(sequences.lengths.numpy(), max_tokens)  # [N] after truncation
    if len(lengths) == 0:
        return []
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    rows_per_batch = max(1, max_tokens // max(1, int(lengths.mean())))
    window = 100 * rows_per_batch
    plan: list[np.ndarray] = []
    for start in range(0, len(order), window):
        chunk = order[start: start + window]
        plan.extend(_pack(chunk[np.argsort(lengths[chunk], kind="stable")], lengths, max_tokens))
    return [plan[i] for i in rng.permutation(len(plan))]


def _pack(sorted_indices: np.ndarray, lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Greedy packing of length-sorted (ascending) sequences under the token budget."""
    groups: list[np.ndarray] = []
    current: list[int] = []
    for i in sorted_indices.tolist():
        # Ascending order: the newcomer is the longest row of the batch.
        if current and (len(current) + 1) * int(lengths[i]) > max_tokens:
            groups.append(np.asarray(current, dtype=np.int64))
            current = []
        current.append(i)
    if current:
        groups.append(np.asarray(current, dtype=np.int64))
    return groups


def batches(
    sequences: Sequences, max_tokens: int, seed: int, epoch: int, skip: int = 0
) -> Iterator[Batch]:
    """Padded batches of one epoch with rows * max_len <= max_tokens.

    Sequences longer than max_tokens are truncated to their first max_tokens
    tokens. `skip=n` resumes after the first n batches without building them.
    """
    plan = batch_plan(sequences, max_tokens, seed, epoch)
    if not 0 <= skip <= len(plan):
        raise ValueError(f"skip={skip} outside this epoch's {len(plan)} batches "
                         f"(resuming with different data or max_tokens?)")
    return (_collate(sequences, indices, max_tokens) for indices in plan[skip:])


def _collate(sequences: Sequences, indices: np.ndarray, max_tokens: int) -> Batch:
    idx = torch.from_numpy(indices)  # [B]
    lengths = sequences.lengths[idx].clamp(max=max_tokens)  # [B]
    input_ids = torch.zeros(len(idx), int(lengths.max()), dtype=torch.int64)  # [B, T]
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.bool)  # [B, T]
    for row, (i, length) in enumerate(zip(idx.tolist(), lengths.tolist())):
        start = int(sequences.offsets[i])
        input_ids[row, :length] = sequences.tokens[start: start + length]
        loss_mask[row, :length] = sequences.row_loss_mask(i, length)  # response tokens (all assistant turns)
    return Batch(input_ids=input_ids, loss_mask=loss_mask, lengths=lengths, indices=idx)
