"""Self-distillation: the base model writes the answers its heads will learn from.

Heads trained on the base model's own outputs learn what it *will* say, which
is what acceptance rewards. Optionally the model first writes user prompts of
its own (`data.self_prompts`), which join the file prompts. Prompts are split
into train and held-out before generation. Train prompts get one greedy
answer plus their source's number of sampled ones; a `followup_fraction` of
them continue with a generic second user turn and a second greedy answer (the
2-turn conversation replaces the 1-turn one). With `data.context_tasks`, the
train prompts and greedy answers are then turned into summarize / documents +
question / translate / short-question prompts (`context_tasks`), answered
greedily and added to the train split. Held-out prompts get one greedy answer
(greedy decoding is what the held-out acceptance simulation reproduces).
Self-prompts, train and held-out sequences are cached on disk.
"""

from __future__ import annotations

import logging
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
from medusa.training.context_tasks import (
    CONTEXT_RULES, answer_text, back_translation_prompts, build_context_prompts, context_knobs, finished_text,
    kind_counts, question_starters, written_questions,
)
from medusa.training.data import Sequences, load_cached, manifest_for, save_cached
from medusa.training.prompt_mix import (
    FOLLOWUPS, SELF_PROMPT_RULES, PromptPool, followup_prompt, open_user_turn_ids, pick_followups,
    select_self_prompts,
)

GREEDY = SamplingConfig()
logger = logging.getLogger(__name__)


def split_prompts(num: int, holdout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(num))
    random.Random(seed).shuffle(order)
    cut = int(round(num * holdout_fraction))
    return sorted(order[cut:]), sorted(order[:cut])


def generate_many(model: DecoderModel, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                  max_new_tokens: int, batch_size: int, eos_ids: Sequence[int],
                  generator: torch.Generator | None = None, desc: str = "generating") -> list[list[int]]:
    """One continuation per prompt, in the prompts' order; batches of similar prompt length (little padding)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    # counts answers, not batches: "0/15" over a CPU's hours said nothing of the rate or what was left
    with tqdm(total=len(order), desc=desc, unit="answer", dynamic_ncols=True) as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            answers = generate_padded(model, [prompts[i] for i in chunk], max_new_tokens, sampling, eos_ids,
                                      generator)
            for i, answer in zip(chunk, answers):
                out[i] = answer
            bar.update(len(chunk))
    return out


def distill_train(model: DecoderModel, tokenizer: Any, conversations: list, prompts: list[list[int]],
                  samples: list[int], settings: DataSection, eos_ids: Sequence[int], seed: int,
                  system_prompt: str | None) -> Sequences:
    """Greedy answers (some continued by a follow-up turn), the sampled answers, then the context tasks'."""
    device = model.embed_tokens.weight.device
    run = dict(max_new_tokens=settings.max_new_tokens, batch_size=settings.distill_batch_size, eos_ids=eos_ids)
    greedy = generate_many(model, prompts, GREEDY, desc="self-distilling (train, greedy)", **run)
    seqs = [p + a for p, a in zip(prompts, greedy)]
    masks: list[list[bool] | None] = [None] * len(seqs)  # None: loss on everything after the prompt
    followups = pick_followups(len(prompts), settings.followup_fraction, seed)
    if followups:
        turns = {i: followup_prompt(tokenizer, conversations[i], prompts[i], greedy[i], text, system_prompt)
                 for i, text in followups.items()}
        second = generate_many(model, [ids for ids, _ in turns.values()], GREEDY,
                               desc="self-distilling (train, follow-up turns)", **run)
        for (i, (ids, mask)), answer in zip(turns.items(), second):
            seqs[i], masks[i] = ids + answer, mask + [True] * len(answer)
    jobs = [i for i, n in enumerate(samples) for _ in range(n)]
    if jobs:
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        hot = SamplingConfig(temperature=settings.sample_temperature)
        sampled = generate_many(model, [prompts[i] for i in jobs], hot, generator=generator,
                                desc="self-distilling (train, sampled)", **run)
        seqs += [prompts[i] + a for i, a in zip(jobs, sampled)]
    context, answers = distill_context_tasks(model, tokenizer, conversations, greedy, settings, eos_ids, seed,
                                             system_prompt, run)
    seqs += [p + a for p, a in zip(context, answers)]
    prompt_lengths = [len(p) for p in prompts] + [len(prompts[i]) for i in jobs] + [len(p) for p in context]
    return Sequences.from_lists(seqs, prompt_lengths, masks + [None] * (len(jobs) + len(context)))


