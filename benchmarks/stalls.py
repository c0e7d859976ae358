"""Why runs of one throughput level differ: the host's stalls on the hot path, step by step.

    python benchmarks/stalls.py --out out/stalls                                  # GPU: default model, 32 and 64
    python benchmarks/stalls.py --concurrency 64 --repeats 5 --prompt-lookup 4 --out out/stalls
    python benchmarks/stalls.py --temperature 0.7 --out out/stalls-sampled     # sampled requests

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
import json
import time
from pathlib import Path

import numpy as np
import torch

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from stall_log import StallLog, stalls_summary
from step_trace import StepTrace, step_kind
from throughput import default_model, run_level


def kinds_summary(steps: list[dict]) -> dict:
    """Per kind of step: count, total, median, p90 and max ms of each step's own wall time (the time from the
    step before it returning to it returning: a stall lands on the step that met it)."""
    times: dict[str, list[float]] = {}
    for step in steps:
        times.setdefault(step_kind(step), []).append(step["ms"])
    return {kind: {"steps": len(ms), "ms": round(sum(ms), 1), "p50": round(float(np.median(ms)), 3),
                   "p90": round(float(np.percentile(ms, 90)), 3), "max": round(max(ms), 2)}
            for kind, ms in sorted(times.items(), key=lambda kv: -sum(kv[1]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-lookup", type=int, default=None, help="lookup nodes (default: the library's)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (seeded per request); warmup then captures sampled steps too")
    args = p.parse_args()
    if not args.temperature >= 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
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
            engine.warmup(sampling=args.temperature > 0)
            run_level(engine, prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), 1)
            engines[mode] = engine
            print(json.dumps({"mode": mode, "warmup_s": time.perf_counter() - start,
                              "warmup_stalls": stalls_summary(log.take())}), flush=True)
        sampled = dict(temperature=args.temperature) if args.temperature > 0 else {}
        for c in args.concurrency:
            level = [prompts[i % len(prompts)] for i in range(8 * c)]
            params = [SamplingParams(max_tokens=args.max_tokens, seed=i if sampled else None, **sampled)
                      for i in range(len(level))]
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
