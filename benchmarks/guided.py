"""Guided decoding (guided_json) with Medusa against plain decoding, on the default model and its heads.

    python benchmarks/guided.py --out out/guided                      # GPU: 1, 8 and 32 concurrent requests
    python benchmarks/guided.py --quick --out out/guided-quick        # CPU smoke run

Spec-Bench first turns (spread over the 13 categories, as throughput.py takes them), each followed by an
instruction to answer as a JSON object with an "answer" string and a "confidence" level, served under that
schema (`SCHEMA`), the same without the guide's forced text on the lookup chain, and free. Each level is
throughput.py's closed loop (`run_level`), plain and Medusa on their own engines, greedy, the faster of
`--repeats` runs each. Guided rows take the engine's host path (a mask per tree node and step, from the
node's own text), so the guided speedup shows what that path costs beside what the trees win.

Also: the seconds the guide takes to build on its first request (the vocabulary's trie, then each state the
answer reaches), against the same request once the guide is built. Writes results.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from medusa.decoding import token_guide
from medusa.decoding.sampling_params import SamplingParams
from medusa.training.data import DATA_DIR
from phases import PhaseTimer
from throughput import default_model, run_level, spread_order

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 600},
                                           "confidence": {"enum": ["low", "medium", "high"]}},
          "required": ["answer", "confidence"]}
INSTRUCTION = ('\n\nAnswer with a JSON object: "answer" (your answer, a string) and "confidence" ("low", "medium" or '
               '"high").')


RUN_DETAIL = ("graphs_captured", "capture_s", "ms_per_step_less_captures", "mean_decode_batch",
              "decode_steps_per_tree", "tree_decisions", "policy_at_level")
KINDS = {"guided": "guided", "unforced": "guided, no forced text", "free": "free"}  # --kinds -> row names


def fits(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == {"answer", "confidence"} and value["confidence"] in SCHEMA[
        "properties"]["confidence"]["enum"]


def schema_check(outputs) -> dict:
    """Of the guided answers that ended (not cut by max_tokens), the share that parse and fit the schema; the
    finish reasons of all of them. A cut answer is a prefix of valid JSON, not a failure of the guide."""
    if not outputs:
        return {"fits_schema": None, "finish_reasons": {}}
    ended = [o.text for o in outputs if o.finish_reason != "length"]
    return {"fits_schema": sum(map(fits, ended)) / len(ended) if ended else None,
            "finish_reasons": dict(Counter(o.finish_reason for o in outputs))}


@contextmanager
def unforced(on: bool):
    """Guided rows without their forced text on the lookup chain (`RegexGuide.forced_tokens`), to measure it."""
    original = token_guide.RegexGuide.forced_tokens
    if on:
        token_guide.RegexGuide.forced_tokens = lambda self, state, limit: ()
    try:
        yield
    finally:
        token_guide.RegexGuide.forced_tokens = original


def first_request_seconds(engine, prompt: list[int], params: SamplingParams) -> dict:
    """One request with a cold guide (tries and guides dropped), then the same again with it built."""
    token_guide._tries.clear()
    token_guide._guides.clear()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        engine.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return {"cold_s": times[0], "warm_s": times[1]}


def profiled(engine, level: list[list[int]], params: SamplingParams, concurrency: int, no_forced: bool) -> dict:
    """Milliseconds a decode step of each phase (`phases.PhaseTimer`: synchronised around each, so steps do
    not overlap while timed) for the level run once more."""
    overlap, engine.overlap = engine.overlap, False
    try:
        with unforced(no_forced), PhaseTimer(engine) as timer:
            run_level(engine, level, params, concurrency)
    finally:
        engine.overlap = overlap
    return timer.report()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each level and mode; the fastest is kept")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: 2 levels of a few short requests")
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="requests to serve")
    parser.add_argument("--profile-steps", action="store_true",
                        help="each level once more on the Medusa engine, synchronous, every step's phases timed "
                             "(throughput.py's: host_verify is the guided rows' targets made on the host)")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.quick
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    if args.quick:
        args.concurrency, args.max_tokens, args.repeats = [1, 2], 16, 1
    model, _ = default_model(device, dtype, None)
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
    engines = {"plain": model.engine(speculative=False), "medusa": model.engine()}
    if gpu:
        for engine in engines.values():
            engine.warmup()
    # each kind of request starts from the warmed-up tree policy (guided rows have a policy of their own, the
    # unforced run must not start from what the forced one learnt)
    policies = {mode: copy.deepcopy(engine.policy) for mode, engine in engines.items()}
    guided = SamplingParams(max_tokens=args.max_tokens, guided_json=SCHEMA)
    free = SamplingParams(max_tokens=args.max_tokens)
    spread = [rows[i] for i in spread_order(len(rows))]
    asks = [model.encode([{"role": "user", "content": r["turns"][0] + INSTRUCTION}]) for r in spread]
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "schema": SCHEMA,
              "first_request": first_request_seconds(engines["medusa"], asks[0], guided), "rows": []}
    for concurrency in args.concurrency:
        level = asks[:2 * concurrency if args.quick else max(8 * concurrency, 32)]
        for name, params in ((KINDS[k], free if k == "free" else guided) for k in args.kinds):
            # the faster of two runs each: a level's first Medusa run may capture graphs
            for mode, engine in engines.items():
                engine.policy = copy.deepcopy(policies[mode])
                if engine.host_policy is not None:
                    engine.host_policy = copy.deepcopy(policies[mode])
            with unforced(name.endswith("no forced text")):
                runs = {mode: max((run_level(engine, level, params, concurrency) for _ in range(args.repeats)),
                                  key=lambda run: run["tok_s"]) for mode, engine in engines.items()}
            checked = engines["medusa"].generate(level[:8], params) if params is guided else []
            row = {"concurrency": concurrency, "params": name, "requests": len(level),
                   "plain_tok_s": runs["plain"]["tok_s"], "medusa_tok_s": runs["medusa"]["tok_s"],
                   "speedup": runs["medusa"]["tok_s"] / runs["plain"]["tok_s"],
                   "mean_accepted_length": runs["medusa"]["mean_accepted_length"],
                   "plain_ms_per_step": runs["plain"]["ms_per_step"],
                   "medusa_ms_per_step": runs["medusa"]["ms_per_step"],
                   **schema_check(checked),
                   # why a level lost or won: captures during the run, which trees ran, what the policy believed
                   "medusa_run": {k: runs["medusa"][k] for k in RUN_DETAIL},
                   "plain_run": {k: runs["plain"][k] for k in RUN_DETAIL[:4]}}
            if args.profile_steps:
                row["medusa_phases"] = profiled(engines["medusa"], level, params, concurrency,
                                                name.endswith("no forced text"))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print("first request (cold guide / warm): %.2f / %.2f s" % (result["first_request"]["cold_s"],
                                                                 result["first_request"]["warm_s"]))


if __name__ == "__main__":
    main()
