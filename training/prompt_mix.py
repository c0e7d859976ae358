"""The prompt mix for self-distillation, beyond reading files.

Heads learn what the base model says on the prompts they are trained on, so
prompt diversity is what carries acceptance to new tasks. This module holds the
model-free parts: per-source caps and sample counts (`gather_prompts`),
generic follow-up user turns that turn an answer into a 2-turn conversation
(`pick_followups`, `followup_prompt`), and the open user turn plus the drop
rules for prompts the base model writes itself (`open_user_turn_ids`,
`select_self_prompts`). `distill` runs the model over them.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from medusa.chat import chat_prompt_ids, validate_messages
from medusa.training.config import DataSection, SourceSpec
from medusa.training.data import DATA_DIR, default_sources, load_conversations, resolve_source

logger = logging.getLogger(__name__)

Conversation = list[dict[str, str]]

# Second user turns that fit almost any first answer (MT-Bench's turn 2 refines or transforms turn 1).
FOLLOWUPS = (
    "Can you explain that in more detail?",
    "Summarize your answer in two sentences.",
    "Rewrite that for a ten-year-old.",
    "Give another example.",
    "Translate your answer into French.",
    "Make your answer shorter.",
    "What are the main assumptions behind your answer?",
    "Turn your answer into a bulleted list.",
    "Can you double-check your answer and correct any mistakes?",
    "Rewrite your answer in a more formal tone.",
    "What would be a counterargument to that?",
    "Give me a step-by-step version of that.",
    "Write a short poem based on your answer.",
    "How would you explain this to an expert?",
    "Write a title and a one-line summary for your answer.",
)

# Drop rules for model-written prompts; they are part of the cache manifest.
SELF_PROMPT_RULES = {
    "min_words": 3,  # fewer words: not a usable request
    "min_distinct_ratio": 0.4,  # distinct / all words, checked from 8 words on: below it, looping text
    "max_chunk_repeats": 7,  # a chunk of <= 10 characters 8 or more times in a row ("hahaha...", "!!!!...")
}


@dataclass(frozen=True)
class PromptPool:
    """Prompts read from files, with their per-prompt sample counts."""

    conversations: list[Conversation]
    samples: list[int]  # sampled answers per conversation (train split), besides the greedy one
    sources: list[Path]  # files read, in order (their hashes go into the cache manifest)


def source_specs(data: DataSection) -> list[tuple[SourceSpec, Path]]:
    """Each prompt source with its resolved file; raises naming every file that is missing, so a run fails
    before it loads a model, not minutes into it."""
    specs = data.sources if data.sources else [SourceSpec(path=str(p)) for p in default_sources()]
    resolved = [(spec, resolve_source(spec.path)) for spec in specs]
    missing = [str(path) for _, path in resolved if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"prompt source not found: {', '.join(missing)} (relative names are also looked "
                                f"for in {DATA_DIR}; set $MEDUSA_DATA_DIR to change that folder)")
    return resolved


def gather_prompts(data: DataSection, seed: int) -> PromptPool:
    """Every source's conversations, capped by its `max_prompts` (a seeded subset)."""
    conversations, samples, paths = [], [], []
    for spec, path in source_specs(data):
        found = cap_prompts(load_conversations(path, spec.columns, limit=data.limit), spec.max_prompts, seed, path.name)
        per_prompt = data.samples_per_prompt if spec.samples_per_prompt is None else spec.samples_per_prompt
        conversations += found
        samples += [per_prompt] * len(found)
        paths.append(path)
        logger.info("%s: %d prompts, %d sampled answers each", path.name, len(found), per_prompt)
    return PromptPool(conversations, samples, paths)


def cap_prompts(conversations: list[Conversation], max_prompts: int | None, seed: int,
                name: str) -> list[Conversation]:
    """At most max_prompts of them, in file order, chosen by (seed, file name) so a source's
    subset does not change when other sources are added or reordered."""
    if max_prompts is None or len(conversations) <= max_prompts:
        return conversations
    keep = sorted(random.Random(f"{seed}:{name}").sample(range(len(conversations)), max_prompts))
    return [conversations[i] for i in keep]


def pick_followups(num: int, fraction: float, seed: int) -> dict[int, str]:
    """{conversation index: follow-up text} for round(num * fraction) conversations, seeded."""
    rng = random.Random(f"followups:{seed}")
    chosen = sorted(rng.sample(range(num), round(num * fraction)))
    return {i: rng.choice(FOLLOWUPS) for i in chosen}


def followup_prompt(tokenizer: Any, conversation: Conversation, prompt: Sequence[int], answer: Sequence[int],
                    followup: str, system_prompt: str | None) -> tuple[list[int], list[bool]]:
    """(ids, loss mask) of the 2-turn prompt: first prompt, first answer, follow-up user turn.

    Built through the chat template from the answer's text, as a chat client
    sends a second turn. The mask is True on the first answer's tokens where
    they reappear verbatim right after the first prompt (all of them with a
    prefix-stable template like ChatML), False on both user turns, so a
    2-turn training sequence trains only on assistant text.
    """
    text = tokenizer.decode(list(answer), skip_special_tokens=True)
    messages = [*conversation, {"role": "assistant", "content": text}, {"role": "user", "content": followup}]
    ids = chat_prompt_ids(tokenizer, messages, system_prompt)
    start, same = len(prompt), 0
    if ids[:start] == list(prompt):
        while same < min(len(answer), len(ids) - start) and ids[start + same] == answer[same]:
            same += 1
    return ids, [False] * start + [True] * same + [False] * (len(ids) - start - same)


def open_user_turn_ids(tokenizer: Any, system_prompt: str | None) -> list[int]:
    """Token ids of the chat up to an open user turn (ChatML: system turn + "<|im_start|>user\\n").

    Found generically: render a conversation with a marker as the user's text
    and cut at the marker, so any chat template works.
    """
    marker = "\x00MEDUSA_USER\x00"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = validate_messages(messages + [{"role": "user", "content": marker}])
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if marker not in text:
        raise ValueError("the chat template does not show the user's text verbatim; cannot open a user turn")
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def select_self_prompts(tokenizer: Any, outputs: Sequence[Sequence[int]],
                        eos_ids: Sequence[int]) -> list[list[int]]:
    """The model-written user messages worth answering, as token ids without the end-of-turn token.

    Dropped: unfinished (no end-of-turn within the token budget), too short,
    repetitive, or a duplicate of an earlier one (case and spacing ignored).
    """
    eos, seen, kept = set(eos_ids), set(), []
    dropped = {"unfinished": 0, "degenerate": 0, "duplicate": 0}
    for out in outputs:
        if not out or out[-1] not in eos:
            dropped["unfinished"] += 1
            continue
        text = tokenizer.decode(list(out[:-1]), skip_special_tokens=True)
        key = " ".join(text.lower().split())
        if is_degenerate(text):
            dropped["degenerate"] += 1
        elif key in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(key)
            kept.append(list(out[:-1]))
    logger.info("self-prompting: kept %d of %d prompts; dropped %s", len(kept), len(outputs), dropped)
    return kept


def is_degenerate(text: str) -> bool:
    """Too short or looping: see SELF_PROMPT_RULES."""
    words = text.lower().split()
    if len(words) < SELF_PROMPT_RULES["min_words"]:
        return True
    if len(words) >= 8 and len(set(words)) < SELF_PROMPT_RULES["min_distinct_ratio"] * len(words):
        return True
    repeats = SELF_PROMPT_RULES["max_chunk_repeats"]
    return re.search(r"(.{1,10}?)\1{%d,}" % repeats, text, flags=re.DOTALL) is not None
