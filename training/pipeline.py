"""The whole `medusa-train` job: data -> self-distillation -> training -> eval -> tree -> saved heads."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from medusa.heads import MedusaHeads
from medusa.loading import load_base_model
from medusa.model import DecoderModel
from medusa.training.config import TrainConfig
from medusa.training.data import Sequences, batches
from medusa.training.distill import self_distill
from medusa.training.distill_cache import model_fingerprint
from medusa.training.evaluate import EvalResult, evaluate_heads
from medusa.training.prompt_mix import PromptPool, gather_prompts, source_specs
from medusa.training.trainer import Trainer, latest_checkpoint, no_checkpoint_message
from medusa.tree import TreeSpec


def load_base(model: str | None, dtype: torch.dtype | None = None, device: torch.device | None = None):
    """(base model, tokenizer, model id, system prompt, EOS ids) for a path or the default model."""
    from transformers import AutoTokenizer

    from medusa import default_model

    system_prompt = None
    if model is None:
        path, system_prompt = default_model.default_model_path(), default_model.DEFAULT_SYSTEM_PROMPT
        model_id = default_model.DEFAULT_MODEL_NAME
    else:
        path, model_id = Path(model), str(model)
    base = load_base_model(path, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eos = set(base.config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    return base, tokenizer, model_id, system_prompt, sorted(eos)


def distill_model_key(model_id: str, model: str | None) -> str:
    """The model as the distillation cache's manifest names it: its name with a fingerprint of its files
    (retrained weights saved to the same path reused the old answers); the default model's is its GGUF file's,
    which `$MEDUSA_DEFAULT_GGUF` may swap for another."""
    from medusa.default_model import find_default_gguf

    return f"{model_id}@{model_fingerprint(find_default_gguf() if model is None else model)}"


def gather_conversations(config: TrainConfig) -> PromptPool:
    """The file prompts of config.data (self-written prompts come later: they need the model)."""
    return gather_prompts(config.data, config.seed)


def run_training(config: TrainConfig, resume: bool = False, tree_name: str | None = None,
                 overwrite: bool = False) -> dict:
    """One process, or several under `accelerate launch` / `torchrun`: the main process distils
    (the others then read its cache), every process trains on its share of the batches, and the
    main process evaluates and saves. Returns the summary (the other processes get {})."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    output = Path(config.output_dir)
    if resume and overwrite:
        raise ValueError("--resume continues the run in output_dir and --overwrite starts it again: give one")
    if resume:  # checked before minutes of self-distillation, not after
        checkpoint = latest_checkpoint(output)
        if checkpoint is None:
            raise FileNotFoundError(no_checkpoint_message(output))
        check_resumable(config, checkpoint)
    elif not overwrite:
        check_no_earlier_run(output)
    source_specs(config.data)  # missing prompt files: before the model loads and anything is written
    if state.is_main_process:
        if overwrite:  # an earlier run's checkpoints would be what a later --resume of this one finds
            shutil.rmtree(output / "checkpoints", ignore_errors=True)
        output.mkdir(parents=True, exist_ok=True)
        (output / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2))
    timings, start = {}, time.perf_counter()
    base, tokenizer, model_id, system_prompt, eos = load_base(config.model, device=state.device)
    timings["load_s"] = time.perf_counter() - start
    start = time.perf_counter()  # distill_s: the data alone (it was 4 s with nothing generated: the model's load)
    cache = Path(config.data.cache_dir) if config.data.cache_dir else output / "distill"
    with state.main_process_first():  # the others find the main process's data in the cache
        pool = gather_conversations(config)
        train, heldout = self_distill(base, tokenizer, pool, distill_model_key(model_id, config.model), config.data,
                                      cache, config.seed, system_prompt, eos)
    timings["distill_s"] = time.perf_counter() - start
    check_splits(train, heldout, config)
    trainer = Trainer(config, base, train, base_name=model_id)
    trainer.train(resume=resume)
    timings["train_s"] = time.perf_counter() - start - timings["distill_s"]
    if not state.is_main_process:
        state.wait_for_everyone()
        return {}
    heads = trainer.unwrapped_heads().float().eval()
    eval_base = _merged_student(trainer) if config.medusa2.enabled else base
    summary = finish_heads(eval_base, heads, heldout, config, output / "heads", tree_name)
    if config.medusa2.enabled:
        save_adapter(trainer.base, output / "heads")
    summary.update(timings, distill_sequences=len(train), distill_tokens=train.num_tokens,
                   heldout_sequences=len(heldout), steps=trainer.state.step, processes=state.num_processes,
                   history=trainer.state.history)
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    state.wait_for_everyone()
    return summary


