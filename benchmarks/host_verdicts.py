"""What requests that need the host cost a decode step besides its forward: PyTorch ops (each a kernel launch
on a GPU) and host reads (`tolist`, `item`, `nonzero`: each waits for the device), for free requests and for
requests with a guide, logprobs or a penalty.

    python benchmarks/host_verdicts.py --out out/host-verdicts          # the default model, on a CPU

Counted by a TorchDispatchMode inside every synchronous decode step (`LLMEngine._decode`: inputs, host
verdicts, logprobs, read-back, tokens applied) of a batch of Spec-Bench first turns, one kind of request a
run, greedy; the step's two device halves (`DecodeStep.forward` and `finish`, two graph replays on a GPU,
the model's eager ops on a CPU) are not counted. The counts do not depend on the device. Writes
results.json: per kind, decode steps, ops and reads a step, rows the host decided a step.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from medusa.decoding import engine as engine_module
from medusa.decoding.engine import LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.training.data import DATA_DIR
from guided import INSTRUCTION, SCHEMA
from throughput import default_model, spread_order

READS = ("_local_scalar_dense", "nonzero", "is_nonzero")
KINDS = {"free": {}, "guided_json": {"guided_json": SCHEMA}, "logprobs": {"logprobs": 1},
         "presence_penalty": {"presence_penalty": 0.5}, "repetition_penalty": {"repetition_penalty": 1.2},
         "min_tokens": {"min_tokens": 40}, "logit_bias": {"logit_bias": {13: 2.0, 30: -5.0}}}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched, and those that read a value back to the host; `tolist` (which
    dispatches no op) is counted by `counting_tolist`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.reads, self.names, self.paused = 0, 0, Counter(), True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops += 1
            self.names[str(func)] += 1
            self.reads += any(name in str(func) for name in READS)
        return func(*args, **(kwargs or {}))


def _counting(counter: OpCounter, method, on: bool):
    """`method` run with the counter switched on (or off), then back as it was."""
    def run(*args, **kwargs):
        before, counter.paused = counter.paused, not on
        try:
            return method(*args, **kwargs)
        finally:
            counter.paused = before
    return run


def counted_run(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Every request added at once, then steps until all finish, the decode steps counted."""
    counter, tolist, tally = OpCounter(), torch.Tensor.tolist, Counter()

    def counting_tolist(tensor):
        counter.reads += not counter.paused
        return tolist(tensor)

    def decode(seqs, tree, *args, **kwargs):
        tally["steps"] += 1
        tally["host_rows"] += sum(engine._needs_host(engine.requests[seq.request_id]) for seq in seqs)
        return _counting(counter, original, True)(seqs, tree, *args, **kwargs)

    step, original = engine.runner.decode, engine._decode
    engine._decode = decode
    step.forward, step.finish = _counting(counter, step.forward, False), _counting(counter, step.finish, False)
    for prompt in prompts:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    torch.Tensor.tolist = counting_tolist
    try:
        with counter:
            while engine.has_unfinished():
                engine.step()
    finally:
        torch.Tensor.tolist = tolist
        del engine._decode, step.forward, step.finish
    steps = max(tally["steps"], 1)
    return {"decode_steps": tally["steps"], "seconds": time.perf_counter() - start,
            "ops_per_step": counter.ops / steps, "reads_per_step": counter.reads / steps,
            "host_rows_per_step": tally["host_rows"] / steps, "top_ops": dict(counter.names.most_common(12))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 requests of 6 tokens")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 2, 6
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    torch.manual_seed(0)
    model, _ = default_model(device, dtype, None)
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
    prompts = [model.encode([{"role": "user", "content": rows[i]["turns"][0] + INSTRUCTION}])
               for i in spread_order(len(rows))[: args.requests]]
    # every decode step synchronous (no overlap), so that `_decode` sees them all
    engine = LLMEngine(model.base, model.heads, replace(model.engine_config(), overlap=False), model.tokenizer,
                       sorted(model.eos_token_ids))
    engine.warmup()
    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "engine": engine_module.__file__,
              "requests": args.requests, "max_tokens": args.max_tokens, "kinds": {}}
    for kind in args.kinds:
        asked = dict(KINDS[kind])
        if "min_tokens" in asked:  # all but the last few tokens, at any length (--quick's too)
            asked["min_tokens"] = min(asked["min_tokens"], args.max_tokens - 1)
        run = counted_run(engine, prompts, SamplingParams(max_tokens=args.max_tokens, **asked))
        result["kinds"][kind] = run
        print(kind, json.dumps({k: v for k, v in run.items() if k != "top_ops"}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
