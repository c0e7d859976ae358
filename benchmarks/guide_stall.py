"""How long a guided request's first arrival stalls the other streams of a server (host work, any device).

    python benchmarks/guide_stall.py --out out/guide-stall [--device cuda]

Serves the default model (uvicorn in a thread, as `medusa serve` runs it), streams one long free answer, and
while it runs sends one request under a large guide (the JSON grammar of benchmarks/guide_build.py, whose token
guide is built on its first use). Records the stream's chunk times: the largest gap between two chunks while the
guided request was being prepared, against the largest gap before it. Repeats with a fresh grammar each round
(one more alternative of the root rule, "#i": a new pattern, so no cache helps). Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from guide_build import JSON_GBNF
from medusa.decoding.engine import EngineConfig
from medusa.decoding.server import build_app
from medusa.decoding.token_guide import VocabTrie
from medusa.medusa_model import MedusaModel

LONG = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
ASK = [{"role": "user", "content": "Describe a cat as JSON."}]


def serve(app) -> tuple[str, uvicorn.Server]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def stream_times(url: str, times: list[float], max_tokens: int) -> None:
    body = {"messages": LONG, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())


def one_round(url: str, grammar: str, max_tokens: int) -> dict:
    times: list[float] = []
    reader = threading.Thread(target=stream_times, args=(url, times, max_tokens))
    reader.start()
    while len(times) < 20:  # the stream is going
        time.sleep(0.01)
    sent = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        resp = client.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 40, "temperature": 0,
                                                               "guided_grammar": grammar})
    done = time.perf_counter()
    assert resp.status_code == 200, resp.text
    reader.join()
    gaps = lambda lo, hi: [b - a for a, b in zip(times, times[1:]) if lo <= b <= hi]  # noqa: E731
    before, during = gaps(times[0], sent), gaps(sent, done)
    return {"guided_request_s": done - sent, "max_gap_before_s": max(before), "max_gap_during_s": max(during),
            "median_gap_before_s": sorted(before)[len(before) // 2], "chunks_during": len(during)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    model = MedusaModel.from_pretrained(device=args.device)
    VocabTrie.of(model.tokenizer)  # as `medusa serve` does at start
    url, server = serve(build_app(model, "m", engine_config=EngineConfig(num_blocks=512)))
    rounds = []
    for i in range(args.rounds):
        grammar = JSON_GBNF.replace("root ::= object", f'root ::= object | "#{i}"')  # its guide is built anew
        rounds.append(one_round(url, grammar, args.max_tokens))
        print(json.dumps(rounds[-1]), flush=True)
    server.should_exit = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"device": str(model.base.embed_tokens.weight.device),
                                                  "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
