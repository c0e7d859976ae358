"""Self-distillation: the base model writes the answers its heads will learn from.

Heads trained on the base model's own outputs learn what it *will* say, which
is what acceptance rewards. Prompts are split into train and held-out before
generation; train prompts get one greedy answer plus `samples_per_prompt`
sampled ones, held-out prompts one greedy answer (greedy decoding is what the
held-out acceptance simulation reproduces). Results are cached on disk.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from medusa.chat import chat_prompt_ids
from medusa.decoding.sampler import SamplingConfig
from medusa.decoding.static_batch import generate_padded
from medusa.model import DecoderModel
from medusa.training.config import DataSection
from medusa.training.data import Sequences, load_cached, manifest_for, save_cached


def split_prompts(num: int, holdout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(num))
    random.Random(seed).shuffle(order)
    cut = int(round(num * holdout_fraction))
    return sorted(order[cut:]), sorted(order[:cut])


def distill_split(model: DecoderModel, prompts: list[list[int]], temperatures: Sequence[float],
                  settings: DataSection, eos_ids: Sequence[int], seed: int, desc: str) -> Sequences:
    """One answer per prompt per temperature; batches of similar prompt length."""
    device = model.embed_tokens.weight.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks = [order[i:i + settings.distill_batch_size] for i in range(0, len(order), settings.distill_batch_size)]
    seqs, prompt_lengths = [], []
    bar = tqdm(total=len(chunks) * len(temperatures), desc=desc, dynamic_ncols=True)
    for index, temperature in enumerate(temperatures):
        generator = torch.Generator(device=device).manual_seed(seed + index)
        sampling = SamplingConfig(temperature=temperature)
        for chunk in chunks:
            batch = [prompts[i] for i in chunk]
            answers = generate_padded(model, batch, settings.max_new_tokens, sampling, eos_ids, generator)
            for prompt, answer in zip(batch, answers):
                seqs.append(list(prompt) + answer)
                prompt_lengths.append(len(prompt))
            bar.update(1)
    bar.close()
    return Sequences.from_lists(seqs, prompt_lengths)


def self_distill(model: DecoderModel, tokenizer: Any, conversations: list, sources: list[Path], model_id: str,
                 settings: DataSection, cache_dir: Path, seed: int, system_prompt: str | None,
                 eos_ids: Sequence[int]) -> tuple[Sequences, Sequences]:
    """(train, held-out) sequences, from the cache when model, files and settings match."""
    prompts = [chat_prompt_ids(tokenizer, conv, system_prompt) for conv in conversations]
    train_idx, held_idx = split_prompts(len(prompts), settings.holdout_fraction, seed)
    knobs = {k: v for k, v in asdict(settings).items() if k not in ("cache_dir", "distill_batch_size")}
    out = []
    for split, idx, temps in (("train", train_idx, [0.0] + [settings.sample_temperature] * settings.samples_per_prompt),
                              ("heldout", held_idx, [0.0])):
        manifest = manifest_for(model_id, sources, {**knobs, "split": split, "seed": seed,
                                                    "system_prompt": system_prompt})
        cached = load_cached(cache_dir / split, manifest)
        if cached is None:
            cached = distill_split(model, [prompts[i] for i in idx], temps, settings, eos_ids, seed,
                                   desc=f"self-distilling ({split})")
            save_cached(cache_dir / split, manifest, cached)
        out.append(cached)
    return out[0], out[1]
