"""Token sequences and their on-disk cache for self-distillation.

Generating answers with the base model is the slow part of training, so the
sequences are kept in a directory:

    manifest.json           what produced them: model, prompt files (size +
                            sha256), number of conversations, generation
                            settings, format version
    sequences.safetensors   tokens [T] int32, offsets [N + 1] int64,
                            prompt_lengths [N] int32, optionally
                            loss_mask [T] bool (see `Sequences`)

A cache is reused only when its manifest matches the wanted one; otherwise
`load_cached` says why (a log line) and returns None so the caller regenerates.
The replaced cache is kept beside the new one as `<name>@<fingerprint>` (the
last KEPT_VERSIONS of them), so going back to earlier settings reuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SEQUENCES = "sequences.safetensors"


@dataclass(frozen=True, eq=False)
class Sequences:
    """Token sequences (prompt + generated response) in flat tensors.

    Sequence i is tokens[offsets[i]:offsets[i + 1]]; its (first) response
    starts at position prompt_lengths[i]. Without `loss_mask` every token from
    there on is trained on; a multi-turn sequence (answer, follow-up user
    turn, second answer) carries a `loss_mask` that is False on its user turns.
    """

    tokens: torch.Tensor  # [total_tokens] int32
    offsets: torch.Tensor  # [num_seqs + 1] int64, offsets[0] == 0
    prompt_lengths: torch.Tensor  # [num_seqs] int32
    loss_mask: torch.Tensor | None = None  # [total_tokens] bool, True on assistant tokens; None: from prompt_lengths

    def __post_init__(self) -> None:
        t, o, p = self.tokens, self.offsets, self.prompt_lengths
        if t.dtype != torch.int32 or o.dtype != torch.int64 or p.dtype != torch.int32:
            raise ValueError(f"dtypes must be tokens int32, offsets int64, prompt_lengths int32; "
                             f"got {t.dtype}, {o.dtype}, {p.dtype}")
        if t.dim() != 1 or o.dim() != 1 or p.dim() != 1 or len(o) != len(p) + 1:
            raise ValueError(f"shapes must be [T], [N + 1], [N]; got {tuple(t.shape)}, {tuple(o.shape)}, "
                             f"{tuple(p.shape)}")
        if t.device.type != "cpu" or o.device.type != "cpu" or p.device.type != "cpu":
            raise ValueError("Sequences tensors live on the CPU")
        if o[0] != 0 or o[-1] != len(t):
            raise ValueError(f"offsets must run from 0 to len(tokens)={len(t)}; got {o[0]}..{o[-1]}")
        lengths = o.diff()
        if len(p) and (bool((lengths < 1).any()) or bool((p < 0).any()) or bool((p > lengths).any())):
            raise ValueError("every sequence needs >= 1 token and 0 <= prompt_length <= length")
        if len(t) and int(t.min()) < 0:
            raise ValueError("token ids must be >= 0")
        m = self.loss_mask
        if m is not None and (m.dtype != torch.bool or m.shape != t.shape or m.device.type != "cpu"):
            raise ValueError(f"loss_mask must be a CPU bool tensor shaped like tokens {tuple(t.shape)}; "
                             f"got {m.dtype} {tuple(m.shape)}")

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                   loss_masks: Sequence[Sequence[bool] | None] | None = None) -> Sequences:
        """`loss_masks[i]` (one bool per token) overrides sequence i's prompt-length mask; None entries keep it."""
        if len(seqs) != len(prompt_lengths) or (loss_masks is not None and len(loss_masks) != len(seqs)):
            raise ValueError(f"{len(seqs)} sequences but {len(prompt_lengths)} prompt lengths"
                             + (f" and {len(loss_masks)} loss masks" if loss_masks is not None else ""))
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        flat = [int(x) for s in seqs for x in s]
        if flat and max(flat) >= 2**31:
            raise ValueError("token ids must fit in int32")
        tokens = torch.tensor(flat, dtype=torch.int32)
        mask = None
        if loss_masks is not None and any(m is not None for m in loss_masks):
            if any(m is not None and len(m) != len(s) for s, m in zip(seqs, loss_masks)):
                raise ValueError("every loss mask needs one entry per token of its sequence")
            mask = torch.cat([torch.zeros(0, dtype=torch.bool)] + [  # [total_tokens]
                torch.arange(len(s)) >= p if m is None else torch.tensor(list(m), dtype=torch.bool)
                for s, p, m in zip(seqs, prompt_lengths, loss_masks)])
        return cls(tokens, offsets, torch.tensor(list(prompt_lengths), dtype=torch.int32), mask)

    def __len__(self) -> int:
        return len(self.prompt_lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """(ids [L] int64, prompt_len) of sequence i."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        i %= n
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[start:end].long(), int(self.prompt_lengths[i])

    @cached_property
    def lengths(self) -> torch.Tensor:
        """[N] int64 tokens per sequence."""
        return self.offsets.diff()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_response_tokens(self) -> int:
        if self.loss_mask is not None:
            return int(self.loss_mask.sum())
        return int((self.lengths - self.prompt_lengths.long()).sum())

    def row_loss_mask(self, i: int, length: int) -> torch.Tensor:
        """[length] bool: which of the first `length` tokens of sequence i are trained on."""
        if self.loss_mask is None:
            return torch.arange(length) >= int(self.prompt_lengths[i])
        start = int(self.offsets[i])
        return self.loss_mask[start: start + length]

    def select(self, indices: Sequence[int] | torch.Tensor) -> Sequences:
        """The sequences at `indices`, in that order, as new flat tensors."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        lengths = self.lengths[idx]  # [K]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])  # [K + 1]
        # Token j of the output comes from old start + (j - new start) of its sequence.
        shift = torch.repeat_interleave(self.offsets[idx] - offsets[:-1], lengths)  # [total]
        gather = torch.arange(int(offsets[-1]), dtype=torch.int64) + shift
        mask = None if self.loss_mask is None else self.loss_mask[gather]
        return Sequences(self.tokens[gather], offsets, self.prompt_lengths[idx].clone(), mask)

    def split(self, holdout_fraction: float, seed: int) -> tuple[Sequences, Sequences]:
        """(train, heldout), split by distinct prompt so held-out prompts are unseen.

        Several samples of one prompt (samples_per_prompt > 1) stay together.
        """
        if not 0 <= holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
        groups = self._prompt_groups()  # [N] group id per sequence
        num_groups = int(groups.max()) + 1 if len(groups) else 0
        num_held = 0
        if holdout_fraction > 0:
            if num_groups < 2:
                raise ValueError(f"cannot hold out prompts from {num_groups} distinct prompt(s)")
            num_held = min(max(1, round(num_groups * holdout_fraction)), num_groups - 1)
        held_groups = np.random.default_rng(seed).permutation(num_groups)[:num_held]
        is_held = np.isin(groups, held_groups)
        return self.select(np.flatnonzero(~is_held)), self.select(np.flatnonzero(is_held))

    def _prompt_groups(self) -> np.ndarray:
        """[N] id of each sequence's prompt, numbered by first appearance."""
        ids: dict[bytes, int] = {}
        tokens, offsets = self.tokens.numpy(), self.offsets.tolist()
        groups = [ids.setdefault(tokens[offsets[i]: offsets[i] + int(p)].tobytes(), len(ids))
                  for i, p in enumerate(self.prompt_lengths.tolist())]
        return np.asarray(groups, dtype=np.int64)



def manifest_for(
    model_id: str | os.PathLike[str],
    sources: Sequence[str | os.PathLike[str]],
    settings: Mapping[str, Any],
    num_conversations: int | None = None,
) -> dict[str, Any]:
    """The manifest describing sequences generated by `model_id` from `sources`.

    `settings` should hold everything that changes the output (max_new_tokens,
    temperature, samples_per_prompt, seed, limit, system prompt, ...): every
    key takes part in the match. Values must be JSON-serialisable.
    """
    if num_conversations is not None and num_conversations < 0:
        raise ValueError(f"num_conversations must be >= 0, got {num_conversations}")
    try:  # round-trip so the in-memory manifest equals what a later load reads back
        settings = json.loads(json.dumps(dict(settings), sort_keys=True))
    except (TypeError, ValueError) as err:
        raise ValueError(f"generation settings must be JSON-serialisable: {err}") from err
    return {
        "format": FORMAT_VERSION,
        "model": str(model_id),
        "sources": [_describe_file(Path(source)) for source in sources],
        "num_conversations": None if num_conversations is None else int(num_conversations),
        "settings": settings,
    }


def _describe_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"path": str(path.resolve()), "name": path.name, "size": path.stat().st_size,
            "sha256": digest.hexdigest()}


