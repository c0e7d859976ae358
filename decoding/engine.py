"""LLMEngine: continuous batching with Medusa tree verification for every sequence.

    engine = LLMEngine(model, heads, EngineConfig(), tokenizer)
    rid = engine.add_request("Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

Each step: schedule -> every decoding sequence verifies its tree in one batched
`DecodeStep` (device-side greedy and sampled verification, CUDA graphs on the GPU;
host verdicts only for rows whose logits the host changes: guides, guided choices, bad
words), whose forward also carries the step's prompt chunks up to
`mixed_prompt_tokens` (on a GPU cut to fill a token bucket); larger chunks, or a step with
nothing decoding, get a prompt forward of their own (replayed from a CUDA graph of
their token bucket, `prefill_graphs.py`) -> append tokens, check stops, free
finished sequences.

With overlap (`EngineConfig.overlap`, on with CUDA graphs) a step is launched before the previous
one is read back, and an admission waits for nothing either: a request's first token is
decided on the device (argmax, or a draw for a sampled one), where the next step's tree starts from it,
and reaches the host with the next step (`engine_admission.py`); only an admission with host work (a guide
or bad words) reads it at once. A step with such rows is launched in two: its first half, then the previous
step read back and applied, then their verdicts (`engine_host.py`) and the second half (`_launch`). With
`apply_interval=k` the steps read back gather until k have, and each sequence's tokens of all of them are
applied at once (`_apply_steps`): the host's counters then lag the device by up to k steps, which the blocks
back as they back a step in flight.

With `prompt_lookup=L`, every speculative tree also carries a chain of L nodes
whose tokens copy what followed the latest earlier occurrence of the sequence's
last few tokens (`prompt_lookup.py`, computed on the device from each row's token history:
`kernels/ngram_lookup.py`); the verification, hence the output, is unchanged.
"""

from __future__ import annotations

import copy
import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Sequence as Seq

import numpy as np
import torch

from medusa.decoding import warmup
from medusa.decoding.block_manager import BlockManager
from medusa.decoding.detokenizer import prepare as prepare_text
from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.engine_admission import Admission, FirstTokens
from medusa.decoding.engine_config import EngineConfig
from medusa.decoding.engine_host import HostVerdicts
from medusa.decoding.engine_request import (EngineRequest, cannot_stop, checked_params, is_token_id,
                                            make_detokenizer, prompt_token_ids, token_rules, until_stop_string)
from medusa.decoding.host_buffers import PendingCopy
from medusa.decoding.logits_processing import token_logprobs
from medusa.decoding.model_runner import ModelRunner
from medusa.decoding.outputs import EngineStats, RequestOutput, RequestStats, TokenLogprob
from medusa.decoding.prefill_graphs import PromptSegment
from medusa.decoding.sampler import TokenSampler
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import ScheduledSeq, Scheduler, prefill_target
from medusa.decoding.sequence import FinishReason, Sequence
from medusa.decoding.step_logprobs import StepLogprobs, queue_step_logprobs
from medusa.decoding.token_guide import build_seconds
from medusa.decoding.tree_policy import TreePolicy
from medusa.heads import MedusaHeads
from medusa.kernels.paged_attention import kernel_pages
from medusa.model import DecoderModel
from medusa.tree import TreeSpec

__all__ = ["EngineConfig", "LLMEngine", "stream"]

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are computed at once (a 128k vocabulary: 128 MB in fp32)


def cost_clock() -> float:
    """The clock the tree policy times steps by: wall seconds less the host's time building guide states. A state
    is built once and kept, so that time is no step's cost, as a graph captured at first use is not. A guided tree
    step walks every node's state: its trial steps, among a level's first, met many new ones (9 ms each on a
    2-core CPU), and after a plain decision a tree runs one step in 200 (its charge the median of its last 5), so
    trees charged that stayed off (session 44: 12 ms of host time a tree step at 8 guided requests)."""
    return time.perf_counter() - build_seconds()


@dataclass
class _InFlight:
    """An overlapped decode step, launched but not yet read back (or read back, its rows not yet applied)."""

    requests: list[EngineRequest]
    tree: DeviceTree
    padded: int
    propose: bool
    result: PendingCopy  # its packed rows
    # whether its cost can be read off the time between two read-backs: launched while the step before it was
    # still in flight, and after no prefill (whose device time, and the admission's sync, would land in it)
    timed: bool
    prompt_hidden: torch.Tensor | None = None  # [P, H] of the prompt chunks its forward carried
    rows: list[list[int]] | None = None  # read back, waiting to be applied with the next ones
    logprobs: StepLogprobs | None = None  # of its rows that ask, on their way to the host
    noted: dict[Sequence, list[TokenLogprob]] = field(default_factory=dict)  # those, read back
    read_at: float = 0.0  # `cost_clock` when its rows reached the host
    policy: TreePolicy | None = None  # the tree policy that chose its tree: its costs and acceptance go there


def _rows_by_request(flights: list[_InFlight]) -> list[tuple[EngineRequest, list[tuple[int, list[int]]]]]:
    """(request, [(step index, packed row), ...]) for every request of the read-back steps, in order of first
    appearance."""
    grouped: dict[Sequence, tuple[EngineRequest, list[tuple[int, list[int]]]]] = {}
    for j, flight in enumerate(flights):
        for request, row in zip(flight.requests, flight.rows):
            entry = grouped.get(request.seq)
            if entry is None:
                entry = grouped[request.seq] = (request, [])
            entry[1].append((j, row))
    return list(grouped.values())


