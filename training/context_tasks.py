"""Context-task prompts: summaries, documents + question, translations and short questions.

Heads learn what the base model says in the contexts they are trained on. The
file prompts (math, instructions, the model's own prompts) never show it an
article to summarize, retrieved documents to answer from, a sentence to
translate or a short factual question, and Spec-Bench's categories of those
kinds are where acceptance is lowest. So after the train split's greedy
answers exist, this module turns texts we already have (the train prompts and
those answers, never Spec-Bench) into such prompts; `distill` answers them
greedily and trains on the result, as for any prompt.

Kinds (`data.context_task_kinds`), sharing `data.context_tasks` evenly:
- summarize: "Summarize: <passage>" and other phrasings; a passage is one or
  two long greedy answers (or a long Self-Instruct input), clipped.
- rag: 2-4 answers as numbered documents in shuffled order, one of them the
  answer to the question that follows (that answer's own user prompt).
- translate: an English sentence (the first of an answer, or the opening
  statement of a prompt) into German (or French / Spanish), then, in
  a second pass, the model's own translation back into English. Half of the
  share is each pass; the second keeps only finished, non-degenerate outputs.
- qa: short questions (one sentence ending with "?", no digits: not math),
  reworded as "Answer briefly: <q>", "Q: <q>\\nA:", lower case, ... The user
  prompts hold few, so the model also writes some: a user turn opened with a
  question word ("Who", "When", ...) and sampled (`question_starters`).

Everything here is model-free and seeded; templates and rules go into the
distillation cache manifest (`context_knobs`).
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

from medusa.training.config import DataSection
from medusa.training.prompt_mix import SELF_PROMPT_RULES, is_degenerate

logger = logging.getLogger(__name__)

# (template, weight). Spec-Bench's own phrasing gets the largest weight; the others keep heads from
# fitting one wording.
SUMMARIZE_TEMPLATES = (
    ("Summarize: {passage}", 4),
    ("Summarize the following article in a few sentences:\n\n{passage}", 2),
    ("TL;DR of this text:\n{passage}", 1),
    ("Write a short summary of this text.\n\n{passage}", 1),
    ("{passage}\n\nSummarize the text above in three sentences.", 1),
)
RAG_TEMPLATES = (
    ("{documents}\n\nQuestion: {question}", 2),
    ("Answer the question using the documents below.\n\n{documents}\n\nQuestion: {question}\nAnswer:", 2),
    ("Use the following passages to answer the question.\n\n{documents}\n\n{question}", 1),
    ("Context:\n{documents}\n\nBased on the context above, answer: {question}", 1),
)
RAG_DOCUMENT_FORMATS = (("Document [{number}] {text}", 2), ("Passage {number}:\n{text}", 1))
TRANSLATE_TEMPLATES = (
    ("Translate English to {language}: {sentence}", 3),
    ("Translate the following sentence into {language}:\n{sentence}", 1),
)
TRANSLATE_BACK_TEMPLATES = (
    ("Translate {language} to English: {text}", 3),
    ("Translate this {language} text into English:\n{text}", 1),
)
TRANSLATE_LANGUAGES = (("German", 3), ("French", 1), ("Spanish", 1))  # Spec-Bench translates German
QUESTION_STARTERS = (("Who", 3), ("What", 3), ("When", 2), ("Where", 2), ("Which", 1), ("How", 1), ("Why", 1))
QA_TEMPLATES = (
    ("Answer briefly: {question}", 2),
    ("{question_lower}", 2),  # natural-questions style: lower case
    ("Question: {question}\nAnswer:", 1),
    ("Q: {question}\nA:", 1),
    ("{question} Answer in one sentence.", 1),
)

# Which texts qualify and how long prompts may get (prompt length is generation memory: keep < ~1k tokens).
CONTEXT_RULES = {
    "passage_min_words": 80,  # summarize: shorter texts do not read like an article
    "passage_max_tokens": 512,  # summarize: the passage (one or two texts) is clipped to this
    "two_passage_share": 0.4,  # summarize: share of passages made of two texts
    "rag_documents": (2, 4),  # documents per prompt, the answering one included
    "rag_document_min_words": 20,
    "rag_document_max_tokens": 160,  # each document is clipped to this
    "rag_question_max_words": 120,
    "sentence_words": (6, 40),  # translate: an English sentence of this many words
    "qa_max_words": 25,
    "question_temperature": 0.8,  # qa: sampling the written questions (CPU check: 64% kept, at 1.0 45%)
    "question_max_tokens": 32,  # qa: a written question not finished within this many tokens is dropped
    "translate_back_share": 0.5,  # of the translate share: the second pass (into English)
    "draws_per_prompt": 4,  # attempts per wanted prompt before giving up on duplicates
}

SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
PLAIN_SENTENCE = re.compile(r"[A-Z][^\n*#`|_<>{}\[\]]*[a-z][^\n*#`|_<>{}\[\]]*[.!?]")


@dataclass(frozen=True)
class ContextPrompt:
    kind: str  # summarize, rag, translate, qa, or translate_back (the second translation pass)
    text: str  # the user message
    language: str | None = None  # translate: the target language; translate_back: the source language


@dataclass(frozen=True)
class ContextSources:
    """The train split's texts that prompts are built from."""

    passages: list[str]  # long texts (>= passage_min_words), unclipped: summarize
    documents: list[str]  # greedy answers clipped to a document's size: rag
    questions: list[str]  # questions[i] is the user prompt that documents[i] answers
    sentences: list[str]  # plain English sentences: translate
    short_questions: list[str]  # one-line questions: qa