# Weight and config files a model folder's fingerprint reads (their names, sizes, first and last MiB)
MODEL_FILES = (".safetensors", ".bin", ".gguf", ".json")


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """12 hex digits that change when a model folder's (or file's) weights or config do: new weights saved
    under the same path must not reuse answers the old ones wrote. Cheap on any size: each file's name and
    size and its first and last MiB, not the whole of it."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in MODEL_FILES and p.is_file())
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def manifest_difference(cached: Mapping[str, Any], wanted: Mapping[str, Any]) -> str | None:
    """Why `cached` cannot stand in for `wanted` (None when it can).

    Source files match by name, size and sha256, not by absolute path, so a
    moved checkout keeps its cache.
    """
    for key in ("format", "model", "num_conversations"):
        if cached.get(key) != wanted.get(key):
            return f"{key} differs (cached {cached.get(key)!r}, wanted {wanted.get(key)!r})"
    fields = ("name", "size", "sha256")
    cached_files = [tuple(f.get(k) for k in fields) for f in cached.get("sources", [])]
    wanted_files = [tuple(f.get(k) for k in fields) for f in wanted.get("sources", [])]
    if cached_files != wanted_files:
        changed = sorted({f[0] for f in set(cached_files) ^ set(wanted_files)})
        return f"prompt files differ ({', '.join(map(str, changed)) or 'order'})"
    cached_settings, wanted_settings = cached.get("settings", {}), wanted.get("settings", {})
    for key in sorted(set(cached_settings) | set(wanted_settings)):
        if cached_settings.get(key) != wanted_settings.get(key):
            return (f"settings.{key} differs (cached {cached_settings.get(key)!r}, "
                    f"wanted {wanted_settings.get(key)!r})")
    return None


def load_cached(cache_dir: str | os.PathLike[str], manifest: Mapping[str, Any]) -> Sequences | None:
    """The cached sequences if `cache_dir`, or one of the earlier versions kept beside it, holds ones made as
    `manifest` says, else None (a log line says why)."""
    cache_dir = Path(cache_dir)
    mismatch = _mismatch(cache_dir, manifest)
    if mismatch is not None:
        earlier = version_dir(cache_dir, manifest)
        if _mismatch(earlier, manifest) is not None:
            logger.info("%s; generating", mismatch)
            return None
        logger.info("%s; an earlier version matches", mismatch)
        cache_dir = earlier
    try:
        tensors = load_file(cache_dir / SEQUENCES)
        sequences = Sequences(tensors["tokens"], tensors["offsets"], tensors["prompt_lengths"],
                              tensors.get("loss_mask"))
    except Exception as err:  # truncated / foreign file: regenerate rather than crash
        logger.warning("distillation cache %s is unreadable (%s); regenerating", cache_dir / SEQUENCES, err)
        return None
    logger.info("reusing %d cached sequences (%d tokens) from %s", len(sequences), sequences.num_tokens, cache_dir)
    return sequences


def _mismatch(cache_dir: Path, manifest: Mapping[str, Any]) -> str | None:
    """Why the cache in `cache_dir` cannot serve `manifest` (None when it can)."""
    manifest_path = cache_dir / MANIFEST
    if not manifest_path.is_file() or not (cache_dir / SEQUENCES).is_file():
        return f"no distillation cache at {cache_dir}"
    try:
        cached = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        return f"distillation cache manifest {manifest_path} is unreadable ({err})"
    reason = manifest_difference(cached, manifest)
    return None if reason is None else f"distillation cache at {cache_dir} was made otherwise: {reason}"


# Earlier versions of a cache kept beside it (`train@<fingerprint>`), so that going back to earlier settings
# does not generate again (hours on a CPU); the oldest beyond this many are deleted
KEPT_VERSIONS = 3


def manifest_fingerprint(manifest: Mapping[str, Any]) -> str:
    """12 hex digits naming what a manifest's data is, as `manifest_difference` compares it (files by name,
    size and sha256, not by path)."""
    same = {**manifest, "sources": [{k: f.get(k) for k in ("name", "size", "sha256")}
                                    for f in manifest.get("sources", [])]}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:12]


def version_dir(cache_dir: Path, manifest: Mapping[str, Any]) -> Path:
    return cache_dir.parent / f"{cache_dir.name}@{manifest_fingerprint(manifest)}"


def _keep_as_earlier_version(cache_dir: Path) -> None:
    """Move a cache that is about to be replaced to its version folder (it goes if its manifest is unreadable),
    and drop the oldest versions beyond KEPT_VERSIONS."""
    try:
        manifest = json.loads((cache_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return
    target = version_dir(cache_dir, manifest)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(cache_dir, target)
    versions = sorted(cache_dir.parent.glob(f"{cache_dir.name}@*"), key=lambda p: p.stat().st_mtime)
    for old in versions[:-KEPT_VERSIONS]:
        shutil.rmtree(old, ignore_errors=True)


def save_cached(cache_dir: str | os.PathLike[str], manifest: Mapping[str, Any], sequences: Sequences) -> None:
    """Write the cache atomically: build it in a sibling temp dir, then swap it in.

    A reader sees the old cache, no cache, or the new one, never a half-written one.
    """
    cache_dir = Path(cache_dir)
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"manifest has format {manifest.get('format')!r}; build it with manifest_for")
    _check_replaceable(cache_dir)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp_dir = cache_dir.parent / f".{cache_dir.name}.tmp-{tag}"
    old_dir = cache_dir.parent / f".{cache_dir.name}.old-{tag}"
    tmp_dir.mkdir()
    try:
        tensors = {"tokens": sequences.tokens.contiguous(), "offsets": sequences.offsets.contiguous(),
                   "prompt_lengths": sequences.prompt_lengths.contiguous()}
        if sequences.loss_mask is not None:
            tensors["loss_mask"] = sequences.loss_mask.contiguous()
        save_file(tensors, tmp_dir / SEQUENCES, metadata={"format": str(FORMAT_VERSION)})
        (tmp_dir / MANIFEST).write_text(json.dumps(dict(manifest), indent=2, sort_keys=True) + "\n")
        if cache_dir.exists():  # kept as an earlier version (os.replace cannot overwrite a non-empty dir)
            _keep_as_earlier_version(cache_dir)
        if cache_dir.exists():  # its manifest was unreadable: moved aside and deleted
            os.replace(cache_dir, old_dir)
        os.replace(tmp_dir, cache_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        shutil.rmtree(old_dir, ignore_errors=True)


def _check_replaceable(cache_dir: Path) -> None:
    # Never move aside (and delete) a directory that holds anything but a cache.
    if not cache_dir.exists():
        return
    if not cache_dir.is_dir():
        raise ValueError(f"{cache_dir} exists and is not a directory")
    foreign = sorted(p.name for p in cache_dir.iterdir() if p.name not in (MANIFEST, SEQUENCES))
    if foreign:
        raise ValueError(f"{cache_dir} holds files that are not a distillation cache ({foreign[:5]}); "
                         f"refusing to replace it")
