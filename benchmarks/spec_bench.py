"""Spec-Bench, greedy, batch 1: plain decoding vs Medusa on our engine vs Hugging Face `generate`.

    python benchmarks/spec_bench.py --out out/spec_bench               # full: all 480 questions
    python benchmarks/spec_bench.py --per-category 5 --hf-per-category 1 --out out/sb
    python benchmarks/spec_bench.py --quick --out out/sb-quick         # CPU smoke run (CI)
    python benchmarks/spec_bench.py --prompt-lookup 4 --out out/sb-pl4 # Medusa trees + a 4-node lookup chain
    python benchmarks/spec_bench.py --pin-tree --prompt-lookup 0 --out out/sb-heads  # the heads' own tree, every step
    python benchmarks/spec_bench.py --decoder generate --per-category 2 --out out/sb-cpu  # what `medusa generate` runs

Writes results.json (per category and overall: tokens/s of each system, Medusa's
speedup over plain and over HF, mean accepted length, how many greedy outputs
were identical) and, when matplotlib is installed, speedup.png. All systems run
in the same process on the same weights, so the ratios are side by side.

Medusa-2 heads carry a LoRA adapter that is merged into the base. For them the
script also decodes every turn with the original base (batched) and reports the adapter's
drift: the share of the original's greedy tokens that the adapted base, fed the
same text, still predicts (teacher-forced argmax agreement), and how many turns
came out identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from medusa.adapter import has_adapter
from medusa.attention import CausalAttention
from medusa.decoding.engine import LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.medusa_model import CPU_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP, MedusaModel
from medusa.training.data import DATA_DIR
from common import sync
from plotting import pyplot

SPEC_BENCH = DATA_DIR / "spec_bench.jsonl"


def load_questions(path: Path, per_category: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    taken: dict[str, int] = defaultdict(int)
    out = []
    for row in rows:
        if per_category is None or taken[row["category"]] < per_category:
            taken[row["category"]] += 1
            out.append(row)
    return out


def pinned_engine(model: MedusaModel) -> LLMEngine:
    """An engine whose only tree is the heads' own (with the model's lookup chain, if any): every Medusa step
    verifies it, with no timed choice of smaller trees or plain steps, so its accepted length is the heads'."""
    config = model.engine_config()
    own = config.trees[-1]  # engine_config lists the heads' own tree (else the largest named one) last
    return LLMEngine(model.base, model.heads, dataclasses.replace(config, trees=(own,)), model.tokenizer,
                     sorted(model.eos_token_ids))


def run_turns(model: MedusaModel, question: dict, decode) -> list[dict]:
    """Every turn of the question, alone; later turns see the model's own earlier answers.
    decode(prompt ids) -> (text, the turn's record: tokens, seconds, steps, emitted, from_lookup, trees, ids)."""
    messages, turns = [], []
    for turn in question["turns"]:
        messages.append({"role": "user", "content": turn})
        ids = model.encode(list(messages))
        text, record = decode(ids)
        messages.append({"role": "assistant", "content": text})
        turns.append({**record, "prompt": ids})
    return turns


def on_engine(engine: LLMEngine, max_new_tokens: int):
    """decode for run_turns: the prompt alone on `engine`, with the trees its steps ran."""
    def decode(ids: list[int]) -> tuple[str, dict]:
        trees_before = engine.stats().steps_per_tree
        sync()
        start = time.perf_counter()
        out = engine.generate([ids], SamplingParams(max_tokens=max_new_tokens))[0]
        seconds = time.perf_counter() - start
        trees = {t: n - trees_before.get(t, 0) for t, n in engine.stats().steps_per_tree.items()}
        # accepted length: tokens per verification step (the prefill's first token is not one)
        return out.text, {"tokens": len(out.token_ids), "seconds": seconds, "steps": out.stats.steps,
                          "emitted": sum(out.stats.accepted_lengths), "from_lookup": out.stats.accepted_from_lookup,
                          "trees": {t: n for t, n in trees.items() if n}, "ids": list(out.token_ids)}
    return decode


def through_generate(model: MedusaModel, max_new_tokens: int, speculative: bool):
    """decode for run_turns: `MedusaModel.generate` of one prompt, as `medusa generate` runs it: on a CPU the
    batch-1 decoder (the tree timed at load, greedy steps gated to plain where speculation loses), on a GPU
    the engine. It does not count lookup acceptances (from_lookup 0)."""
    def decode(ids: list[int]) -> tuple[str, dict]:
        sync()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, speculative=speculative)
        sync()
        seconds = time.perf_counter() - start
        return out.text, {"tokens": len(out.token_ids), "seconds": seconds, "steps": out.steps,
                          "emitted": sum(out.accepted_lengths), "from_lookup": 0, "trees": {},
                          "ids": list(out.token_ids)}
    return decode


