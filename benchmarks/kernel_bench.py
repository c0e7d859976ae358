"""Kernel and step-cost curves: tree-attention bandwidth, verification cost against tree size.

    python benchmarks/kernel_bench.py --out out/kernels                 # GPU, full size
    python benchmarks/kernel_bench.py --quick --out out/kernels-quick   # CPU smoke run (CI)
    python benchmarks/kernel_bench.py --launch-sweep --skip-steps --out out/sweep   # GPU: attention launch settings

1. Tree attention over paged KV (batch 32, 64 tree tokens, 8 KV heads of 128,
   32 query heads by default) at growing contexts: achieved KV read bandwidth,
   against a device-to-device copy measured in the same run.
2. One engine forward (random weights in a real model's shape) for B sequences
   x N tree tokens, N from 1 to 128: the curve the scheduler's tree budget uses.
   On a GPU the forward is captured as a CUDA graph, as the engine runs it, with the engine's
   key bound for short plain steps (`kv_len_bound`; --no-kv-bound: the tables' width alone).
3. With --launch-sweep (GPU only): the attention of 1. at 512 and 4096 keys under
   num_warps 4 / 8 and num_stages 1-6, the data behind `_launch_config`, then under
   other row-tile and key-chunk sizes (BLOCK_M x BLOCK_N).
4. With --split-sweep (GPU only): attention at small batches (one token or a
   64-node tree per sequence, the three model shapes' heads) under each split-KV
   count, per call inside a CUDA graph of back-to-back calls, as a step runs it:
   the data behind `_pick_splits`.
Writes results.json and, with matplotlib, kernels.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from medusa.config import ModelConfig
from medusa.decoding.decode_step import bounds_tree_keys, kv_len_bound
from medusa.decoding.paged_cache import PagedKVCache, StepMetadata
from medusa.kernels.paged_attention import paged_attention_reference
from medusa.loading import empty_model
from common import SHAPES
from plotting import pyplot


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of fn() after one warm-up, timed with CUDA events on a GPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, mib: int) -> float:
    x = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), 10, device)


def paged_batch(batch: int, context: int, tree: int, hq: int, hkv: int, d: int, dtype, device, page: int = 16):
    """Random paged KV where each sequence has `context` tokens, the last `tree` of them a chain-shaped step."""
    blocks_per_seq = -(-context // page)
    k = torch.randn(batch * blocks_per_seq * page, hkv, d, dtype=dtype, device=device)
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).to(torch.int32)
    bits = torch.tensor([_chain_bits(i) for i in range(tree)], dtype=torch.long, device=device).repeat(batch)
    return dict(q=torch.randn(batch * tree, hq, d, dtype=dtype, device=device), k_cache=k, v_cache=torch.randn_like(k),
                block_tables=tables, kv_lens=torch.full((batch,), context, device=device),
                query_start=torch.arange(batch + 1, device=device) * tree,
                causal=torch.zeros(batch, dtype=torch.int32, device=device), step_bits=bits)  # as the engine passes it


def _chain_bits(i: int) -> int:
    """Ancestor bits of node i of a chain (all of 0..i) as a signed int64; past 64 nodes the chunk is causal."""
    return (1 << (i + 1)) - 1 if i < 63 else -1


def attention_curve(args, device, dtype) -> list[dict]:
    rows = []
    for context in args.contexts:
        page = args.block_size
        batch = paged_batch(args.batch, context, args.tree, args.q_heads, args.kv_heads, args.head_dim, dtype, device,
                            page=page)
        if device.type == "cuda":
            from medusa.kernels.paged_attention_triton import bulk_copies_fit, page_descriptors, paged_attention_triton

            # TMA descriptors built once, as the engine's cache keeps them (an eager call would build them each time)
            descs = page_descriptors(batch["k_cache"], batch["v_cache"]) \
                if bulk_copies_fit(batch["q"], batch["k_cache"], batch["v_cache"], page) else None
            fn = lambda: paged_attention_triton(**batch, block_size=page, max_query_len=args.tree,  # noqa: E731
                                                descriptors=descs)
        else:
            fn = lambda: paged_attention_reference(**batch, block_size=page)  # noqa: E731
        seconds = timed(fn, args.repeats, device)
        kv_bytes = 2 * args.batch * context * args.kv_heads * args.head_dim * batch["k_cache"].element_size()
        rows.append({"context": context, "seconds": seconds, "kv_gb_s": kv_bytes / seconds / 1e9})
    return rows


def launch_sweep(args, device, dtype) -> list[dict]:
    """Tree attention under each of LAUNCHES (warps, stages, tile sizes): milliseconds and KV read rate."""
    from medusa.kernels.paged_attention_triton import paged_attention_triton

    rows = []
    for context in (512, 4096):
        batch = paged_batch(args.batch, context, args.tree, args.q_heads, args.kv_heads, args.head_dim, dtype, device)
        kv_bytes = 2 * args.batch * context * args.kv_heads * args.head_dim * batch["k_cache"].element_size()
        for launch in LAUNCHES:
            seconds = timed(lambda: paged_attention_triton(**batch, block_size=16, max_query_len=args.tree,
                                                           launch=launch), args.repeats, device)
            rows.append({"context": context, **launch, "seconds": seconds, "kv_gb_s": kv_bytes / seconds / 1e9})
            print(rows[-1], flush=True)
    return rows


# (BLOCK_M, BLOCK_N, num_warps, num_stages): 128-row tiles give each K/V chunk twice the rows (two
# warpgroups' MMAs), 128-key chunks halve the loop trips; stages kept within shared memory
TILE_VARIANTS = [(64, 64, 4, 4), (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                 (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 4, 4), (128, 64, 4, 3)]
# the default tiles under each num_warps x num_stages, then the tile variants
LAUNCHES = [dict(num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3, 4, 5, 6)] + [
    dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in TILE_VARIANTS]
SPLIT_SHAPES = {"llama-3.1-8b": (32, 8, 128), "llama-3.2-1b": (32, 8, 64), "smollm2-135m": (9, 3, 64)}


def split_sweep(args, device, dtype, attention=None, calls: int = 10,
                split_counts=(None, 1, 2, 4, 8, 16, 32)) -> list[dict]:
    """Microseconds per attention call at small batches under each split count (None: the wrapper's pick).

    Timed as a CUDA graph of `calls` back-to-back calls, so launch gaps count as in a step.
    attention: the function to time (default the library's kernel; a probe can pass an older one).
    """
    if attention is None:
        from medusa.kernels.paged_attention_triton import paged_attention_triton as attention
    rows = []
    for shape, (hq, hkv, d) in SPLIT_SHAPES.items():
        for batch_size, tree in ((1, 1), (1, 64), (8, 1), (8, 16)):
            for context in (512, 2048):
                batch = paged_batch(batch_size, context, tree, hq, hkv, d, dtype, device)
                # the engine's tables are as wide as the longest context it serves, not this one
                batch["block_tables"] = torch.nn.functional.pad(batch["block_tables"], (0, 4096 // 16), value=0)
                for splits in split_counts:
                    def fn():
                        for _ in range(calls):
                            attention(**batch, block_size=16, max_query_len=tree, num_splits=splits)
                    us = timed(captured(fn), args.repeats, device) / calls * 1e6
                    rows.append({"shape": shape, "batch": batch_size, "tree": tree, "context": context,
                                 "splits": splits, "us": us})
                    print(rows[-1], flush=True)
    return rows


def step_curve(args, device, dtype) -> tuple[list[dict], list[dict]]:
    """(step seconds per batch and tree size, the kernels of each batch-1 step when --kernel-profile)"""
    hidden, inter, layers, heads, kv_heads, vocab = SHAPES[args.shape]
    if args.quick:
        hidden, inter, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 256
    config = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                         max_position_embeddings=4096)
    model = empty_model(config, dtype, device)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    rows, kernels = [], []
    for batch in args.batches:
        pages = batch * (-(-max(args.step_context + 128, args.table_keys) // args.block_size))
        cache = PagedKVCache(config, pages, args.block_size, dtype, device)
        for tree in args.tree_sizes:
            meta = _step_metadata(batch, tree, args.step_context, args.table_keys, device, not args.no_kv_bound,
                                  args.block_size, bounds_tree_keys(config, tree))
            ids = torch.zeros(batch * tree, dtype=torch.long, device=device)
            pos = torch.full((batch * tree,), args.step_context, device=device)

            def forward():
                with torch.inference_mode():
                    return model.compute_logits(cache.forward(model, ids, pos, meta))

            fn = captured(forward) if device.type == "cuda" else forward
            rows.append({"batch": batch, "tree_tokens": tree, "seconds": timed(fn, args.repeats, device)})
            if args.kernel_profile and batch == 1 and device.type == "cuda":
                print(f"-- kernels of a batch-1 step of {tree} tokens", flush=True)
                kernels.append({"tree_tokens": tree, "kernels": kernel_table(fn)})
    return rows, kernels


def kernel_table(replay, steps: int = 20) -> list[dict]:
    """What one replayed step is made of: per kernel name, launches and device microseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:120], "launches": e.count / steps, "us": us / steps})
    rows.sort(key=lambda r: -r["us"])
    for r in rows[:25]:
        print(f"{r['us']:9.1f} us  {r['launches']:6.1f} x  {r['kernel']}", flush=True)
    total = sum(r["us"] for r in rows), sum(r["launches"] for r in rows)
    print(f"kernels: {total[1]:.0f} launches, {total[0]:.0f} us of kernel time per step", flush=True)
    return rows