def distill_context_tasks(model: DecoderModel, tokenizer: Any, conversations: list, greedy: list[list[int]],
                          settings: DataSection, eos_ids: Sequence[int], seed: int, system_prompt: str | None,
                          run: dict[str, Any]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy answers) of the context-task prompts built from the train conversations and their
    greedy answers; the model's finished translations take a second pass, back into English."""
    if not settings.context_tasks:
        return [], []
    counts = kind_counts(settings.context_tasks, settings.context_task_kinds)
    users = [conversation[-1]["content"] for conversation in conversations]
    written = write_short_questions(model, tokenizer, counts.get("qa", 0), seed, system_prompt, eos_ids,
                                    settings.distill_batch_size)
    texts = [answer_text(tokenizer, a, eos_ids) for a in greedy]
    first = build_context_prompts(tokenizer, users, texts, counts, seed, written)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.text}], system_prompt) for p in first]
    answers = generate_many(model, prompts, GREEDY, desc="self-distilling (context tasks)", **run)
    outputs = [finished_text(tokenizer, a, eos_ids) for a in answers]
    back = back_translation_prompts(first, outputs, counts.get("translate_back", 0), seed)
    back_prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.text}], system_prompt) for p in back]
    answers += generate_many(model, back_prompts, GREEDY, desc="self-distilling (context tasks, into English)", **run)
    return prompts + back_prompts, answers


def write_short_questions(model: DecoderModel, tokenizer: Any, count: int, seed: int, system_prompt: str | None,
                          eos_ids: Sequence[int], batch_size: int) -> list[str]:
    """Up to `count` short questions the model writes in a user turn opened with a question word (sampled)."""
    if not count:
        return []
    starters = question_starters(count, seed)
    prefix = open_user_turn_ids(tokenizer, system_prompt)  # [P] ids ending "<|im_start|>user\n"
    prompts = [prefix + tokenizer(s, add_special_tokens=False)["input_ids"] for s in starters]
    generator = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed + 3)
    outputs = generate_many(model, prompts, SamplingConfig(temperature=CONTEXT_RULES["question_temperature"]),
                            CONTEXT_RULES["question_max_tokens"], batch_size, eos_ids, generator,
                            desc="writing short questions")
    return written_questions(tokenizer, starters, outputs, eos_ids)


def write_self_prompts(model: DecoderModel, tokenizer: Any, model_id: str, settings: DataSection, cache_dir: Path,
                       seed: int, system_prompt: str | None, eos_ids: Sequence[int]) -> list[list[dict[str, str]]]:
    """`settings.self_prompts` samples of a user message from an open user turn, filtered; cached."""
    knobs = {"self_prompts": settings.self_prompts, "temperature": settings.self_prompt_temperature,
             "max_tokens": settings.self_prompt_max_tokens, "rules": SELF_PROMPT_RULES, "seed": seed,
             "system_prompt": system_prompt}
    manifest = manifest_for(model_id, [], knobs)
    kept = load_cached(cache_dir / "self_prompts", manifest)
    if kept is None:
        prefix = open_user_turn_ids(tokenizer, system_prompt)  # [P] ids ending "<|im_start|>user\n"
        generator = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed + 2)
        outputs = generate_many(model, [prefix] * settings.self_prompts,
                                SamplingConfig(temperature=settings.self_prompt_temperature),
                                settings.self_prompt_max_tokens, settings.distill_batch_size, eos_ids, generator,
                                desc="self-prompting")
        messages = select_self_prompts(tokenizer, outputs, eos_ids)
        kept = Sequences.from_lists(messages, [0] * len(messages))
        save_cached(cache_dir / "self_prompts", manifest, kept)
    texts = [tokenizer.decode(kept[i][0].tolist(), skip_special_tokens=True) for i in range(len(kept))]
    return [[{"role": "user", "content": text}] for text in texts]


def distill_knobs(settings: DataSection) -> dict[str, Any]:
    """Every setting that changes the generated data (the cache manifest's settings), but the context
    tasks' (`context_knobs`): those change only the train split."""
    skip = ("cache_dir", "distill_batch_size", "context_tasks", "context_task_kinds")
    knobs = {k: v for k, v in asdict(settings).items() if k not in skip}
    if knobs["sources"]:  # a source without a column mapping keeps the manifest it had before mappings existed
        knobs["sources"] = [{k: v for k, v in s.items() if k != "columns" or v is not None} for s in knobs["sources"]]
    if settings.followup_fraction > 0:
        knobs["followups"] = list(FOLLOWUPS)
    if settings.self_prompts > 0:
        knobs["self_prompt_rules"] = SELF_PROMPT_RULES
    else:  # unused: changing them must not regenerate anything
        del knobs["self_prompt_temperature"], knobs["self_prompt_max_tokens"]
    return knobs


