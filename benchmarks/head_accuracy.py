"""Teacher-forced head accuracy on Spec-Bench, per category: what the heads would accept, without decoding.

    python benchmarks/head_accuracy.py --per-category 3 --out out/ha                  # the shipped heads
    python benchmarks/head_accuracy.py --heads out/a/heads --heads out/b/heads --out out/ha
    python benchmarks/head_accuracy.py --quick --out out/ha-quick                     # CPU smoke run (CI)

Greedy Medusa decoding keeps the base model's greedy text, so the tokens a step would accept follow from
the heads' top-k at every position of that text (training/evaluate.py): one forward per turn instead of a
decoding loop, so heads can be compared on a CPU. The base's greedy turns are generated once, batched on
the engine, and kept in --out/turns.json with the settings that made them; later runs with the same
settings reuse them. Each heads folder is scored per category: per-head top-1 and top-5 accuracy and the
accepted length its own tree (or --tree) reaches. The numbers are the heads alone: prompt-lookup nodes
are not simulated. This is evaluation only: nothing here trains or chooses anything on Spec-Bench.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from medusa import default_model
from medusa.adapter import has_adapter
from medusa.heads import MedusaHeads
from medusa.medusa_model import MedusaModel
from medusa.training.data import batches
from medusa.training.distill_cache import Sequences
from medusa.training.evaluate import EvalResult, evaluate_heads
from medusa.tree import TreeSpec
from spec_bench import SPEC_BENCH, load_questions, reference_turns

MAX_TOKENS_PER_BATCH = 16384  # padded tokens per scoring forward


def greedy_turns(model: MedusaModel, questions: list[dict], max_new_tokens: int, path: Path,
                 settings: dict) -> list[dict]:
    """[{category, prompt, ids}] for every turn: the base's greedy answers, from `path` when its settings match."""
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("settings") == settings:
            return cached["turns"]
    turns = reference_turns(model, questions, max_new_tokens)
    rows = [{"category": q["category"], "prompt": t["prompt"], "ids": t["ids"]}
            for q, question_turns in zip(questions, turns) for t in question_turns]
    path.write_text(json.dumps({"settings": settings, "turns": rows}))
    return rows


def check_heads_path(path: str) -> str | None:
    """Why `path` cannot be scored here, or None."""
    if not Path(path).exists():
        return f"no heads at {path}"
    if has_adapter(path):
        return (f"{path} holds a Medusa-2 LoRA adapter: its base writes different greedy text, which this tool "
                "does not generate; measure it with benchmarks/spec_bench.py")
    return None


def load_heads(path: str, model: MedusaModel) -> MedusaHeads:
    base = model.base
    dtype, device = base.embed_tokens.weight.dtype, base.embed_tokens.weight.device
    heads = MedusaHeads.from_pretrained(path, lm_head_weight=base.lm_head.weight, dtype=dtype, device=device)
    return heads.eval().requires_grad_(False)


def score(model: MedusaModel, heads: MedusaHeads, tree: TreeSpec, rows: list[dict]) -> EvalResult:
    """Head accuracy and simulated accepted lengths over `rows` (turns)."""
    seqs = Sequences.from_lists([r["prompt"] + r["ids"] for r in rows], [len(r["prompt"]) for r in rows])
    return evaluate_heads(model.base, heads, batches(seqs, MAX_TOKENS_PER_BATCH, 0, 0), tree=tree,
                          max_rank=max(5, max(tree.topk_per_depth, default=1)))


def merged(results: list[EvalResult]) -> EvalResult:
    """Several groups' results as one: accuracies weighted by targets, every step's accepted length kept."""
    targets = sum(r.num_targets for r in results)
    rows, ranks = len(results[0].accuracies), len(results[0].accuracies[0])
    accuracies = [[sum(r.accuracies[k][j] * r.num_targets for r in results) / max(targets, 1) for j in range(ranks)]
                  for k in range(rows)]
    return EvalResult(accuracies, [n for r in results for n in r.accepted_lengths], targets)


def summary(result: EvalResult, turns: int) -> dict:
    return {"turns": turns, "targets": result.num_targets, "top1": result.topk_accuracy(1),
            "top5": result.topk_accuracy(5), "accepted_length": result.mean_accepted_length}


def score_by_category(model: MedusaModel, heads: MedusaHeads, tree: TreeSpec, rows: list[dict]) -> dict:
    by_category = defaultdict(list)
    for row in rows:
        by_category[row["category"]].append(row)
    results = {name: score(model, heads, tree, group) for name, group in by_category.items()}
    # overall: every turn's steps together, as spec_bench.py's mean accepted length counts them
    return {"overall": summary(merged(list(results.values())), len(rows)),
            "categories": {name: summary(r, len(by_category[name])) for name, r in results.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="base model (default: the default model)")
    p.add_argument("--heads", action="append", default=None,
                   help="a heads folder; repeat to compare several (default: the default model's shipped heads)")
    p.add_argument("--tree", default=None, help="named tree or JSON for every heads folder (default: each one's own)")
    p.add_argument("--data", default=str(SPEC_BENCH))
    p.add_argument("--per-category", type=int, default=None, help="questions per category (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="one question of 4 categories, 8 tokens (CI)")
    args = p.parse_args()
    if args.quick:
        args.per_category, args.max_new_tokens = 1, 8
    if args.heads is None and args.model is not None:
        p.error("--heads is required with --model: only the default model ships heads")
    heads_paths = args.heads or [str(default_model.default_heads_path())]
    for problem in filter(None, map(check_heads_path, heads_paths)):
        p.error(problem)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = MedusaModel.from_pretrained(args.model, heads=None)
    try:  # every heads folder loads (and fits the model) before minutes of generation
        loaded = {path: load_heads(path, model) for path in heads_paths}
    except ValueError as err:
        p.error(str(err))
    questions = load_questions(Path(args.data), args.per_category)[: 4 if args.quick else None]
    settings = {"model": args.model or "default", "data": str(args.data), "questions": len(questions),
                "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
                "dtype": str(model.base.embed_tokens.weight.dtype)}
    rows = greedy_turns(model, questions, args.max_new_tokens, out / "turns.json", settings)
    results = {"settings": settings, "heads": {}}
    for path, heads in loaded.items():
        tree = TreeSpec.load(args.tree) if args.tree else TreeSpec.from_paths(heads.config.tree)
        results["heads"][path] = {"tree_nodes": tree.num_nodes, **score_by_category(model, heads, tree, rows)}
        _print(path, results["heads"][path])
    (out / "results.json").write_text(json.dumps(results, indent=2))


def _print(path: str, result: dict) -> None:
    print(f"{path} ({result['tree_nodes']}-node tree)")
    rows = sorted(result["categories"].items()) + [("overall", result["overall"])]
    for name, r in rows:
        top1 = " / ".join(f"{a:.3f}" for a in r["top1"])
        print(f"  {name:15s} turns {r['turns']:4d}  top-1 {top1}  accepted {r['accepted_length']:.2f}")


if __name__ == "__main__":
    main()
