"""A step's prompt chunks through CUDA graphs captured per token bucket.

Run eagerly, a prompt forward launches every kernel of every layer from Python
(~10 per layer); the profiled throughput runs of RESULTS.md put 15-22 ms on each
prefill of the 135M default model on the H200, against ~1 ms for the captured
decode step. Medusa admits requests one by one as they finish at different
steps, so it pays that more often than plain decoding, whose requests of equal
length finish together and are admitted in one prefill. (Since session 10 a few
prompt chunks ride in the decode step's own graph instead: `PromptSegment`.)

So the chunks of a step are padded to a token bucket and replayed from a graph
captured with static inputs: room for `max_seqs` sequences, block tables of
fixed width, `max_query_len` = the bucket (it sizes the attention grid; rows past a
sequence's own tokens exit at once). Padding tokens write no KV (slot -1) and
belong to no sequence; padding sequences have no tokens and no KV. The same
padded path runs eagerly on the CPU, so tests cover the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from medusa.decoding.host_buffers import host_buffer, overwritten, upload
from medusa.decoding.paged_cache import PagedKVCache, StepMetadata
from medusa.model import DecoderModel


@dataclass(frozen=True)
class PrefillBatch:
    """A step's prompt chunks on the host, flattened: S sequences, T tokens."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64, where each token's k/v go
    tables: np.ndarray  # [S, W] int32 block tables, -1 padded
    kv_lens: np.ndarray  # [S] int64 KV entries after this step's writes
    query_start: np.ndarray  # [S + 1] int64 cu_seqlens

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    @property
    def starts(self) -> list[int]:
        """Where each sequence's tokens begin in the flat batch."""
        return self.query_start[:-1].tolist()

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start).max())


