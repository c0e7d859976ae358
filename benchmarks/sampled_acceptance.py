"""Tokens a step for sampled requests with the heads' proposals coupled to the draws' noise and without
(`DecodeStep._coupled_proposals`), on the same seeded requests: the outputs must not change, only how many
steps they take. --per-category Spec-Bench questions per category (first turns), the default model and heads,
all submitted at once (a batch of up to max_num_seqs).

With --pin-tree every step verifies the heads' own tree: on a GPU the timed policy may run plain steps for
sampled rows (where their trees do not pay), and a plain step proposes nothing to compare.

    python benchmarks/sampled_acceptance.py --out out/sampled_acceptance.json            # CPU, float32
    python benchmarks/sampled_acceptance.py --device cuda --dtype bfloat16 --pin-tree --out ...  # a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from unittest import mock

import torch

from medusa.decoding.decode_step import DecodeStep
from medusa.decoding.sampling_params import SamplingParams
from medusa.medusa_model import MedusaModel
from spec_bench import SPEC_BENCH, load_questions, pinned_engine


def run(model: MedusaModel, prompts: list, params: list, coupled: bool, pin_tree: bool) -> dict:
    independent = mock.patch.object(DecodeStep, "_coupled_proposals", lambda self, logits, top, window: top)
    engine = pinned_engine(model) if pin_tree else model.engine()
    before = dict(engine.stats().steps_per_tree)
    with contextlib.nullcontext() if coupled else independent:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
    steps = sum(len(o.stats.accepted_lengths) for o in outs)
    tokens = sum(sum(o.stats.accepted_lengths) for o in outs)
    trees = {t: n - before.get(t, 0) for t, n in engine.stats().steps_per_tree.items() if n > before.get(t, 0)}
    return {"tokens_per_step": tokens / steps, "seconds": seconds, "steps_per_tree": trees,
            "token_ids": [o.token_ids for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per category (of 13)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help="4 questions, 6 tokens: a CPU smoke run (CI)")
    p.add_argument("--pin-tree", action="store_true", help="every step verifies the heads' own tree (no timed "
                   "policy, which may run plain steps): the proposals' effect alone")
    args = p.parse_args()
    for flag, value in (("--per-category", args.per_category), ("--max-tokens", args.max_tokens)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if not args.temperature > 0:
        p.error(f"--temperature must be > 0 (the comparison is of sampled requests), got {args.temperature}")
    if args.quick:
        args.per_category, args.max_tokens = 1, 6
    model = MedusaModel.from_pretrained(dtype=getattr(torch, args.dtype), device=args.device)
    questions = load_questions(SPEC_BENCH, args.per_category)[: 4 if args.quick else None]
    prompts = [model.encode([{"role": "user", "content": q["turns"][0]}]) for q in questions]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=100 + i)
              for i in range(len(prompts))]
    rows = {name: run(model, prompts, params, coupled, args.pin_tree)
            for name, coupled in (("independent", False), ("coupled", True))}
    same = sum(a == b for a, b in zip(rows["independent"]["token_ids"], rows["coupled"]["token_ids"]))
    for name, row in rows.items():
        print(f"{name:12s} {row['tokens_per_step']:.3f} tokens a step  {row['seconds']:.1f} s  {row['steps_per_tree']}")
    print(f"identical outputs: {same} of {len(prompts)}")
    with open(args.out, "w") as f:
        json.dump({"device": args.device, "dtype": args.dtype, "temperature": args.temperature,
                   "max_tokens": args.max_tokens, "pinned_tree": args.pin_tree, "identical_outputs": same,
                   "prompts": len(prompts),
                   **{name: {k: v for k, v in row.items() if k != "token_ids"} for name, row in rows.items()}},
                  f, indent=1)


if __name__ == "__main__":
    main()