class LLMEngine(Admission, HostVerdicts):
    def __init__(self, model: DecoderModel, heads: MedusaHeads | None, config: EngineConfig = EngineConfig(),
                 tokenizer: Any = None, eos_token_ids: Seq[int] = ()) -> None:
        self.model, self.heads, self.config, self.tokenizer = model, heads, config, tokenizer
        prepare_text(tokenizer)
        self.device = model.embed_tokens.weight.device
        if self.device.type == "cuda" and not kernel_pages(config.block_size):
            raise ValueError(f"block_size must be a power of two >= 16 on a GPU (the attention kernel walks whole "
                             f"pages of those), got {config.block_size}")
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        trees = [t if isinstance(t, TreeSpec) else TreeSpec.load(t) for t in config.trees] if heads is not None \
            else [TreeSpec.load("single")]
        trees = _fitting_trees(trees, heads, config.trees == EngineConfig.trees)
        trees = _with_lookup(trees, config.prompt_lookup)
        self.scheduler = Scheduler(config.scheduler, self.blocks, trees)
        self._device_trees: dict[TreeSpec, DeviceTree] = {}
        context = model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context, config.num_blocks * config.block_size)
        device_trees = [self._device_tree(t) for t in trees]
        if max(t.num_nodes for t in trees) > 64:
            raise ValueError("engine trees may have at most 64 nodes (the kernels' ancestor bitmask)")
        self.runner = ModelRunner(model, heads, self.blocks, config.num_blocks, config.scheduler.max_num_seqs,
                                  self.max_model_len, max(t.num_nodes for t in trees),
                                  max(t.max_topk for t in device_trees), config.cuda_graphs,
                                  config.scheduler.max_num_batched_tokens, config.prompt_lookup,
                                  steps_ahead=config.apply_interval)
        self.eos = set(eos_token_ids) | set(model.config.eos_token_ids)
        self.requests: dict[str, EngineRequest] = {}
        self._ids = itertools.count()
        self.totals = RequestStats()  # over the engine's life, for /metrics
        self.steps_per_tree: Counter[str] = Counter()  # decode steps per tree label, likewise
        # the measured tree policy (filled by warmup()) of greedy traffic, and its copy for traffic with sampled
        # rows, which accept less (a node passes only when the base draws it): one policy for both let a burst
        # of sampled requests settle a batch size on plain decoding that greedy requests then ran (session 41)
        self.policy = TreePolicy()
        self.sampled_policy: TreePolicy | None = None  # warmup's copy of `policy`, before any traffic
        # and one for traffic with rows the host decides (guides, bad words), whose steps cost several times a
        # free step's (H100, 8 guided requests: 7.3 ms a tree step, 1.9 ms a plain one, against 1.4 and 0.7 ms
        # free, session 43): their costs must not switch free traffic's speculation off (session 38), nor free
        # traffic's cheap steps make their trees look cheap
        self.host_policy: TreePolicy | None = None
        self._sampled_seqs = 0  # unfinished sequences that sample
        self._host_seqs = 0  # unfinished sequences the host decides
        self.overlap = self.runner.decode.use_graphs if config.overlap is None else config.overlap
        self.mixed_prompt_tokens = config.mixed_prompt_tokens
        # cut carried prompt chunks to fill a token bucket: only where graphs pad them to one (eagerly a cut
        # saves nothing and delays the rest of a prompt by a step); tests turn it on for the CPU
        self.fill_buckets = self.runner.prefill.use_graphs
        self._inflight: _InFlight | None = None
        self._pending: list[_InFlight] = []  # read back, not applied yet (at most apply_interval - 1)
        self.apply_interval = config.apply_interval
        self._first_tokens: list[FirstTokens] = []  # admissions whose first tokens the host has not read
        self._read_back_time = 0.0  # `cost_clock` when the last overlapped step's tokens were read back

    # ---- public API ------------------------------------------------------

    def add_request(self, prompt: str | Seq[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        """Queue a request; with n > 1 it runs as n sequences sharing the id (outputs carry `index`)."""
        return self._add(prompt, params, request_id, quiet=False)

    def _add(self, prompt: str | Seq[int], params: SamplingParams, request_id: str | None, quiet: bool) -> str:
        params = checked_params(params)
        if not params.speculative and self.heads is not None:
            # one tree is verified for every row of a step, so a row cannot opt out within this engine
            raise ValueError("SamplingParams(speculative=False) on an engine with Medusa heads, which speculates "
                             "for every request: send it to a plain engine over the same model instead "
                             "(MedusaModel.engine(speculative=False), as `medusa serve` does)")
        vocab = self.model.config.vocab_size
        ids = prompt_token_ids(prompt, self.tokenizer, vocab)
        bias_ids = [t for t, _ in params.logit_bias]
        for name, named in (("stop_token_ids", params.stop_token_ids), ("logit_bias", bias_ids),
                            ("allowed_token_ids", params.allowed_token_ids or ())):
            too_big = [t for t in named if t >= vocab]
            if too_big:
                raise ValueError(f"{name} names token ids {too_big} past the model's vocabulary of {vocab} tokens")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the engine's "
                             f"context of {self.max_model_len} tokens (max_model_len)")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string (or None for a fresh one), got {request_id!r}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests or f"{rid}#0" in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        stop_ids = frozenset() if params.ignore_eos else frozenset(self.eos | set(params.stop_token_ids))
        rules = token_rules(self.tokenizer, params, self.eos)
        for index in range(params.n):
            # unseeded: a random seed, so that each output position's noise is fixed before its draw and the
            # heads can propose under it (`DecodeStep._coupled_proposals`); draws stay independent
            seed = params.seed_for(index)
            seed = random.getrandbits(64) if seed is None else seed
            sub = rid if params.n == 1 else f"{rid}#{index}"
            detok = make_detokenizer(self.tokenizer, params)
            # prompt logprobs need every prompt position's hidden state: none may come from the prefix cache
            seq = Sequence(sub, ids, reads_prefix_cache=params.prompt_logprobs is None)
            request = EngineRequest(seq, params, TokenSampler(seed), detok, parent_id=rid, index=index,
                                    stop_ids=stop_ids, quiet=quiet, rules=rules.for_sequence())
            self.requests[sub] = request
            self._count(request, 1)
            self.scheduler.add(request.seq)
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its n sequences); False if it is unknown or already finished."""
        subs = [k for k, r in self.requests.items() if r.parent_id == request_id]
        for sub in subs:
            self._forget(sub)
            self.scheduler.abort(sub)
        live = lambda flight: any(self.requests.get(r.seq.request_id) is r for r in flight.requests)  # noqa: E731
        if self._inflight is not None and not live(self._inflight):
            self._inflight = None  # nothing left to read back: has_unfinished() must not wait for it
        self._pending = [flight for flight in self._pending if live(flight)]
        return bool(subs)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.blocks.usage, self.totals,
                           dict(self.steps_per_tree))

    def warmup(self, context: int = 512, max_batch: int | None = None, sampling: bool = False) -> dict[int, str]:
        """Capture the prefill and decode steps' CUDA graphs and, with heads, let the measured
        tree policy (`tree_policy.py`) pick each batch size's tree: its prior comes from the
        heads' measured accuracies, or a cautious guess for heads that carry none. An engine
        with one tree (or no heads) has nothing to choose: its tree runs wherever the token
        budget allows. Returns bucket -> chosen tree name.

        max_batch: only the batch buckets up to this many sequences (`medusa generate` runs one
        request, so bucket 1; every bucket took 23 s for the default model on an H200); None: up to
        max_num_seqs. A bucket left out is captured at its first use and its tree left to the token
        budget, as without warmup.
        sampling: also capture, for the trees each batch size tries first, the graphs of steps with
        sampling rows (temperature > 0, an OpenAI client's default), which are graphs of their own,
        and the temperature-only step of every other tree timed there (its trials run them): without
        them the first sampled requests capture them mid-run.

        Without graphs (a CPU) nothing is captured and each batch size is its own bucket: warmup times
        each tree at one row and plain steps at 1, 2, 4, ... rows eagerly, and the measured policy
        starts from costs read off those (`eager_costs.py`; on two cores 3 s for the default model's
        one-request bucket, 10 s for all 64).
        """
        chosen = warmup.run(self, context, max_batch, sampling)
        if self.sampled_policy is None and self.scheduler.policy is not None:
            self.sampled_policy = copy.deepcopy(self.policy)
            self.host_policy = copy.deepcopy(self.policy)
        return chosen

    def policy_for(self, sampled: bool, host: bool = False) -> TreePolicy:
        """The tree policy of greedy traffic, of traffic with sampled rows, or of traffic with rows the host
        decides, which wins (their verdicts dominate a step's cost); the greedy one before warmup."""
        if host and self.host_policy is not None:
            return self.host_policy
        return self.sampled_policy if sampled and self.sampled_policy is not None else self.policy

    def traffic_policy(self) -> TreePolicy:
        """The tree policy of the traffic now: the host one while any unfinished sequence is decided on the
        host, else the sampled one while any samples."""
        return self.policy_for(self._sampled_seqs > 0, self._host_seqs > 0)

    def _measured_tree(self, num_decoding: int) -> TreeSpec | None:
        """The measured policy's tree for a step of `num_decoding` sequences (the scheduler's `policy` once warmup
        has run); None past warmup's max_batch, where nothing was timed."""
        bucket, policy = self.runner.decode.bucket(num_decoding), self.traffic_policy()
        return policy.choose(bucket) if bucket in policy.step_cost else None

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or self._inflight is not None or bool(self._pending)
                or bool(self._first_tokens))

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] = SamplingParams()) -> list[RequestOutput]:
        """Run to completion; one output per prompt and completion, ordered by (prompt, index). Only the
        finished outputs are returned, so the text is decoded once per request (output_kind="final") and
        step() builds no output for a request before it finishes. One prompt (a string or a list of token
        ids) may be given alone, as vLLM's LLM.generate takes it."""
        if self.requests:  # their outputs would come out of generate's steps and be dropped
            raise RuntimeError(f"generate() runs the engine to completion, and {len(self.requests)} sequence(s) "
                               "added with add_request are unfinished: step() them to the end (or abort them) first")
        if _one_prompt(prompts):  # not a list of one-character prompts, or of one-token ones
            prompts = [prompts]
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif isinstance(params, Seq) and not isinstance(params, str):
            params = list(params)
        else:
            checked_params(params)  # raises, naming the type
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams: "
                             "give one, or one per prompt")
        params = [replace(checked_params(p), output_kind="final") for p in params]
        ids = []
        try:
            for prompt, sp in zip(prompts, params):
                ids.append((self._add(prompt, sp, None, quiet=True), sp.n))
        except Exception:  # a bad prompt: the ones queued before it must not run on a later step
            for rid, _ in ids:
                self.abort(rid)
            raise
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        return [final[rid, i] for rid, n in ids for i in range(n)]

    # ---- one step --------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs = []
        # a sequence may be preempted only once the host knows all its tokens
        plan = self.scheduler.schedule(preempt=self._inflight is None and not self._pending and not self._first_tokens)
        if plan is None:  # blocks are short while a step is in flight: its tokens first, then preemption
            outputs += self._catch_up()
            plan = self.scheduler.schedule()
        for seq in plan.preempted:  # its KV is gone; the row is re-leased after recompute
            self._release_row(self.requests[seq.request_id])
        prefills = [item for item in plan.scheduled if item.is_prefill]
        decodes = [item.seq for item in plan.scheduled if not item.is_prefill]
        tree = self._device_tree(plan.tree)
        overlapped = bool(decodes) and self._can_overlap(decodes, tree)
        if not overlapped:  # this step needs every token on the host first
            outputs += self._catch_up(set(decodes), tree.num_nodes)
            decodes = [seq for seq in decodes if not seq.is_finished]  # finished by a token just read back
        prefills, batch, prompts, hidden = self._prefill(prefills, decodes, tree)
        if overlapped:  # launch, then read the previous step back while the device runs this one
            launched, caught = self._launch(decodes, tree, timed=not prefills, prompts=prompts)
            hidden = launched.prompt_hidden if prompts is not None else hidden
            outputs += caught + self._catch_up(set(decodes), tree.num_nodes, apply_all=False)
            self._inflight = launched
        elif decodes:
            decoded, carried = self._decode(decodes, tree, timed=not prefills, prompts=prompts)
            outputs += decoded
            hidden = carried if prompts is not None else hidden
        if batch is not None:
            self._note_prompt_logprobs(prefills, batch, hidden)
            ready = self._commit_prefills(prefills, batch)
            if ready:
                outputs += self._start_decoding(ready, hidden)
        return outputs

    def _prefill(self, prefills: list[ScheduledSeq], decodes: list[Sequence], tree: DeviceTree):
        """The step's prompt chunks -> (the chunks run, their batch, the `PromptSegment` the decode step's
        forward carries, or their hidden states [T, H] from a forward of their own; None for what does
        not apply). Beside a decoding batch they ride in its forward if they are few (`mixed_prompt_tokens`),
        cut to fill a token bucket where graphs pad them (`fill_buckets`): padding costs as much as prompt
        tokens; and if that step's graph exists or is worth capturing (`_may_carry`)."""
        if not prefills:
            return prefills, None, None, None
        if decodes and self.fill_buckets:
            prefills = _fill_bucket(prefills, self.runner.prefill.buckets, self.mixed_prompt_tokens)
        batch = self.runner.prepare_prefill(prefills)
        carry = bool(decodes) and self._may_carry(len(decodes), tree, batch)
        prompts = self.runner.prompt_segment(batch, self.mixed_prompt_tokens) if carry else None
        return prefills, batch, prompts, self.runner.run(batch) if prompts is None else None

    def _may_carry(self, rows: int, tree: DeviceTree, batch) -> bool:
        """Whether a decode step of `rows` sequences verifying `tree` may carry `batch`'s prompt chunks:
        without graphs always; with them if the step's graph for the chunks' token bucket is captured,
        or if the batch size has settled on `tree` (`TreePolicy.settled_on`), so that a capture now
        serves many steps. A tree on trial, or a revisit's, runs a step or a few: capturing its graph
        for each prompt bucket it meets (43-79 ms each for the default model on an H200) would stall
        the first requests of a level, so its steps run the chunks in a prefill forward of their own."""
        step = self.runner.decode
        if not step.use_graphs or not self.runner.prefill.fits(batch):
            return True  # nothing to capture (prompt_segment turns a batch that does not fit down)
        padded, tokens = step.bucket(rows), self.runner.prefill.bucket(batch.num_tokens)
        return step.has_mixed_graph(tree, padded, tokens) or self.traffic_policy().settled_on(padded, tree.spec)

    def _commit_prefills(self, prefills: list, batch) -> list[tuple[EngineRequest, int]]:
        """The chunks' KV is (being) written: commit it. -> (request, row of its last prompt token in the
        batch's hidden states) for each sequence whose prompt is now all cached."""
        ready = []
        for item, start in zip(prefills, batch.starts):
            self.blocks.commit(item.seq, item.num_tokens)
            if item.seq.num_computed_tokens >= prefill_target(item.seq):
                ready.append((self.requests[item.seq.request_id], start + item.num_tokens - 1))
        return ready

    # ---- overlapped steps -------------------------------------------------

    def _forced(self, request: EngineRequest, lookup: int) -> tuple[int, ...]:
        """A guided row's forced text in tokens after the output the host knows, for its lookup chain: enough
        for the chain after the tokens the step in flight emits (`DecodeStep._forced_chain` starts it there)."""
        guide = request.rules.guide
        if guide is None:
            return ()
        ahead = self._inflight.tree.spec.max_depth + 1 if self._inflight is not None else 0
        return guide.forced_after(request.seq.output_token_ids, lookup + ahead)

    def _can_overlap(self, seqs: list[Sequence], tree: DeviceTree) -> bool:
        """A step launched before the previous one is read back. The device knows each row's committed length
        and tokens, so the tree goes in place before the host does; rows the host decides wait for it inside
        the step (`_launch`). A guided row's forced text (`_forced`) is laid from where the step in flight
        ends, as far as the host knows it: not while one's forced text ends within that step and the chain
        after it (a choice of the guide's comes first), where a step that waits lays what follows the choice."""
        if not self.overlap:
            return False
        if not tree.num_lookup or self._inflight is None:
            return True
        reach = tree.num_lookup + self._inflight.tree.spec.max_depth + 1
        return all(not 0 < len(self._forced(self.requests[seq.request_id], tree.num_lookup)) < reach for seq in seqs)

    def _launch(self, seqs: list[Sequence], tree: DeviceTree, timed: bool = True,
                prompts: PromptSegment | None = None) -> tuple[_InFlight, list[RequestOutput]]:
        """Queue a decode step (carrying `prompts`, if given); until it is read back, each sequence may be up
        to depth + 1 tokens further along than its counters say (`num_inflight_tokens`), and the scheduler
        backs that with blocks. -> (the step in flight, outputs of the steps read back meanwhile).

        Rows the host decides (guides, bad words) need every earlier token on the host: part 1 is queued, then
        the steps before it are read back and applied while it runs, then their targets are made (guides walked
        from the candidates copied ahead of part 1, `_forward`) and part 2 queued, so the host's bookkeeping of
        every row still overlaps the device."""
        step, policy = self.runner.decode, self.traffic_policy()  # the one whose tree this is
        captured = step.capture_seconds
        requests, padded, propose, part1, host, early = self._forward(seqs, tree, prompts)
        timed = timed and self._inflight is not None
        if step.capture_seconds != captured and self._inflight is not None:
            self._inflight.timed = False  # its read-back comes after this capture: its charge would hold it
        caught = []
        if host:
            caught = self._catch_up(set(seqs), tree.num_nodes)
            self._verify_on_host(requests, tree, part1, host, early)
        packed, result = step.finish_to_host(tree, padded, len(seqs))
        timed = timed and step.capture_seconds == captured  # a graph captured at first use (43-79 ms) is no cost
        most = tree.spec.max_depth + 1
        for seq in seqs:
            seq.num_inflight_tokens += most
        return _InFlight(requests, tree, padded, propose, result, timed, part1.prompt_hidden,
                         logprobs=self._queue_logprobs(requests, tree, part1, packed), policy=policy), caught

    def _forward(self, seqs: list[Sequence], tree: DeviceTree, prompts: PromptSegment | None):
        """Part 1 of a decode step for `seqs` -> (their requests, padded batch, whether it proposes, part 1, the
        rows whose verdicts are the host's, the candidates on their way to the host for those rows' walks, or
        None: a plain step, or no such row)."""
        step = self.runner.decode
        requests = [self.requests[seq.request_id] for seq in seqs]
        sampling = [self._row_sampling(r, tree) for r in requests]
        propose = self.traffic_policy().proposes(step.bucket(len(seqs)), tree.spec)
        forced = [self._forced(r, tree.num_lookup) for r in requests] if tree.num_lookup else None
        changes = [self._row_changes(r) for r in requests]
        padded = step.prepare(seqs, [r.row for r in requests], tree, self.blocks, sampling, propose, prompts, forced,
                              changes)
        host = self._host_rows(requests)
        early = step.candidates_to_host(tree, padded) if host and tree.num_nodes > 1 else None
        return requests, padded, propose, step.forward(tree, padded), host, early

    def _catch_up(self, ahead: set[Sequence] = frozenset(), ahead_nodes: int = 0,
                  apply_all: bool = True) -> list[RequestOutput]:
        """Everything the device decided that the host has not seen: first tokens of admissions, then the
        overlapped step in flight, read back, and the steps read back before it (`_apply_pending`'s arguments).
        apply_all=False: the read-back steps wait while fewer than `apply_interval` have gathered."""
        outputs = self._read_first_tokens()
        if self._inflight is not None:
            self._read_back_inflight()
        pending = self._pending
        if pending and (apply_all or len(pending) >= self.apply_interval):
            outputs += self._apply_pending(ahead, ahead_nodes)
        return outputs

    def _read_back_inflight(self) -> None:
        """The overlapped step's packed rows to the host (waiting for the step), kept with the steps to apply."""
        flight, self._inflight = self._inflight, None
        flight.rows = flight.result.tolist()
        flight.noted = self._read_logprobs(flight.requests, flight.logprobs, flight.rows)
        flight.read_at = cost_clock()
        self._pending.append(flight)

    def _apply_pending(self, ahead: set[Sequence] = frozenset(), ahead_nodes: int = 0) -> list[RequestOutput]:
        """The read-back steps' tokens, with stops and outputs as in `_decode`. `ahead`: sequences a later
        step (launched or about to run) writes `ahead_nodes` tree slots for, past these steps' tokens."""
        flights, self._pending = self._pending, []
        for flight in flights:
            most = flight.tree.spec.max_depth + 1
            for request in flight.requests:
                request.seq.num_inflight_tokens -= most
        outputs = self._apply_steps(flights, ahead, ahead_nodes)
        self._observe_costs(flights, cost_clock())
        return outputs

    def _observe_costs(self, flights: list[_InFlight], applied_at: float) -> None:
        """Each timed step's cost, for the policy: the time between its read-back and the one before it
        (the first of these steps: since the last application), plus its share of this application.
        A run of overlapped steps reaches that from its second step on. The first one's host work
        overlaps nothing: timed, a lone plain step (a revisit) would charge plain decoding the cost of a step
        without overlap, and speculation would win too often. One launched after a prefill would be charged
        the prefill (on an 8B shape, several ms), and with speculation requests finish, so prompts are
        admitted, at scattered steps: its revisits, at 8B and 64 requests, charged plain decoding twice its
        step (session 9). Steps applied together are timed one by one, not only when all of them are: with
        apply_interval=4 at 32 requests, admissions every other step left the policy a quarter of its
        timings, and its decision unsettled (session 35, RESULTS.md)."""
        share = (applied_at - flights[-1].read_at) / len(flights)
        previous = self._read_back_time
        for flight in flights:
            if flight.timed and flight.padded in flight.policy.step_cost:
                flight.policy.observe_step(flight.padded, flight.tree.spec, flight.read_at - previous + share,
                                           flight.propose)
            previous = flight.read_at
        self._read_back_time = applied_at

    def _decode(self, seqs: list[Sequence], tree: DeviceTree, timed: bool = True,
                prompts: PromptSegment | None = None) -> tuple[list[RequestOutput], torch.Tensor | None]:
        """One batched verification step for every decoding sequence, read back at once -> (outputs, the
        hidden states [P, H] of the prompt chunks it carried, if any). `timed`: its wall time is the step's
        alone (no prefill ran in this engine step), so the policy learns from it."""
        start, policy = cost_clock(), self.traffic_policy()  # the one whose tree this is
        captured = self.runner.decode.capture_seconds
        requests, padded, propose, part1, host, early = self._forward(seqs, tree, prompts)
        self._verify_on_host(requests, tree, part1, host, early)
        packed = self.runner.decode.finish(tree, padded)[: len(seqs)]
        logprobs = self._queue_logprobs(requests, tree, part1, packed)
        packed = packed.tolist()  # the step's one device-to-host copy (and its logprobs', where asked)
        outputs = self._apply_rows(requests, tree, packed, noted=self._read_logprobs(requests, logprobs, packed),
                                   policy=policy)
        timed = timed and self.runner.decode.capture_seconds == captured  # no graph captured at first use in it
        if timed and padded in policy.step_cost:  # the measured policy is on: it learns what steps cost
            policy.observe_step(padded, tree.spec, cost_clock() - start, propose)
        return outputs, part1.prompt_hidden

    def _apply_rows(self, requests: list[EngineRequest], tree: DeviceTree, rows: list[list[int]],
                    ahead: set[Sequence] = frozenset(), ahead_nodes: int = 0,
                    noted: dict[Sequence, list[TokenLogprob]] | None = None,
                    policy: TreePolicy | None = None) -> list[RequestOutput]:
        """A step's packed rows (count, D + 1 tokens, deepest accepted node) -> tokens appended up to the
        first stop, KV committed, statistics. Sequences finished or aborted since the launch are skipped
        (the step ran one too many for them; nothing is preempted while a step is in flight).
        `ahead`: sequences whose next step is already scheduled, with `ahead_nodes` tree slots. `noted`: the
        logprobs of the tokens of the rows that asked. `policy`: the one that chose the step's tree."""
        # drafts came through the lookup chain if the deepest node is on it (no node is, without one: first == N)
        first = tree.first_lookup_node
        drafted, depth = tree.num_nodes - 1, tree.spec.max_depth
        outputs, counts, bests, from_lookup = [], [], [], 0
        live, commit = self.requests, self.blocks.commit  # looked up once: this loop runs for every row
        for request, row in zip(requests, rows):
            seq, count = request.seq, row[0]
            if seq.is_finished or live.get(seq.request_id) is not request:
                continue
            looked_up = count - 1 if row[-1] >= first else 0
            request.stats.record_step(drafted, depth, count, looked_up)
            counts.append(count)
            bests.append(row[-1])
            from_lookup += looked_up
            if noted:
                request.logprobs += noted.get(seq, [])
            emitted = self._append(request, row[1:count + 1])
            if not seq.is_finished:
                commit(seq, count, ahead_nodes if seq in ahead else 0)
            if not request.quiet or seq.is_finished:  # a quiet request is reported once, finished
                outputs.append(self._output(request, emitted))
        self._count_step(tree.spec, counts, from_lookup, bests, policy)
        return outputs

    def _apply_steps(self, flights: list[_InFlight], ahead: set[Sequence] = frozenset(),
                     ahead_nodes: int = 0) -> list[RequestOutput]:
        """Several read-back steps at once (`EngineConfig.apply_interval`), as `_apply_rows` would apply them
        one by one: each step is recorded as it ran, up to the sequence's stop; a sequence's tokens of all of
        them are appended (one detokenizer call), committed and reported together where nothing among them
        can stop it, else step by step up to the stop."""
        if len(flights) == 1:  # every step's case, kept apart: the general loop below is slower for one step
            flight = flights[0]
            return self._apply_rows(flight.requests, flight.tree, flight.rows, ahead, ahead_nodes, flight.noted,
                                    flight.policy)
        counts = [[] for _ in flights]  # per step: tokens each recorded row emitted, its deepest accepted node
        bests = [[] for _ in flights]
        from_lookup = [0] * len(flights)
        trees = [(f.tree.first_lookup_node, f.tree.num_nodes - 1, f.tree.spec.max_depth) for f in flights]
        outputs = []
        for request, rows in _rows_by_request(flights):
            seq = request.seq
            if seq.is_finished or self.requests.get(seq.request_id) is not request:
                continue
            tokens = [t for _, row in rows for t in row[1:row[0] + 1]]
            whole = cannot_stop(request, tokens)
            emitted = []
            for j, row in rows:
                if seq.is_finished:  # stopped in an earlier one of these steps
                    break
                first, drafted, depth = trees[j]
                count = row[0]
                looked_up = count - 1 if row[-1] >= first else 0
                request.stats.record_step(drafted, depth, count, looked_up)
                counts[j].append(count)
                bests[j].append(row[-1])
                from_lookup[j] += looked_up
                request.logprobs += flights[j].noted.get(seq, [])
                if not whole:
                    emitted += self._append(request, row[1:count + 1])
            if whole:
                emitted = self._append(request, tokens)
            if not seq.is_finished:  # nothing was cut: every token is kept
                self.blocks.commit(seq, len(tokens), ahead_nodes if seq in ahead else 0)
            if not request.quiet or seq.is_finished:
                outputs.append(self._output(request, emitted))
        for flight, step_counts, step_bests, looked_up in zip(flights, counts, bests, from_lookup):
            self._count_step(flight.tree.spec, step_counts, looked_up, step_bests, flight.policy)
        return outputs

    def _count_step(self, spec: TreeSpec, counts: list[int], from_lookup: int = 0, bests: list[int] = (),
                    policy: TreePolicy | None = None) -> None:
        """A decode step's totals, once for the batch: tokens each row emitted (counts), for the acceptance seen
        by `policy` (the one that chose the tree; None: the greedy one), the engine's statistics and its steps
        per tree; each row's deepest accepted node (bests), for what the trees inside `spec` would have emitted."""
        policy = self.policy if policy is None else policy
        policy.observe(spec, sum(counts), len(counts))
        self.totals.record_steps(spec.num_nodes - 1, spec.max_depth, counts, from_lookup)
        self.steps_per_tree[spec.label] += 1
        if bests and spec.num_nodes > 1:
            policy.observe_subtrees(spec, np.asarray(bests, dtype=np.int64))

    @staticmethod
    def _queue_logprobs(requests: list[EngineRequest], tree: DeviceTree, part1,
                        packed: torch.Tensor) -> StepLogprobs | None:
        """The logprobs of a step's emitted tokens for its rows that ask, queued on the device right after the
        step (before the next one overwrites its logits); packed [B, D + 3] on the device."""
        asks = {i: r.params.logprobs for i, r in enumerate(requests) if r.params.logprobs is not None}
        return queue_step_logprobs(tree, part1.logits, packed, asks) if asks else None

    @staticmethod
    def _read_logprobs(requests: list[EngineRequest], logprobs: StepLogprobs | None,
                       packed: list[list[int]]) -> dict[Sequence, list[TokenLogprob]]:
        """A step's queued logprobs, once its packed rows are on the host -> {sequence: one per emitted token}."""
        if logprobs is None:
            return {}
        emitted = [(row[0], row[1:]) for row in packed]
        return {requests[i].seq: noted for i, noted in logprobs.read(emitted).items()}

    # ---- helpers ---------------------------------------------------------

    def _append(self, request: EngineRequest, tokens: list[int]) -> list[int]:
        """Append up to the first stop condition; finish and free the sequence if one hit. `tokens`: ints."""
        seq, params, detok = request.seq, request.params, request.detok
        if cannot_stop(request, tokens):  # most steps
            if detok is not None:
                request.new_text += detok.add(tokens)
            seq.output_token_ids.extend(tokens)
            return tokens
        done = len(seq.output_token_ids)
        room = max(params.max_tokens - done, 1)  # a token is always kept unless it stops the sequence
        kept = tokens[:room]
        reason = FinishReason.LENGTH if len(tokens) >= room else None
        if not request.stop_ids.isdisjoint(kept):  # rare: find the first stop token past min_tokens
            for i, token in enumerate(kept):
                if token in request.stop_ids and done + i >= params.min_tokens:
                    kept, reason = kept[:i], FinishReason.STOP
                    request.stop_reason = token if token in params.stop_token_ids else None
                    break
        if request.detok is not None:
            kept, stopped = until_stop_string(request, kept)
            if stopped:
                reason, request.stop_reason = FinishReason.STOP, request.detok.stop_string
        seq.append_tokens(kept)
        if request.logprobs:
            del request.logprobs[seq.num_output_tokens:]  # drop those of tokens cut by a stop
        if reason is not None:
            seq.finish(reason)
            self.scheduler.finish(seq)
            self._release_row(request)
        return kept

    def _note_prompt_logprobs(self, prefills: list[ScheduledSeq], batch, hidden: torch.Tensor) -> None:
        """Prompt logprobs from the hidden states [T, H] of the chunks just run, for requests that ask: the
        state at prompt position q gives token q + 1's. Positions already noted (a recompute after
        preemption runs them again) are skipped; the last prompt position predicts the first output token."""
        for item, start in zip(prefills, batch.starts):
            request = self.requests[item.seq.request_id]
            noted = request.prompt_logprobs
            if noted is None:
                continue
            first, prompt = item.seq.num_computed_tokens, item.seq.prompt_token_ids
            for begin in range(max(first, len(noted) - 1), min(first + item.num_tokens, len(prompt) - 1),
                               PROMPT_LOGPROB_ROWS):  # [rows, V] logits at a time, not the whole prompt's
                end = min(begin + PROMPT_LOGPROB_ROWS, first + item.num_tokens, len(prompt) - 1)
                logits = self.model.compute_logits(hidden[start + begin - first: start + end - first])
                noted += token_logprobs(logits, prompt[begin + 1: end + 1], request.params.prompt_logprobs)

    def _forget(self, sub: str) -> None:
        """A sequence leaves the engine (finished or aborted): its decode row freed, its traffic uncounted."""
        request = self.requests.pop(sub, None)
        if request is not None:
            self._count(request, -1)
            self._release_row(request)

    def _count(self, request: EngineRequest, sign: int) -> None:
        """Traffic counts that pick the step's tree policy (`traffic_policy`), as a sequence comes or goes."""
        self._sampled_seqs += sign * (not request.sampling.greedy)
        self._host_seqs += sign * request.host_always

    def _release_row(self, request: EngineRequest) -> None:
        if request.row is not None:
            self.runner.decode.release_row(request.row)
            request.row = None

    def _output(self, request: EngineRequest, new: list[int]) -> RequestOutput:
        seq = request.seq
        finished = seq.is_finished
        text, delta = "", ""
        if request.detok is not None:
            delta = request.new_text + (request.detok.flush() if finished else "")
            request.new_text, text = "", request.detok.text
        if finished:
            self._forget(seq.request_id)
        if request.quiet:  # reported once, finished (`generate`): its one output covers the whole output
            new = seq.output_token_ids[:]
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = request.logprobs[-len(new):] if new else []
        return RequestOutput(request.parent_id, new, delta, finished,
                             seq.finish_reason.value if seq.finish_reason else None,
                             seq.output_token_ids, seq.num_output_tokens, text, request.stats,
                             request.index, logprobs, request.prompt_logprobs,
                             request.stop_reason if finished else None)

    def _device_tree(self, spec: TreeSpec) -> DeviceTree:
        if spec not in self._device_trees:
            self._device_trees[spec] = DeviceTree.from_spec(spec, self.device)
        return self._device_trees[spec]