def context_knobs(settings: DataSection) -> dict[str, Any]:
    """The train manifest's context-task settings; {} when off, so older caches still match."""
    if not settings.context_tasks:
        return {}
    return {"context_tasks": settings.context_tasks, "context_task_kinds": list(settings.context_task_kinds),
            "context_rules": CONTEXT_RULES, "degenerate_rules": SELF_PROMPT_RULES,
            "context_templates": {"summarize": SUMMARIZE_TEMPLATES, "rag": RAG_TEMPLATES,
                                  "rag_documents": RAG_DOCUMENT_FORMATS, "translate": TRANSLATE_TEMPLATES,
                                  "translate_back": TRANSLATE_BACK_TEMPLATES, "languages": TRANSLATE_LANGUAGES,
                                  "qa": QA_TEMPLATES, "question_starters": QUESTION_STARTERS}}


def kind_counts(total: int, kinds: Sequence[str]) -> dict[str, int]:
    """Prompts wanted per kind: `total` shared evenly (earlier kinds take the remainder); the translate
    share is split between its first pass and `translate_back`, which is an upper bound (outputs are filtered)."""
    counts = {kind: total // len(kinds) + (i < total % len(kinds)) for i, kind in enumerate(kinds)}
    if "translate" in counts:
        back = int(counts["translate"] * CONTEXT_RULES["translate_back_share"])
        counts["translate"], counts["translate_back"] = counts["translate"] - back, back
    return counts


# ---- texts ------------------------------------------------------------------------------------------


def answer_text(tokenizer: Any, answer: Sequence[int], eos_ids: Sequence[int]) -> str:
    """An answer's text; one that ran out of tokens is cut after its last full sentence."""
    text = tokenizer.decode(list(answer), skip_special_tokens=True).strip()
    return text if answer and answer[-1] in set(eos_ids) else cut_to_sentence(text, keep=0.0)


def finished_text(tokenizer: Any, answer: Sequence[int], eos_ids: Sequence[int]) -> str | None:
    """A finished, non-degenerate answer's text; None otherwise (it would teach a broken continuation)."""
    if not answer or answer[-1] not in set(eos_ids):
        return None
    text = tokenizer.decode(list(answer), skip_special_tokens=True).strip()
    return None if is_degenerate(text) else text


def cut_to_sentence(text: str, keep: float) -> str:
    """Text up to its last sentence end if that keeps more than `keep` of it, else unchanged."""
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    return text[: ends[-1]] if ends and ends[-1] > keep * len(text) else text


def clip_text(tokenizer: Any, text: str, max_tokens: int) -> str:
    """At most max_tokens tokens of text, ending at a sentence end when one lies in the second half."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return cut_to_sentence(tokenizer.decode(ids[:max_tokens]).strip(), keep=0.5)


def first_sentence(text: str, more_follows: bool = False) -> str | None:
    """The first sentence of text's first paragraph if it is plain English prose of sentence_words words.

    more_follows: only when more of the paragraph follows (a GSM8K question's opening statement), not
    a one-sentence instruction, which the model would carry out instead of translating.
    """
    paragraph = text.strip().split("\n", 1)[0].strip()
    match = SENTENCE_END.search(paragraph)
    if match is None or (more_follows and not paragraph[match.end():].strip()):
        return None
    sentence = paragraph[: match.end()]
    low, high = CONTEXT_RULES["sentence_words"]
    ok = PLAIN_SENTENCE.fullmatch(sentence) and low <= len(sentence.split()) <= high
    return sentence if ok else None


def is_short_question(text: str) -> bool:
    """One sentence ending with "?", 3 to qa_max_words words, no digits: a question with a short
    answer, not a math word problem (GSM8K's short ones have numbers, most have several sentences)."""
    text = text.strip()
    one_sentence = "\n" not in text and [m.end() for m in SENTENCE_END.finditer(text)] == [len(text)]
    return (one_sentence and text.endswith("?") and 3 <= len(text.split()) <= CONTEXT_RULES["qa_max_words"]
            and not re.search(r"\d", text))


def instance_input(user_text: str) -> str:
    """The input of an "instruction\\n\\ninput" prompt (Self-Instruct); "" for other prompts."""
    return user_text.split("\n\n", 1)[1].strip() if "\n\n" in user_text else ""


def question_starters(count: int, seed: int) -> list[str]:
    """`count` question words (QUESTION_STARTERS' weights) that open a user turn for the model to finish."""
    return random.Random(f"context:{seed}:questions").choices(
        [w for w, _ in QUESTION_STARTERS], weights=[n for _, n in QUESTION_STARTERS], k=count)


def written_questions(tokenizer: Any, starters: Sequence[str], outputs: Sequence[Sequence[int]],
                      eos_ids: Sequence[int]) -> list[str]:
    """starter + the model's continuation, for continuations that finish a short question; distinct."""
    kept = []
    for starter, output in zip(starters, outputs):
        if output and output[-1] in set(eos_ids):
            question = (starter + tokenizer.decode(list(output), skip_special_tokens=True)).strip()
            if is_short_question(question) and not is_degenerate(question):
                kept.append(question)
    kept = list(dict.fromkeys(kept))
    logger.info("context tasks: kept %d of %d written questions", len(kept), len(starters))
    return kept


def gather_sources(tokenizer: Any, users: Sequence[str], answers: Sequence[str],
                   written: Sequence[str] = ()) -> ContextSources:
    """Sort the train texts into the pools each kind draws from; degenerate texts are left out.

    users[i] is train prompt i's last user message, answers[i] its greedy answer's text; `written`
    are model-written short questions (`written_questions`).
    """
    rules = CONTEXT_RULES
    long_inputs = [instance_input(u) for u in users]
    passages = [t for t in [*answers, *long_inputs] if len(t.split()) >= rules["passage_min_words"]]
    passages = [t for t in dict.fromkeys(passages) if not is_degenerate(t)]
    pairs = [(u, a) for u, a in zip(users, answers) if len(a.split()) >= rules["rag_document_min_words"]
             and len(u.split()) <= rules["rag_question_max_words"] and not is_degenerate(a)]
    documents = [clip_text(tokenizer, a, rules["rag_document_max_tokens"]) for _, a in pairs]
    found = [first_sentence(u, more_follows=True) for u in users] + [first_sentence(a) for a in answers]
    sentences = [s for s in found if s and not is_degenerate(s)]
    short = [u.strip() for u in users if is_short_question(u) and not is_degenerate(u)] + list(written)
    return ContextSources(passages, documents, [u.strip() for u, _ in pairs], list(dict.fromkeys(sentences)),
                          list(dict.fromkeys(short)))


# ---- one prompt of each kind ----------------------------------------------------------------------


def pick(rng: random.Random, weighted: Sequence[tuple[str, int]]) -> str:
    return rng.choices([item for item, _ in weighted], weights=[w for _, w in weighted])[0]


def summarize_prompt(sources: ContextSources, rng: random.Random, tokenizer: Any) -> ContextPrompt | None:
    """One passage (sometimes two joined, like a longer article), clipped, under a summarize template."""
    if not sources.passages:
        return None
    two = len(sources.passages) > 1 and rng.random() < CONTEXT_RULES["two_passage_share"]
    texts = rng.sample(sources.passages, 2 if two else 1)
    passage = clip_text(tokenizer, "\n\n".join(texts), CONTEXT_RULES["passage_max_tokens"])
    return ContextPrompt("summarize", pick(rng, SUMMARIZE_TEMPLATES).format(passage=passage))


def rag_prompt(sources: ContextSources, rng: random.Random, tokenizer: Any = None) -> ContextPrompt | None:
    """A question, the document that answers it and 1-3 other documents, shuffled and numbered."""
    if len(sources.documents) < 2:
        return None
    low, high = CONTEXT_RULES["rag_documents"]
    answering = rng.randrange(len(sources.documents))
    others = [i for i in rng.sample(range(len(sources.documents)), min(high, len(sources.documents)))
              if i != answering]
    chosen = [answering, *others[: rng.randint(low, high) - 1]]
    rng.shuffle(chosen)
    form = pick(rng, RAG_DOCUMENT_FORMATS)
    documents = "\n\n".join(form.format(number=n + 1, text=sources.documents[i]) for n, i in enumerate(chosen))
    text = pick(rng, RAG_TEMPLATES).format(documents=documents, question=sources.questions[answering])
    return ContextPrompt("rag", text)


def translate_prompt(sources: ContextSources, rng: random.Random, tokenizer: Any = None) -> ContextPrompt | None:
    """An English sentence to translate into German (mostly), French or Spanish."""
    if not sources.sentences:
        return None
    language = pick(rng, TRANSLATE_LANGUAGES)
    text = pick(rng, TRANSLATE_TEMPLATES).format(language=language, sentence=rng.choice(sources.sentences))
    return ContextPrompt("translate", text, language)


def qa_prompt(sources: ContextSources, rng: random.Random, tokenizer: Any = None) -> ContextPrompt | None:
    """A short question, reworded."""
    if not sources.short_questions:
        return None
    question = rng.choice(sources.short_questions)
    text = pick(rng, QA_TEMPLATES).format(question=question, question_lower=question.lower())
    return ContextPrompt("qa", text)


BUILDERS: dict[str, Callable[[ContextSources, random.Random, Any], ContextPrompt | None]] = {
    "summarize": summarize_prompt, "rag": rag_prompt, "translate": translate_prompt, "qa": qa_prompt,
}


# ---- whole sets -------------------------------------------------------------------------------------


def draw_distinct(make: Callable[[], ContextPrompt | None], count: int, taken: set[str]) -> list[ContextPrompt]:
    """Up to `count` prompts whose texts are new to `taken` (updated); fewer when the pool runs dry."""
    found: list[ContextPrompt] = []
    for _ in range(count * CONTEXT_RULES["draws_per_prompt"]):
        if len(found) == count:
            break
        prompt = make()
        if prompt is not None and prompt.text not in taken:
            taken.add(prompt.text)
            found.append(prompt)
    return found


def build_context_prompts(tokenizer: Any, users: Sequence[str], answers: Sequence[str], counts: dict[str, int],
                          seed: int, written: Sequence[str] = ()) -> list[ContextPrompt]:
    """The first-pass prompts, kind by kind; each kind has its own seeded stream (adding a kind
    leaves the others' prompts as they were). Never a copy of a train prompt."""
    sources = gather_sources(tokenizer, users, answers, written)
    taken = {u.strip() for u in users}
    prompts: list[ContextPrompt] = []
    for kind, build in BUILDERS.items():
        if counts.get(kind, 0) > 0:
            rng = random.Random(f"context:{seed}:{kind}")
            made = draw_distinct(partial(build, sources, rng, tokenizer), counts[kind], taken)
            logger.info("context tasks: %d of %d %s prompts", len(made), counts[kind], kind)
            prompts += made
    return prompts


def back_translation_prompts(first: Sequence[ContextPrompt], outputs: Sequence[str | None], count: int,
                             seed: int) -> list[ContextPrompt]:
    """Second translation pass: up to `count` of the model's finished translations (outputs[i] answers
    first[i]; None: unfinished or degenerate, dropped), each to be translated back into English.

    Only a translation's first line is kept: the source is one sentence, and later lines are mostly the
    model's comments on its translation.
    """
    rng = random.Random(f"context:{seed}:translate_back")
    lines = [(p.language, text.strip().split("\n", 1)[0].strip())
             for p, text in zip(first, outputs) if p.kind == "translate" and text]
    kept = list(dict.fromkeys((lang, line) for lang, line in lines if not is_degenerate(line)))
    chosen = rng.sample(kept, min(count, len(kept)))
    logger.info("context tasks: %d of %d translate_back prompts (%d usable translations)", len(chosen), count,
                len(kept))
    return [ContextPrompt("translate_back", pick(rng, TRANSLATE_BACK_TEMPLATES).format(language=lang, text=text),
                          lang) for lang, text in chosen]