@torch.inference_mode()
def agreement(model: MedusaModel, prompt_ids: list[int], ids: list[int]) -> int:
    """How many of `ids` (another model's greedy continuation of prompt_ids) this model's argmax predicts too."""
    if not ids:
        return 0
    device = model.base.embed_tokens.weight.device
    seq = torch.tensor(prompt_ids + ids, device=device)  # [T]
    hidden = model.base(seq, torch.arange(len(seq), device=device), CausalAttention())  # [T, H]
    predicted = model.base.compute_logits(hidden[len(prompt_ids) - 1 : -1]).argmax(-1)  # [len(ids)]
    return int((predicted == seq[len(prompt_ids):]).sum())


def reference_turns(reference: MedusaModel, questions: list[dict], max_new_tokens: int) -> list[list[dict]]:
    """The original base's greedy turns of every question: turn k of all questions in one engine batch
    (later turns see the reference's own earlier answers). Batch-1 decoding of every turn made a full
    Medusa-2 run overrun its time on the H200; the engine's batched greedy output is batch-1's."""
    engine = reference.engine(False)
    histories, turns = [[] for _ in questions], [[] for _ in questions]
    for k in range(max((len(q["turns"]) for q in questions), default=0)):
        live = [i for i, q in enumerate(questions) if k < len(q["turns"])]
        prompts = []
        for i in live:
            histories[i].append({"role": "user", "content": questions[i]["turns"][k]})
            prompts.append(reference.encode(list(histories[i])))
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens))
        for i, ids, out in zip(live, prompts, outs):
            histories[i].append({"role": "assistant", "content": out.text})
            turns[i].append({"tokens": len(out.token_ids), "ids": list(out.token_ids), "prompt": ids})
    return turns


def drift(model: MedusaModel, ref_turns: list[dict], ours: list[dict]) -> dict:
    """The adapted base (its plain turns `ours`) against the original's turns: agreeing tokens, identical turns."""
    return {"tokens": sum(t["tokens"] for t in ref_turns),
            "agreeing": sum(agreement(model, t["prompt"], t["ids"]) for t in ref_turns),
            "identical_turns": sum(a["ids"] == b["ids"] for a, b in zip(ref_turns, ours)),
            "turns": len(ref_turns)}


