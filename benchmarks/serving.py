"""Serving load test: N concurrent streaming clients against `medusa serve`, speculation off and on.

    python benchmarks/serving.py --out out/serving                        # GPU, full size
    python benchmarks/serving.py --quick --out out/serving-quick          # CPU smoke run (CI)

Starts the server itself (127.0.0.1, a free port; stopped with SIGTERM at the
end), or hits a running one with --url. At each concurrency C (default 1, 8,
32, 64) it sends num_prompts Spec-Bench first turns (default max(4C, 32);
each level takes the next prompts of the file, so levels never share a prefix
cache) with exactly C requests in flight, once with `speculative: false`
(plain decoding) and once with `speculative: true` (Medusa), on the same
server. Streaming chat completions, greedy, SmolLM2's system prompt.
Per request: TTFT (first content token) and TPOT = (latency - TTFT) /
(output tokens - 1), output tokens from the usage chunk. Writes results.json
(config, environment, one row per mode and concurrency: req/s, output tok/s,
TTFT and TPOT p50/p99, mean latency, the server's speculation counters) and,
with matplotlib, serving.png (output tok/s and TPOT p50 against concurrency).
The server's log goes to server.log. On a GPU the server sizes its KV cache
from free memory (`--gpu-memory-utilization`); --num-kv-blocks overrides that.
It needs the `serve` extra (fastapi, uvicorn: wheels in .device-cache/whl for
an offline GPU host) and httpx here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from medusa.default_model import DEFAULT_SYSTEM_PROMPT
from medusa.training.data import DATA_DIR
from plotting import pyplot

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = DATA_DIR / "spec_bench.jsonl"
MODES = (("plain", False), ("medusa", True))
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def load_prompts(path: Path) -> list[str]:
    """First turns, categories interleaved (1st of each category, then 2nd, ...) so any prefix is a mix."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rank: dict[str, int] = defaultdict(int)
    keyed = []
    for i, row in enumerate(rows):
        keyed.append((rank[row["category"]], i, row["turns"][0]))
        rank[row["category"]] += 1
    return [prompt for _, _, prompt in sorted(keyed)]


# ---- the server ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "medusa.cli", "serve", "--port", str(port), "--log-level", "warning"]
    for flag in ("model", "heads", "device", "max_num_seqs", "num_kv_blocks"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    with log_path.open("w") as log:  # the child keeps its own handle
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server was not healthy after {args.start_timeout}s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (the server aborts what runs and exits 0); kill only if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def spec_counters(url: str, headers: dict) -> dict[str, float]:
    """The speculation counters from /metrics (empty if the server exposes none)."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        m = re.match(r"medusa:(\w+?)(?:_total)? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in SPEC_COUNTERS:
            out[m.group(1)] = float(m.group(2))
    return out


# ---- the clients --------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    """Stream one chat completion; returns latency, TTFT, output tokens (or an error)."""
    start = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": str(event["error"])}
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    chunks += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - start
    latency = time.perf_counter() - start
    tokens = usage["completion_tokens"] if usage else chunks  # a chunk can hold several tokens
    tpot = (latency - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"latency": latency, "ttft": ttft, "tpot": tpot, "tokens": tokens}


def request_body(args, prompt: str, speculative: bool, max_tokens: int) -> dict:
    body = {"messages": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "speculative": speculative, "ignore_eos": args.ignore_eos}
    if args.model_name:
        body["model"] = args.model_name
    return body


async def run_level(args, prompts: list[str], speculative: bool, concurrency: int, bar) -> tuple[list[dict], float]:
    """All prompts with `concurrency` requests in flight at once; returns per-request records and wall time."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=args.headers, timeout=args.request_timeout,
                                 limits=limits) as client:

        async def guarded(prompt: str) -> dict:
            async with gate:
                try:
                    record = await one_request(client, request_body(args, prompt, speculative, args.max_tokens))
                except httpx.HTTPError as err:
                    record = {"error": f"{type(err).__name__}: {err}"}
            bar.update(1)
            return record

        start = time.perf_counter()
        records = await asyncio.gather(*(guarded(p) for p in prompts))
        return list(records), time.perf_counter() - start


def summarise(records: list[dict], seconds: float) -> dict:
    ok = [r for r in records if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)

    def pct(key: str, q: float) -> float | None:
        values = [r[key] for r in ok if r.get(key) is not None]
        return float(np.percentile(values, q)) if values else None

    return {"requests": len(records), "failed": len(records) - len(ok), "seconds": seconds,
            "request_throughput": len(ok) / seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "ttft_p50": pct("ttft", 50), "ttft_p99": pct("ttft", 99), "tpot_p50": pct("tpot", 50),
            "tpot_p99": pct("tpot", 99), "mean_latency": float(np.mean([r["latency"] for r in ok])) if ok else None,
            "errors": sorted({r["error"] for r in records if "error" in r})[:3]}


def speculation_delta(before: dict, after: dict) -> dict:
    if not before or not after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    steps = d["spec_decode_num_drafts"]
    return {"drafts": d["spec_decode_num_drafts"], "draft_tokens": d["spec_decode_num_draft_tokens"],
            "accepted_tokens": d["spec_decode_num_accepted_tokens"],
            "mean_accepted_length": 1 + d["spec_decode_num_accepted_tokens"] / steps if steps else None}


