"""What the device's logit changes cost a decode step (`decoding/device_changes.py`): `DeviceChanges.apply` on
random logits for B rows of a tree, every row penalized (presence and frequency; with --repetition also the
repetition penalty), timed as the median of repeats; on a GPU as a captured CUDA graph (as the engine's step
runs it: launch costs hidden), its logits in bfloat16 (the model's). Writes OUT/results.json.

    python benchmarks/logit_changes.py --out OUT [--rows 4 32] [--trees single tree-16] [--vocab 49152]
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

import torch

from medusa.decoding.device_changes import DeviceChanges, RowChanges
from medusa.decoding.device_tree import DeviceTree
from medusa.tree import TreeSpec


def time_apply(rows: int, spec: TreeSpec, vocab: int, repetition: float, device: torch.device,
               repeats: int, dtype: torch.dtype) -> float:
    """Median seconds of one `apply` over `rows` rows of `spec`'s nodes."""
    tree = DeviceTree.from_spec(spec, device)
    n, g = tree.num_nodes, torch.Generator().manual_seed(0)
    changes = DeviceChanges(rows, vocab, device)
    outputs = [torch.randint(0, vocab, (200,), generator=g).tolist() for _ in range(rows)]
    changes.set_rows(list(range(rows)), outputs, [list(range(100))] * rows, [None] * rows, [None] * rows)
    kind = changes.prepare([RowChanges(frequency=0.3, presence=0.5, repetition=repetition)] * rows, rows)
    logits = torch.randn(rows * n, vocab, generator=g).to(device, dtype)
    candidates = torch.randint(0, vocab, (rows, n), generator=g).to(device)
    at, window = torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.long, device=device)
    apply = changes.apply
    if "kind" not in inspect.signature(apply).parameters:  # a commit before `kind` (an A/B run): always all
        apply = lambda *arguments: changes.apply(*arguments[:-1])  # noqa: E731
    if device.type == "cuda":
        return time_graph(lambda: apply(logits, at, tree, candidates, window, kind), repeats)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        apply(logits, at, tree, candidates, window, kind)
        times.append(time.perf_counter() - start)
    kept = sorted(times[2:])
    return kept[len(kept) // 2]


def time_graph(work, repeats: int) -> float:
    """Median seconds of one replay of `work` captured as a CUDA graph (CUDA events around each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()  # warm-up: Triton compiles, allocator pools
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    kept = sorted(times[2:])
    return kept[len(kept) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--trees", nargs="+", default=["single", "tree-16"])
    parser.add_argument("--lookup", type=int, default=4, help="lookup nodes added to each tree but single")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the logits' (default: bfloat16 on a GPU, float32 on a CPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    results = []
    for name in args.trees:
        spec = TreeSpec.load(name)
        spec = spec.with_lookup(args.lookup) if args.lookup and spec.num_nodes > 1 else spec
        for rows in args.rows:
            for repetition in (1.0, 1.2):
                with torch.inference_mode():  # as the engine's step runs (Triton kernels serve inference only)
                    seconds = time_apply(rows, spec, args.vocab, repetition, device, args.repeats, dtype)
                row = {"tree": name, "nodes": spec.num_nodes, "rows": rows, "repetition": repetition != 1,
                       "ms": seconds * 1e3}
                results.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    (out / "results.json").write_text(json.dumps({"device": name, "vocab": args.vocab, "dtype": str(dtype),
                                                  "rows": results}, indent=1))


if __name__ == "__main__":
    main()
