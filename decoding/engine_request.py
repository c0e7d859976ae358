"""The engine's state per sequence, and the checks and conversions a request goes through on its way in and out
(prompt token ids, sampling parameters, the detokenizer, stops)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from medusa.decoding.detokenizer import FinalDetokenizer, IncrementalDetokenizer
from medusa.decoding.logits_processing import TokenRules
from medusa.decoding.outputs import RequestStats, TokenLogprob
from medusa.decoding.sampler import SamplingConfig, TokenSampler
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.sequence import Sequence
from medusa.decoding.token_guide import GuideProgress, RegexGuide


@dataclass
class EngineRequest:
    """One sequence the engine runs (a request with n > 1 is n of them): its tokens, sampling and output state."""

    seq: Sequence
    params: SamplingParams
    sampler: TokenSampler
    detok: IncrementalDetokenizer | FinalDetokenizer | None
    row: int | None = None  # the decode state row (pending root, head top-k) while it decodes
    new_text: str = ""  # released by the detokenizer since the last output
    parent_id: str = ""  # the id the client knows (several sequences share it when n > 1)
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    stats: RequestStats = field(default_factory=RequestStats)
    stop_ids: frozenset[int] = frozenset()  # tokens that end it (past min_tokens): EOS and stop_token_ids
    rules: TokenRules = TokenRules()  # bad words and guided choices as token sequences (`token_rules`)
    stop_reason: int | str | None = None  # vLLM's: the stop_token_ids token or stop string that ended it (not EOS)
    sampling: SamplingConfig = field(init=False)  # params.sampling(), built once rather than every step
    quiet: bool = False  # step() reports it only when it finishes (LLMEngine.generate's requests)
    host_always: bool = field(init=False)  # logit changes the host makes (guides, bias...): every verdict is its
    eos_banned_until: int = field(init=False)  # output tokens before which EOS is banned (min_tokens)
    device_changes: bool = field(init=False)  # bias, count penalties or min_tokens: `device_changes.py` (unless
    # the host decides the row: `LLMEngine._needs_host`)
    first_pending: bool = False  # its first output token was drawn on the device and is not read back yet
    # with params.prompt_logprobs: None for the first prompt token, then each next one's, as prefill reaches it
    prompt_logprobs: list[TokenLogprob | None] | None = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.sampling = params.sampling()
        self.host_always = params.has_host_changes
        self.eos_banned_until = 0 if params.ignore_eos else params.min_tokens
        self.device_changes = params.has_count_penalties or params.has_bias or self.eos_banned_until > 0
        self.prompt_logprobs = None if params.prompt_logprobs is None else [None]

    @property
    def batchable(self) -> bool:
        """Whether its logit changes, if any, are a guided regex, schema or grammar and count penalties, which
        `logits_processing.batch_changes` makes for many rows at once (bias, allowed tokens, bad words and
        choices are made row by row)."""
        params = self.params
        return not (params.has_bias or params.bad_words
                    or params.guided_choice)


def make_detokenizer(tokenizer: Any, params: SamplingParams) -> IncrementalDetokenizer | FinalDetokenizer | None:
    """Text every step (streaming, or stop strings to look for), else text once at the end."""
    if tokenizer is None:
        return None
    if params.output_kind == "final" and not params.stop:
        return FinalDetokenizer(tokenizer, params.skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens,
                                  params.min_tokens)


def token_rules(tokenizer: Any, params: SamplingParams, eos: set[int]) -> TokenRules:
    """params' bad words and guided choices as token sequences: a bad word as the tokenizer writes it alone and
    after a space (vLLM's two spellings), a choice as it writes it; a choice then ends with one of `eos`. A guided
    regex, schema or grammar as a cursor in its token guide over the tokenizer's vocabulary, ending with one of
    `eos` too."""
    dfa = params.guide_dfa()  # the automaton of a guided regex, schema or grammar (cached), or None
    if not (params.bad_words or params.guided_choice or dfa is not None):
        return TokenRules()
    if tokenizer is None:
        raise ValueError("bad_words and guided decoding (guided_choice, regex, json, grammar) need the "
                         "engine's tokenizer (this engine was made without one)")
    if (params.guided_choice or dfa is not None) and not eos:
        raise ValueError("guided decoding (guided_choice, regex, json, grammar) needs an end-of-sequence "
                         "token to end the output")

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    words = {encode(prefix + word.lstrip()) for word in params.bad_words for prefix in ("", " ")}
    choices, ends = {encode(choice) for choice in params.guided_choice} - {()}, set(eos)
    if params.allowed_token_ids is not None:  # a choice allowed_token_ids cuts short would leave no token to write
        allowed = set(params.allowed_token_ids)
        choices, ends = {c for c in choices if allowed.issuperset(c)}, ends & allowed
        if params.guided_choice and not (choices and ends):
            raise ValueError("allowed_token_ids leaves no guided_choice that can be written and ended (every choice "
                             "has a token it does not allow, or it allows no end-of-sequence token)")
    guide = None
    if dfa is not None:
        if not ends:
            raise ValueError("allowed_token_ids allows no end-of-sequence token: a guided output could not end")
        guide = GuideProgress(RegexGuide.of(dfa, tokenizer, sorted(ends)))
    return TokenRules(tuple(sorted(w for w in words if w)), tuple(sorted(choices)), tuple(sorted(ends)), guide)


def until_stop_string(request: EngineRequest, tokens: list[int]) -> tuple[list[int], bool]:
    """Feed tokens to the detokenizer; with stop strings one at a time, so the output ends at the
    token that completes one."""
    if not request.detok.stop:  # nothing to stop at: one decode for the step's tokens, not one per token
        if tokens:
            request.new_text += request.detok.add(tokens)
        return tokens, False
    for i, token in enumerate(tokens):
        request.new_text += request.detok.add([token])
        if request.detok.stopped:
            return tokens[: i + 1], True
    return tokens, False


def cannot_stop(request: EngineRequest, tokens: list[int]) -> bool:
    """Whether appending `tokens` surely ends nothing: under max_tokens, no stop token, no stop string to find."""
    detok = request.detok
    return (len(tokens) < request.params.max_tokens - len(request.seq.output_token_ids)
            and request.stop_ids.isdisjoint(tokens) and (detok is None or not detok.stop))


def checked_params(params: Any) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams (or one per prompt), got {type(params).__name__}")
    return params


def prompt_token_ids(prompt: Any, tokenizer: Any, vocab: int) -> list[int]:
    """A prompt (text, or token ids as a list, tuple, tensor or array) -> its token ids, checked. Text gets the
    tokenizer's own special tokens (a BOS where it adds one), as `MedusaModel.encode` and vLLM give it."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    elif hasattr(prompt, "tolist"):  # a 1-D tensor / array of token ids
        ids = prompt.tolist()
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (dict, bytes)):
        ids = list(prompt)
    else:
        raise ValueError(f"a prompt is a string or a sequence of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if not isinstance(prompt, str):
        check_token_ids(ids, vocab)
    return ids


def is_token_id(value: Any) -> bool:
    """A token id's type: a Python or NumPy integer, not a bool (True is no token)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_token_ids(ids: list, vocab: int) -> None:
    """Prompt token ids must be integers in [0, vocab): a bad id would index past the embedding on the device."""
    array = np.asarray(ids)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        bad = next((t for t in ids if not is_token_id(t)), ids)
        raise ValueError(f"prompt token ids must be integers, got {bad!r}")
    if array.min() < 0 or array.max() >= vocab:
        bad = int(array[(array < 0) | (array >= vocab)][0])
        raise ValueError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab})")
