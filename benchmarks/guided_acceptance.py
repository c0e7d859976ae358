"""Tokens a step of guided_json rows with and without their forced text on the lookup chain (device-independent).

    python benchmarks/guided_acceptance.py --questions 8 --out out/guided-acc          # this CPU: ~1 minute
    python benchmarks/guided_acceptance.py --device cuda --questions 64 --out out/guided-acc

`benchmarks/guided.py`'s schema and instruction on its first questions (Spec-Bench first turns spread over the
categories, clipped to 300 characters), greedy, trees every step (no timed policy: on a CPU its timings would
choose plain steps), the default lookup chain. The same tokens must come out either way; the steps differ.
Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.tree_policy import TreePolicy
from medusa.medusa_model import MedusaModel
from medusa.training.data import DATA_DIR
from guided import INSTRUCTION, SCHEMA, fits, unforced
from throughput import spread_order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = MedusaModel.from_pretrained(device=args.device, dtype=dtype)
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
    rows = [rows[i] for i in spread_order(len(rows))][: args.questions]
    asks = [model.encode([{"role": "user", "content": r["turns"][0][:300] + INSTRUCTION}]) for r in rows]
    params = SamplingParams(max_tokens=args.max_tokens, guided_json=SCHEMA)
    engine = model.engine()
    engine.policy, engine.scheduler.policy = TreePolicy(), None  # the token budget's largest tree, every step
    result, tokens = {"device": args.device, "questions": args.questions, "runs": {}}, {}
    for name, off in (("forced text", False), ("no forced text", True)):
        with unforced(off):
            start = time.perf_counter()
            outs = engine.generate(asks, params)
        steps = sum(o.stats.steps for o in outs)
        tokens[name] = [o.token_ids for o in outs]
        result["runs"][name] = {"tokens": sum(len(o.token_ids) for o in outs), "steps": steps,
                                "tokens_per_step": sum(len(o.token_ids) for o in outs) / steps,
                                "from_lookup": sum(o.stats.accepted_from_lookup for o in outs),
                                "fit_schema": sum(fits(o.text) for o in outs), "seconds": time.perf_counter() - start}
        print(name, json.dumps(result["runs"][name]), flush=True)
    result["same_tokens"] = tokens["forced text"] == tokens["no forced text"]
    print("same tokens:", result["same_tokens"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
