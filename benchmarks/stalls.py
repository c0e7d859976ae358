"""Why runs of one throughput level differ: the host's stalls on the hot path, step by step.

    python benchmarks/stalls.py --out out/stalls                                  # GPU: default model, 32 and 64
    python benchmarks/stalls.py --concurrency 64 --repeats 5 --prompt-lookup 4 --out out/stalls

Each level runs --repeats times per mode (plain, then Medusa, alternating, one engine each, as in
throughput.py) with every engine step recorded (`step_trace.py`) and, as they happen, every Triton compile,
CUDA graph capture and garbage collection, with the engine step it fell in and its milliseconds, and the
caching allocator's retries (each frees the cache and synchronises). In session 21 the same code's Medusa
runs at 32 requests gave 19,006 / 21,562 / 37,673 tok/s while plain decoding's gave 20,618-20,882; this
tool says which steps took the difference and what they waited for.

Writes runs.json (a row per run: tok/s, ms per step, per kind of step its count, total, median, p90 and max
ms, the stalls) and steps.json (every step of the first level's Medusa runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from step_trace import StepTrace
from throughput import default_model, run_level


class StallLog:
    """Triton compiles, CUDA graph captures and GC passes while active: [{kind, name, ms, step}], where step
    is the number of engine steps `trace` had recorded when it ended (-1 without a trace)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.trace: StepTrace | None = None
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


def step_kind(step: dict) -> str:
    """A trace step's kind: prefill (a prompt forward alone), plain or tree-N decode, +prompts (carried in the
    decode graph), +prefill (a prompt forward of its own beside it)."""
    kind = "prefill" if not step["rows"] else ("plain" if step["nodes"] == 1 else f"tree-{step['nodes']}")
    return kind + ("+prompts" if step["carried"] else "") + ("+prefill" if step["rows"] and step["prefilled"] else "")


def kinds_summary(steps: list[dict]) -> dict:
    """Per kind of step: count, total, median, p90 and max ms of each step's own wall time (the time from the
    step before it returning to it returning: a stall lands on the step that met it)."""
    times: dict[str, list[float]] = {}
    for step in steps:
        times.setdefault(step_kind(step), []).append(step["ms"])
    return {kind: {"steps": len(ms), "ms": round(sum(ms), 1), "p50": round(float(np.median(ms)), 3),
                   "p90": round(float(np.percentile(ms, 90)), 3), "max": round(max(ms), 2)}
            for kind, ms in sorted(times.items(), key=lambda kv: -sum(kv[1]))}


def stalls_summary(events: list[dict]) -> dict:
    """Per kind of event: count and total ms."""
    out: dict[str, dict] = {}
    for e in events:
        s = out.setdefault(e["kind"], {"count": 0, "ms": 0.0})
        s["count"] += 1
        s["ms"] = round(s["ms"] + e["ms"], 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-lookup", type=int, default=None, help="lookup nodes (default: the library's)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("stalls.py measures the GPU engine's hot path: it needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    model, prompts = default_model(device, torch.bfloat16, None)
    scheduler = SchedulerConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=4096)
    config = EngineConfig(num_blocks=4096, trees=model.engine_config().trees, scheduler=scheduler,
                          prompt_lookup=model.prompt_lookup if args.prompt_lookup is None else args.prompt_lookup)
    eos = sorted(model.eos_token_ids)
    log = StallLog()
    runs, medusa_steps = [], {}
    with log:
        engines = {}
        for mode, heads in (("plain", None), ("medusa", model.heads)):
            start = time.perf_counter()
            engine = LLMEngine(model.base, heads, config, model.tokenizer, eos)
            engine.warmup()
            run_level(engine, prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), 1)
            engines[mode] = engine
            print(json.dumps({"mode": mode, "warmup_s": time.perf_counter() - start,
                              "warmup_stalls": stalls_summary(log.take())}), flush=True)
        params = SamplingParams(max_tokens=args.max_tokens)
        for c in args.concurrency:
            level = [prompts[i % len(prompts)] for i in range(8 * c)]
            for rep in range(args.repeats):
                for mode, engine in engines.items():
                    memory = torch.cuda.memory_stats()
                    with StepTrace(engine) as trace:
                        log.trace = trace
                        result = run_level(engine, level, params, c)
                    log.trace = None
                    events = log.take()
                    retries = torch.cuda.memory_stats()["num_alloc_retries"] - memory["num_alloc_retries"]
                    row = {"concurrency": c, "run": rep, "mode": mode, "tok_s": round(result["tok_s"]),
                           "ms_per_step": round(result["ms_per_step"], 3), "engine_steps": result["engine_steps"],
                           "mean_accepted_length": round(result["mean_accepted_length"], 3),
                           "mean_decode_batch": round(result["mean_decode_batch"], 2),
                           "decode_steps_per_tree": result["decode_steps_per_tree"],
                           "alloc_retries": retries, "stalls": stalls_summary(events),
                           "stall_events": [e for e in events if e["ms"] >= 5 or e["kind"] != "gc"],
                           "kinds": kinds_summary(trace.steps)}
                    print(json.dumps(row), flush=True)
                    runs.append(row)
                    if mode == "medusa" and c == args.concurrency[0]:
                        medusa_steps[f"run{rep}"] = trace.steps
    (out / "runs.json").write_text(json.dumps(runs, indent=1))
    (out / "steps.json").write_text(json.dumps(medusa_steps))


if __name__ == "__main__":
    main()
