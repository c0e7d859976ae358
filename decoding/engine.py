"""LLMEngine: continuous batching with Medusa tree verification for every sequence.

    engine = LLMEngine(model, heads, EngineConfig(), tokenizer)
    rid = engine.add_request("Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

Each step: schedule -> build candidates from each decoding sequence's heads ->
one forward for the whole batch -> verify per sequence -> compact KV ->
append tokens, check stops, free finished sequences.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import torch

from medusa.decoding.block_manager import BlockManager
from medusa.decoding.detokenizer import IncrementalDetokenizer
from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.model_runner import ModelRunner
from medusa.decoding.proposer import propose_from_heads
from medusa.decoding.sampler import TokenSampler, target_probs
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import Scheduler, SchedulerConfig, prefill_target
from medusa.decoding.sequence import FinishReason, Sequence
from medusa.decoding.verifier import AcceptanceConfig, verify
from medusa.heads import MedusaHeads
from medusa.model import DecoderModel
from medusa.tree import TreeSpec


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trees: tuple[str, ...] = ("single", "tree-4", "tree-8", "tree-16", "tree-32", "tree-64")


@dataclass
class RequestStats:
    steps: int = 0  # verification steps
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafted tokens the base agreed with
    accepted_per_depth: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted by each verification step

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted_tokens / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks referenced
    totals: RequestStats  # drafted / accepted tokens over every finished and running request


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # of the base model's raw distribution (no temperature), as OpenAI reports
    top: list[tuple[int, float]]  # the most likely alternatives, best first


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    token_ids: list[int]  # all output tokens so far
    text: str
    stats: RequestStats
    index: int = 0  # which of the request's n completions
    new_logprobs: list[TokenLogprob] | None = None  # for new_token_ids, when asked for


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    sampler: TokenSampler
    detok: IncrementalDetokenizer | None
    head_logits: torch.Tensor | None = None  # [K, V] proposals for the pending root
    new_text: str = ""  # released by the detokenizer since the last output
    parent_id: str = ""  # the id the client knows (several sequences share it when n > 1)
    index: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    stats: RequestStats = field(default_factory=RequestStats)


def _until_stop_string(request: _Request, tokens: list[int]) -> tuple[list[int], bool]:
    """Feed tokens one at a time, so the output ends at the token that completes a stop string."""
    for i, token in enumerate(tokens):
        request.new_text += request.detok.add([token])
        if request.detok.stopped:
            return tokens[: i + 1], True
    return tokens, False


class LLMEngine:
    def __init__(self, model: DecoderModel, heads: MedusaHeads | None, config: EngineConfig = EngineConfig(),
                 tokenizer: Any = None, eos_token_ids: Seq[int] = ()) -> None:
        self.model, self.heads, self.config, self.tokenizer = model, heads, config, tokenizer
        self.device = model.embed_tokens.weight.device
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        trees = [TreeSpec.load(t) for t in config.trees] if heads is not None else [TreeSpec.load("single")]
        trees = [t for t in trees if heads is None or t.max_depth <= heads.config.num_heads]
        self.scheduler = Scheduler(config.scheduler, self.blocks, trees)
        self.runner = ModelRunner(model, self.blocks, config.num_blocks)
        self.eos = set(eos_token_ids) | set(model.config.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._device_trees: dict[TreeSpec, DeviceTree] = {}
        self.totals = RequestStats()  # over the engine's life, for /metrics

    # ---- public API ------------------------------------------------------

    def add_request(self, prompt: str | Seq[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queue a request; with n > 1 it runs as n sequences sharing the id (outputs carry `index`)."""
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        context = self.model.config.max_position_embeddings
        if len(ids) + params.max_tokens + 8 > context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of {context}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests or f"{rid}#0" in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            sub = rid if params.n == 1 else f"{rid}#{index}"
            detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None
            request = _Request(Sequence(sub, ids), params, TokenSampler(seed), detok, parent_id=rid, index=index)
            self.requests[sub] = request
            self.scheduler.add(request.seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its n sequences); False if it is unknown or already finished."""
        subs = [k for k, r in self.requests.items() if r.parent_id == request_id]
        for sub in subs:
            self.requests.pop(sub)
            self.scheduler.abort(sub)
        return bool(subs)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.usage, self.totals)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] = SamplingParams()
                 ) -> list[RequestOutput]:
        """Run to completion; one output per prompt and completion, ordered by (prompt, index)."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [(self.add_request(p, sp), sp.n) for p, sp in zip(prompts, params)]
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        return [final[rid, i] for rid, n in ids for i in range(n)]

    # ---- one step --------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        tree = self._device_tree(plan.tree)
        candidates = {item.seq.request_id: self._propose(item.seq, tree)
                      for item in plan.scheduled if not item.is_prefill}
        inputs = self.runner.prepare(plan, candidates)
        hidden = self.runner.run(inputs)  # [T, H]
        outputs = []
        for item, start in zip(plan.scheduled, inputs.starts):
            request = self.requests[item.seq.request_id]
            rows = hidden[start:start + item.num_tokens]
            if item.is_prefill:
                new = self._after_prefill(request, item.num_tokens, rows)
            else:
                new = self._after_verify(request, tree, candidates[item.seq.request_id], rows)
            if new is not None:
                outputs.append(self._output(request, new))
        return outputs

    def _propose(self, seq: Sequence, tree: DeviceTree) -> torch.Tensor:
        root = torch.tensor(seq.output_token_ids[-1], device=self.device)
        return propose_from_heads(tree, root, self.requests[seq.request_id].head_logits, seq.output_token_ids)

    def _after_prefill(self, request: _Request, n: int, rows: torch.Tensor) -> list[int] | None:
        seq = request.seq
        self.blocks.commit(seq, n)
        if seq.num_computed_tokens < prefill_target(seq):
            return None  # more prompt chunks to go
        request.head_logits = self._heads(rows[-1])
        if seq.output_token_ids:
            return None  # recomputed after preemption: the pending root is already known
        raw = self.model.compute_logits(rows[-1:])
        logits = self._suppress_eos(request, raw, torch.zeros(1, device=self.device))
        sampling = request.params.sampling()
        first = torch.zeros(1, dtype=torch.long, device=self.device)  # output index 0
        root = logits[0].argmax() if sampling.greedy else request.sampler(target_probs(logits, sampling), first)[0]
        self._note_logprobs(request, raw, [int(root)])
        return self._append(request, [int(root)])

    def _after_verify(self, request: _Request, tree: DeviceTree, candidates: torch.Tensor,
                      rows: torch.Tensor) -> list[int]:
        seq = request.seq
        raw = self.model.compute_logits(rows)
        logits = self._suppress_eos(request, raw, tree.depths)
        verdict = verify(tree, candidates, logits, request.params.sampling(), AcceptanceConfig(), request.sampler,
                         seq.num_output_tokens)
        accepted = verdict.accepted
        self.runner.compact(seq, tree.num_nodes, accepted)
        new = candidates[accepted[1:]].tolist() + [int(verdict.next_token)]
        self._note_logprobs(request, raw[accepted], new)
        self._record(request, tree, len(accepted) - 1)
        emitted = self._append(request, new)
        if not seq.is_finished:
            self.blocks.commit(seq, len(accepted))
            request.head_logits = self._heads(rows[accepted[-1]])
        return emitted

    # ---- helpers ---------------------------------------------------------

    def _append(self, request: _Request, tokens: list[int]) -> list[int]:
        """Append up to the first stop condition; finish and free the sequence if one hit."""
        seq, params = request.seq, request.params
        kept, reason = [], None
        for token in tokens:
            if not params.ignore_eos and (token in self.eos or token in params.stop_token_ids) \
                    and seq.num_output_tokens + len(kept) >= params.min_tokens:
                reason = FinishReason.STOP
                break
            kept.append(token)
            if seq.num_output_tokens + len(kept) >= params.max_tokens:
                reason = FinishReason.LENGTH
                break
        if request.detok is not None:
            kept, stopped = _until_stop_string(request, kept)
            reason = FinishReason.STOP if stopped else reason
        seq.append_tokens(kept)
        del request.logprobs[seq.num_output_tokens:]  # drop those of tokens cut by a stop
        if reason is not None:
            seq.finish(reason)
            self.scheduler.finish(seq)
        return kept

    def _suppress_eos(self, request: _Request, logits: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """Before min_tokens outputs, EOS / stop tokens may not be chosen at any node.

        logits [N, V]; depths [N]: node i's target is output number
        num_output_tokens + depths[i] (the pending root counts as output).
        """
        params = request.params
        banned = sorted(self.eos | set(params.stop_token_ids))
        produced = request.seq.num_output_tokens
        if params.ignore_eos or not banned or produced + int(depths.min()) >= params.min_tokens:
            return logits
        rows = (produced + depths < params.min_tokens).nonzero().squeeze(-1)
        logits = logits.clone()
        logits[rows[:, None], torch.tensor(banned, device=logits.device)[None, :]] = float("-inf")
        return logits

    def _note_logprobs(self, request: _Request, logits: torch.Tensor, tokens: list[int]) -> None:
        """logits [n, V]: row i is the distribution tokens[i] was drawn from."""
        k = request.params.logprobs
        if k is None:
            return
        logp = torch.log_softmax(logits.float(), -1)
        chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, device=logp.device)].tolist()
        top = logp.topk(k, dim=-1) if k else None
        for i, token in enumerate(tokens):
            alternatives = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if k else []
            request.logprobs.append(TokenLogprob(token, chosen[i], alternatives))

    def _heads(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.heads is None:
            return None
        with torch.inference_mode():
            return self.heads(hidden, self.model.lm_head.weight)

    def _record(self, request: _Request, tree: DeviceTree, accepted_drafts: int) -> None:
        for stats in (request.stats, self.totals):
            stats.steps += 1
            stats.drafted_tokens += tree.num_nodes - 1
            stats.accepted_tokens += accepted_drafts
            missing = tree.spec.max_depth - len(stats.accepted_per_depth)
            stats.accepted_per_depth += [0] * max(missing, 0)
            for depth in range(accepted_drafts):
                stats.accepted_per_depth[depth] += 1
        request.stats.accepted_lengths.append(1 + accepted_drafts)

    def _output(self, request: _Request, new: list[int]) -> RequestOutput:
        seq = request.seq
        finished = seq.is_finished
        text, delta = "", ""
        if request.detok is not None:
            delta = request.new_text + (request.detok.flush() if finished else "")
            request.new_text, text = "", request.detok.text
        if finished:
            self.requests.pop(seq.request_id, None)
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = request.logprobs[-len(new):] if new else []
        return RequestOutput(request.parent_id, new, delta, finished,
                             seq.finish_reason.value if seq.finish_reason else None,
                             list(seq.output_token_ids), text, request.stats, request.index, logprobs)

    def _device_tree(self, spec: TreeSpec) -> DeviceTree:
        if spec not in self._device_trees:
            self._device_trees[spec] = DeviceTree.from_spec(spec, self.device)
        return self._device_trees[spec]


def stream(engine: LLMEngine, prompt: str | Seq[int], params: SamplingParams = SamplingParams()):
    """Drive `engine` until one new request finishes, yielding its outputs as they come."""
    rid = engine.add_request(prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.index == 0:
                yield out
                if out.finished:
                    return