def check_no_earlier_run(output: Path) -> None:
    """A fresh run must not write over an earlier run's heads or checkpoints unasked (it did, silently)."""
    earlier = [p for p in (output / "heads", output / "checkpoints") if p.is_dir() and any(p.iterdir())]
    if earlier:
        raise ValueError(f"output_dir {output} holds an earlier run ({', '.join(p.name for p in earlier)}): "
                              "--resume to continue it, --overwrite to start it again, or another output_dir")


def check_splits(train: Sequences, heldout: Sequences, config: TrainConfig) -> None:
    """Both splits must hold sequences: no training data trains nothing, and without held-out data the
    accuracies are zeros and the searched tree a guess (runs on a dozen prompts ended so, with rc 0)."""
    for name, split in (("train", train), ("held-out", heldout)):
        if len(split) == 0:
            raise ValueError(f"the {name} split is empty ({len(train)} train / {len(heldout)} held-out sequences "
                             f"from the prompts, data.holdout_fraction={config.data.holdout_fraction}): give more "
                             "prompts, or change data.holdout_fraction")


# Settings a checkpoint's weights and data position depend on: a resume must keep them (train.epochs, max_steps,
# save_every and the like may change; the schedule then follows the new step count)
_RESUME_FIXED = ("model", "seed", "heads", "data", "medusa2", "train.max_tokens_per_batch", "train.grad_accum")


def check_resumable(config: TrainConfig, checkpoint: Path) -> None:
    """Raise naming every setting that differs from the checkpoint's run where the checkpoint could not continue
    under it (other heads' shapes, other data: it failed deep in loading, or after re-distilling)."""
    saved_file = checkpoint / "train_config.json"
    if not saved_file.is_file():
        return  # a checkpoint from before configs were saved with it
    # both through JSON, so tuples and lists compare alike
    saved, now = _flat(json.loads(saved_file.read_text())), _flat(json.loads(json.dumps(config.to_dict())))
    changed = [key for key in sorted(saved.keys() | now.keys())
               if key.startswith(_RESUME_FIXED) and key != "data.cache_dir" and saved.get(key) != now.get(key)]
    if changed:
        shown = "; ".join(f"{key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in changed)
        raise ValueError(f"--resume from {checkpoint}: these settings differ from that run's ({shown}); "
                         "use its settings, or train without --resume into another output_dir")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and key != "columns":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def finish_heads(base: DecoderModel, heads: MedusaHeads, heldout: Sequences, config: TrainConfig,
                 out_dir: Path, tree_name: str | None = None) -> dict:
    """Measure accuracies, search the tree for them, measure its accepted length, save everything."""
    ev = config.eval
    subset = _first(heldout, ev.max_sequences)
    accuracy = evaluate_heads(base, heads, batches(subset, config.train.max_tokens_per_batch, 0, 0), max_rank=ev.max_rank)
    tree = TreeSpec.search(accuracy.accuracies, ev.tree_nodes, name=tree_name or f"searched-{ev.tree_nodes}")
    measured = evaluate_heads(base, heads, batches(subset, config.train.max_tokens_per_batch, 0, 0), tree=tree,
                              max_rank=max(ev.max_rank, max(tree.topk_per_depth, default=1)))
    heads.config = dataclasses.replace(heads.config, tree=[list(p) for p in tree.paths],
                                       accuracies=accuracy.accuracies)
    heads.save_pretrained(out_dir)
    tree.save(out_dir / "tree.json")
    return _summary(accuracy, measured, tree)


def _summary(accuracy: EvalResult, measured: EvalResult, tree: TreeSpec) -> dict:
    return {
        "top1": accuracy.topk_accuracy(1), "top5": accuracy.topk_accuracy(5),
        "tree_nodes": tree.num_nodes, "tree_depth": tree.max_depth,
        "expected_accepted_length": tree.expected_accept_length(accuracy.accuracies),
        "heldout_mean_accepted_length": measured.mean_accepted_length,
        "heldout_steps": len(measured.accepted_lengths), "heldout_targets": accuracy.num_targets,
    }


def _first(seqs: Sequences, n: int) -> Sequences:
    return seqs.select(range(min(n, len(seqs))))


def _merged_student(trainer: Trainer) -> DecoderModel:
    """The LoRA-adapted base, merged, as inference will run it."""
    import copy

    return copy.deepcopy(trainer.base).merge_and_unload().eval()


def save_adapter(peft_model, out_dir: Path) -> None:
    """LoRA weights under our own module names + their config, for `medusa.adapter.merge_lora`."""
    from safetensors.torch import save_file

    cfg = peft_model.peft_config["default"]
    state = {}
    for name, tensor in peft_model.state_dict().items():
        if "lora_" in name:
            clean = name.removeprefix("base_model.model.").replace(".default", "")
            state[clean] = tensor.detach().float().cpu().contiguous()
    save_file(state, str(out_dir / "adapter.safetensors"))
    meta = {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "target_modules": sorted(cfg.target_modules)}
    (out_dir / "adapter_config.json").write_text(json.dumps(meta, indent=2))