def captured(fn):
    """fn recorded as a CUDA graph (after warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _step_metadata(batch: int, tree: int, context: int, table_keys: int, device, kv_bound: bool = True,
                   page: int = 16, bounds_trees: bool = False) -> StepMetadata:
    """A step of `tree` chain tokens per sequence after `context` cached ones; block tables as wide as
    table_keys (the engine's are as wide as the longest context it serves, which sets the split count),
    and with kv_bound the key bound the engine's decode step would run under."""
    per_seq = -(-max(context + 128, table_keys) // page)
    bound = kv_len_bound(batch, tree, context + tree, per_seq * page, False, bounds_trees) if kv_bound else None
    tables = torch.arange(batch * per_seq, device=device, dtype=torch.int32).view(batch, per_seq)
    slots = (tables.long()[:, :1] * page + context + torch.arange(tree, device=device)).flatten()
    bits = torch.tensor([_chain_bits(i) for i in range(tree)], device=device).repeat(batch)
    return StepMetadata(slot_mapping=slots, block_tables=tables, kv_lens=torch.full((batch,), context + tree, device=device),
                        query_start=torch.arange(batch + 1, device=device) * tree,
                        causal=torch.full((batch,), int(tree > 64), dtype=torch.int32, device=device), step_bits=bits,
                        max_query_len=tree, max_kv_len=bound)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    att = results["attention"]
    a.plot([r["context"] for r in att], [r["kv_gb_s"] for r in att], marker="o", label="tree attention")
    a.axhline(results["copy_gb_s"], color="grey", ls="--", label="device copy")
    a.set(xlabel="context tokens", ylabel="KV read GB/s", title="Tree attention bandwidth")
    a.legend()
    for batch in sorted({r["batch"] for r in results["steps"]}):
        rows = [r for r in results["steps"] if r["batch"] == batch]
        b.plot([r["tree_tokens"] for r in rows], [r["seconds"] * 1e3 for r in rows], marker="o", label=f"batch {batch}")
    b.set(xlabel="tree tokens per sequence", ylabel="ms per step", xscale="log", title=f"Step cost ({results['shape']})")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--skip-attention", action="store_true", help="only the step-cost curve")
    p.add_argument("--skip-steps", action="store_true", help="no step-cost curve")
    p.add_argument("--launch-sweep", action="store_true", help="attention under each num_warps / num_stages (GPU)")
    p.add_argument("--kernel-profile", action="store_true", help="the kernels of each batch-1 step (GPU profiler)")
    p.add_argument("--split-sweep", action="store_true", help="small-batch attention under each split count (GPU)")
    p.add_argument("--table-keys", type=int, default=8192,
                   help="block-table width of the step curve in tokens, as the engine sizes it for its longest "
                        "context (sessions 1-12 used context + 128)")
    p.add_argument("--step-context", type=int,
                   help="cached tokens per sequence in the step curve (default 512; --quick: 32)")
    p.add_argument("--no-kv-bound", action="store_true",
                   help="step curve without the engine's key bound for short plain steps (splits from the tables)")
    p.add_argument("--block-size", type=int, default=16, choices=(16, 32, 64, 128),
                   help="KV page size of the attention and step curves (64+: TMA loads on Hopper)")
    p.add_argument("--batches", type=int, nargs="+", help="step-curve batch sizes (default 1 8 32)")
    p.add_argument("--tree-sizes", type=int, nargs="+", help="step-curve tokens per sequence (default 1 to 128)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if (args.launch_sweep or args.split_sweep) and device.type != "cuda":
        p.error("--launch-sweep and --split-sweep time the Triton kernel's launch settings: they need a CUDA device")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    big = not args.quick
    args.contexts = [512, 1024, 2048, 4096] if big else [64, 128]
    args.batch, args.tree = (32, 64) if big else (2, 8)
    args.q_heads, args.kv_heads, args.head_dim = (32, 8, 128) if big else (4, 2, 64)
    batches, tree_sizes = ([1, 8, 32], [1, 2, 4, 8, 16, 32, 64, 128]) if big else ([1, 2], [1, 4])
    args.batches, args.tree_sizes = args.batches or batches, args.tree_sizes or tree_sizes
    if args.step_context is not None and args.step_context < 1:
        p.error(f"--step-context must be >= 1, got {args.step_context}")
    args.step_context, args.repeats = (args.step_context or (512 if big else 32)), (20 if big else 2)
    shape = args.shape if big else "tiny (quick)"
    args.copy_bytes_s = copy_bandwidth(device, 1024 if big else 16)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": shape,
               "dtype": str(dtype), "copy_gb_s": args.copy_bytes_s / 1e9,
               "step_context": args.step_context, "table_keys": args.table_keys, "kv_bound": not args.no_kv_bound,
               "block_size": args.block_size,
               "attention": [] if args.skip_attention else attention_curve(args, device, dtype),
               "launch_sweep": launch_sweep(args, device, dtype) if args.launch_sweep else [],
               "split_sweep": split_sweep(args, device, dtype) if args.split_sweep else []}
    results["steps"], results["kernel_profile"] = ([], []) if args.skip_steps else step_curve(args, device, dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "kernels.png")
    print(json.dumps({k: v for k, v in results.items() if k not in ("steps", "kernel_profile", "split_sweep")},
                     indent=2))


if __name__ == "__main__":
    main()