def _fitting_trees(trees: list[TreeSpec], heads: MedusaHeads | None, defaults: bool) -> list[TreeSpec]:
    """The trees the heads can fill: the default trees deeper than the heads are dropped; a tree the user gave
    that needs more heads, or ranks past their vocabulary, is refused by name."""
    if heads is None:
        return trees
    num_heads, vocab = heads.config.num_heads, heads.config.vocab_size
    usable = [t for t in trees if t.head_depth <= num_heads]
    if not usable:
        raise ValueError(f"no tree in config.trees fits the heads: each needs more than their "
                         f"{num_heads} heads ({', '.join(f'{t.label}: {t.head_depth}' for t in trees)})")
    for tree in trees if not defaults else usable:
        try:
            tree.check_heads(num_heads, vocab)
        except ValueError as err:
            raise ValueError(f"config.trees: tree {tree.label}: {err}") from None
    return usable


def _one_prompt(prompts: Any) -> bool:
    """Whether generate's prompts are one prompt: a string, a flat sequence of token ids (Python or NumPy
    integers), or a tensor / array that is not 2-D (a 2-D one is a batch, a row a prompt)."""
    if isinstance(prompts, str):
        return True
    if hasattr(prompts, "ndim") and hasattr(prompts, "tolist"):
        return prompts.ndim != 2
    return isinstance(prompts, Seq) and bool(prompts) and all(is_token_id(t) for t in prompts)


