"""`medusa-train`: train Medusa heads (`train`) and measure them (`eval`).

    medusa-train train --config medusa1-smollm2 train.epochs=2 output_dir=out/run1
    medusa-train train --config medusa1-smollm2 --resume
    medusa-train eval --heads out/run1/heads                   # the heads' own tree, on the run's held-out data
    medusa-train eval --heads out/run1/heads --tree tree-32    # or a tree from configs/trees/, or a JSON file
    accelerate launch -m medusa.training.cli train --config medusa1-smollm2        # several GPUs
    torchrun --standalone --nproc_per_node 2 -m medusa.training.cli train ...     # the same
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from medusa import __version__
from medusa.paths import new_tree_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medusa-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="self-distil, train heads, search their tree")
    train.add_argument("--config", default=None, help="recipe name in configs/train/ or a YAML path")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="start afresh in an output_dir that holds an earlier run (its heads and checkpoints "
                       "are replaced); without it such a run is refused")
    train.add_argument("--tree-name", default=None,
                       help="also save the searched tree as a named tree (configs/trees/<name>.json in a source "
                       "checkout, ~/.config/medusa/trees/ for an installed package, or $MEDUSA_TREES_DIR)")
    train.add_argument("overrides", nargs="*", help="section.key=value (e.g. train.lr=5e-4)")
    train.set_defaults(run=_train)
    ev = commands.add_parser("eval", help="head accuracy and accepted length on held-out data")
    ev.add_argument("--heads", required=True)
    ev.add_argument("--model", default=None, help="base model (default: the default model)")
    ev.add_argument("--tree", default=None, help="named tree or JSON (default: the heads' own tree)")
    ev.add_argument("--config", default=None, help="recipe whose data settings define the held-out split "
                    "(default: the run's train_config.json next to the heads folder)")
    ev.add_argument("overrides", nargs="*")
    ev.set_defaults(run=_eval)
    args = parser.parse_args(argv)
    show_progress_logs()
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"medusa-train {args.command}: error: {err}", file=sys.stderr)
        return 2


def show_progress_logs() -> None:
    """Our modules' INFO lines (what is distilled, what the cache reuses) on stderr; other libraries' stay quiet."""
    logger = logging.getLogger("medusa")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("medusa-train: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _train(args) -> int:
    from medusa.training.config import load_config
    from medusa.training.pipeline import run_training
    from medusa.training.trainer import TrainingDivergedError

    config = load_config(args.config, args.overrides)
    # a taken name fails now, not after training
    tree_file = new_tree_file(args.tree_name) if args.tree_name is not None else None
    try:
        summary = run_training(config, resume=args.resume, tree_name=args.tree_name, overwrite=args.overwrite)
    except TrainingDivergedError as err:
        print(f"medusa-train train: stopped: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # a line that says what is kept, not a traceback
        print(interrupted_message(Path(config.output_dir)), file=sys.stderr)
        return 130
    if not summary:  # not the main process of a multi-process run: the main one reports
        return 0
    if tree_file is not None:
        _write_named_tree(Path(config.output_dir) / "heads" / "tree.json", tree_file)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
    return 0


def interrupted_message(output: Path) -> str:
    from medusa.training.trainer import latest_checkpoint

    checkpoint = latest_checkpoint(output)
    kept = (f"the last checkpoint is {checkpoint}: the same command with --resume continues from it"
            if checkpoint else "no checkpoint was saved yet (train.save_every sets how often)")
    return (f"\nmedusa-train train: interrupted; {kept}. Self-distilled data is cached once a split is complete, so "
            "a rerun does not generate it again.")


def _write_named_tree(searched: Path, target: Path) -> None:
    """Copy the run's searched tree to its named file, never over an existing one (a run of the same name
    may have finished meanwhile); the tree stays with the heads either way."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(target, "x") as out:
            out.write(searched.read_text())
    except FileExistsError:
        print(f"medusa-train train: {target} appeared during the run; the tree is left only in {searched}",
              file=sys.stderr)
        return
    print(f"medusa-train train: tree {target.stem!r} written to {target}", file=sys.stderr)


