"""The `medusa` command: `medusa generate` and `medusa serve` (the OpenAI-compatible server)."""

from __future__ import annotations

import argparse
import sys
import time

from medusa import __version__

DTYPES = ("auto", "bfloat16", "float16", "float32")  # torch is imported only by the commands that run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medusa", description="Medusa speculative decoding")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate text for one prompt"))
    _add_serve(commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API"))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"medusa {args.command}: error: {err}", file=sys.stderr)
        return 2


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="Write a short poem about the sea, then explain its imagery.",
                   help="the user message (chat template applied unless --raw; default: a demo prompt, a poem "
                        "about the sea)")
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--heads", default=None, help="heads folder/file (default: the default model's shipped heads); "
                   "'none' for plain decoding")
    p.add_argument("--tree", default=None, help="named tree, JSON file, or 'auto' (measured on this device)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default: 256")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="default: 1.0 (off)")
    p.add_argument("--top-k", type=int, default=0, help="default: 0 (off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")
    p.add_argument("--device", default=None, help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights' dtype (auto: bfloat16 on a GPU, float32 on a CPU); float32 makes greedy Medusa "
                        "output identical to plain decoding, where bfloat16 may differ at near-ties")
    p.add_argument("--prompt-lookup", type=int, default=None,
                   help="prompt-lookup nodes (n-gram copies of earlier text) added to the tree; 0: the heads "
                        "alone (default: the library's, 8 on a GPU, 4 on a CPU)")
    p.add_argument("--compare", action="store_true",
                   help="also decode without speculation and report the measured speedup")
    p.set_defaults(run=_generate)


def _add_serve(p: argparse.ArgumentParser) -> None:
    from medusa.decoding.server.cli import add_arguments, serve

    add_arguments(p)
    p.set_defaults(run=serve)


def adapter_note(folder) -> str:
    """Medusa-2 heads change the base model's weights (their LoRA is merged in): the load line says so."""
    if folder is None:
        return ""
    return f"; base model with the Medusa-2 LoRA adapter of {folder} merged in"


def _generate(args: argparse.Namespace) -> int:
    from medusa.medusa_model import MedusaModel, _named_tree, generate_params

    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed, stop=args.stop)
    generate_params(**options)  # a bad option fails now, not after the model loads
    args.tree = _named_tree(args.tree)  # so does an unknown tree name or a missing tree file
    if args.compare and args.heads == "none":
        raise ValueError("--compare measures Medusa against plain decoding; with --heads none both are plain")
    heads = None if args.heads in (None, "none") else args.heads
    start = time.perf_counter()
    lookup = {} if args.prompt_lookup is None else {"prompt_lookup": args.prompt_lookup}
    model = MedusaModel.from_pretrained(args.model, heads=heads, device=args.device, dtype=args.dtype, **lookup)
    if args.heads == "none":
        model.heads = None
    inputs = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    tree = model.resolve_tree(args.tree)
    print(f"[loaded in {time.perf_counter() - start:.1f}s on {model.base.embed_tokens.weight.device}; "
          f"tree: {tree.name or 'custom'} ({tree.num_nodes} nodes"
          f"{f' + {model.prompt_lookup} prompt-lookup' if tree.num_nodes > 1 and model.prompt_lookup else ''})"
          f"{adapter_note(model.merged_adapter)}]", file=sys.stderr)
    if model.base.embed_tokens.weight.is_cuda:  # graph captures and kernel compiles stay out of the timing
        if model._on_engine(tree, "auto"):  # one request: batch bucket 1 is all the engine will run
            sampled = args.temperature > 0  # sampled steps have graphs of their own
            model.engine(True).warmup(max_batch=1, sampling=sampled)
            if args.compare:
                model.engine(False).warmup(max_batch=1, sampling=sampled)
        warm = {**options, "max_new_tokens": 2}
        model.generate(inputs, tree=tree, **warm)
        if args.compare:
            model.generate(inputs, speculative=False, **warm)
    stream = model.generate(inputs, stream=True, tree=tree, **options)
    for delta in stream:
        print(delta, end="", flush=True)
    print()
    result = stream.result
    print(f"\n[{len(result.token_ids)} tokens in {result.steps} steps: mean accepted length "
          f"{result.mean_accepted_length:.2f}, {result.tokens_per_second:.1f} tokens/s]")
    if args.compare:
        _compare(model, inputs, options, result, tree.num_nodes)
    return 0


def _compare(model, inputs, options, medusa_result, tree_nodes: int) -> None:
    """Plain decoding of the same prompt in the same process, for an honest ratio."""
    plain = model.generate(inputs, speculative=False, **options)
    speedup = medusa_result.tokens_per_second / max(plain.tokens_per_second, 1e-9)
    verdict = "faster" if speedup >= 1 else "slower"
    print(f"[plain decoding: {plain.tokens_per_second:.1f} tokens/s -> Medusa is {speedup:.2f}x ({verdict}) "
          f"on {model.base.embed_tokens.weight.device.type}]")
    if tree_nodes == 1:  # the tree measured at load (or the one given) is the root alone
        print("[the tree for this device is plain decoding (at load its trees' measured step costs said "
              "speculation would not pay, as on a busy CPU), so both runs decoded plainly and the ratio is timing "
              "noise; --tree tree-8 pins a speculative tree]")
    if options["temperature"] == 0:
        dtype = str(model.base.embed_tokens.weight.dtype).removeprefix("torch.")
        print(greedy_verdict(plain.token_ids, medusa_result.token_ids, dtype))
    if speedup < 1 and model.base.embed_tokens.weight.device.type == "cpu":
        print("[on a CPU, verifying a tree of 4-16 tokens costs about 1-2 single-token steps, so Medusa "
              "gains only where the heads accept well (and the CPU is not busy); on a GPU the tree is nearly free]")


def greedy_verdict(plain: list[int], medusa: list[int], dtype: str) -> str:
    """Whether greedy Medusa gave plain decoding's tokens; if not, where they part and, in 16-bit
    weights, why: a tree's forward sums in another order than a single token's, so a near-tie
    between two tokens can go the other way (float32 leaves no such ties in practice)."""
    if plain == medusa:
        return "[greedy outputs identical: yes]"
    first = next((i for i, (a, b) in enumerate(zip(plain, medusa)) if a != b), min(len(plain), len(medusa)))
    line = f"[greedy outputs identical: NO, they part at token {first + 1} of {len(plain)}"
    if dtype in ("bfloat16", "float16"):
        line += (f"; in {dtype} the tree's forward rounds differently from plain "
                 "decoding's, so a near-tie can flip: --dtype float32 gives identical outputs")
    return line + "]"


if __name__ == "__main__":
    sys.exit(main())
