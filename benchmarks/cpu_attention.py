"""Attention of a few queries on a CPU: `attend`'s explicit path against SDPA, per call.

    python benchmarks/cpu_attention.py --out out/cpu-attention          # the default model's heads, float32
    python benchmarks/cpu_attention.py --quick --out out/cpu-attention  # two shapes (CI smoke run)

`medusa/attention.py` runs 1 to CPU_EXPLICIT_MAX_QUERIES non-causal float32 queries on a CPU as matmul, softmax,
matmul with each KV head's query heads folded into the query length (`_attend_explicit`). This times that
against SDPA's grouped path (`enable_gqa`, what `attend` runs otherwise) and against SDPA on the folded queries
(the path before session 48, past 384 keys), for the default model's 9 query and 3 KV heads of 64 at the
query and key counts of decode steps (1 query), tree verification (16-17) and short prompt chunks (64), with
a tree mask: every key of the prefix, then a random ancestor pattern. Median of --repeats calls after a
warm-up; CPU timings drift between runs, so compare within one. Writes results.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from medusa.attention import CPU_EXPLICIT_MAX_QUERIES, _attend_explicit
from cpu_projection import median_ms

SHAPES = ((1, 16), (1, 256), (1, 512), (1, 2048), (4, 256), (16, 128), (16, 256), (16, 512), (17, 1024),
          (48, 2048), (64, 512))
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # the default model's


def median_us(fn, repeats: int) -> float:
    for _ in range(max(2, repeats // 10)):  # warm-up beyond median_ms's one call
        fn()
    return median_ms(fn, repeats) * 1e3


def tree_mask(t: int, s: int, generator: torch.Generator) -> torch.Tensor:
    own = (torch.rand(t, t, generator=generator) < 0.5).tril() | torch.eye(t, dtype=torch.bool)
    return torch.cat([torch.ones(t, s - t, dtype=torch.bool), own], dim=1)  # [T, S]


def sdpa_grouped(q, k, v, mask):
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def sdpa_folded(q, k, v, mask):
    t, group = q.shape[0], HEADS // KV_HEADS
    folded = q.transpose(0, 1).reshape(KV_HEADS, group * t, HEAD_DIM)
    out = F.scaled_dot_product_attention(folded, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask.repeat(group, 1))
    return out.reshape(HEADS, t, HEAD_DIM).transpose(0, 1)


def time_shape(t: int, s: int, repeats: int, generator: torch.Generator) -> dict:
    q = torch.randn(t, HEADS, HEAD_DIM, generator=generator)
    k, v = torch.randn(2, s, KV_HEADS, HEAD_DIM, generator=generator)
    mask = tree_mask(t, s, generator)
    explicit = lambda: _attend_explicit(q, k, v, mask, None, HEADS // KV_HEADS)  # noqa: E731
    error = (explicit() - sdpa_grouped(q, k, v, mask)).abs().max().item()
    row = {"queries": t, "keys": s, "explicit_us": median_us(explicit, repeats),
           "sdpa_grouped_us": median_us(lambda: sdpa_grouped(q, k, v, mask), repeats),
           "sdpa_folded_us": median_us(lambda: sdpa_folded(q, k, v, mask), repeats), "max_abs_difference": error}
    print(f"{t:3d} queries x {s:5d} keys: explicit {row['explicit_us']:8.1f} us, SDPA grouped "
          f"{row['sdpa_grouped_us']:8.1f}, SDPA folded {row['sdpa_folded_us']:8.1f} (max |diff| {error:.1e})",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=301, help="timed calls per figure (the median is kept)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    shapes, repeats = (SHAPES[:2], 5) if args.quick else (SHAPES, args.repeats)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        rows = [time_shape(t, s, repeats, generator) for t, s in shapes if t <= CPU_EXPLICIT_MAX_QUERIES]
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "heads": HEADS, "kv_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "repeats": repeats, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