def _eval(args) -> int:
    from medusa.training.data import batches
    from medusa.training.distill import self_distill
    from medusa.training.evaluate import evaluate_heads
    from medusa.training.pipeline import _first, distill_model_key, gather_conversations, load_base
    from medusa.training.prompt_mix import source_specs
    from medusa.tree import TreeSpec

    config = eval_config(args)
    source_specs(config.data)  # the held-out split is distilled from them: a missing file fails before loading
    tree = TreeSpec.load(args.tree) if args.tree else None  # so does an unknown tree
    base, tokenizer, model_id, system_prompt, eos = load_base(args.model or config.model)
    heads = heads_on_their_base(base, args.heads)
    tree = tree or TreeSpec.from_paths(heads.config.tree or [], name="heads")
    try:
        tree.check_heads(heads.config.num_heads, heads.config.vocab_size)
    except ValueError as err:
        which = f"--tree {args.tree}" if args.tree else f"the tree saved with {args.heads}"
        raise ValueError(f"{which}: {err}; pick a tree at most {heads.config.num_heads} deep") from None
    pool = gather_conversations(config)
    cache = Path(config.data.cache_dir) if config.data.cache_dir else Path(config.output_dir) / "distill"
    key = distill_model_key(model_id, args.model or config.model)
    _, heldout = self_distill(base, tokenizer, pool, key, config.data, cache, config.seed, system_prompt, eos,
                              train=False, heldout_limit=config.eval.max_sequences)  # all eval reads
    if len(heldout) == 0:
        raise ValueError(f"the held-out split is empty (data.holdout_fraction={config.data.holdout_fraction} of "
                         f"{len(pool.conversations)} prompts): nothing to measure")
    subset = _first(heldout, config.eval.max_sequences)
    rank = max(config.eval.max_rank, max(tree.topk_per_depth, default=1))
    result = evaluate_heads(base, heads, batches(subset, config.train.max_tokens_per_batch, 0, 0), tree, rank)
    print(json.dumps({"top1": result.topk_accuracy(1), "top5": result.topk_accuracy(5), "tree_nodes": tree.num_nodes,
                      "mean_accepted_length": result.mean_accepted_length,
                      "steps": len(result.accepted_lengths)}, indent=2))
    return 0


def heads_on_their_base(base, folder: str):
    """The heads of `folder`, float32 on the base's device; Medusa-2 heads first merge their LoRA adapter into
    `base`, which they were trained with (measured on the plain base they fall short, as they would not in use)."""
    from medusa.adapter import heads_for_base

    heads, merged = heads_for_base(base, folder)
    if merged:
        print(f"medusa-train eval: merged the Medusa-2 LoRA adapter of {folder} into the base", file=sys.stderr)
    return heads.float().to(base.lm_head.weight.device)


def eval_config(args):
    """The settings that define eval's held-out data: --config, else the run's own saved config (heads are saved
    to <output_dir>/heads, the config to <output_dir>/train_config.json), else the defaults, said loudly: they
    mean self-distilling the default prompts first, hours on a CPU, unless their cache exists."""
    from medusa.training.config import SAVED_CONFIG, load_config, load_saved_config

    saved = Path(args.heads).parent / SAVED_CONFIG
    if args.config is not None:
        config, source = load_config(args.config, args.overrides), f"recipe {args.config}"
    elif saved.is_file():
        config, source = load_saved_config(saved, args.overrides), f"the run's {saved}"
    else:
        config, source = load_config(None, args.overrides), "the defaults"
        print(f"medusa-train eval: no --config and no {saved} (a `medusa-train train` run writes it next to "
              "heads/), so the data settings are the defaults: unless their cache exists, this first self-distils "
              f"the first {config.eval.max_sequences} held-out prompts of the default sources (GSM8K train + "
              "Self-Instruct) with the base model, up to an hour on a CPU (eval.max_sequences=N answers fewer). "
              "To use a run's cached data, pass --config <its recipe> output_dir=<its output_dir> "
              "(or data.cache_dir=<its cache>).", file=sys.stderr)
    cache = Path(config.data.cache_dir) if config.data.cache_dir else Path(config.output_dir) / "distill"
    print(f"medusa-train eval: data settings from {source}; held-out data from {cache / 'heldout'} or an earlier "
          "version kept beside it; if not cached with these settings, the first eval.max_sequences="
          f"{config.eval.max_sequences} held-out prompts are self-distilled into "
          f"{cache / f'heldout-first-{config.eval.max_sequences}'}", file=sys.stderr)
    return config


if __name__ == "__main__":
    sys.exit(main())