def _fill_bucket(prefills: list[ScheduledSeq], buckets: list[int], limit: int) -> list[ScheduledSeq]:
    """Prompt chunks cut to fill the largest token bucket they cover, the newest cut first: a decode step's
    graph computes its bucket's padding at full cost (an 8B model, ~16 GFLOP a token; Spec-Bench prompts of
    130 tokens pad to 256), while the tokens cut wait a step in their sequences' next chunk. A chunk cut to
    nothing waits whole, its blocks allocated. Unchanged if they fill a bucket, cover none, or exceed `limit`."""
    total = sum(item.num_tokens for item in prefills)
    fitting = [b for b in buckets if b <= min(total, limit)]
    if total > limit or not fitting or fitting[-1] == total:
        return prefills
    cut, kept = total - fitting[-1], []
    for item in reversed(prefills):
        take = min(cut, item.num_tokens)
        cut -= take
        if take < item.num_tokens:
            kept.append(item._replace(num_tokens=item.num_tokens - take))
    return kept[::-1]


def _with_lookup(trees: list[TreeSpec], length: int) -> list[TreeSpec]:
    """Each speculative tree with a lookup chain of `length` nodes (the plain one stays plain), once each:
    trees cut down to fit 64 nodes may coincide."""
    if not length:
        return trees
    return list(dict.fromkeys(t.with_lookup(length) if t.num_nodes > 1 else t for t in trees))


def stream(engine: LLMEngine, prompt: str | Seq[int], params: SamplingParams = SamplingParams()):
    """Drive `engine` until one new request finishes, yielding its outputs as they come: with n > 1, those of
    every completion (tell them apart by `out.index`) until all n have finished.

    If the caller stops iterating early, the request is aborted so its KV blocks are freed.
    """
    rid = engine.add_request(prompt, params)
    unfinished = set(range(params.n))
    try:
        while unfinished:
            for out in engine.step():
                if out.request_id == rid:
                    if out.finished:
                        unfinished.discard(out.index)
                    yield out
    finally:
        if unfinished:
            engine.abort(rid)
