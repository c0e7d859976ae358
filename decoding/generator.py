"""Batch-1 Medusa decoding: prefill, then propose -> verify -> commit until done.

One step forwards the whole tree (root + proposals) with the tree mask, asks the
verifier for the accepted path, moves that path's KV into place, and proposes
the next tree from the heads at the deepest accepted node. Plain decoding is the
same loop with the single-node tree, so comparisons run identical code. A tree's
prompt-lookup chain (`TreeSpec.lookup`) gets the tokens after the latest earlier
occurrence of the sequence's last few tokens, as in the engine. With a
`SpeculationGate`, greedy decoding runs plain steps wherever speculation is
measured to lose (`speculation_gate.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.kv_cache import ContiguousKVCache
from medusa.decoding.prompt_lookup import NgramIndex
from medusa.decoding.proposer import Proposer, propose_from_heads
from medusa.decoding.sampler import SamplingConfig, TokenSampler
from medusa.decoding.speculation_gate import SpeculationGate
from medusa.decoding.verifier import AcceptanceConfig, verify
from medusa.heads import MedusaHeads
from medusa.model import DecoderModel
from medusa.tree import TreeSpec


@dataclass
class DecodeStats:
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(self.steps, 1)

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens over the whole call, prefill included (what a user waits for)."""
        total = self.prefill_seconds + self.decode_seconds
        return sum(self.accepted_lengths) / total if total > 0 else 0.0


