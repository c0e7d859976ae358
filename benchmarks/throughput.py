"""Engine throughput: Medusa vs plain decoding at 1, 8, 32 and 64 concurrent requests.

    python benchmarks/throughput.py --out out/throughput                       # GPU: default model + 1B/8B shapes
    python benchmarks/throughput.py --models default --out out/tp
    python benchmarks/throughput.py --models default --profile-steps --out out/tp   # + where each step's time goes
    python benchmarks/throughput.py --models default --concurrency 64 --host-profile --out out/tp   # + the host's work
    python benchmarks/throughput.py --quick --out out/tp-quick                 # CPU smoke run (CI)
    python benchmarks/throughput.py --models default --prompt-lookup 4 --out out/tp-pl4   # + a lookup chain
    python benchmarks/throughput.py --models default --temperature 0.7 --out out/tp-t07  # seeded sampled requests
    python benchmarks/throughput.py --models default --heads out/m2/heads --out out/tp-m2   # other heads (Medusa-2 too)
    python benchmarks/throughput.py --models default --prompt-order file --out out/tp-file  # sessions 1-30's prompts

For each model and concurrency C, a closed loop keeps C requests in flight on
one engine (greedy) until 8 x C requests, and at least 64, are served (a new one joins as soon as
one finishes, as C busy clients would send them); output tokens/s is all their
tokens over the wall time, prefill included. The last round drains the batch:
plain decoding's equal-length requests finish together, Medusa's at scattered
steps, so with 3 rounds (sessions 2-5) a third of Medusa's steps ran part-empty
(`mean_decode_batch` 51.5 against plain's 63.5 for the 8B shape at C = 64); 8
rounds measure the steady state a server sees. At one request the 8 requests of 8 x C were too few
prompts (Spec-Bench's answers differ widely in how well the heads predict them): 1.40-2.02x run to run,
against 1.84-1.95x with 64 (RESULTS.md, session 31). Each level runs --repeats times on the
same engine and the median run is reported; plain and Medusa runs alternate (both engines
stay loaded), and `speedup_runs` gives each Medusa run over the plain run just before it. The default model runs Spec-Bench first turns with
its shipped heads, taken spread over all 13 categories (`spread_order`; sessions 1-30 took them in file order,
`--prompt-order file`, so one request served MT-bench writing only). The Llama-3.2-1B and Llama-3.1-8B shapes have random weights
and random heads, which accept almost nothing: those rows measure what
speculation *costs* (the adaptive tree must keep it near 1.0x), not what it
gains. Writes results.json and, with matplotlib, throughput.png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from medusa.config import ModelConfig
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.medusa_model import CPU_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP, default_prompt_lookup
from medusa.decoding.scheduler import SchedulerConfig
from medusa.heads import HeadsConfig, MedusaHeads
from medusa.loading import empty_model
from medusa.training.data import DATA_DIR
from common import SHAPES, sync
from phases import PhaseTimer
from stall_log import StallLog
from step_trace import StepTrace
from host_profile import HostProfile
from gpu_trace import GpuTrace
from plotting import pyplot



def random_model(shape: str, device, dtype):
    hidden, inter, layers, heads, kv_heads, vocab = SHAPES[shape]
    torch.manual_seed(0)  # the same weights every run: random heads' acceptance depends on the draw
    config = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                         max_position_embeddings=8192)
    model = empty_model(config, dtype, device)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    medusa = MedusaHeads(HeadsConfig(num_heads=4, hidden_size=hidden, vocab_size=vocab)).to(device, dtype).eval()
    return model, medusa, None


def spread_order(n: int) -> list[int]:
    """0 .. n-1 in bit-reversed (van der Corput) order: every prefix of 2^k indices is evenly strided over
    the whole range, and other prefixes nearly so.

    Spec-Bench's file holds its 13 categories one after another (MT-bench's eight of 10 questions, then
    five of 80), so a level's first requests taken in file order all come from its first categories: at one
    request the 8 served were all MT-bench writing, which the heads predict worst. Spread, they sample the
    480 questions as evenly as the all-480 Spec-Bench run weighs them.
    """
    bits = max(1, (n - 1).bit_length())
    reversed_bits = (int(f"{i:0{bits}b}"[::-1], 2) for i in range(1 << bits))
    return [i for i in reversed_bits if i < n]


def default_model(device, dtype, heads: str | None, prompt_order: str = "spread"):
    from medusa.medusa_model import MedusaModel

    m = MedusaModel.from_pretrained(device=device, dtype=dtype, heads=heads)  # None: the shipped heads
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
    if prompt_order == "spread":
        rows = [rows[i] for i in spread_order(len(rows))]
    prompts = [m.encode([{"role": "user", "content": r["turns"][0]}]) for r in rows]
    return m, prompts


def run_level(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
              concurrency: int) -> dict:
    """Closed loop: `concurrency` requests stay in flight until every prompt is served (params: one for all,
    or one per prompt)."""
    sync()
    trees_before = engine.stats().steps_per_tree
    step = engine.runner.decode
    graphs_before, capture_before = step.num_graphs, step.capture_seconds
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    policy = engine.policy_for(sampled=any(p.temperature > 0 for p in params),
                               host=any(p.has_host_changes for p in params))
    queue, finished, in_flight, steps = list(zip(prompts, params)), [], 0, 0
    full_tokens, full_seconds = 0, None  # while every slot is busy: until the last request is admitted
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            engine.add_request(*queue.pop(0))
            in_flight += 1
        outputs = engine.step()
        if queue:  # requests still wait for a slot: every slot is busy
            full_tokens += sum(len(o.new_token_ids) for o in outputs)
            full_seconds = time.perf_counter() - start
        done = [o for o in outputs if o.finished]
        finished += done
        in_flight -= len(done)
        steps += 1
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in finished)
    verify_steps = sum(o.stats.steps for o in finished)
    emitted = sum(sum(o.stats.accepted_lengths) for o in finished)
    from_lookup = sum(o.stats.accepted_from_lookup for o in finished)
    trees = engine.stats().steps_per_tree
    decode_steps = sum(trees.values()) - sum(trees_before.values())
    return {"requests": len(finished), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            # tok/s while all `concurrency` requests were in flight (the closed loop's tail, where requests
            # drain at scattered steps, left out); None with a single wave
            "full_tok_s": full_tokens / full_seconds if full_seconds else None,
            "engine_steps": steps, "ms_per_step": 1e3 * seconds / steps,
            # decode graphs captured during the run (not by warmup), and the seconds that took: a level's first run
            # captures the mixed graphs of the trees its batch sizes settle on (session 35: 0.22-0.44 s of runs of
            # 1.2-2.9 s at 32-64 requests), so compare runs by ms a step without them too
            "graphs_captured": step.num_graphs - graphs_before, "capture_s": step.capture_seconds - capture_before,
            "ms_per_step_less_captures": 1e3 * (seconds - step.capture_seconds + capture_before) / steps,
            # sequences per decode step: below C where requests drain at the end or wait for prefill
            "mean_decode_batch": verify_steps / max(decode_steps, 1),
            "mean_accepted_length": emitted / max(verify_steps, 1),
            "accepted_from_lookup_per_step": from_lookup / max(verify_steps, 1),
            "decode_steps_per_tree": {t: n - trees_before.get(t, 0) for t, n in trees.items()
                                      if n > trees_before.get(t, 0)},
            # batch bucket -> the tree its timings chose; buckets still on trial, borrowing plain decoding
            # from a smaller one, or never run are absent
            # (the policy of the level's traffic: greedy, with sampled rows, or with guided rows:
            # `LLMEngine.policy_for`)
            "tree_decisions": {b: t.label for b, t in sorted(policy.decision.items())},
            "policy_at_level": policy_view(engine, policy, concurrency)}


def policy_view(engine: LLMEngine, policy, concurrency: int) -> dict:
    """What the tree policy believes at this level's batch size, per tree: graph-timed and charged ms per step
    (charged: the median wall time once tried), the steps it was wall-timed, its expected tokens per step."""
    bucket = engine.runner.decode.bucket(concurrency)
    view = {}
    for tree, graph in policy.step_cost.get(bucket, {}).items():
        wall = policy.wall.get(bucket, {}).get(tree)
        view[tree.label] = {
            "graph_ms": 1e3 * graph, "charged_ms": 1e3 * policy.cost(bucket, tree),
            "timed_steps": wall.steps if wall else 0, "expected_tokens": policy.expected_length(tree)}
    return view


def answer_lengths(count: int, mean: int, spread: float) -> list[int]:
    """max_tokens per request: all `mean`, or with spread F uniform in [mean (1 - F), mean (1 + F)] (seeded, so
    both modes serve the same requests). With equal lengths, plain decoding's requests of a round finish at one
    step and their replacements' prompts share prefill forwards, where speculation's finish at scattered steps
    and are prefilled one by one; serving traffic varies in length, so both modes would admit one by one."""
    if not spread:
        return [mean] * count
    g = torch.Generator().manual_seed(0)
    low, high = max(1, round(mean * (1 - spread))), round(mean * (1 + spread))
    return torch.randint(low, high + 1, (count,), generator=g).tolist()


def summarize_runs(runs: list[dict]) -> dict:
    """A level's runs on one engine (its tree policy keeps learning): the run with the median tok/s, and every
    run's tok/s, graphs captured and capture seconds, Triton kernels compiled and compile seconds, in run order. A level lasts about a second, and single
    runs of the same code differed by up to 0.15 in speedup (RESULTS.md, Run E)."""
    median = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    # in run order: a level's first run pays for its trials and for graphs captured at first use
    keys = ("tok_s", "graphs_captured", "capture_s", "triton_compiles", "compile_s")
    return {**median, **{f"{key}_runs": [r[key] for r in runs] for key in keys}}


def diagnose(row: dict, engine: LLMEngine, args, level: list[list[int]], params: list[SamplingParams]) -> None:
    """The level again once per diagnosis asked for (--profile-steps, --trace-steps, --host-profile,
    --gpu-trace), into `row`."""
    c, tag = row["concurrency"], f"{row['model']}_{row['mode']}_c{row['concurrency']}"
    if args.profile_steps:  # the same level again, every phase timed
        with PhaseTimer(engine) as timer:
            run_level(engine, level, params, c)
        row["phases"] = timer.report()
    if args.trace_steps:  # and again with every engine step recorded
        with StepTrace(engine) as trace:
            run_level(engine, level, params, c)
        row["trace"] = trace.summary()
        (Path(args.out) / f"trace_{tag}.json").write_text(json.dumps(trace.steps))
    if args.host_profile:  # and again under cProfile: the host's work per step, by function
        with HostProfile() as profile:
            run_level(engine, level, params, c)
        row["host_profile"] = profile.summary()
        profile.write(Path(args.out) / f"host_profile_{tag}.txt")
    if args.gpu_trace:  # and again under torch.profiler: GPU busy and idle time per step, the top kernels
        with GpuTrace() as trace:  # two requests per slot: a trace of ~500 steps stays a few MB
            run = run_level(engine, level[:2 * c], params[:2 * c], c)
        row["gpu_trace"] = trace.summary(run["engine_steps"])
        trace.write(Path(args.out) / f"gpu_trace_{tag}.json.gz")


def asked(args) -> dict:
    """What every request asks for beside its length: sampling, logprobs, penalties."""
    return dict(temperature=args.temperature, logprobs=args.logprobs, presence_penalty=args.presence_penalty,
                repetition_penalty=args.repetition_penalty)


def bench_model(name: str, args, device, dtype) -> list[dict]:
    if name == "default":
        m, prompts = default_model(device, dtype, args.heads, args.prompt_order)
        base, heads, tokenizer, eos = m.base, m.heads, m.tokenizer, sorted(m.eos_token_ids)
        config = m.engine_config()
        params = SamplingParams(max_tokens=args.max_tokens, output_kind=args.output_kind, **asked(args))
    else:
        base, heads, tokenizer = random_model(name, device, dtype)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, base.config.vocab_size, (int(n),), generator=g).tolist()
                   for n in torch.randint(64, 256, (max(args.requests_per_slot * max(args.concurrency),
                                                        args.min_requests),), generator=g)]
        eos, config = [], EngineConfig()
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, output_kind=args.output_kind,
                                **asked(args))
    scheduler = SchedulerConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=4096)
    # the phase timer synchronises around every phase, so a profiled engine runs without overlap
    overlap = False if args.profile_steps or args.no_overlap else None
    config = EngineConfig(num_blocks=max(1, args.num_blocks * 16 // args.block_size), block_size=args.block_size,
                          trees=config.trees, scheduler=scheduler,
                          prompt_lookup=args.prompt_lookup, overlap=overlap,
                          mixed_prompt_tokens=args.mixed_prompt_tokens, apply_interval=args.apply_interval)
    engines = {}  # mode -> (engine, its warmup figures); both stay alive so that their runs can alternate
    for mode, medusa in (("plain", None), ("medusa", heads)):
        engine = LLMEngine(base, medusa, config, tokenizer, eos)
        start = time.perf_counter()
        policy = engine.warmup(sampling=args.temperature > 0)
        warmup = {"warmup_s": time.perf_counter() - start, "decode_graphs": engine.runner.decode.num_graphs}
        print(json.dumps({"model": name, "mode": mode, "tree_policy": policy, **warmup}), flush=True)
        run_level(engine, prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), 1)
        engines[mode] = (engine, warmup)
    rows = []
    for c in args.concurrency:
        served = max(args.requests_per_slot * c, args.min_requests)
        level = [prompts[i % len(prompts)] for i in range(served)]  # Spec-Bench has 480
        lengths = answer_lengths(len(level), args.max_tokens, args.length_spread)
        # sampled requests are seeded one by one: both modes draw the same uniforms for the same request
        level_params = [replace(params, max_tokens=n, seed=i if args.temperature > 0 else None)
                        for i, n in enumerate(lengths)]
        # plain and Medusa runs alternate: the machine's speed drifts (up to 35% between runs of one level in
        # one lease, RESULTS.md Run O), and a drift then lands on both modes' runs alike
        runs = {mode: [] for mode in engines}
        for _ in range(args.repeats):
            for mode, (engine, _) in engines.items():
                with StallLog() as log:  # a kernel compiled mid-run stalls it (session 21: 0.3 s each)
                    run = run_level(engine, level, level_params, c)
                compiles = [e["ms"] for e in log.take() if e["kind"] == "triton_compile"]
                runs[mode].append({**run, "triton_compiles": len(compiles), "compile_s": sum(compiles) / 1e3})
        for mode, (engine, warmup) in engines.items():
            row = {"model": name, "mode": mode, "concurrency": c, **warmup, **summarize_runs(runs[mode])}
            diagnose(row, engine, args, level, level_params)
            print(json.dumps(row), flush=True)
            rows.append(row)
    del engines, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    plain = {r["concurrency"]: r for r in rows if r["mode"] == "plain"}
    for r in rows:
        base = plain[r["concurrency"]]
        r["speedup"] = r["tok_s"] / base["tok_s"]
        # each run over the plain run just before it: the pairs share the machine's speed of the moment
        r["speedup_runs"] = [m / p for m, p in zip(r["tok_s_runs"], base["tok_s_runs"])]
        r["full_speedup"] = r["full_tok_s"] / base["full_tok_s"] if r["full_tok_s"] and base["full_tok_s"] else None
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for mode in ("plain", "medusa"):
            sel = [r for r in rows if r["model"] == model and r["mode"] == mode]
            ax.plot([r["concurrency"] for r in sel], [r["tok_s"] for r in sel], marker="o", label=mode)
        ax.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title=model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="default,llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of 16 tokens (fewer, larger ones under "
                   "--block-size: the pool keeps num_blocks x 16 slots)")
    p.add_argument("--block-size", type=int, default=16, choices=(16, 32, 64, 128),
                   help="tokens per KV block (EngineConfig.block_size); 64+ takes TMA loads on Hopper")
    p.add_argument("--requests-per-slot", type=int, default=8, help="requests served per concurrent slot")
    p.add_argument("--min-requests", type=int, default=None,
                   help="requests each level serves at least, so that low concurrencies sample enough prompts "
                        "(default 64; 0 under --quick)")
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="answer lengths uniform in max_tokens x [1 - F, 1 + F] (default 0: all max_tokens)")
    p.add_argument("--repeats", type=int, default=3, help="runs per level; the median one is reported")
    p.add_argument("--profile-steps", action="store_true",
                   help="run each level a second time with every step phase timed (benchmarks/phases.py)")
    p.add_argument("--trace-steps", action="store_true",
                   help="run each level once more recording every engine step (trace_*.json, a summary in the row)")
    p.add_argument("--host-profile", action="store_true",
                   help="run each level once more under cProfile (host_profile_*.txt, the top functions in the row)")
    p.add_argument("--gpu-trace", action="store_true",
                   help="run each level once more under torch.profiler: GPU busy/idle ms per step, top kernels")
    p.add_argument("--no-overlap", action="store_true",
                   help="EngineConfig.overlap=False: no plain step is launched before the last one is read back")
    p.add_argument("--mixed-prompt-tokens", type=int, default=EngineConfig.mixed_prompt_tokens,
                   help="prompt tokens a decode step's forward may carry (0: every prompt chunk in a forward of its own)")
    p.add_argument("--apply-interval", type=int, default=EngineConfig.apply_interval,
                   help="EngineConfig.apply_interval: apply the rows' tokens (stops, text, outputs) every this many "
                        "overlapped steps")
    p.add_argument("--output-kind", default="delta", choices=("delta", "final"),
                   help="SamplingParams.output_kind: text every step (streaming, the default) or once at the end")
    p.add_argument("--heads", default=None, help="heads folder for the default model (default: the shipped heads)")
    p.add_argument("--prompt-order", default="spread", choices=("spread", "file"),
                   help="the default model's Spec-Bench first turns spread over the whole file, so that a level's "
                        "requests sample every category (`spread_order`), or in file order (sessions 1-30)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature, each request seeded (default 0: greedy); warmup then "
                        "captures sampled steps too")
    p.add_argument("--logprobs", type=int, default=None,
                   help="every request asks for its tokens' logprobs and this many alternatives (default: none)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="every request's presence_penalty")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="every request's repetition_penalty")
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 levels, 8 tokens (CPU, CI)")
    p.add_argument("--prompt-lookup", type=int, default=None,
                   help="prompt-lookup nodes added to every Medusa tree (EngineConfig.prompt_lookup); 0: the "
                        f"heads alone (default: the library's, {DEFAULT_PROMPT_LOOKUP} on a GPU and "
                        f"{CPU_PROMPT_LOOKUP} on a CPU)")
    args = p.parse_args()
    if not 0 <= args.length_spread < 1:
        p.error(f"--length-spread must be in [0, 1), got {args.length_spread}")
    if not args.temperature >= 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.mixed_prompt_tokens < 0:
        p.error(f"--mixed-prompt-tokens must be >= 0, got {args.mixed_prompt_tokens}")
    if args.apply_interval < 1:
        p.error(f"--apply-interval must be >= 1, got {args.apply_interval}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.models, args.concurrency, args.max_tokens, args.num_blocks = "tiny", [1, 4], 8, 128
        args.requests_per_slot = 3
    if args.min_requests is None:
        args.min_requests = 0 if args.quick else 64
    if args.min_requests < 0:
        p.error(f"--min-requests must be >= 0, got {args.min_requests}")
    if args.prompt_lookup is None:
        args.prompt_lookup = default_prompt_lookup(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for name in args.models.split(",") for r in bench_model(name, args, device, dtype)]
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    (out / "results.json").write_text(json.dumps({"device": device_name, "dtype": str(dtype),
                                                   "max_tokens": args.max_tokens, "length_spread": args.length_spread,
                                                   "prompt_lookup": args.prompt_lookup, "temperature": args.temperature,
                                                   "logprobs": args.logprobs,
                                                   "presence_penalty": args.presence_penalty,
                                                   "repetition_penalty": args.repetition_penalty,
                                                   "repeats": args.repeats, "heads": args.heads, "output_kind": args.output_kind,
                                                   "overlap": not (args.no_overlap or args.profile_steps),
                                                   "mixed_prompt_tokens": args.mixed_prompt_tokens,
                                                   "apply_interval": args.apply_interval,
                                                   "block_size": args.block_size, "prompt_order": args.prompt_order,
                                                   "rows": rows}, indent=2))
    plot(rows, out / "throughput.png")
    for r in rows:
        pairs = "-".join(f"{x:.2f}" for x in (min(r["speedup_runs"]), max(r["speedup_runs"])))
        print(f"{r['model']:>14} {r['mode']:>6} C={r['concurrency']:<3} {r['tok_s']:9.1f} tok/s "
              f"{r['speedup']:.2f}x (pairs {pairs})  {r['ms_per_step']:.2f} ms/step  "
              f"accepted {r['mean_accepted_length']:.2f}"
              + (f"  all slots busy {r['full_speedup']:.2f}x" if r["full_speedup"] else "")
              + (f"  [{r['graphs_captured']} graphs captured in the run, {r['capture_s']:.2f} s: "
                 f"{r['ms_per_step_less_captures']:.2f} ms/step without]" if r["graphs_captured"] else ""))


if __name__ == "__main__":
    main()