def run_all(args, prompts: list[str]) -> list[dict]:
    levels, offset = [], 0
    for c in args.concurrency:
        n = args.num_prompts or (2 * c if args.quick else max(4 * c, 32))
        levels.append((c, [prompts[(offset + i) % len(prompts)] for i in range(n)]))
        offset += n
    for _, speculative in MODES:  # warm-up: builds both engines, compiles what compiles lazily
        asyncio.run(run_level(args, prompts[-1:], speculative, 1, tqdm(disable=True)))
    rows = []
    with tqdm(total=2 * sum(len(p) for _, p in levels), desc="serving", dynamic_ncols=True) as bar:
        for c, level_prompts in levels:
            for mode, speculative in MODES:
                bar.set_postfix_str(f"{mode} c={c}")
                before = spec_counters(args.url, args.headers)
                records, seconds = asyncio.run(run_level(args, level_prompts, speculative, c, bar))
                rows.append({"mode": mode, "speculative": speculative, "concurrency": c,
                             **summarise(records, seconds), **speculation_delta(before, spec_counters(
                                 args.url, args.headers))})
    for row in rows:
        plain = next(r for r in rows if r["mode"] == "plain" and r["concurrency"] == row["concurrency"])
        row["speedup_vs_plain"] = row["output_tok_s"] / plain["output_tok_s"] if plain["output_tok_s"] else None
    return rows


# ---- reporting ----------------------------------------------------------------


def environment(log_path: Path | None) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    def run(cmd: list[str]) -> str | None:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    env = {"python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
           "host": platform.node(), "cpu_count": os.cpu_count(), "git_commit": run(["git", "rev-parse", "HEAD"]),
           "git_dirty": bool(run(["git", "status", "--porcelain"])),
           "gpu": run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])}
    loaded = re.search(r"\[medusa serve: '(.*)' loaded in .* on (\S+); heads: (\w+); prompt lookup: (\d+) nodes; "
                       r"KV cache: (\d+) blocks", log_path.read_text()) if log_path and log_path.exists() else None
    if loaded:
        env.update(served_model=loaded.group(1), server_device=loaded.group(2), heads=loaded.group(3),
                   prompt_lookup=int(loaded.group(4)), kv_blocks=int(loaded.group(5)))
    return env


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, _ in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        xs = [r["concurrency"] for r in mine]
        ax1.plot(xs, [r["output_tok_s"] for r in mine], marker="o", label=mode)
        ax2.plot(xs, [(r["tpot_p50"] or float("nan")) * 1e3 for r in mine], marker="o", label=mode)
    for ax, label in ((ax1, "output tokens/s"), (ax2, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("medusa serve: streaming chat completions, Spec-Bench first turns, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict]) -> str:
    def ms(x):
        return f"{x * 1e3:.1f}" if x is not None else "-"

    lines = ["| mode | conc. | requests (failed) | req/s | output tok/s | vs plain | TTFT p50 / p99 ms "
             "| TPOT p50 / p99 ms | mean latency s | accepted length |", "|" + " --- |" * 10]
    for r in rows:
        acc = r.get("mean_accepted_length")
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['requests']} ({r['failed']}) "
                     f"| {r['request_throughput']:.2f} | {r['output_tok_s']:.1f} | {r['speedup_vs_plain'] or 0:.2f}x "
                     f"| {ms(r['ttft_p50'])} / {ms(r['ttft_p99'])} | {ms(r['tpot_p50'])} / {ms(r['tpot_p99'])} "
                     f"| {r['mean_latency'] or 0:.2f} | {f'{acc:.2f}' if acc else '-'} |")
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json, serving.png and server.log")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("MEDUSA_API_KEY"))
    p.add_argument("--model", default=None, help="passed to `medusa serve` (default: the default model)")
    p.add_argument("--heads", default=None, help="passed to `medusa serve`")
    p.add_argument("--device", default=None, help="passed to `medusa serve`")
    p.add_argument("--max-num-seqs", type=int, default=None, help="passed to `medusa serve`")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="passed to `medusa serve`")
    p.add_argument("--data", default=str(SPEC_BENCH))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--num-prompts", type=int, default=None, help="per level (default: max(4 x concurrency, 32))")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="every request generates exactly --max-tokens")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 2, 2 and 4 prompts, 8 tokens (CI)")
    args = p.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.ignore_eos = [1, 2], 8, True
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return args


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(Path(args.data))
    log_path, proc = None, None
    if args.url is None:
        log_path = out / "server.log"
        proc, args.url = start_server(args, log_path)
    try:
        models = httpx.get(args.url + "/v1/models", headers=args.headers, timeout=10).json()
        args.model_name = models["data"][0]["id"]
        rows = run_all(args, prompts)
    finally:
        exit_code = stop_server(proc) if proc is not None else None
    config = {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")}
    results = {"config": config, "environment": {**environment(log_path), "server_exit_code": exit_code},
               "rows": rows}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(rows, out / "serving.png")
    print(table(rows))


if __name__ == "__main__":
    main()