@dataclass(frozen=True)
class PromptSegment:
    """A step's prompt chunks on the device, padded to P tokens and S sequences (S = max_seqs, the
    padding ones empty), for a decode step to carry in its own forward: one read of the weights for
    both. Views of `PrefillGraphs`' static inputs, so a graph captured with them replays any batch."""

    input_ids: torch.Tensor  # [P]
    positions: torch.Tensor  # [P]
    slots: torch.Tensor  # [P] -1 for padding tokens (no KV written)
    tables: torch.Tensor  # [S, W] int32
    kv_lens: torch.Tensor  # [S]
    query_start: torch.Tensor  # [S + 1] from 0
    causal: torch.Tensor  # [S] int32, all 1
    step_bits: torch.Tensor  # [P] int64, all 0 (causal rows read no tree bits)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def padding(self):
        """Inside: no token writes KV and no sequence has tokens (for warm-up and capture); the
        uploaded batch comes back afterwards."""
        return overwritten([(self.slots, -1), (self.kv_lens, 0), (self.query_start, 0)])


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: powers of two from 16 to 512, then multiples of 512, up to max_tokens."""
    buckets, size = [], 16
    while size < min(max_tokens, 512):
        buckets.append(size)
        size *= 2
    size = min(size, 512)
    while size < max_tokens:
        buckets.append(size)
        size += 512
    return buckets + [max_tokens]


class PrefillGraphs:
    def __init__(self, model: DecoderModel, cache: PagedKVCache, max_seqs: int, table_width: int, max_tokens: int,
                 use_graphs: bool, pool=None) -> None:
        self.model, self.cache = model, cache
        self.device = model.embed_tokens.weight.device
        self.max_seqs, self.width = max_seqs, table_width
        self.buckets = token_buckets(max_tokens)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._pool = pool
        t = self.buckets[-1]
        # ids, positions, slots, kv_lens, query_start: views of one buffer, uploaded in one copy
        sizes = (t, t, t, max_seqs, max_seqs + 1)
        self._host = host_buffer((sum(sizes),), torch.int64, self.device)
        self._host_views = np.split(self._host, np.cumsum(sizes)[:-1])
        self._host_tables = host_buffer((max_seqs, table_width), torch.int32, self.device)
        self._inputs = torch.zeros(sum(sizes), dtype=torch.long, device=self.device)
        self.input_ids, self.positions, self.slots, self.kv_lens, self.query_start = self._inputs.split(sizes)
        self.tables = torch.zeros(max_seqs, table_width, dtype=torch.int32, device=self.device)
        self.causal = torch.ones(max_seqs, dtype=torch.int32, device=self.device)  # [S] 1: every row is a prompt chunk
        self.step_bits = torch.zeros(t, dtype=torch.long, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._uploaded: torch.cuda.Event | None = None  # recorded after the last upload

    def fits(self, batch: PrefillBatch) -> bool:
        return (batch.num_tokens <= self.buckets[-1] and batch.num_seqs <= self.max_seqs
                and batch.tables.shape[1] <= self.width)

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def capture_all(self) -> None:
        """Capture every bucket's graph now rather than at first use (no-op without graphs)."""
        if self.use_graphs:
            for bucket in self.buckets:
                self._graph(bucket)

    @torch.inference_mode()
    def run(self, batch: PrefillBatch) -> torch.Tensor:
        """-> final hidden states [T, H] of the batch's tokens; valid until the next run."""
        bucket = self.bucket(batch.num_tokens)
        captured = self._graph(bucket) if self.use_graphs else None  # a first capture pads the inputs itself
        self._upload(batch, bucket)
        if captured is None:
            return self._forward(bucket)[: batch.num_tokens]
        graph, hidden = captured
        graph.replay()
        return hidden[: batch.num_tokens]

    def segment(self, batch: PrefillBatch) -> PromptSegment:
        """Upload `batch` for a decode step's forward to carry (`fits` first): padded to its token bucket
        where graphs replay, else at its own length (a graph per bucket; eagerly, padding is only waste)."""
        bucket = self.bucket(batch.num_tokens) if self.use_graphs else batch.num_tokens
        self._upload(batch, bucket)
        return self.static_segment(bucket)

    def static_segment(self, bucket: int) -> PromptSegment:
        """The static inputs' first `bucket` tokens as a segment, as uploaded last (for a capture)."""
        return PromptSegment(self.input_ids[:bucket], self.positions[:bucket], self.slots[:bucket], self.tables,
                             self.kv_lens, self.query_start, self.causal, self.step_bits[:bucket])

    def _upload(self, batch: PrefillBatch, bucket: int) -> None:
        if self._uploaded is not None:  # the host buffers are reused: the last upload must have left them
            self._uploaded.synchronize()
        t, s, w = batch.num_tokens, batch.num_seqs, batch.tables.shape[1]
        ids, positions, slots, kv_lens, query_start = self._host_views
        ids[:t], ids[t:bucket] = batch.input_ids, 0
        positions[:t], positions[t:bucket] = batch.positions, 0
        slots[:t], slots[t:bucket] = batch.slots, -1  # padding tokens store nothing
        kv_lens[:s], kv_lens[s:] = batch.kv_lens, 0
        query_start[: s + 1], query_start[s + 1:] = batch.query_start, t  # padding sequences: no tokens
        tables = self._host_tables
        tables[:s, :w], tables[:s, w:], tables[s:] = batch.tables, -1, 0
        upload(self._inputs, self._host)
        upload(self.tables, tables)
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def _forward(self, bucket: int) -> torch.Tensor:
        """The model over the static inputs' first `bucket` tokens -> hidden [bucket, H]."""
        step = StepMetadata(
            slot_mapping=self.slots[:bucket], block_tables=self.tables, kv_lens=self.kv_lens,
            query_start=self.query_start, causal=self.causal, step_bits=self.step_bits[:bucket],
            max_query_len=bucket)
        return self.cache.forward(self.model, self.input_ids[:bucket], self.positions[:bucket], step)

    def _graph(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        return self._graphs[bucket]

    @torch.inference_mode()
    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up and capture on all-padding inputs: no sequence, no KV written."""
        self.slots.fill_(-1)
        self.kv_lens.zero_()
        self.query_start.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bucket)  # compiles the Triton kernels of this shape outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(bucket)
        return graph, hidden
