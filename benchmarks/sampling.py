"""What device-side sampling adds to a decode step: `sampled_targets` with and without the top-k / top-p
filters (the sort that finds their cutoffs), against a greedy step's argmax, at the rows x nodes a step
draws for (GPU).

A step whose sampling rows only set a temperature (an OpenAI request's default) runs it unfiltered
(the Gumbel-max kernels alone); one with a top-k or top-p row runs the filters for every row. Eager
calls under inference mode (where the Triton kernels run), CUDA-event timed.

    python benchmarks/sampling.py --out out/sampling.json
"""

from __future__ import annotations

import argparse
import json

import torch

from medusa.decoding.batch_verify import sampled_targets
from medusa.kernels.top_k import top_k_indices
from step_parts import median_ms


def time_draws(rows: int, nodes: int, vocab: int, filtered: bool | None) -> float:
    """Median ms of one step's draws; filtered=None: the greedy argmax instead."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(rows, nodes, vocab, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    temperature = torch.full((rows,), 0.7, device="cuda")
    top_k = torch.zeros(rows, dtype=torch.long, device="cuda")
    top_p = torch.ones(rows, device="cuda")
    min_p = torch.zeros(rows, device="cuda")
    uniforms = torch.rand(rows, nodes, dtype=torch.float64, device="cuda", generator=g)
    if filtered is None:
        return median_ms(lambda: top_k_indices(logits, 1))
    return median_ms(lambda: sampled_targets(logits, temperature, top_k, top_p, min_p, uniforms, filtered=filtered))


@torch.inference_mode()  # the kernels serve inference only (kernels/dispatch.py)
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    p.add_argument("--shapes", nargs="+", default=["1x1", "1x16", "8x1", "8x16", "32x1", "32x16", "64x1"],
                   help="rows x nodes per step")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    rows = []
    for shape in args.shapes:
        b, n = (int(x) for x in shape.split("x"))
        row = {"rows": b, "nodes": n, "vocab": args.vocab,
               "filtered_ms": time_draws(b, n, args.vocab, True), "unfiltered_ms": time_draws(b, n, args.vocab, False),
               "argmax_ms": time_draws(b, n, args.vocab, None)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
