"""What the engine reports: per-request outputs, their logprobs, and statistics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property


@dataclass
class RequestStats:
    """A request's verification steps as the base model verified them: what each step accepted, as vLLM's
    speculative-decoding counters count it. A step that meets a stop or max_tokens may accept tokens past the end
    that the output then leaves out, so at the end these can exceed the tokens written; the first output token
    (the prompt's) is no step. `MedusaModel.generate` reports the written tokens per step (`written_lengths`)."""

    steps: int = 0  # verification steps
    drafting_steps: int = 0  # of those, the ones that verified drafted tokens (a plain step drafts none)
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens the base agreed with
    accepted_from_lookup: int = 0  # of those, the ones on the prompt-lookup chain (EngineConfig.prompt_lookup)
    accepted_per_depth: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)  # tokens each verification step accepted, + 1

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted_tokens / self.steps if self.steps else 0.0

    def record_step(self, drafted: int, max_depth: int, count: int, from_lookup: int = 0) -> None:
        """One sequence's verification step: `drafted` tree tokens (max_depth deep), `count` tokens emitted,
        `from_lookup` of whose drafts came through the prompt-lookup chain."""
        self.steps += 1
        self.drafting_steps += drafted > 0
        self.drafted_tokens += drafted
        self.accepted_tokens += count - 1
        self.accepted_from_lookup += from_lookup
        self.accepted_lengths.append(count)
        per_depth = self.accepted_per_depth
        if len(per_depth) < max_depth:
            per_depth += [0] * (max_depth - len(per_depth))
        for depth in range(count - 1):
            per_depth[depth] += 1

    def record_steps(self, drafted: int, max_depth: int, counts: list[int], from_lookup: int = 0) -> None:
        """Verification steps of one tree (`drafted` tokens, max_depth deep) that emitted counts[i] tokens
        (1 + accepted drafts) each, `from_lookup` drafts through the lookup chain in all; accepted_lengths
        stays as it is (the engine's totals keep none)."""
        self.steps += len(counts)
        self.drafting_steps += len(counts) if drafted else 0
        self.drafted_tokens += drafted * len(counts)
        self.accepted_tokens += sum(counts) - len(counts)
        self.accepted_from_lookup += from_lookup
        per_depth = self.accepted_per_depth
        if len(per_depth) < max_depth:
            per_depth += [0] * (max_depth - len(per_depth))
        for count, rows in Counter(counts).items():  # a handful of distinct counts, not one loop per row
            for depth in range(count - 1):
                per_depth[depth] += rows


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks referenced
    totals: RequestStats  # drafted / accepted tokens over every finished and running request
    steps_per_tree: dict[str, int] = field(default_factory=dict)  # decode steps run with each tree


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # of the base model's raw distribution (no temperature, penalties or min_tokens ban)
    top: list[tuple[int, float]]  # the most likely alternatives, best first
    rank: int | None = None  # 1 + how many tokens are more likely (vLLM's Logprob.rank)


@dataclass(frozen=True, init=False)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    # The sequence's own output list, which keeps growing, and how much of it this output covers:
    # copying every output's tokens every step would cost O(length) per sequence per step.
    _output_ids: list[int] = field(repr=False, compare=False)
    _num_tokens: int
    text: str
    stats: RequestStats
    index: int = 0  # which of the request's n completions
    new_logprobs: list[TokenLogprob] | None = None  # for new_token_ids, when asked for
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then each next one's (the same list
    # in every output of the request)
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)
    # once finished: the stop_token_ids token or stop string that ended it; None for EOS, length, abort (vLLM's)
    stop_reason: int | str | None = None

    def __init__(self, request_id: str, new_token_ids: list[int], new_text: str, finished: bool,
                 finish_reason: str | None, _output_ids: list[int], _num_tokens: int, text: str,
                 stats: RequestStats, index: int = 0, new_logprobs: list[TokenLogprob] | None = None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None,
                 stop_reason: int | str | None = None) -> None:
        # The engine makes one per sequence per step: a frozen dataclass's own __init__ calls
        # object.__setattr__ per field (2.1 us for these eleven on a 2-core CPU), writing the instance
        # dict directly takes 0.8. The instance stays frozen: assignment still raises.
        own = self.__dict__
        own["request_id"], own["new_token_ids"], own["new_text"] = request_id, new_token_ids, new_text
        own["finished"], own["finish_reason"] = finished, finish_reason
        own["_output_ids"], own["_num_tokens"], own["text"] = _output_ids, _num_tokens, text
        own["stats"], own["index"], own["new_logprobs"] = stats, index, new_logprobs
        own["prompt_logprobs"], own["stop_reason"] = prompt_logprobs, stop_reason

    @cached_property
    def token_ids(self) -> list[int]:
        """All output tokens up to this output (a copy, made when first read)."""
        return self._output_ids[:self._num_tokens]
