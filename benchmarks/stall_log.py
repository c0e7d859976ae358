"""Stalls of the host on the hot path, logged as they happen: Triton compiles, CUDA graph captures, GC passes.

`with StallLog() as log:` patches Triton's JIT compile and torch's graph capture for its duration (and adds a
GC callback); `log.take()` returns the events so far. Used by throughput.py (compiles per run) and stalls.py.
"""

from __future__ import annotations

import gc
import time

import torch


class StallLog:
    """Triton compiles, CUDA graph captures and GC passes while active: [{kind, name, ms, step}], where step
    is the number of engine steps `trace` had recorded when it ended (-1 without a trace). A decode step's
    capture is also logged as one `decode_graph` event named by its key (rows, tree, sampling kind, heads,
    prompt tokens, key bound), whose ms hold its two `graph_capture` events: which graphs first use captured."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.trace = None  # a step_trace.StepTrace, whose step count each event notes
        self._patched: list[tuple[object, str, object]] = []
        self._gc_start = 0.0

    def _note(self, kind: str, name: str, start: float) -> None:
        step = len(self.trace.steps) if self.trace is not None else -1
        self.events.append({"kind": kind, "name": name, "ms": 1e3 * (time.perf_counter() - start), "step": step})

    def _patch(self, owner, attr: str, make) -> None:
        original = getattr(owner, attr)
        self._patched.append((owner, attr, original))
        setattr(owner, attr, make(original))

    def __enter__(self) -> "StallLog":
        log = self

        def compile_(original):  # JITFunction._do_compile: a cache miss of a kernel's variant
            def wrapped(fn, *args, **kwargs):
                start = time.perf_counter()
                out = original(fn, *args, **kwargs)
                log._note("triton_compile", getattr(fn, "__name__", "?"), start)
                return out
            return wrapped

        def capture_end(original):  # a graph's capture, from its capture_begin
            def wrapped(graph, *args, **kwargs):
                out = original(graph, *args, **kwargs)
                log._note("graph_capture", "", getattr(graph, "_stall_log_start", time.perf_counter()))
                return out
            return wrapped

        def capture_begin(original):
            def wrapped(graph, *args, **kwargs):
                graph._stall_log_start = time.perf_counter()
                return original(graph, *args, **kwargs)
            return wrapped

        def decode_capture(original):  # DecodeStep._capture: a decode graph pair, named by its key
            def wrapped(step, tree, padded, sampling, propose, prompts, *rest, **kwargs):
                start = time.perf_counter()
                out = original(step, tree, padded, sampling, propose, prompts, *rest, **kwargs)
                kv_bound = rest[0] if rest else kwargs.get("kv_bound")  # the rest of the key passes through
                log._note("decode_graph", decode_graph_name(tree.spec.label, padded, sampling, propose,
                                                            prompts.num_tokens if prompts else 0, kv_bound), start)
                return out
            return wrapped

        from medusa.decoding.decode_step import DecodeStep

        self._patch(DecodeStep, "_capture", decode_capture)
        try:
            from triton.runtime.jit import JITFunction
            if hasattr(JITFunction, "_do_compile"):
                self._patch(JITFunction, "_do_compile", compile_)
        except ImportError:
            pass
        if torch.cuda.is_available():
            self._patch(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
            self._patch(torch.cuda.CUDAGraph, "capture_end", capture_end)
        gc.callbacks.append(self._gc)
        return self

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._note("gc", f"generation {info.get('generation')}", self._gc_start)

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._gc)
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched.clear()

    def take(self) -> list[dict]:
        """The events so far, emptied."""
        events, self.events = self.events, []
        return events


def decode_graph_name(tree: str, padded: int, sampling: int, propose: bool, prompt_tokens: int,
                      kv_bound: int | None) -> str:
    from medusa.decoding.decode_step import FILTERED, GREEDY, SAMPLED

    kinds = {GREEDY: "greedy", SAMPLED: "sampled", FILTERED: "filtered"}
    name = f"{padded} rows, {tree}, {kinds.get(int(sampling), sampling)}, {'heads' if propose else 'no heads'}"
    name += f", {prompt_tokens} prompt tokens" if prompt_tokens else ""
    return name + (f", keys <= {kv_bound}" if kv_bound else "")


def stalls_summary(events: list[dict]) -> dict:
    """Per kind of event: count and total ms."""
    out: dict[str, dict] = {}
    for e in events:
        s = out.setdefault(e["kind"], {"count": 0, "ms": 0.0})
        s["count"] += 1
        s["ms"] = round(s["ms"] + e["ms"], 1)
    return out
