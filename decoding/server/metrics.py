"""Prometheus metrics, one registry per app (so several apps in one process never collide).

Request-driven series (finish reasons, token counts, latencies) are updated as
outputs stream; engine-wide ones (running / waiting requests, KV usage, the
speculation counters) are read from `LLMEngine.stats()` at scrape time, so they
can never drift from the engine's own totals.

Mean accepted length (tokens per verification step) follows from the counters:
1 + accepted_tokens / drafts.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from medusa.decoding.engine import LLMEngine
from medusa.decoding.outputs import RequestOutput

disable_created_metrics()  # the *_created series only add noise to every counter (vLLM drops them too)

PREFIX = "medusa:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads the engines' stats on every scrape. engines() -> [(engine, speculative), ...]."""

    def __init__(self, engines: Callable[[], list[tuple[LLMEngine, bool]]], pending: Callable[[], int]) -> None:
        self.engines, self.pending = engines, pending

    def collect(self) -> Iterable:
        engines = self.engines()
        stats = [(engine.stats(), engine, speculative) for engine, speculative in engines]
        yield _gauge("num_requests_running", "Sequences in the running batch.", sum(s.num_running for s, _, _ in stats))
        yield _gauge("num_requests_waiting", "Sequences waiting to be scheduled (and requests not yet added).",
                     sum(s.num_waiting for s, _, _ in stats) + self.pending())
        total = sum(e.blocks.num_blocks for _, e, _ in stats)
        used = sum(s.kv_usage * e.blocks.num_blocks for s, e, _ in stats)
        yield _gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", used / max(total, 1))
        yield from _speculation([s.totals for s, _, speculative in stats if speculative])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _speculation(totals: list) -> Iterable:
    """Counters of the speculative engine only: plain decoding drafts nothing and would dilute the mean."""
    # vLLM's num_drafts: steps that drafted (plain steps, which the policy runs where trees do not pay, count
    # no draft; counted, they made the mean accepted length read ~1.0 on a CPU that runs plain steps)
    drafts = sum(t.drafting_steps for t in totals)
    drafted = sum(t.drafted_tokens for t in totals)
    accepted = sum(t.accepted_tokens for t in totals)
    yield CounterMetricFamily(PREFIX + "spec_decode_num_drafts",
                              "Verification steps that drafted tokens (one tree each).", value=drafts)
    yield CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens", "Tree tokens drafted (by the heads and prompt lookup).",
                              value=drafted)
    yield CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens", "Drafted tokens the base model accepted.",
                              value=accepted)
    yield CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_from_lookup",
                              "Of those, the ones on the prompt-lookup chain (--prompt-lookup).",
                              value=sum(t.accepted_from_lookup for t in totals))
    per_depth = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_depth",
                                    "Accepted drafted tokens by tree depth (1 = the first head's guess).",
                                    labels=["depth"])
    depth_counts: list[int] = []
    for t in totals:
        for d, count in enumerate(t.accepted_per_depth):
            depth_counts += [0] * (d + 1 - len(depth_counts))
            depth_counts[d] += count
    for d, count in enumerate(depth_counts):
        per_depth.add_metric([str(d + 1)], count)
    yield per_depth
    yield _gauge("spec_decode_mean_accepted_length", "Tokens emitted per verification step (1 + accepted / drafts).",
                 1 + accepted / drafts if drafts else 0.0)


class ServerMetrics:
    def __init__(self, engines: Callable[[], list[tuple[LLMEngine, bool]]], pending: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.finished = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time per output token after the first (a step's gap shared by the tokens it emitted).",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token of each choice.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engines, pending))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, prompt_tokens: int) -> "RequestTracker":
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTracker(self)


class RequestTracker:
    """One request's timings; choices are keyed by their OpenAI choice index."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token = False
        self.last: dict[int, float] = {}  # choice -> time of its previous tokens
        self.done: set[int] = set()  # choices that finished

    def output(self, choice: int, out: RequestOutput) -> None:
        now, m = time.perf_counter(), self.metrics
        new = len(out.new_token_ids)
        if new:
            m.generation_tokens.inc(new)
            if not self.first_token:
                self.first_token = True
                m.ttft.observe(now - self.start)
            if choice in self.last:
                for _ in range(new):
                    m.itl.observe((now - self.last[choice]) / new)
            self.last[choice] = now
        if out.finished:
            self.done.add(choice)
            m.finished.labels(out.finish_reason or "stop").inc()
            m.e2e.observe(now - self.start)

    def aborted(self, num_choices: int) -> None:
        """The request ended early (disconnect, shutdown): every unfinished choice counts as aborted."""
        unfinished = num_choices - len(self.done)
        if unfinished:
            self.metrics.finished.labels("abort").inc(unfinished)