class TreeDecoder:
    """Runs one sequence at a time on a contiguous KV cache."""

    def __init__(self, model: DecoderModel, heads: MedusaHeads | None, tree: TreeSpec,
                 proposer: Proposer = propose_from_heads, gate: SpeculationGate | None = None) -> None:
        if tree.num_nodes > 1:
            if heads is None and proposer is propose_from_heads:
                raise ValueError("a tree with more than one node needs Medusa heads (or a custom proposer)")
            if heads is not None:
                tree.check_heads(heads.config.num_heads, heads.config.vocab_size)
        self.model, self.heads, self.proposer = model, heads, proposer
        self.device = model.embed_tokens.weight.device
        self.tree = DeviceTree.from_spec(tree, self.device)
        self.single = DeviceTree.from_spec(TreeSpec.load("single"), self.device)  # a gated step's plain fallback
        self.gate = gate if tree.num_nodes > 1 else None  # kept across calls: it learns this device's costs
        self.stats = DecodeStats()

    def decode(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
               acceptance: AcceptanceConfig = AcceptanceConfig()) -> Iterator[list[int]]:
        """Yield each step's accepted tokens (EOS and length are the caller's business).

        Each step runs under inference mode, entered around it rather than around the generator: a generator
        under a torch context manager re-enters it on close, and a stream left half-read closes at interpreter
        exit, after torch is torn down ("Exception ignored ... 'NoneType' object has no attribute")."""
        steps = self._steps(prompt_ids, max_new_tokens, sampling, acceptance)
        while True:
            with torch.inference_mode():
                tokens = next(steps, None)
            if tokens is None:
                return
            yield tokens

    def _steps(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
               acceptance: AcceptanceConfig) -> Iterator[list[int]]:
        self._check_length(len(prompt_ids), max_new_tokens)
        sampler = TokenSampler(sampling.seed)
        cache = ContiguousKVCache(self.model.config, len(prompt_ids) + max_new_tokens + self.tree.num_nodes,
                                  self.model.embed_tokens.weight.dtype, self.device)
        self.stats = DecodeStats(prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        root, head_logits = self._prefill(cache, prompt_ids, sampling, sampler)
        self._sync()
        self.stats.prefill_seconds = time.perf_counter() - start
        generated: list[int] = []
        # prompt + generated + the pending root, which the next step emits first
        lookup = NgramIndex(prompt_ids + [int(root)]) if self.tree.num_lookup else None
        gate = self.gate if sampling.greedy else None
        speculate, heads_seconds = True, 0.0  # the prefill's heads proposed the first tree (not charged)
        while len(generated) < max_new_tokens:
            step_start = time.perf_counter()
            tree = self.tree if speculate else self.single
            candidates = self._candidates(tree, root, head_logits, generated, lookup)  # [N]
            hidden = self._forward(cache, candidates, cache.length + tree.depths, tree.mask)
            logits = self.model.compute_logits(hidden)
            verdict = verify(tree, candidates, logits, sampling, acceptance, sampler, len(generated) + 1)
            cache.commit(verdict.accepted)
            tokens = candidates[verdict.accepted].tolist()
            root = verdict.next_token
            if lookup is not None:  # tokens[0] is the old root, already indexed; .tolist() has synced
                lookup.extend(tokens[1:] + [int(root)])
            if gate is not None:  # a speculative step is charged the heads that proposed its tree
                seconds = time.perf_counter() - step_start + (heads_seconds if speculate else 0.0)
                gate.observe(speculate, seconds, len(tokens))
                speculate = gate.speculate()
            heads_start = time.perf_counter()
            head_logits = self._head_logits(hidden[verdict.accepted[-1]], root) if speculate else None
            if gate is not None:
                self._sync()
                heads_seconds = time.perf_counter() - heads_start
            generated.extend(tokens)
            self.stats.accepted_lengths.append(len(tokens))
            self.stats.decode_seconds += time.perf_counter() - step_start
            yield tokens

    def _candidates(self, tree: DeviceTree, root, head_logits: torch.Tensor | None, generated: list[int],
                    lookup: NgramIndex | None) -> torch.Tensor:
        """The step's tree tokens [N]: the heads' proposals (and lookup chain), or the root alone."""
        if tree is self.single:
            return torch.as_tensor(root, device=self.device).view(1)
        candidates = self.proposer(tree, root, head_logits, generated)
        return self._fill_lookup(candidates, lookup) if lookup is not None else candidates

    def _fill_lookup(self, candidates: torch.Tensor, lookup: NgramIndex) -> torch.Tensor:
        """candidates [N] with the lookup chain's tokens proposed from the index (prompt + output + root)."""
        chain = torch.tensor(lookup.propose(self.tree.num_lookup), device=candidates.device)
        return torch.cat([candidates[: self.tree.first_lookup_node], chain])

    def _prefill(self, cache: ContiguousKVCache, prompt_ids: list[int], sampling: SamplingConfig,
                 sampler: TokenSampler):
        ids = torch.tensor(prompt_ids, device=self.device)
        causal = torch.ones(len(prompt_ids), len(prompt_ids), dtype=torch.bool, device=self.device).tril()
        hidden = self._forward(cache, ids, torch.arange(len(prompt_ids), device=self.device), causal)
        cache.commit(torch.arange(len(prompt_ids), device=self.device))
        last = hidden[-1]
        logits = self.model.compute_logits(last[None])  # [1, V]
        first = torch.zeros(1, dtype=torch.long, device=self.device)  # output index 0
        root = logits[0].argmax() if sampling.greedy else sampler(logits, sampling, first)[0]
        return root, self._head_logits(last, root)

    def _forward(self, cache: ContiguousKVCache, ids: torch.Tensor, positions: torch.Tensor,
                 step_mask: torch.Tensor) -> torch.Tensor:
        cache.begin(positions, step_mask)
        return self.model(ids, positions, cache)  # [T, H]

    def _head_logits(self, hidden: torch.Tensor, root) -> torch.Tensor | None:
        """hidden [H] and the root it emits ([] tensor or int) -> [K, V], or None for plain decoding."""
        if self.heads is None or self.tree.num_nodes == 1:
            return None
        return self.heads(hidden, self.model.lm_head.weight, roots=torch.as_tensor(root, device=hidden.device))

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        context = self.model.config.max_position_embeddings
        needed = prompt_len + max_new_tokens + self.tree.spec.max_depth
        if needed > context:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + tree depth "
                f"({self.tree.spec.max_depth}) exceeds the model's context of {context} tokens"
            )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

