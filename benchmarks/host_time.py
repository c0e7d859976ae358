"""The engine's host work per step, without the device: where a step's CPU time goes at C requests.

    python benchmarks/host_time.py --out out/host               # plain and Medusa at 64 requests, 3 runs
    python benchmarks/host_time.py --quick --out out/host-quick  # CPU smoke run (CI)
    python benchmarks/host_time.py --apply-interval 1 4 --out out/host-apply  # tokens applied every step, every 4th

On a GPU the decode step is a graph replay and the host's bookkeeping (scheduling, inputs, appending
tokens, text, block commits, outputs) is what bounds a small model at many requests. This measures
that bookkeeping on the CPU: a 1-layer, 32-wide random model whose attention is stubbed out (its
reference loops over sequences and would dominate), the default model's tokenizer, overlapped steps,
a closed loop of C requests. Each part of a step is timed by wrapping its method; `host_ms` is the step
less the model's forward and verification (`forward`, `finish_to_host`), plus `prepare` (inputs), the
part a GPU host would still do. The minimum over --repeats runs is reported (other processes only add).

It also times the streaming detokenizer per token on the default tokenizer, by each text source: the
byte table (`ByteText`), `DecodeStream`, the windowed Rust decode, and the window through transformers'
Python `decode` (what the engine used on the GPU machine before session 12). Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

import medusa.decoding.byte_level as byte_level
import medusa.decoding.detokenizer as detokenizer
import medusa.decoding.paged_cache as paged_cache
from medusa.config import ModelConfig
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.heads import HeadsConfig, MedusaHeads
from medusa.model import DecoderModel
from throughput import run_level

PARTS = {  # label -> (owner attribute path from the engine, method)
    "step": ("", "step"), "schedule": ("scheduler", "schedule"), "prepare": ("runner.decode", "prepare"),
    "forward": ("runner.decode", "forward"), "finish_to_host": ("runner.decode", "finish_to_host"),
    "apply_rows": ("", "_apply_rows"), "apply_steps": ("", "_apply_steps"), "append": ("", "_append"),
    "output": ("", "_output"),
    "commit": ("blocks", "commit"), "start_decoding": ("", "_start_decoding"),
}


def tiny_engine(mode: str, concurrency: int, tokenizer, apply_interval: int = 1) -> LLMEngine:
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=2048, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    model = DecoderModel(config).eval()
    heads = MedusaHeads(HeadsConfig(hidden_size=32, vocab_size=2048, num_heads=4)).eval() if mode == "medusa" else None
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=4096, overlap=True, apply_interval=apply_interval,
                                                  scheduler=SchedulerConfig(max_num_seqs=concurrency,
                                                                            max_num_batched_tokens=4096)),
                       tokenizer, [])
    if heads is not None:  # a 4-node tree every step (no measured policy on a CPU)
        tree = next(t for t in engine.scheduler.trees if t.num_nodes >= 4)
        engine.scheduler.policy = lambda n: tree
    return engine


def timed_parts(engine: LLMEngine, totals: Counter) -> None:
    """Wrap each part's method on its owner (an instance attribute shadows the method)."""
    for label, (path, name) in PARTS.items():
        owner = engine
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr)
        method = getattr(owner, name)

        def wrapped(*args, _method=method, _label=label, **kwargs):
            start = time.perf_counter()
            out = _method(*args, **kwargs)
            totals[_label] += time.perf_counter() - start
            return out
        setattr(owner, name, wrapped)


def host_level(mode: str, concurrency: int, requests_per_slot: int, max_tokens: int, repeats: int, tokenizer,
               apply_interval: int = 1) -> dict:
    engine = tiny_engine(mode, concurrency, tokenizer, apply_interval)
    totals = Counter()
    timed_parts(engine, totals)
    prompts = [[1 + (i % 200), 2, 3, 4 + (i % 7)] * 30 for i in range(requests_per_slot * concurrency)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    run_level(engine, prompts[:concurrency], params, concurrency)  # warm up
    runs = []
    for _ in range(repeats):
        totals.clear()
        steps = run_level(engine, prompts, params, concurrency)["engine_steps"]
        part = {label: 1e3 * totals[label] / steps for label in PARTS}
        part["host_ms"] = part["step"] - part["forward"] - part["finish_to_host"] + part["prepare"]
        runs.append(part)
    best = {label: min(r[label] for r in runs) for label in runs[0]}
    return {"mode": mode, "concurrency": concurrency, "apply_interval": apply_interval, "ms_per_step": best,
            "host_ms_runs": [r["host_ms"] for r in runs]}


def detokenizer_us(tokenizer, tokens: int = 256, rounds: int = 50) -> dict:
    """Microseconds per streamed token (one token a step, no stop strings), by text source."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)[:tokens]
    detokenizer.prepare(tokenizer)  # the byte table, built once per tokenizer, is not a token's cost
    source, table, cleans = detokenizer._text_source, byte_level.byte_table, detokenizer._cleans_up_spaces
    result = {}
    for name in ("bytes", "stream", "window_rust", "window_transformers"):
        if name != "bytes":  # as for a tokenizer that is not byte-level
            byte_level.byte_table = lambda tok, skip_special=True: None
        if name.startswith("window"):
            detokenizer._text_source = detokenizer.WindowText
        if name == "window_transformers":  # as if transformers would clean up spaces: its Python decode
            detokenizer._cleans_up_spaces = lambda tok: True
        try:
            start = time.perf_counter()
            for _ in range(rounds):
                detok = detokenizer.IncrementalDetokenizer(tokenizer)
                for token in ids:
                    detok.add([token])
            result[name] = 1e6 * (time.perf_counter() - start) / (rounds * len(ids))
        finally:
            detokenizer._text_source, byte_level.byte_table, detokenizer._cleans_up_spaces = source, table, cleans
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--modes", nargs="+", default=["plain", "medusa"], choices=("plain", "medusa"))
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests-per-slot", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--apply-interval", type=int, nargs="+", default=[1],
                   help="EngineConfig.apply_interval values to time (each mode at each)")
    p.add_argument("--quick", action="store_true", help="8 requests of 16 tokens, 2 runs (CI)")
    args = p.parse_args()
    if args.quick:
        args.concurrency, args.requests_per_slot, args.max_tokens, args.repeats = 8, 2, 16, 2
    from transformers import AutoTokenizer

    from medusa.default_model import default_model_path

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    attention = paged_cache.reference_plan, paged_cache.attend_planned
    paged_cache.reference_plan = lambda *args: []  # stubs: host work only
    paged_cache.attend_planned = lambda q, *rest, **kw: q.clone()
    try:
        levels = [host_level(m, args.concurrency, args.requests_per_slot, args.max_tokens, args.repeats, tokenizer, k)
                  for m in args.modes for k in args.apply_interval]
    finally:
        paged_cache.reference_plan, paged_cache.attend_planned = attention
    result = {"device": "cpu", "levels": levels, "detokenizer_us_per_token": detokenizer_us(tokenizer)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    for level in levels:
        parts = {k: round(v, 3) for k, v in level["ms_per_step"].items()}
        print(f"{level['mode']:>6} C={level['concurrency']} apply every {level['apply_interval']}: {parts} ms per step "
              f"(min of {args.repeats})")
    print("detokenizer, us per token:", {k: round(v, 2) for k, v in result["detokenizer_us_per_token"].items()})


if __name__ == "__main__":
    main()
