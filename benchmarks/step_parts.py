"""Where a batch-1 decode step's device time goes, per candidate tree (a diagnosis tool, GPU only).

The engine captures each decode step as two CUDA graphs: part 1 (tree placement,
candidates, forward, logits, argmax, greedy verdict) and part 2 (acceptance, KV
moves, the heads and their top-k). This replays each part of every tree the
engine holds, alone and together, at one sequence with `--context` cached keys
(an all-padding batch: no sequence's state is touched), and traces one replay of
the trees of `--trace-tokens` tokens: every kernel in launch order with its
duration (`last_pair`), and a condensed profile (`gpu_trace.GpuTrace`).

    python benchmarks/step_parts.py --out step_parts.json
"""

from __future__ import annotations

import argparse
import json

import torch

from gpu_trace import GpuTrace


def median_ms(fn, inner: int = 20, repeats: int = 7) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return sorted(times)[repeats // 2]


def replays(step, graphs: dict, context: int, names: tuple[str, ...]):
    """A callable replaying `names` of a tree's graphs, the padding row's KV length set to `context`."""
    def run():
        step.row_base[step.padding_row] = context
        for name in names:
            graphs[name].replay()
    return run


def kernels_of(trace: GpuTrace, pairs: int) -> list[tuple[float, float, str]]:
    """The last of `pairs` traced replays: (start us from its first kernel, duration us, name) per kernel."""
    device = sorted((e for e in trace.events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                           "gpu_memset")),
                    key=lambda e: e["ts"])
    last = device[-(len(device) // pairs):]
    return [(round(e["ts"] - last[0]["ts"], 1), round(e["dur"], 1), e["name"][:70]) for e in last]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--model", default=None, help="base model (default: the shipped default model and heads)")
    p.add_argument("--context", type=int, default=512, help="cached keys of the sequence")
    p.add_argument("--trace-tokens", type=int, nargs="*", default=[8, 12, 16],
                   help="trace the trees of these many tokens")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_parts.py replays CUDA graphs: it needs a GPU")
    from medusa.medusa_model import MedusaModel

    torch.set_grad_enabled(False)
    engine = MedusaModel.from_pretrained(args.model, device="cuda", dtype=torch.bfloat16).engine()
    engine.warmup(max_batch=1)
    step = engine.runner.decode
    rows, traces = [], {}
    for spec in engine.scheduler.trees:
        tree = engine._device_tree(spec)
        for propose in ((False, True) if spec.num_nodes == 1 else (True,)):
            graphs = step._graph(tree, 1, False, propose)
            with step._padding_inputs():
                row = {"tree": spec.label, "nodes": spec.num_nodes, "heads": propose,
                       **{f"{part}_ms": median_ms(replays(step, graphs, args.context, names))
                          for part, names in (("part1", ("g1",)), ("part2", ("g2",)), ("both", ("g1", "g2")))}}
                if propose and spec.num_nodes in args.trace_tokens:
                    run = replays(step, graphs, args.context, ("g1", "g2"))
                    median_ms(run, inner=3, repeats=1)
                    with GpuTrace() as trace:
                        for _ in range(5):
                            run()
                        torch.cuda.synchronize()
                    traces[spec.label] = {"summary": trace.summary(5, top=30), "last_pair": kernels_of(trace, 5)}
            print(row, flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "context": args.context, "rows": rows, "traces": traces},
                  f, indent=1)


if __name__ == "__main__":
    main()
