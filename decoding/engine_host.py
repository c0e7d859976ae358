"""The engine's rows that the host decides, and the logit changes the device makes for the others.

Most rows are verified on the device (`DecodeStep`: greedy and sampled targets, and the bias, count
penalties and min_tokens ban of `device_changes.py`). A row whose logits need the host (a guide, guided
choices, bad words, or a min_tokens ban of more end tokens than the device holds) gets its node targets
here, from its own changed logits, and the device takes them over its own (`DecodeStep.override`).

`HostVerdicts` is a part of `LLMEngine` (a mixin): it reads the engine's `runner`, `device` and requests.
"""

from __future__ import annotations

import torch

from medusa.decoding.decode_step import RowSampling
from medusa.decoding.device_changes import MAX_BANNED, RowChanges
from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.engine_request import EngineRequest
from medusa.decoding.host_buffers import PendingCopy, to_device
from medusa.decoding.logits_processing import batch_changes, penalize, suppress_eos

# rows whose logit changes are made together (a guide, count penalties): [rows, N, V] float32 at a time, 63 MB
# for 16 rows of a 20-node tree over a 49k vocabulary (a 128k one: 164 MB)
HOST_CHUNK_ROWS = 16


class HostVerdicts:
    """Which rows the host decides, their verdicts, and the device-side settings of the rows it does not."""

    def _host_rows(self, requests: list[EngineRequest]) -> list[int]:
        """The rows of a step's requests whose verdicts are the host's, as the step was prepared (a row under a
        min_tokens ban the device cannot hold stays the host's for the step, whatever the host learns meanwhile:
        its sampling settings did not go up)."""
        return [i for i, request in enumerate(requests) if self._needs_host(request)]

    def _verify_on_host(self, requests: list[EngineRequest], tree: DeviceTree, part1, host: list[int],
                        early: PendingCopy | None = None) -> None:
        """Verdicts for rows `host` the device rules cannot decide (guides, bad words): each such row's node
        targets from its own changed logits (the argmax, or its sampler's draw), then one batched verdict for
        them all on the device, over the device's own. Rows whose changes can be made together (`batchable`)
        are, HOST_CHUNK_ROWS at a time, their guides walked from the candidates copied ahead of part 1
        (`early`, `DecodeStep.candidates_to_host`): nothing they do waits for part 1, whose forward the
        walk overlaps. The step's packed copy carries these verdicts with the others. The host knows each
        row's output up to the step's root."""
        if not host:
            return
        n = tree.num_nodes
        together = [i for i in host if requests[i].batchable]
        alone = [i for i in host if not requests[i].batchable]
        tokens = early.tolist() if early is not None and together else None  # waits for the copy alone
        targets = [self._batch_targets(requests, together[at:at + HOST_CHUNK_ROWS], tree, part1, tokens)
                   for at in range(0, len(together), HOST_CHUNK_ROWS)]
        targets += [self._host_targets(requests[i], tree, part1.logits[i * n:(i + 1) * n], part1.candidates[i])[None]
                    for i in alone]
        self.runner.decode.override(tree, together + alone, part1.candidates, torch.cat(targets))

    def _batch_targets(self, requests: list[EngineRequest], rows: list[int], tree: DeviceTree,
                       part1, tokens: list[list[int]] | None = None) -> torch.Tensor:
        """Batchable rows' logit changes made at once (`batch_changes`) -> their node targets [G, N]: one argmax
        for them all, then a sampled row's draws, or a row's under the min_tokens ban, row by row. tokens: the
        step's candidates on the host, per batch row, if copied."""
        n, at = tree.num_nodes, to_device(rows, torch.long, self.device)
        asked = [requests[i] for i in rows]
        logits = batch_changes(part1.logits.view(-1, n, part1.logits.shape[-1])[at], [r.params for r in asked],
                               [r.rules for r in asked], [r.seq.output_token_ids for r in asked],
                               [r.seq.prompt_token_ids for r in asked], tree, part1.candidates[at],
                               [tokens[i] for i in rows] if tokens is not None else None)  # [G, N, V]
        targets = logits.argmax(-1)  # [G, N]
        for g, request in enumerate(asked):
            if not request.sampling.greedy or request.seq.num_output_tokens < request.eos_banned_until:
                targets[g] = self._host_targets(request, tree, None, None, changed=logits[g])
        return targets

    def _host_targets(self, request: EngineRequest, tree: DeviceTree, raw: torch.Tensor, candidates: torch.Tensor,
                      changed: torch.Tensor | None = None) -> torch.Tensor:
        """raw [N, V] logits at a row's nodes -> each node's target [N] after the request's logit changes (given as
        `changed` where they are done already): the argmax, or its sampler's draw for output number (the output
        so far) + depth (as `verifier.verify`)."""
        if changed is None:
            changed = self._penalize(request, raw, tree, candidates)
        logits = self._suppress_eos(request, changed, tree.depths)
        if request.sampling.greedy:
            return logits.argmax(-1)
        return request.sampler(logits, request.sampling, request.seq.num_output_tokens + tree.depths)

    def _needs_host(self, request: EngineRequest) -> bool:
        """Whether the request's rows need the host's verdict: logit changes the device does not make (guides,
        guided choices, bad words), or a min_tokens ban of more end tokens than it holds. Its first token too."""
        return request.host_always or (request.seq.num_output_tokens < request.eos_banned_until
                                       and len(request.stop_ids) > MAX_BANNED)

    def _row_changes(self, request: EngineRequest) -> RowChanges | None:
        """The bias, count penalties and min_tokens ban the device makes for a row the host does not decide
        (None: none). The ban's bound counts from the host's output count, as the device's root window does."""
        if not request.device_changes or self._needs_host(request):  # most rows: one attribute read
            return None
        params = request.params
        ban_left = request.eos_banned_until - request.seq.num_output_tokens - request.first_pending
        banned = tuple(sorted(request.stop_ids)) if ban_left > 0 else ()
        if not (params.has_count_penalties or banned or params.has_bias):
            return None
        return RowChanges(params.frequency_penalty, params.presence_penalty, params.repetition_penalty,
                          ban_left, banned, params.has_bias)

    def _row_sampling(self, request: EngineRequest, tree: DeviceTree | None) -> RowSampling | None:
        """Device-side sampling settings for a sampling row the host does not handle; None otherwise.

        Node i's target is output number num_output_tokens + (tokens of steps in flight) + depth(i);
        its uniform is the one the host sampler would use there. The heads' proposals for the next
        step reach as many positions further (`DecodeStep._coupled_proposals`), up to the device
        buffer's width. A first token drawn on the device and not read back yet counts as an output.
        tree=None: the first token's own draw (one uniform).
        """
        sampling = request.sampling
        if sampling.greedy or self._needs_host(request):
            return None
        # from the host's output count on: the steps in flight (up to M tokens) come before this one's
        step = self.runner.decode
        reach = request.seq.num_inflight_tokens + tree.spec.max_depth + 1 + step.num_heads if tree is not None else 1
        start = request.seq.num_output_tokens + request.first_pending
        uniforms = request.sampler.window(start, min(reach, step.uniforms.shape[1]))
        return RowSampling(sampling.temperature, sampling.top_k, sampling.top_p, uniforms, sampling.min_p)

    def _suppress_eos(self, request: EngineRequest, logits: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        banned = sorted(request.stop_ids)  # empty with ignore_eos, when suppress_eos bans nothing anyway
        return suppress_eos(request.params, request.seq.num_output_tokens, banned, logits, depths)

    def _penalize(self, request: EngineRequest, logits: torch.Tensor, tree: DeviceTree | None = None,
                  candidates: torch.Tensor | None = None) -> torch.Tensor:
        return penalize(request.params, request.seq.output_token_ids, logits, tree, candidates,
                        request.seq.prompt_token_ids, request.rules)