def run_hf(hf, model: MedusaModel, question: dict, max_new_tokens: int) -> dict:
    ids = torch.tensor([model.encode([{"role": "user", "content": question["turns"][0]}])], device=hf.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    sync()
    return {"tokens": out.shape[1] - ids.shape[1], "seconds": time.perf_counter() - start}


def summarise(records: list[dict]) -> dict:
    def rate(system):
        toks = sum(t["tokens"] for r in records for t in r[system])
        secs = sum(t["seconds"] for r in records for t in r[system])
        return toks / secs if secs else 0.0

    plain, medusa = rate("plain"), rate("medusa")
    steps = sum(t["steps"] for r in records for t in r["medusa"])
    tokens = sum(t["emitted"] for r in records for t in r["medusa"])
    pairs = [(p["ids"], m["ids"]) for r in records for p, m in zip(r["plain"], r["medusa"])]
    hf_records = [r for r in records if r.get("hf")]
    out = {"questions": len(records), "plain_tok_s": plain, "medusa_tok_s": medusa,
           "speedup_vs_plain": medusa / plain if plain else None,
           "mean_accepted_length": tokens / max(steps, 1),
           "accepted_from_lookup_per_step": sum(t["from_lookup"] for r in records for t in r["medusa"]) / max(steps, 1),
           "identical_greedy_turns": sum(a == b for a, b in pairs), "turns": len(pairs),
           # which tree each of Medusa's decode steps ran: the timed policy may try other trees or plain
           # steps between the ones it settled on, which lowers the accepted length below the heads' own
           "medusa_steps": steps,
           "decode_steps_per_tree": dict(sum((Counter(t["trees"]) for r in records for t in r["medusa"]), Counter()))}
    drifts = [r["drift"] for r in records if r.get("drift")]
    if drifts:
        agreeing, total = sum(d["agreeing"] for d in drifts), sum(d["tokens"] for d in drifts)
        out["adapter_drift"] = {"token_agreement": agreeing / max(total, 1), "tokens": total,
                                "identical_turns": sum(d["identical_turns"] for d in drifts),
                                "turns": sum(d["turns"] for d in drifts)}
    if hf_records:
        hf_rate = sum(r["hf"]["tokens"] for r in hf_records) / sum(r["hf"]["seconds"] for r in hf_records)
        out.update(hf_tok_s=hf_rate, hf_questions=len(hf_records), speedup_vs_hf=medusa / hf_rate)
    return out


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    cats = [c for c in summary["categories"]]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(cats, [summary["categories"][c]["speedup_vs_plain"] for c in cats], color="#4c72b0")
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_ylabel("Medusa speedup over plain decoding")
    ax.set_title(f"Spec-Bench, greedy, batch 1 (overall {summary['overall']['speedup_vs_plain']:.2f}x, "
                 f"mean accepted length {summary['overall']['mean_accepted_length']:.2f})")
    plt.xticks(rotation=35, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--heads", default=None)
    p.add_argument("--data", default=str(SPEC_BENCH))
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--hf-per-category", type=int, default=0, help="questions per category for the HF baseline")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="at most this many questions in all")
    p.add_argument("--quick", action="store_true", help="4 questions, 8 tokens: a CPU smoke run (CI)")
    p.add_argument("--pin-tree", action="store_true",
                   help="every Medusa step verifies the heads' own tree: no timed policy (which may run smaller "
                        "trees or plain steps), so the accepted length is the heads' alone")
    p.add_argument("--prompt-lookup", type=int, default=None,
                   help="prompt-lookup nodes added to every Medusa tree (EngineConfig.prompt_lookup); 0: the "
                        f"heads alone (default: the library's, {DEFAULT_PROMPT_LOOKUP} on a GPU and "
                        f"{CPU_PROMPT_LOOKUP} on a CPU)")
    p.add_argument("--decoder", default="engine", choices=("engine", "generate"),
                   help="engine: each turn alone on the batching engine (the GPU path); generate: "
                        "MedusaModel.generate of one prompt, which on a CPU is the batch-1 decoder that `medusa "
                        "generate` runs (its tree timed at load, its speculation gate)")
    args = p.parse_args()
    if args.decoder == "generate" and args.pin_tree:
        p.error("--pin-tree pins the engine's tree: with --decoder generate the batch-1 decoder times its own")
    if args.quick:
        args.per_category, args.max_new_tokens, args.limit = 1, 8, 4
        args.hf_per_category = min(args.hf_per_category, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = MedusaModel.from_pretrained(args.model, heads=args.heads, prompt_lookup=args.prompt_lookup)
    hf = _load_hf(model) if args.hf_per_category else None
    # Medusa-2: the original base, to measure how far the merged adapter moved the outputs
    reference = MedusaModel.from_pretrained(args.model) if args.heads and has_adapter(args.heads) else None
    questions = load_questions(Path(args.data), args.per_category)[: args.limit]
    plain_engine = model.engine(False)
    medusa_engine = pinned_engine(model) if args.pin_tree else model.engine(True)
    plain_engine.warmup()  # captures the CUDA graphs before anything is timed
    policy = medusa_engine.warmup()  # and measures which tree each batch size gets
    if args.decoder == "generate":
        batch1_tree = model.resolve_tree().label  # timed at load on a CPU, before anything is timed
        plain, medusa = (through_generate(model, args.max_new_tokens, speculative) for speculative in (False, True))
    else:
        batch1_tree = None
        plain, medusa = (on_engine(engine, args.max_new_tokens) for engine in (plain_engine, medusa_engine))
    references = reference_turns(reference, questions, args.max_new_tokens) if reference is not None else None
    records, hf_taken = [], defaultdict(int)
    for index, q in enumerate(tqdm(questions, desc="spec-bench", dynamic_ncols=True)):
        rec = {"category": q["category"], "plain": run_turns(model, q, plain), "medusa": run_turns(model, q, medusa)}
        if hf is not None and hf_taken[q["category"]] < args.hf_per_category:
            hf_taken[q["category"]] += 1
            rec["hf"] = run_hf(hf, model, q, args.max_new_tokens)
        if references is not None:
            rec["drift"] = drift(model, references[index], rec["plain"])
        records.append(rec)
    by_cat = defaultdict(list)
    for r in records:
        by_cat[r["category"]].append(r)
    summary = {"device": _device_name(), "decoder": args.decoder, "batch1_tree": batch1_tree,
               "tree_nodes": max(t.num_nodes for t in medusa_engine.scheduler.trees),
               "tree_policy": policy, "pinned_tree": args.pin_tree,
               "candidate_trees": [t.label for t in medusa_engine.scheduler.trees],
               "prompt_lookup": model.prompt_lookup, "max_new_tokens": args.max_new_tokens,
               "dtype": str(model.base.embed_tokens.weight.dtype), "overall": summarise(records),
               "categories": {c: summarise(rs) for c, rs in by_cat.items()}}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out / "speedup.png")
    print(json.dumps(summary["overall"], indent=2))


def _load_hf(model: MedusaModel):
    import transformers

    from medusa import default_model

    path = default_model.default_model_path()  # the benchmark's HF baseline is the default model
    device = model.base.embed_tokens.weight.device
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=model.base.embed_tokens.weight.dtype).to(device).eval()


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
