"""The batched decoding step: propose -> forward the trees -> verify -> compact KV -> next proposals.

All of it runs on the device from static buffers, in two parts so that rows
needing host logic (guides, bad words) can be decided between
them:

    part 1  each row's tree placed at its committed length (positions, KV slots, lengths),
            candidates from each row's saved root and head top-k (and, for a tree's
            lookup chain, n-gram proposals from the row's token history), one
            forward of B x N tree tokens over the paged cache, logits (bias, count
            penalties and min_tokens bans applied, `device_changes.py`), each row's verdict
            (greedy, or its seeded draws)
    (host)  targets for the rows that need it, one verdict written into `best`/`next`
    part 2  emitted tokens (appended to the token history), KV of accepted paths moved
            into place, committed lengths advanced, heads at the accepted node -> each
            row's next root and top-k saved (a plain step that the next step will not
            speculate from skips the heads: with a large vocabulary they cost as much
            as the rest of part 2)

On CUDA each part is captured once per (batch bucket, tree) as a CUDA graph and
replayed; the only device-to-host copy of a step is the packed [B, D + 3] result.
On the CPU the same functions run eagerly, so the tests exercise this code.
Per-sequence state (pending root, head top-k, committed length) lives in rows of
`roots`/`topk`/`row_base`; the engine leases a row to each decoding sequence.
Because a row's committed length lives on the device, a step can be launched
before the previous one's accepted lengths are back on the host: the host only
has to back the worst case with blocks (`Sequence.num_inflight_tokens`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from medusa.config import ModelConfig
from medusa.decoding.batch_verify import sampled_targets
from medusa.decoding.block_manager import BlockManager
from medusa.decoding.device_changes import UNCHANGED, DeviceChanges, RowChanges
from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.host_buffers import PendingCopy, copy_to_host, host_buffer, overwritten, to_device, upload
from medusa.decoding.paged_cache import PagedKVCache, StepMetadata
from medusa.decoding.prefill_graphs import PromptSegment
from medusa.heads import MedusaHeads
from medusa.kernels.gumbel_sample import gumbel_top_k
from medusa.kernels.ngram_lookup import ngram_lookup
from medusa.kernels.paged_attention import chunks_per_split, row_tile
from medusa.kernels.top_k import top_k_indices
from medusa.kernels.tree_accept import accept, verdict
from medusa.kernels.tree_candidates import gather_candidates
from medusa.kernels.tree_placement import place_tree
from medusa.model import DecoderModel


# A step's sampling kind, part of its graphs' key: no sampling rows; rows drawn at a temperature only (an
# OpenAI request's default); some row also filtered by top-k or top-p, which sorts each node's logits (two
# sorts of [rows x nodes, vocab]: on the GPU they cost a sampled step more than the rest of its sampling)
GREEDY, SAMPLED, FILTERED = 0, 1, 2


@dataclass(frozen=True)
class RowSampling:
    """A sampling row's settings for one step; uniforms [D + 1] are those of output
    positions num_output_tokens + depth (see TokenSampler.uniforms)."""

    temperature: float
    top_k: int
    top_p: float
    uniforms: np.ndarray  # [M + D + 1]: from the host's output count on, M the tokens of steps in flight
    min_p: float = 0.0

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclass
class _Part1:
    candidates: torch.Tensor  # [Bp, N]
    hidden: torch.Tensor  # [Bp * N, H]
    logits: torch.Tensor  # [Bp * N, V]
    prompt_hidden: torch.Tensor | None = None  # [P, H] of the prompt chunks the step carried
    # sampling steps: [Bp] each row's column in `uniforms` of its root's target (output position host count + it)
    root_window: torch.Tensor | None = None


# Plain steps of at most SHORT_KV_MAX_BATCH sequences whose keys fit SHORT_KV_KEYS replay a graph captured with
# that bound (`StepMetadata.max_kv_len`): its attention splits each sequence's keys at most 16 ways instead of
# the 32-64 that the tables' width calls for, most of them empty at such contexts. H200, session 19 (RESULTS.md):
# the 135M plain step at 512 keys 0.472 ms against 0.512 with 64 splits, but 0.576 against 0.536 at 2048 keys,
# hence a bound the host checks per step. Trees of 16-row tiles already run at most 16 splits there; trees of
# 64-row tiles with heads of 128 (an 8B shape's 16+ nodes) get the bound too, and 2 splits under it where
# filling the GPU picks 4 (`chunks_per_split`; session 30: the 8B's 64-node tree at 512 keys 15.1 -> 12.7 us
# a layer's attention; a tree whose tiles fill less than a fifth of the GPU splits as it would unbounded).
SHORT_KV_KEYS = 1024
SHORT_KV_MAX_BATCH = 2


def bounds_tree_keys(config: ModelConfig, num_nodes: int) -> bool:
    """Whether a tree step of `num_nodes` tokens runs under the short-context key bound as plain steps do:
    where its attention's row tiles are ones whose split count the bound lowers (`chunks_per_split`)."""
    tile = row_tile(num_nodes, config.num_heads // config.num_kv_heads)
    return num_nodes > 1 and chunks_per_split(tile, config.head_dim) > 1


def kv_len_bound(padded: int, num_nodes: int, longest: int, table_keys: int, with_prompts: bool,
                 bounds_trees: bool = False) -> int | None:
    """The `max_kv_len` a decode step runs under: SHORT_KV_KEYS for a plain step (one node, no prompt
    chunks), or a tree step where `bounds_trees` (`bounds_tree_keys`), of at most SHORT_KV_MAX_BATCH rows
    whose longest sequence has at most that many keys after the step, where the tables are wider; None
    (the tables' width) otherwise."""
    short = (num_nodes == 1 or bounds_trees) and padded <= SHORT_KV_MAX_BATCH and not with_prompts
    return SHORT_KV_KEYS if short and longest <= SHORT_KV_KEYS < table_keys else None


def batch_buckets(max_seqs: int) -> list[int]:
    """Padded batch sizes a graph is captured for: 1, 2, 4, then multiples of 8, and max_seqs itself
    (the step's buffers hold max_seqs rows: a bucket past it would not fit them)."""
    return [b for b in (1, 2, 4) if b < max_seqs] + list(range(8, max_seqs, 8)) + [max_seqs]


class DecodeStep:
    def __init__(self, model: DecoderModel, heads: MedusaHeads | None, cache: PagedKVCache, scratch_slot: int,
                 max_seqs: int, max_blocks_per_seq: int, max_tree: int, kmax: int, use_graphs: bool,
                 max_lookup: int = 0, steps_ahead: int = 1) -> None:
        self.model, self.heads, self.cache = model, heads, cache
        self.device = model.embed_tokens.weight.device
        self.scratch_slot, self.max_seqs, self.kmax = scratch_slot, max_seqs, kmax
        # the last position the RoPE table covers: a tree at the end of the context reaches past it (nodes
        # past the context carry tokens past max_model_len, which the engine cuts, so any position serves them)
        self.last_position = model.config.max_position_embeddings - 1
        long = dict(dtype=torch.long, device=self.device)
        self.padding_row = max_seqs
        self.roots = torch.zeros(max_seqs + 1, **long)  # [R + 1] pending root per row (+ padding row)
        k = self.num_heads = heads.config.num_heads if heads is not None else 0
        self.topk = torch.zeros(max_seqs + 1, k, kmax, **long)  # [R + 1, K, kmax] heads' top tokens
        # rows (state row per batch row), known_base (the committed tokens the host knows of) and
        # query_start are views of one buffer that `prepare` fills from a host copy in one transfer: on a
        # GPU every copy from pageable host memory is a synchronisation
        sizes = (max_seqs, max_seqs, max_seqs + 1)
        self._host_inputs = host_buffer((sum(sizes),), torch.int64, self.device)
        self._host = dict(zip(("rows", "known_base", "query_start"),
                              np.split(self._host_inputs, np.cumsum(sizes)[:-1])))  # name -> view of the host copy
        self._host["rows"][:] = self.padding_row
        self._inputs = torch.from_numpy(self._host_inputs).to(self.device, copy=True)
        self.rows, self.known_base, self.query_start = self._inputs.split(sizes)
        # committed tokens per state row: the truth a step places its tree by, advanced by each step's
        # part 2 and set at admission; the host's counters may lag it by the steps in flight
        self.row_base = torch.zeros(max_seqs + 1, **long)  # [R + 1]
        self.kv_lens = torch.zeros(max_seqs, **long)  # [B] written by part 1
        self.slots = torch.full((max_seqs * max_tree,), scratch_slot, **long)  # [B * N] written by part 1
        # With lookup trees, each state row's tokens so far (prompt + output, the pending root last) live on
        # the device, appended by every step: lookup proposals need no host tokens. One spare column takes
        # the writes of tokens a step does not emit.
        self.max_lookup = max_lookup
        width = max_blocks_per_seq * cache.block_size + 1 if max_lookup else 1
        self.history = torch.zeros(max_seqs + 1, width, **long)  # [R + 1, W + 1]
        self.history_len = torch.zeros(max_seqs + 1, **long)  # [R + 1]
        self.tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self._host_tables = host_buffer((max_seqs, max_blocks_per_seq), torch.int32, self.device)
        self._table_rows: list[tuple | None] = [None] * max_seqs  # (sequence, its table_version) in each host row
        self.causal = torch.zeros(max_seqs, dtype=torch.int32, device=self.device)  # [B] 0: every row is a tree
        self.sampled = torch.zeros(max_seqs, dtype=torch.bool, device=self.device)  # [B] row samples
        self.temperature = torch.ones(max_seqs, dtype=torch.float32, device=self.device)
        self.top_k = torch.zeros(max_seqs, **long)
        self.top_p = torch.ones(max_seqs, dtype=torch.float32, device=self.device)
        self.min_p = torch.zeros(max_seqs, dtype=torch.float32, device=self.device)
        # [B, M + D + 1 ...] from the host's output count on; a row's step picks its window at the device's
        # count, up to `steps_ahead` steps (each up to a tree's depth + 1 tokens) past the host's
        self.uniforms = torch.zeros(max_seqs, (steps_ahead + 1) * max_tree, dtype=torch.float64, device=self.device)
        # guided rows' forced tokens (`RegexGuide.forced_tokens`) after the host's output, laid on the lookup chain
        # in place of its n-gram proposals from the tokens the steps in flight emitted on: [B, L + max_tree] (a
        # step emits at most a tree's depth + 1) and [B] (0: the row keeps its proposals)
        self.forced = torch.zeros(max_seqs, max(max_lookup, 1) + max_tree, **long)
        self.forced_len = torch.zeros(max_seqs, **long)
        self.forced_step = False  # whether the prepared step lays forced tokens (graphs of their own)
        # bias, count penalties and min_tokens bans the device makes alone (`device_changes.py`)
        self.changes = DeviceChanges(max_seqs, model.config.vocab_size, self.device)
        self.changes_step = UNCHANGED  # what the prepared step changes in its logits (graphs of their own)
        self.sampling_step = GREEDY  # the prepared step's sampling kind (graphs of their own)
        self.propose_step = True  # whether the prepared step runs the heads for the next one
        self.kv_bound: int | None = None  # the prepared step's max_kv_len (`kv_len_bound`)
        self.prompts: PromptSegment | None = None  # prompt chunks the prepared step's forward carries
        self.best = torch.zeros(max_seqs, **long)  # [B] deepest accepted node
        self.next = torch.zeros(max_seqs, **long)  # [B] target token there: the next root
        # an overlapped step's result is copied out while the next step runs: two page-locked buffers, one
        # per step in flight, and an event for the inputs' host copy, rewritten only once its upload has run
        pinned = self.device.type == "cuda"
        self._results = [torch.zeros(max_seqs * (max_tree + 3), dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._result_done = [torch.cuda.Event() for _ in range(2)] if pinned else []  # recorded after each copy
        self._result_turn = 0
        self._uploaded = torch.cuda.Event() if pinned else None  # recorded after each step's upload
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.buckets = batch_buckets(max_seqs)
        self._graphs: dict = {}
        self._shapes: set = set()  # (padded, tree spec, prompt tokens) of the graphs in _graphs
        self.capture_seconds = 0.0  # spent capturing graphs so far (warmup's and those captured at first use)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    # ---- per-sequence state rows -----------------------------------------

    def acquire_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free decode state row: more decoding sequences than max_num_seqs")
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    @property
    def rows_in_use(self) -> int:
        return self.max_seqs - len(self._free_rows)

    @torch.inference_mode()
    def set_states(self, rows: list[int], roots: list[int] | torch.Tensor, bases: list[int], last_hidden: torch.Tensor,
                   propose: bool = True, tokens: list[list[int]] | None = None) -> None:
        """Sequences' pending roots (host ints, or a device tensor [n] the host has not read yet),
        committed token counts (`bases`) and, with `propose`, the heads' top-k at their last tokens
        (hidden [n, H]), in one go. Without it a row keeps its last holder's top-k, as after a plain
        step that skipped the heads: stale proposals cost acceptance, never correctness. `tokens`: each
        sequence's tokens before its root, for the lookup history, which gets the root after them on
        the device (needed when the step has lookup nodes)."""
        # queued copies only: an admission must not wait for the overlapped step still running
        at = to_device(rows, torch.long, self.device)
        self.roots[at] = roots if isinstance(roots, torch.Tensor) else to_device(roots, torch.long, self.device)
        self.row_base[at] = to_device(bases, torch.long, self.device)
        if self.max_lookup:
            if tokens is None:
                raise ValueError("this decode step proposes lookup tokens: set_states needs each row's tokens")
            self._set_history(at, tokens)
        if propose and self.heads is not None and self.kmax:
            logits = self.heads(last_hidden, self.model.lm_head.weight, roots=self.roots[at])  # [K, n, V]
            self.topk[at] = top_k_indices(logits, self.kmax).transpose(0, 1)  # [n, K, kmax]

    def add_roots(self, rows: list[int]) -> None:
        """Penalized rows' roots, as `set_states` put them in place (read back or not), join their counts."""
        if rows:
            self.changes.add_roots(rows, self.roots[to_device(rows, torch.long, self.device)])

    def _set_history(self, at: torch.Tensor, tokens: list[list[int]]) -> None:
        """history[at] = each row's tokens, then its root (already in `roots`)."""
        width = self.history.shape[1] - 1
        longest = max(len(t) for t in tokens)
        if longest + 1 > width:
            raise ValueError(f"a sequence of {longest + 1} tokens does not fit the lookup history ({width} tokens)")
        padded = np.zeros((len(tokens), longest), dtype=np.int64)
        for i, row in enumerate(tokens):
            padded[i, : len(row)] = row
        lengths = to_device([len(t) for t in tokens], torch.long, self.device)
        self.history[at, :longest] = to_device(padded, torch.long, self.device)
        self.history[at, lengths] = self.roots[at]
        self.history_len[at] = lengths + 1

    # ---- one step ---------------------------------------------------------

    def prepare(self, seqs: list, rows: list[int], tree: DeviceTree, blocks: BlockManager,
                sampling: list[RowSampling | None] | None = None, propose: bool = True,
                prompts: PromptSegment | None = None, forced: list[tuple[int, ...]] | None = None,
                changes: list[RowChanges | None] | None = None) -> int:
        """Fill the input buffers for `seqs` (state rows `rows`; `sampling` per row, None = greedy);
        returns the padded batch size. A sequence's block table must back its committed tokens, the
        tokens of its steps in flight (`num_inflight_tokens`) and this tree's.

        propose=False (for a plain step) skips the heads, leaving each row's top-k stale: the
        next step should then not speculate (it would stay correct, but accept little).
        prompts: uploaded prompt chunks to run in the same forward (their hidden states come back
        in `_Part1.prompt_hidden`); each (padded batch, tree, prompt bucket) is a graph of its own.
        forced: per row, the tokens its guide forces after the host's output (guided rows): the lookup chain
        takes them from where the steps in flight end, in place of its n-gram proposals (`_forced_chain`).
        changes: per row, the bias, count penalties and min_tokens ban the device applies (None: none).
        """
        self.propose_step, self.prompts = propose, prompts
        if self._uploaded is not None:  # an overlapped step's upload may still be queued behind the step before
            self._uploaded.synchronize()
        b, n = len(seqs), tree.num_nodes
        padded = self.bucket(b)
        _check_backed(seqs, n, self.cache.block_size)
        # keys after the step (only short steps can use it: a 64-row step skips the pass over its sequences)
        longest = 0
        if padded <= SHORT_KV_MAX_BATCH:
            longest = max(s.num_computed_tokens + s.num_inflight_tokens for s in seqs) + n
        self.kv_bound = kv_len_bound(padded, n, longest, self._table_keys, prompts is not None,
                                     bounds_tree_keys(self.model.config, n))
        tables = self._host_tables[:padded]
        # padding rows: block 0, whose first tree-size slots their queries read (real KV, finite: their
        # own tokens' KV goes to the scratch slot) and whose results nothing uses
        tables[b:] = 0
        self._table_rows[b:padded] = [None] * (padded - b)
        blocks.write_tables(seqs, self._host_tables, self._table_rows)  # only the rows that changed
        # padding rows b..padded: the padding state row (no KV), their own n tokens as queries (so that every
        # step token belongs to a sequence and prompt chunks carried after them start at Bp * N), the
        # scratch slot
        host = self._host
        host["rows"][:b] = rows
        host["rows"][b:padded] = self.padding_row
        host["known_base"][:b] = [s.num_computed_tokens for s in seqs]
        host["known_base"][b:padded] = 0
        host["query_start"][: padded + 1] = np.arange(padded + 1) * n
        if tree.num_lookup > self.max_lookup:
            raise ValueError(f"tree {tree.spec.name!r} has {tree.num_lookup} lookup nodes; this step was built "
                             f"for at most {self.max_lookup}")
        upload(self._inputs, self._host_inputs)  # the three in one copy
        upload(self.tables, tables)
        self.changes_step = self.changes.prepare(changes or [], padded)  # from page-locked memory too
        if self._uploaded is not None:
            self._uploaded.record()
        self._prepare_sampling(sampling or [], padded)
        self._prepare_forced(forced or [], padded, tree.num_lookup)
        return padded

    def _prepare_forced(self, forced: list[tuple[int, ...]], padded: int, lookup: int) -> None:
        self.forced_step = lookup > 0 and any(forced)
        if not self.forced_step:
            return
        width = self.forced.shape[1]
        tokens, lengths = np.zeros((padded, width), dtype=np.int64), np.zeros(padded, dtype=np.int64)
        for i, chain in enumerate(forced):
            chain = chain[:width]
            tokens[i, : len(chain)], lengths[i] = chain, len(chain)
        upload(self.forced, tokens)
        upload(self.forced_len, lengths)

    def _prepare_sampling(self, sampling: list[RowSampling | None], padded: int) -> None:
        drawn = [r for r in sampling if r is not None]
        self.sampling_step = FILTERED if any(r.filters for r in drawn) else SAMPLED if drawn else GREEDY
        if not drawn:
            return
        rows = sampling + [None] * (padded - len(sampling))
        upload(self.sampled, np.array([r is not None for r in rows]))
        upload(self.temperature, np.array([r.temperature if r else 1.0 for r in rows], dtype=np.float32))
        upload(self.top_k, np.array([r.top_k if r else 0 for r in rows], dtype=np.int64))
        upload(self.top_p, np.array([r.top_p if r else 1.0 for r in rows], dtype=np.float32))
        upload(self.min_p, np.array([r.min_p if r else 0.0 for r in rows], dtype=np.float32))
        width = self.uniforms.shape[1]
        uniforms = np.zeros((padded, width), dtype=np.float64)
        for i, r in enumerate(rows):
            if r is not None:
                uniforms[i, : len(r.uniforms)] = r.uniforms
        upload(self.uniforms, uniforms)

    @property
    def _table_keys(self) -> int:
        return self.tables.shape[1] * self.cache.block_size

    def bucket(self, batch: int) -> int:
        """The padded batch size a step of `batch` sequences runs at."""
        return next(x for x in self.buckets if x >= batch) if self.use_graphs else batch

    def capture(self, tree: DeviceTree, padded: int, sampling: int = GREEDY, propose: bool = True,
                prompts: PromptSegment | None = None) -> None:
        """Capture this bucket's graphs (carrying `prompts`' token bucket; `sampling`: the step's sampling kind,
        True meaning SAMPLED) now rather than at first use (no-op without graphs)."""
        if self.use_graphs:
            self._graph(tree, padded, sampling, propose, prompts)

    @torch.inference_mode()
    def time_step(self, tree: DeviceTree, padded: int, context: int, num_blocks: int, repeats: int = 5,
                  propose: bool = True) -> float:
        """Median seconds of one step of `padded` rows at `context` cached tokens each: its captured
        graphs where graphs run, else the two parts run eagerly (the host's dispatch is then part of
        the step, as it is of every eager step). The first of the `repeats + 1` runs warms up.

        A synthetic batch: rows read real KV blocks (read only) but write only the
        scratch slot and the padding state row, so running sequences are untouched.
        """
        graphs = self._graph(tree, padded, False, propose) if self.use_graphs else None
        times = []
        n, width = tree.num_nodes, self.tables.shape[1]
        with self._padding_inputs():
            self.query_start[: padded + 1] = torch.arange(padded + 1, device=self.device) * n
            self.tables.copy_(torch.arange(self.tables.numel(), device=self.device).view_as(self.tables) % num_blocks)
            for _ in range(repeats + 1):
                # every padding row at `context` committed tokens (part 2 puts the padding row back at 0)
                self.row_base[self.padding_row] = min(context, width * self.cache.block_size - n)
                times.append(self._replay_seconds(graphs) if graphs else self._eager_seconds(tree, padded, propose))
        kept = times[1:] if repeats else times  # repeats=0: the one run, the caller having warmed it up
        return sorted(kept)[len(kept) // 2]

    def _replay_seconds(self, graphs: dict) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs["g1"].replay()
        graphs["g2"].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _eager_seconds(self, tree: DeviceTree, padded: int, propose: bool) -> float:
        start = time.perf_counter()
        self._part2(tree, padded, self._part1(tree, padded, GREEDY), propose)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def forward(self, tree: DeviceTree, padded: int) -> _Part1:
        """Part 1; afterwards `best`/`next` hold the greedy verdict of every row."""
        if not self.use_graphs:
            self._last = self._part1(tree, padded, self.sampling_step, self.prompts, self.kv_bound, self.changes_step)
            return self._last
        graphs = self._graph(tree, padded, self.sampling_step, self.propose_step, self.prompts, self.kv_bound,
                             self.changes_step)
        graphs["g1"].replay()
        return graphs["part1"]

    def finish(self, tree: DeviceTree, padded: int) -> torch.Tensor:
        """Part 2 -> packed [Bp, D + 3] long on the device: (count, D + 1 tokens, best node) per row."""
        if not self.use_graphs:
            return self._part2(tree, padded, self._last, self.propose_step, self.changes_step)
        graphs = self._graph(tree, padded, self.sampling_step, self.propose_step, self.prompts, self.kv_bound,
                             self.changes_step)
        graphs["g2"].replay()
        return graphs["packed"]

    def finish_to_host(self, tree: DeviceTree, padded: int, rows: int) -> tuple[torch.Tensor, PendingCopy]:
        """Part 2, and its first `rows` packed rows queued for the host -> (those rows on the device, their copy):
        the caller may launch the next step before reading them (an overlapped step; at most two in flight,
        one buffer each)."""
        packed = self.finish(tree, padded)[:rows]
        if self.device.type != "cuda":
            return packed, copy_to_host(packed)
        turn, self._result_turn = self._result_turn, 1 - self._result_turn
        host = self._results[turn][: packed.numel()].view(packed.shape)
        return packed, copy_to_host(packed, host, self._result_done[turn])

    def override(self, tree: DeviceTree, rows: list[int], candidates: torch.Tensor, targets: torch.Tensor) -> None:
        """Host-decided node targets [H, N] for batch rows `rows` (logits the host changed: guides, bad
        words): their verdicts, on the device, replace the device's own before part 2.
        candidates [Bp, N]: the step's."""
        at = to_device(rows, torch.long, self.device)
        best, next_tokens = torch.empty_like(at), torch.empty_like(at)
        verdict(tree, candidates[at], targets, best, next_tokens)
        self.best[at] = best
        self.next[at] = next_tokens

    # ---- the two parts ----------------------------------------------------

    def _part1(self, tree: DeviceTree, padded: int, sampling: int, prompts: PromptSegment | None = None,
               kv_bound: int | None = None, changes: int = UNCHANGED) -> _Part1:
        n = tree.num_nodes
        rows = self.rows[:padded]
        # each row's tree after its committed tokens (base [Bp]): fills `slots` and `kv_lens`
        base, positions = place_tree(self.row_base, rows, self.tables[:padded], tree.depths, self.cache.block_size,
                                     self.padding_row, self.scratch_slot, self.last_position,
                                     self.slots[: padded * n], self.kv_lens[:padded])
        candidates = self._candidates(tree, rows, base)
        meta = StepMetadata(slot_mapping=self.slots[: padded * n], block_tables=self.tables[:padded],
                            kv_lens=self.kv_lens[:padded], query_start=self.query_start[: padded + 1],
                            causal=self.causal[:padded], step_bits=tree.batch_bits(padded), max_query_len=n,
                            max_kv_len=kv_bound)
        ids = candidates.flatten()
        if prompts is not None:
            ids, positions, meta = _with_prompts(ids, positions, meta, prompts, padded * n)
        hidden = self.cache.forward(self.model, ids, positions, meta)  # [Bp * N (+ P), H]
        hidden, prompt_hidden = hidden[: padded * n], (hidden[padded * n:] if prompts is not None else None)
        logits = self.model.compute_logits(hidden)  # [Bp * N, V], raw: logprobs are reported from them
        # tokens each row's steps in flight accepted past the host's count: node i's target is output
        # number (host's count) + root_window + depth(i)
        root_window = base - self.known_base[:padded] if sampling or changes else None  # [Bp]
        chosen = self.changes.apply(logits, rows, tree, candidates, root_window, changes) if changes else logits
        targets = top_k_indices(chosen.view(padded * n, -1), 1).view(padded, n)  # argmax: the first maximum
        if sampling:  # lossless sampling: each node's target is a draw; acceptance is then the same test
            uniforms = self._uniforms_at(root_window[:, None] + tree.depths[None])  # [Bp, N]
            drawn = sampled_targets(chosen.view(padded, n, -1), self.temperature[:padded], self.top_k[:padded],
                                    self.top_p[:padded], self.min_p[:padded], uniforms,
                                    filtered=sampling == FILTERED)
            targets = torch.where(self.sampled[:padded, None], drawn, targets)
        verdict(tree, candidates, targets, self.best[:padded], self.next[:padded])
        return _Part1(candidates, hidden, logits, prompt_hidden, root_window)

    def _candidates(self, tree: DeviceTree, rows: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """rows [Bp] state rows, base [Bp] their committed lengths -> [Bp, N]: each row's root, its heads'
        proposals (their top-k [R, K, kmax] from the last step) and its lookup chain."""
        lookup = ngram_lookup(self.history, self.history_len, rows, tree.num_lookup) if tree.num_lookup else None
        if lookup is not None and self.forced_step:  # guided rows: the text their guide forces, spelled in tokens
            lookup = self._forced_chain(lookup, rows, base - self.known_base[: rows.shape[0]])
        return gather_candidates(tree, rows, self.roots, self.topk if self.kmax else None, lookup)

    def candidates_to_host(self, tree: DeviceTree, padded: int) -> PendingCopy:
        """The prepared step's candidates [Bp, N], made again ahead of part 1 from the same inputs (so the same
        tokens) and queued for the host: rows the host decides walk their guides from them while part 1 runs,
        where reading part 1's own would wait for its forward. Call between `prepare` and `forward`."""
        rows = self.rows[:padded]
        return copy_to_host(self._candidates(tree, rows, self.row_base[rows]))

    def _forced_chain(self, lookup: torch.Tensor, rows: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """lookup [Bp, L] n-gram proposals; window [Bp] tokens the steps in flight emitted past the host's output
        (the last `window` of each row's history) -> each guided row's chain: its forced tokens from `window` on,
        where the emitted tokens are the forced ones (a guide allows nothing else, but a row may spell the
        same text in other tokens: then it keeps its n-gram proposals, as past the forced text)."""
        padded, lookup_len = lookup.shape
        forced, width = self.forced[:padded], self.forced.shape[1]
        ahead = torch.arange(width, device=self.device)[None]  # [1, W]
        ends = self.history_len[rows][:, None]  # [Bp, 1]
        at = (ends - window[:, None] + ahead).clamp(0, self.history.shape[1] - 1)
        emitted = self.history[rows[:, None], at]  # [Bp, W]: the window's tokens in its first columns
        agrees = ((emitted == forced) | (ahead >= window[:, None])).all(1, keepdim=True)  # [Bp, 1]
        chain = window[:, None] + ahead[:, :lookup_len]  # [Bp, L] positions in the forced tokens
        laid = agrees & (chain < self.forced_len[:padded, None])
        return torch.where(laid, forced.gather(1, chain.clamp(max=width - 1)), lookup)

    def _uniforms_at(self, window: torch.Tensor) -> torch.Tensor:
        """window [Bp, W] columns of each row's uniforms (output positions from the host's count) -> [Bp, W]
        float64; columns past the buffer read its last one (junk for a draw no row can emit)."""
        return self.uniforms[: window.shape[0]].gather(1, window.clamp(max=self.uniforms.shape[1] - 1))

    def _part2(self, tree: DeviceTree, padded: int, part1: _Part1, propose: bool = True,
               changes: int = UNCHANGED) -> torch.Tensor:
        n = tree.num_nodes
        best, next_tokens, rows = self.best[:padded], self.next[:padded], self.rows[:padded]
        history = (self.history, self.history_len) if self.max_lookup else (None, None)
        # emitted tokens, the lookup history, the accepted path's KV moves, roots and committed lengths
        packed, src, dst = accept(tree, part1.candidates, best, next_tokens, self.slots[: padded * n].view(padded, n),
                                  rows, self.roots, self.row_base, self.padding_row, *history)
        self.cache.move_all(src, dst, src.numel() // padded)  # one row of moves per batch row
        if changes:
            self.changes.record(rows, packed)
        if self.kmax and (propose or tree.num_nodes > 1):
            at_best = part1.hidden.view(padded, n, -1)[torch.arange(padded, device=self.device), best]  # [Bp, H]
            head_logits = self.heads(at_best, self.model.lm_head.weight, roots=next_tokens)  # [K, Bp, V]
            top = top_k_indices(head_logits, self.kmax)  # [K, Bp, kmax]
            if part1.root_window is not None:  # the next step's root target: one past this step's last token
                top = self._coupled_proposals(head_logits, top, part1.root_window + tree.depths[best] + 1)
            self.topk[rows] = top.transpose(0, 1)
        return packed  # [Bp, D + 3]: count, D + 1 tokens, best (did the lookup chain win)

    def _coupled_proposals(self, head_logits: torch.Tensor, top: torch.Tensor, root_window: torch.Tensor) -> torch.Tensor:
        """A sampled row's proposals: each head's kmax best of logits / T + the Gumbel noise that its position
        will be drawn with (head k: the next root's target + k, `root_window` [Bp] that of the next root),
        in place of its kmax most likely tokens (`top` [K, Bp, kmax], kept for the other rows).

        A node's target is the base's draw argmax(base logits / T + G) at its position, whatever was proposed,
        so outputs do not change; but a head whose distribution is near the base's proposes, under the same
        noise, the very token the base will draw, where its most likely token matches that draw only as often
        as the base picks it. A seeded request's noise is fixed per position (`TokenSampler`); so is an
        unseeded one's, whose sampler gets a random seed."""
        k, bp, vocab = head_logits.shape
        window = root_window[:, None] + torch.arange(k, device=self.device)[None]  # [Bp, K]
        uniforms = self._uniforms_at(window).T.reshape(-1)  # [K * Bp], head-major as the logits
        temperature = self.temperature[:bp].repeat(k)
        none = torch.full((k * bp,), float("-inf"), device=self.device)
        coupled = gumbel_top_k(head_logits.reshape(k * bp, vocab), temperature, none, uniforms, self.kmax)
        return torch.where(self.sampled[:bp, None], coupled.view(k, bp, -1), top)

    # ---- CUDA graphs ------------------------------------------------------

    def _graph(self, tree: DeviceTree, padded: int, sampling: int, propose: bool = True,
               prompts: PromptSegment | None = None, kv_bound: int | None = None, changes: int = UNCHANGED) -> dict:
        """The graphs of one key, captured at first use; a graph of the tables' width also captures its
        short-context sibling (`kv_len_bound`) if it has one, so that warmup leaves none for the hot path."""
        prompt_tokens = prompts.num_tokens if prompts else 0
        key = (padded, tree.spec, sampling, propose or tree.num_nodes > 1, kv_bound, self.forced_step,
               changes and (changes, self.changes.layout), prompt_tokens)
        if key not in self._graphs:
            start = time.perf_counter()
            self._graphs[key] = self._capture(tree, padded, sampling, key[3], prompts, kv_bound, changes)
            self._shapes.add((padded, tree.spec, key[-1]))
            self.capture_seconds += time.perf_counter() - start
            short = kv_len_bound(padded, tree.num_nodes, 0, self._table_keys, prompts is not None,
                                 bounds_tree_keys(self.model.config, tree.num_nodes))
            if kv_bound is None and short is not None:
                self._graph(tree, padded, sampling, propose, prompts, short, changes)
        return self._graphs[key]

    @property
    def num_graphs(self) -> int:
        """(Batch bucket, tree, sampling, proposing, prompt bucket) combinations captured so far."""
        return len(self._graphs)

    def has_mixed_graph(self, tree: DeviceTree, padded: int, prompt_tokens: int) -> bool:
        """Whether a graph of `tree` at `padded` rows carrying `prompt_tokens` prompt tokens is captured
        (with any sampling or proposing flags: one of those is missing only in rare steps)."""
        return (padded, tree.spec, prompt_tokens) in self._shapes

    @torch.inference_mode()
    def _capture(self, tree: DeviceTree, padded: int, sampling: int, propose: bool,
                 prompts: PromptSegment | None, kv_bound: int | None = None, changes: int = UNCHANGED) -> dict:
        """Warm up on an all-padding batch (touches only the scratch slot and padding row, and no
        prompt token's KV), then capture."""
        with self._padding_inputs(), (prompts.padding() if prompts is not None else nullcontext()):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # one eager run compiles this shape's Triton kernels outside the capture
                self._part2(tree, padded, self._part1(tree, padded, sampling, prompts, kv_bound, changes), propose,
                            changes)
            torch.cuda.current_stream().wait_stream(stream)
            g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g1, pool=self.pool):
                part1 = self._part1(tree, padded, sampling, prompts, kv_bound, changes)
            with torch.cuda.graph(g2, pool=self.pool):
                packed = self._part2(tree, padded, part1, propose, changes)
        return {"g1": g1, "g2": g2, "part1": part1, "packed": packed}

    def _padding_inputs(self):
        """Inside: an all-padding batch (no sequence's KV or state row is touched); the prepared
        inputs come back afterwards (the tables too, which `time_step` rewrites)."""
        fills = [(self.rows, self.padding_row), (self.known_base, 0), (self.query_start, 0)]
        return overwritten(fills, kept=(self.tables,))


def _with_prompts(ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata, prompts: PromptSegment,
                  offset: int) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
    """The step's tree tokens [Bp * N] followed by its prompt chunks [P], as one varlen batch of Bp + S
    sequences: the prompts' queries start at `offset` = Bp * N, where the padding rows' queries end, and
    they are causal and carry no tree bits."""
    joined = StepMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, prompts.slots]),
        block_tables=torch.cat([meta.block_tables, prompts.tables]),
        kv_lens=torch.cat([meta.kv_lens, prompts.kv_lens]),
        query_start=torch.cat([meta.query_start, prompts.query_start[1:] + offset]),
        causal=torch.cat([meta.causal, prompts.causal]),
        step_bits=torch.cat([meta.step_bits, prompts.step_bits]),
        max_query_len=max(meta.max_query_len, prompts.num_tokens))
    return torch.cat([ids, prompts.input_ids]), torch.cat([positions, prompts.positions]), joined


def _check_backed(seqs: list, num_nodes: int, block_size: int) -> None:
    """Each sequence's blocks must reach past its committed tokens, the tokens its steps in flight may add
    and this step's tree: the device places the tree where those steps leave it."""
    for seq in seqs:
        need = seq.num_computed_tokens + seq.num_inflight_tokens + num_nodes
        if need > len(seq.block_table) * block_size:
            raise ValueError(f"request {seq.request_id!r} needs {need} slots for this step ({seq.num_computed_tokens}"
                             f" committed, {seq.num_inflight_tokens} in flight, a {num_nodes}-node tree) but holds "
                             f"{len(seq.block_table)} blocks of {block_size}; allocate first")
