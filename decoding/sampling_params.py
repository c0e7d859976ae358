"""Per-request sampling settings for the engine (the OpenAI / vLLM knobs)."""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field

from medusa.decoding.grammar import grammar_dfa
from medusa.decoding.json_schema import schema_dfa
from medusa.decoding.regex_dfa import LazyDFA, compile_regex
from medusa.decoding.sampler import SamplingConfig


GUIDES = ("guided_choice", "guided_regex", "guided_json", "guided_grammar")  # at most one per request


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    min_tokens: int = 0  # EOS and stop tokens are suppressed, and stop strings not looked for, before this many outputs
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # vLLM's: keep tokens at least this fraction of the most likely one's probability
    seed: int | None = None  # same seed, same output, whatever else is in the batch
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before it
    skip_special_tokens: bool = True  # False: special tokens' text (say <|im_end|>) stays in the output text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # independent completions of the prompt (seeds seed, seed + 1, ...)
    logprobs: int | None = None  # return each token's log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (none from the prefix cache)
    # OpenAI penalties on the output so far (not the prompt, as vLLM): before temperature and top-k/p,
    # logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's repetition penalty, over the prompt and the output: a seen token's logit is divided by it where
    # positive and multiplied by it where not (1: off). Applied before presence / frequency
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit before any penalty (OpenAI's logit_bias, in [-100, 100]). A dict is
    # kept as sorted (id, bias) pairs, so that the params stay hashable
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: only these tokens may be output (sorted, no repeats); None: any. Like the bias, applied per tree
    # node before the verdict, so Medusa still gives plain decoding's tokens
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words that may not be written. A word's token sequence (as the tokenizer writes it alone and after a
    # space) may not be completed: its last token is banned wherever the output (and a tree node's path) ends with
    # the rest; a one-token word is banned outright
    bad_words: tuple[str, ...] = ()
    # vLLM's guided_choice: the output is one of these strings (as the tokenizer writes each), then EOS
    guided_choice: tuple[str, ...] = ()
    # vLLM's guided_regex: the output's text is a whole match of this pattern (`regex_dfa` says what syntax), then
    # EOS. Tokens that would leave every match are banned at each tree node, from the node's own text
    guided_regex: str | None = None
    # vLLM's guided_json: the output is one JSON text valid under this JSON Schema (a dict is kept as its JSON
    # text; `json_schema` says what is supported), then EOS. Followed as the regex the schema gives
    guided_json: str | None = None
    # vLLM's guided_grammar: the output's text is a whole match of this GBNF grammar's root rule (`grammar` says
    # how recursion is followed), then EOS. Followed as the regex the grammar gives
    guided_grammar: str | None = None
    speculative: bool = True  # False: plain decoding, which only an engine without heads runs (it checks)
    # "delta": every output carries the text its new tokens add (streaming: the text is decoded every
    # step). "final": text only in the finished output, decoded once at the end; earlier outputs carry
    # token ids only. Per-step detokenizing costs about as much host time per token as the rest of a
    # step's bookkeeping, so a caller that waits for the end should ask for "final" (LLMEngine.generate
    # and non-streaming server requests do). Stop strings are still looked for every step.
    output_kind: str = "delta"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.stop_token_ids is None:  # vLLM's default
            object.__setattr__(self, "stop_token_ids", ())
        if self.top_k == -1:  # vLLM's "off", as 0 is here
            object.__setattr__(self, "top_k", 0)
        for name in ("max_tokens", "min_tokens", "top_k", "n", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if not (value is None and name in ("seed", "logprobs", "prompt_logprobs")) and not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if isinstance(self.stop, str):  # one stop string, as the OpenAI API allows
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop strings must be non-empty strings, got {text!r} in stop={self.stop!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):  # "no" would be true
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            if not _is_int(token) or token < 0:
                raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {token!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 1 <= self.n <= 64:
            raise ValueError(f"n must be in [1, 64], got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
            object.__setattr__(self, name, float(value))
        rep = self.repetition_penalty
        if isinstance(rep, bool) or not isinstance(rep, (int, float)) or not 0 < rep < float("inf"):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 is off), got {rep!r}")
        object.__setattr__(self, "repetition_penalty", float(rep))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._check_token_limits()
        if self.output_kind not in ("delta", "final"):
            raise ValueError(f"output_kind must be 'delta' or 'final', got {self.output_kind!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):  # NumPy's float32 too
                raise ValueError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        self.sampling()  # validates temperature, top_p, top_k

    def _check_token_limits(self) -> None:
        """allowed_token_ids, bad_words and the guides (guided_choice, regex, json, grammar): checked, the lists
        kept as sorted / plain tuples, a schema as its JSON text."""
        if self.allowed_token_ids is not None:
            allowed = [None] if isinstance(self.allowed_token_ids, (str, bytes)) else list(self.allowed_token_ids)
            if not allowed or any(not _is_int(t) or t < 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                                 f"got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in allowed})))
        for name, blank_ok in (("bad_words", False), ("guided_choice", True)):
            texts = getattr(self, name)
            if isinstance(texts, str) or any(not isinstance(t, str) or not (t if blank_ok else t.strip())
                                             for t in texts):
                raise ValueError(f"{name} must be a list of non-{'empty' if blank_ok else 'blank'} strings, "
                                 f"got {texts!r}")
            object.__setattr__(self, name, tuple(texts))
        if self.guided_choice and (self.ignore_eos or self.min_tokens):
            raise ValueError("guided_choice ends the output with EOS once a choice is written: it cannot be "
                             "combined with ignore_eos or min_tokens")
        if self.guided_json is not None:
            schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            object.__setattr__(self, "guided_json", schema)
        for name in ("guided_regex", "guided_grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        guides = self.guides
        if len(guides) > 1:
            raise ValueError(f"{guides[-1]} and {guides[0]} cannot both be set: give one guide")
        if self.guide_pattern is not None and (self.ignore_eos or self.min_tokens):  # also checks the pattern
            raise ValueError(f"{guides[0]} ends the output with EOS once its text cannot go on matching: it "
                             f"cannot be combined with ignore_eos or min_tokens")

    @property
    def guides(self) -> list[str]:
        """The guide fields set (guided_choice non-empty, the others not None)."""
        return [name for name in GUIDES if (getattr(self, name) if name == "guided_choice"
                                            else getattr(self, name) is not None)]

    @property
    def guide_pattern(self) -> str | None:
        """The guide's key: guided_regex itself, or "guided_json:" / "guided_grammar:" and its text (None without
        one; ValueError, naming the field, for one that cannot be followed)."""
        dfa = self.guide_dfa()
        return None if dfa is None else dfa.pattern

    def guide_dfa(self) -> LazyDFA | None:
        """The automaton the output's text follows (cached by pattern, schema or grammar): a regex's over its NFA,
        a schema's or a grammar's made on demand from its rules (`json_schema.schema_dfa`, `grammar.grammar_dfa`),
        so their recursion is followed as deep as the text goes."""
        if self.guided_regex is not None:
            return compile_regex(self.guided_regex)
        if self.guided_grammar is not None:
            return grammar_dfa(self.guided_grammar)
        if self.guided_json is None:
            return None
        try:
            return schema_dfa(self.guided_json)
        except ValueError as err:
            message = str(err)
            if message.startswith("guided_json"):
                raise
            # a string "pattern" in the schema the regex parser cannot follow
            raise ValueError(f"guided_json: a pattern in the schema cannot be followed ({message})") from None

    @property
    def has_penalties(self) -> bool:
        """Whether any logit change (bias, allowed tokens, bad words, a guide or a penalty) applies."""
        return self.has_count_penalties or self.has_bias or bool(self.bad_words) or bool(self.guides)

    @property
    def has_bias(self) -> bool:
        """Whether logit_bias or allowed_token_ids applies (a fixed change per token)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def has_host_changes(self) -> bool:
        """Whether a logit change only the host makes applies (bad words, a guide or guided choice): the host then
        gives every verdict. Bias, allowed tokens and count penalties the device makes (`device_changes.py`)."""
        return bool(self.bad_words) or bool(self.guides)

    @property
    def has_count_penalties(self) -> bool:
        """Whether a penalty that counts the output's tokens applies: repetition, presence or frequency."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def seed_for(self, index: int) -> int | None:
        """The seed of completion `index` of n: seed + index, wrapped into [0, 2**63) (None: unseeded). The
        engine seeds its n sequences so, and the server its n single-completion requests, alike."""
        return None if self.seed is None else (self.seed + index) % 2**63

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              min_p=self.min_p)


def _is_int(value) -> bool:
    """A Python or NumPy integer, not a bool (True would pass as max_tokens=1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict or pairs; ids >= 0, biases in [-100, 100]."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(token, value) for token, value in items]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}") from None
    for token, value in pairs:
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
    ids = [int(token) for token, _ in pairs]
    if len(set(ids)) < len(ids):
        raise ValueError(f"logit_bias names a token twice: {sorted(ids)}")
    return tuple(sorted((int(token), float(value)) for token, value in pairs))
