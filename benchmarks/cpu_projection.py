"""Vocabulary projections on a CPU: F.linear against the weight as the left operand, and a speculative step.

    python benchmarks/cpu_projection.py --out out/cpu-projection          # the default model, float32
    python benchmarks/cpu_projection.py --quick --out out/cpu-projection  # a small random model (CI smoke run)

`kernels/skinny_matmul.py` computes a CPU product of 2-64 rows by a weight of CPU_SWAP_MIN_BYTES or more
(the default model's lm_head and so the heads' shared projection; a larger model's layers too) as
`weight @ x.T` instead of F.linear's `x @ weight.T` (`swaps_on_cpu`). This times, on this machine:

1. both forms for the model's lm_head shape at 1 to 256 rows (cache-warm, median of --repeats calls), and
   for other weights of 2-235 MB at 2-64 rows (the data behind CPU_SWAP_MIN_BYTES);
2. with `swaps_on_cpu` on, on for the lm_head alone (session 27's rule) and off, in interleaved rounds: a
   verification forward of 1, 4, 8 and 16 tokens after 256 cached ones (`tree_select.step_seconds`) and the
   heads' proposals (`heads_seconds`), the two costs the batch-1 decoder's tree choice weighs.

CPU timings vary between runs (other processes, frequency scaling): compare within one run. Writes
results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import medusa.kernels.skinny_matmul as skinny
from medusa.config import ModelConfig
from medusa.decoding.tree_select import heads_seconds, step_seconds
from medusa.heads import HeadsConfig, MedusaHeads
from medusa.loading import empty_model

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TREE_TOKENS = (1, 4, 8, 16)
# weights of 2 MB to 235 MB: the default model's gate/up (7 MB), vocabulary projections of 32k-49k tokens,
# a 1B-class lm_head slice and an 8B-class down projection
OTHER_WEIGHTS = ((8192, 64), (3072, 576), (8192, 576), (32000, 576), (8192, 2048), (32000, 2048), (14336, 4096))
OTHER_ROWS = (2, 4, 8, 16, 64)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def projection_curve(weight: torch.Tensor, rows: tuple[int, ...], repeats: int) -> list[dict]:
    """ms per product of `rows` rows by weight [V, H], as F.linear and as weight @ x.T."""
    out = []
    for n in rows:
        x = torch.randn(n, weight.shape[1])
        linear = median_ms(lambda: F.linear(x, weight), repeats)
        swapped = median_ms(lambda: torch.mm(weight, x.t()).t().contiguous(), repeats)
        out.append({"rows": n, "linear_ms": round(linear, 3), "swapped_ms": round(swapped, 3),
                    "speedup": round(linear / swapped, 2)})
        print(f"  {n:4d} rows: F.linear {linear:8.3f} ms, weight @ x.T {swapped:8.3f} ms", flush=True)
    return out


# session 27's rule: only weights of 16 MB or more (the default model's lm_head, not its layers) swapped
LM_HEAD_ONLY_BYTES = 16 << 20


def step_rounds(base, heads, rounds: int, repeats: int) -> dict[str, list[dict]]:
    """Interleaved rounds of swap on (`swaps_on_cpu`), on for weights of LM_HEAD_ONLY_BYTES or more only, and
    off: forward ms per tree size and the heads' ms."""
    enabled = skinny.swaps_on_cpu

    def large_only(x, weight):
        return enabled(x, weight) and weight.numel() * weight.element_size() >= LM_HEAD_ONLY_BYTES

    rules = {"on": enabled, "lm_head_only": large_only, "off": lambda x, weight: False}
    runs: dict[str, list[dict]] = {label: [] for label in rules}
    try:
        for _ in range(rounds):
            for label, rule in rules.items():
                skinny.swaps_on_cpu = rule
                row = {f"forward_{n}_ms": round(step_seconds(base, n, 256, repeats) * 1e3, 2) for n in TREE_TOKENS}
                row["heads_ms"] = round(heads_seconds(base, heads, repeats) * 1e3, 2)
                runs[label].append(row)
                print(f"  swap {label:12s}: {row}", flush=True)
    finally:
        skinny.swaps_on_cpu = enabled
    return runs


def load(quick: bool):
    if quick:  # an lm_head just large enough to take the swapped path (float32 rows of CPU_SWAP_MIN_K)
        hidden = skinny.CPU_SWAP_MIN_K
        config = ModelConfig(model_type="llama", vocab_size=skinny.CPU_SWAP_MIN_BYTES // (4 * hidden),
                             hidden_size=hidden, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=16, max_position_embeddings=512)
        torch.manual_seed(0)
        base = empty_model(config, torch.float32, torch.device("cpu"))
        for p in base.parameters():
            p.data.normal_(0, 0.02)
        heads = MedusaHeads(HeadsConfig(num_heads=4, hidden_size=hidden, vocab_size=config.vocab_size)).eval()
        return base, heads, "random (quick)"
    from medusa.medusa_model import MedusaModel

    model = MedusaModel.from_pretrained(device="cpu", dtype=torch.float32)
    return model.base, model.heads, "default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved on/off rounds of part 2")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per figure (the median is kept)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds and --repeats must be >= 1, got {args.rounds} and {args.repeats}")
    rounds, repeats = (1, 2) if args.quick else (args.rounds, args.repeats)
    base, heads, name = load(args.quick)
    results = {"model": name, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "swap_min_bytes": skinny.CPU_SWAP_MIN_BYTES, "swap_max_rows": skinny.CPU_SWAP_MAX_ROWS}
    with torch.inference_mode():
        print(f"lm_head {tuple(base.lm_head.weight.shape)}, {name} model, {results['threads']} threads", flush=True)
        rows = ROWS[:3] if args.quick else ROWS
        results["projection"] = projection_curve(base.lm_head.weight, rows, repeats)
        results["other_weights"] = {} if args.quick else {  # what CPU_SWAP_MIN_BYTES rests on
            f"{n}x{k}": projection_curve(torch.randn(n, k), OTHER_ROWS, repeats) for n, k in OTHER_WEIGHTS}
        print("verification forwards and the heads' proposals", flush=True)
        results["steps"] = step_rounds(base, heads, rounds, repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
