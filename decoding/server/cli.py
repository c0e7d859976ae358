"""`medusa serve`: load a model and serve it over the OpenAI API with uvicorn.

fastapi / uvicorn are imported only when serving, so `medusa generate` works
without the `serve` extra installed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from medusa.paths import TEMPLATES_DIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    from medusa.decoding.kv_budget import CPU_BLOCKS
    from medusa.decoding.server.tool_parsers import TOOL_PARSERS

    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--heads", default=None, help="heads folder/file; 'none' for plain decoding only")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MEDUSA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MEDUSA_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together in one step")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 503")
    p.add_argument("--prompt-lookup", type=int, default=None,
                   help="prompt-lookup nodes (n-gram copies of earlier text) in every Medusa tree; 0: off "
                        "(default: 8 on a GPU, 4 on a CPU)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="paged KV cache size per engine, in blocks of --block-size tokens (default: from "
                        f"--gpu-memory-utilization on a GPU, {CPU_BLOCKS} on a CPU)")
    p.add_argument("--block-size", type=int, default=16, choices=(16, 32, 64, 128),
                   help="tokens per KV block; 64 or more loads K/V by TMA on Hopper GPUs (faster attention at "
                        "long contexts) but shares cached prefixes only in whole blocks (default: 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                   help="share of the GPU memory left free by the weights that the KV caches may take; "
                        "split between the plain and the Medusa engine")
    p.add_argument("--apply-interval", type=int, default=1,
                   help="apply the rows' tokens (stops, text, outputs) every this many decode steps, each stream's at "
                        "once: less host work per step at many requests, outputs this many steps apart (default: 1)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template instead of the model's own: a shipped one by name (chatml-tools: "
                        "shows the request's tools to the model), a file, or the template's text")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (the default with tools): the model decides, and "
                        "--tool-call-parser finds its calls in the text")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>, as Hermes, "
                        "Qwen 2.5 / 3 and SmolLM3 write them) or llama3_json (an answer of JSON calls, as Llama "
                        "3.1-3.3 write them)")
    p.add_argument("--device", default=None)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from medusa.decoding.server.app import build_app
    except ImportError as err:  # before the model loads
        print(f"medusa serve: error: the server needs the 'serve' extra ({err.name} is missing): "
              "pip install -e '.[serve]' in a checkout, or pip install 'medusa-decoding[serve]'", file=sys.stderr)
        return 2
    from medusa.decoding.engine import EngineConfig
    from medusa.decoding.kv_budget import auto_num_blocks
    from medusa.decoding.scheduler import SchedulerConfig
    from medusa.chat import chat_prompt_ids
    from medusa.decoding.token_guide import VocabTrie
    from medusa.default_model import DEFAULT_MODEL_NAME
    from medusa.medusa_model import MedusaModel

    if args.max_num_seqs < 1 or args.max_waiting < 1 or args.apply_interval < 1 or (
            args.num_kv_blocks is not None and args.num_kv_blocks < 1):
        raise ValueError("--max-num-seqs, --max-waiting, --apply-interval and --num-kv-blocks must be >= 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: give both or neither")
    template = _chat_template(args.chat_template)
    configure_logging(args.log_level)
    start = time.perf_counter()
    heads = None if args.heads in (None, "none") else args.heads
    model = MedusaModel.from_pretrained(args.model, heads=heads, device=args.device, prompt_lookup=args.prompt_lookup)
    if args.heads == "none":
        model.heads = None
    if template is not None:
        model.tokenizer.chat_template = template
        try:  # a template that cannot render a one-line conversation fails now, not in every request
            chat_prompt_ids(model.tokenizer, [{"role": "user", "content": "Hi"}], model.system_prompt)
        except Exception as err:
            raise ValueError(f"--chat-template does not render a conversation: {err}") from None
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(2048, args.max_num_seqs))
    num_blocks = args.num_kv_blocks or auto_num_blocks(
        model, args.gpu_memory_utilization / (2 if model.heads is not None else 1),  # plain + Medusa engines
        args.max_num_seqs, args.block_size)
    VocabTrie.of(model.tokenizer)  # guided decoding's vocabulary trie (~1 s): now, not inside a request's step
    app = build_app(model, name, api_key=args.api_key, max_waiting=args.max_waiting,
                    engine_config=EngineConfig(num_blocks=num_blocks, block_size=args.block_size, scheduler=scheduler,
                                               prompt_lookup=model.prompt_lookup, apply_interval=args.apply_interval),
                    tool_parser=args.tool_call_parser)
    print(f"[medusa serve: '{name}' loaded in {time.perf_counter() - start:.1f}s on "
          f"{model.base.embed_tokens.weight.device}; heads: {'yes' if model.heads is not None else 'none'}; "
          f"prompt lookup: {model.prompt_lookup} nodes; "
          f"KV cache: {num_blocks} blocks of {args.block_size} tokens per engine]",
          file=sys.stderr)
    server = _make_server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=10))
    # uvicorn re-raises the signal it stopped on once it is done; exit 0 then (a clean shutdown),
    # not by the default SIGTERM action. Installed only now, so a SIGTERM while loading still kills.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    server.run()
    return 0


def configure_logging(level: str) -> None:
    """Show the medusa loggers' lines on stderr at --log-level: nothing else configures them, so the server's start
    line (the tree each batch size uses) and its request errors would be lost. Left alone where the user's own
    logging is set up already (a handler on the root or the medusa logger)."""
    root, medusa = logging.getLogger(), logging.getLogger("medusa")
    if root.handlers or medusa.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))  # beside uvicorn's lines
    medusa.addHandler(handler)
    medusa.setLevel(level.upper())


def _chat_template(given: str | None) -> str | None:
    """--chat-template's text: a file's, a shipped template's (a name in configs/chat_templates), or the argument
    itself where it is a template (it has "{{" or "{%")."""
    if given is None:
        return None
    for path in (Path(given), TEMPLATES_DIR / f"{given}.jinja"):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    if "{{" in given or "{%" in given:
        return given
    shipped = ", ".join(sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")))
    raise ValueError(f"--chat-template {given!r} is not a file, a shipped template ({shipped}) or a Jinja template")


def _make_server(config):
    """A uvicorn.Server that, on SIGTERM / SIGINT, also ends the requests in flight at once
    (streams get an error event), so shutdown does not wait for long generations."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            state = config.app.state.server
            if state.loop is not None:
                state.loop.call_soon_threadsafe(state.begin_shutdown)

    return Server(config)


def _exit_cleanly(sig, frame) -> None:
    raise SystemExit(0)