def distill_plan(settings: DataSection, train_samples: list[int] | None, heldout: int, cache_dir: Path) -> str:
    """What self-distillation is about to generate (it takes hours for the default recipe on a CPU, and its
    progress bars count batches of distill_batch_size): answers per kind, and how to make it smaller."""
    parts = []
    if train_samples is not None:
        n = len(train_samples)
        answers = [f"{n} greedy", _plural(sum(train_samples), "sampled answer")]
        if settings.followup_fraction:
            answers.append(_plural(round(n * settings.followup_fraction), "follow-up turn"))
        if settings.context_tasks:
            answers.append(f"about {settings.context_tasks} context tasks")
        parts.append(f"{_plural(n, 'train prompt')} ({' + '.join(answers)})")
    if heldout:
        parts.append(f"{_plural(heldout, 'held-out prompt')} (greedy)")
    hint = " (data.limit=N reads N prompts per file)" if settings.limit is None else ""
    return (f"self-distilling {' and '.join(parts)}, up to {settings.max_new_tokens} new tokens each, in batches of "
            f"{settings.distill_batch_size}, cached in {cache_dir}{hint}")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def self_distill(model: DecoderModel, tokenizer: Any, pool: PromptPool, model_id: str, settings: DataSection,
                 cache_dir: Path, seed: int, system_prompt: str | None, eos_ids: Sequence[int],
                 train: bool = True, heldout_limit: int | None = None) -> tuple[Sequences | None, Sequences]:
    """(train, held-out) sequences, from the cache when model, files and settings match. train=False: the
    held-out split alone (`medusa-train eval`) and None, since the train split's answers are most of the
    generation; with `heldout_limit` N and no full held-out split cached, only its first N prompts are answered
    (cached apart, in heldout-first-N: eval measures N sequences, so answering the rest was hours wasted)."""
    knobs = {**distill_knobs(settings), "seed": seed, "system_prompt": system_prompt}
    only = {"train": context_knobs(settings), "heldout": {}}  # held-out keeps its cache when context tasks change
    manifests = {split: manifest_for(model_id, pool.sources, {**knobs, **only[split], "split": split},
                                     len(pool.conversations)) for split in ("train", "heldout")}
    # eval (train=False) reads the held-out split alone: the train split's cache is not even looked for
    cached = {split: load_cached(cache_dir / split, manifest) if train or split == "heldout" else None
              for split, manifest in manifests.items()}
    if cached["heldout"] is not None and (cached["train"] is not None or not train):
        return cached["train"], cached["heldout"]
    partial = None
    if not train and heldout_limit is not None:  # eval: the first N held-out prompts are all it reads
        split = f"heldout-first-{heldout_limit}"
        partial = (cache_dir / split, manifest_for(model_id, pool.sources, {**knobs, "split": split},
                                                   len(pool.conversations)))
        cached["heldout"] = load_cached(*partial)
        if cached["heldout"] is not None:
            return None, cached["heldout"]
    conversations, samples = list(pool.conversations), list(pool.samples)
    if settings.self_prompts:
        written = write_self_prompts(model, tokenizer, model_id, settings, cache_dir, seed, system_prompt, eos_ids)
        conversations += written
        samples += [settings.samples_per_prompt] * len(written)
    prompts = [chat_prompt_ids(tokenizer, conv, system_prompt) for conv in conversations]
    train_idx, held_idx = split_prompts(len(prompts), settings.holdout_fraction, seed)
    if partial is not None:
        held_idx = held_idx[:heldout_limit]
    logger.info("%s", distill_plan(settings, [samples[i] for i in train_idx] if train and cached["train"] is None
                                   else None, len(held_idx) if cached["heldout"] is None else 0, cache_dir))
    if train and cached["train"] is None:
        cached["train"] = distill_train(model, tokenizer, [conversations[i] for i in train_idx],
                                        [prompts[i] for i in train_idx], [samples[i] for i in train_idx],
                                        settings, eos_ids, seed, system_prompt)
        save_cached(cache_dir / "train", manifests["train"], cached["train"])
    if cached["heldout"] is None:
        held = [prompts[i] for i in held_idx]
        answers = generate_many(model, held, GREEDY, settings.max_new_tokens, settings.distill_batch_size, eos_ids,
                                desc="self-distilling (heldout)")
        cached["heldout"] = Sequences.from_lists([p + a for p, a in zip(held, answers)], [len(p) for p in held])
        save_cached(*(partial or (cache_dir / "heldout", manifests["heldout"])), cached["heldout"])
    return cached["train"], cached["heldout"]
