"""Admission: a request whose prompt is cached gets a decode row, its first output token and the heads'
first proposals.

With overlap the first token is decided on the device (the argmax, or a draw for a sampled request) and
read back a step later (`FirstTokens`), so an admission does not stall the overlapped steps; a request
with host work (a guide, bad words) has it decided on the host at once.

`Admission` is a part of `LLMEngine` (a mixin): it reads the engine's `runner`, `model`, `device`,
`overlap`, `requests`, `_first_tokens` and `traffic_policy()`, and appends through `_append` / `_output`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from medusa.decoding.batch_verify import sampled_targets
from medusa.decoding.engine_request import EngineRequest
from medusa.decoding.host_buffers import PendingCopy, copy_to_host, to_device
from medusa.decoding.logits_processing import token_logprobs
from medusa.decoding.outputs import RequestOutput
from medusa.decoding.scheduler import prefill_target
from medusa.decoding.step_logprobs import StepLogprobs, queue_first_logprobs


@dataclass
class FirstTokens:
    """First output tokens of admitted rows that need no host logic (greedy or sampled, with the logit
    changes the device makes; their logprobs queued on the device too), decided on the device and read back a step
    later, so an admission does not stall the overlapped steps (the next step decodes from the device's
    roots)."""

    requests: list[EngineRequest]
    tokens: PendingCopy  # [n], one per request
    logprobs: StepLogprobs | None = None  # theirs, for those that ask


class Admission:
    """First tokens of admitted requests (on the host, or on the device and read back later), their decode rows."""

    def _read_first_tokens(self) -> list[RequestOutput]:
        """Append the deferred first tokens (`_start_decoding`), with stops and outputs. A request that stops at
        its first token had a step launched for it already: that step's read-back skips it."""
        outputs = []
        for batch in self._first_tokens:
            for request in batch.requests:
                request.first_pending = False
            tokens = batch.tokens.tolist()
            noted = batch.logprobs.read([(1, [token]) for token in tokens]) if batch.logprobs is not None else {}
            live = []
            for j, (request, token) in enumerate(zip(batch.requests, tokens)):
                if self.requests.get(request.seq.request_id) is request:  # not aborted meanwhile
                    request.logprobs += noted.get(j, [])
                    live.append((request, token))
            outputs += self._emit_first_tokens(live)
        self._first_tokens.clear()
        return outputs

    def _emit_first_tokens(self, pairs: list[tuple[EngineRequest, int]]) -> list[RequestOutput]:
        """Append each request's first output token, with stops; the outputs of those that report it."""
        outputs = []
        for request, token in pairs:
            emitted = self._append(request, [token])
            if not request.quiet or request.seq.is_finished:
                outputs.append(self._output(request, emitted))
        return outputs

    def _start_decoding(self, ready: list[tuple[EngineRequest, int]], hidden: torch.Tensor) -> list[RequestOutput]:
        """Sequences whose prompt is now cached get a decode state row, their pending root and the
        heads' proposals: one lm_head, one argmax, one sync and one heads call for all of them.

        The root is the first output token, except after preemption, when it is already known.
        """
        last = hidden[to_device([i for _, i in ready], torch.long, self.device)]  # [n, H]
        step = self.runner.decode
        for request, _ in ready:
            request.row = step.acquire_row()
        self._set_changes(ready)
        fresh = [k for k, (request, _) in enumerate(ready) if not request.seq.output_token_ids]
        roots = [request.seq.output_token_ids[-1] if request.seq.output_token_ids else 0 for request, _ in ready]
        deferred = None
        if fresh:
            at = to_device(fresh, torch.long, self.device)
            raw = self.model.compute_logits(last[at])  # [f, V], kept for logprobs
            chosen = self._first_changes([ready[k][0] for k in fresh], raw)  # with the device's logit changes
            argmax = chosen.argmax(-1)  # [f]
            if self.overlap and not any(self._needs_host(ready[k][0]) for k in fresh):
                # the device keeps the roots (argmax, or a draw for sampled rows); the host reads them a step later
                first = self._draw_first_tokens([ready[k][0] for k in fresh], chosen, argmax)
                roots = to_device(roots, torch.long, self.device)
                roots[at] = first
                deferred = copy_to_host(first)
                asks = {j: ready[k][0].params.logprobs for j, k in enumerate(fresh)
                        if ready[k][0].params.logprobs is not None}
                first_logprobs = queue_first_logprobs(raw, first, asks)
                for k in fresh:
                    ready[k][0].first_pending = True
            else:
                plain = [(r := ready[k][0]).sampling.greedy and not self._needs_host(r) and r.params.logprobs is None
                         for k in fresh]  # the others' tokens, and any logprobs, are `_first_token`'s
                argmax = argmax.tolist()  # the step's one sync for plain greedy rows
                for j, k in enumerate(fresh):
                    roots[k] = argmax[j] if plain[j] else self._first_token(ready[k][0], raw[j:j + 1])
        # the heads' proposals only where the rows' next steps may speculate: on a 128k vocabulary they
        # are an eager lm_head per admission, which a batch settled on plain decoding would not use
        propose = self.traffic_policy().may_speculate(step.bucket(step.rows_in_use))
        tokens = None
        if step.max_lookup:  # the lookup history: every token before the root (a fresh row's root is new)
            tokens = [(seq := request.seq).token_ids(0, prefill_target(seq)) for request, _ in ready]
        bases = [request.seq.num_computed_tokens for request, _ in ready]
        step.set_states([request.row for request, _ in ready], roots, bases, last, propose, tokens)
        step.add_roots([request.row for request, _ in ready if self._device_counts(request)])
        if deferred is not None:
            self._first_tokens.append(FirstTokens([ready[k][0] for k in fresh], deferred, first_logprobs))
            return []
        return self._emit_first_tokens([(ready[k][0], roots[k]) for k in fresh])

    def _device_counts(self, request: EngineRequest) -> bool:
        """Whether the device keeps the request's output counts (it makes its count penalties)."""
        return request.params.has_count_penalties and not self._needs_host(request)

    def _set_changes(self, ready: list[tuple[EngineRequest, int]]) -> None:
        """Admitted rows whose logits the device changes, before their first token: a penalized row's counts
        of its outputs before the root (`DecodeStep.add_roots` adds the root once in place) and the prompt
        tokens a repetition penalty counts; a biased row's bias."""
        requests = [r for r, _ in ready if (r.params.has_count_penalties or r.params.has_bias)
                    and not self._needs_host(r)]
        if not requests:
            return
        counted = [self._device_counts(r) for r in requests]
        outputs = [r.seq.output_token_ids[:-1] if c else None for r, c in zip(requests, counted)]  # fresh: none yet
        prompts = [r.seq.prompt_token_ids if c and r.params.repetition_penalty != 1 else []
                   for r, c in zip(requests, counted)]
        self.runner.decode.changes.set_rows([r.row for r in requests], outputs, prompts,
                                            [r.params.logit_bias or None for r in requests],
                                            [r.params.allowed_token_ids for r in requests])

    def _first_changes(self, requests: list[EngineRequest], raw: torch.Tensor) -> torch.Tensor:
        """Fresh rows' first-token logits raw [f, V] with the changes the device makes for them (bias, the
        repetition penalty's prompt tokens, the min_tokens ban), or raw itself where none has any."""
        changes = [self._row_changes(r) for r in requests]
        if not any(changes):
            return raw
        return self.runner.decode.changes.first(raw, [r.row for r in requests], changes)

    def _draw_first_tokens(self, requests: list[EngineRequest], raw: torch.Tensor,
                           argmax: torch.Tensor) -> torch.Tensor:
        """Output token 0 of fresh requests that need no host logic, on the device: `argmax` [f] for greedy
        ones, for sampled ones a draw from raw logits [f, V] as a decode step draws its targets
        (`sampled_targets`: for a seeded request the host sampler's draw, with output 0's uniform)."""
        sampled = [j for j, request in enumerate(requests) if not request.sampling.greedy]
        if not sampled:
            return argmax
        rows = [self._row_sampling(requests[j], None) for j in sampled]
        at = to_device(sampled, torch.long, self.device)
        # to_device, not torch.tensor(device=...): a copy from pageable memory would wait for the queued steps
        drawn = sampled_targets(
            raw[at][:, None, :], to_device([r.temperature for r in rows], torch.float32, self.device),
            to_device([r.top_k for r in rows], torch.long, self.device),
            to_device([r.top_p for r in rows], torch.float32, self.device),
            to_device([r.min_p for r in rows], torch.float32, self.device),
            to_device(np.array([r.uniforms[:1] for r in rows]), torch.float64, self.device),
            filtered=any(r.filters for r in rows))  # [s, 1]
        return argmax.index_copy(0, at, drawn[:, 0])

    def _first_token(self, request: EngineRequest, raw: torch.Tensor) -> int:
        """Output token 0 from raw logits [1, V], with penalties, the min_tokens ban, sampling, logprobs."""
        logits = self._suppress_eos(request, self._penalize(request, raw), torch.zeros(1, device=self.device))
        sampling = request.sampling
        first = torch.zeros(1, dtype=torch.long, device=self.device)  # output index 0
        root = logits[0].argmax() if sampling.greedy else request.sampler(logits, sampling, first)[0]
        self._note_logprobs(request, raw, [int(root)])
        return int(root)

    def _note_logprobs(self, request: EngineRequest, logits: torch.Tensor, tokens: list[int]) -> None:
        """logits [n, V]: row i is the distribution tokens[i] was drawn from."""
        if request.params.logprobs is not None:
            request.logprobs += token_logprobs(logits, tokens, request.params.logprobs)
