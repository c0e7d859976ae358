"""The training loop: Medusa-1 (frozen base, heads only) and Medusa-2 (LoRA base + heads).

Runs under `accelerate` (one process here, `accelerate launch -m
medusa.training.cli ...` for many GPUs: each process takes every n-th batch).
Checkpoints hold heads, adapter, optimizer, scheduler, RNG and the data
position, so a resumed run continues exactly where it stopped. A non-finite
loss stops the run before the optimizer touches the weights, so the last
checkpoint stays the last good state.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from medusa.attention import CausalAttention
from medusa.heads import HeadsConfig, MedusaHeads
from medusa.model import DecoderModel
from medusa.training.config import TrainConfig
from medusa.training.data import Sequences, batch_plan, batches
from medusa.training.losses import chain_tokens, kl_distillation, medusa_loss, next_tokens


class TrainingDivergedError(RuntimeError):
    pass


@dataclass
class TrainState:
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this epoch already consumed (all processes)
    step: int = 0  # optimizer steps
    history: list[dict] = field(default_factory=list)  # logged metrics


def cosine_factor(step: int, warmup: int, total: int) -> float:
    """The learning rate's factor after `step` optimizer steps: linear warm-up, then a cosine to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup: int, total: int, calls_per_step: int = 1):
    """The schedule as a LambdaLR stepped `calls_per_step` times per optimizer step: accelerate's prepared
    scheduler steps once per process for each optimizer step (it assumes one process's count of steps)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda calls: cosine_factor(calls // calls_per_step, warmup, total))


class Trainer:
    def __init__(self, config: TrainConfig, base: DecoderModel, data: Sequences, base_name: str | None = None) -> None:
        self.config, self.data = config, data
        t = config.train
        precision = t.mixed_precision
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_available() else "no"
        # cpu=True on a machine without CUDA lets `torchrun`/`accelerate launch` run several CPU processes (gloo)
        self.accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=t.grad_accum,
                                       cpu=not torch.cuda.is_available())
        set_seed(config.seed)
        base = base.to(self.accelerator.device)
        self.heads = MedusaHeads(HeadsConfig(
            hidden_size=base.config.hidden_size, vocab_size=base.config.vocab_size,
            num_heads=config.heads.num_heads, num_layers=config.heads.num_layers,
            lm_head=config.heads.lm_head, lora_rank=config.heads.lora_rank, base_model=base_name,
            condition_on_root=config.heads.condition_on_root, condition_on_chain=config.heads.condition_on_chain))
        if config.heads.init_from:
            self._init_heads_from(config.heads.init_from, base)
        elif config.heads.lm_head == "full":
            self.heads.init_full_lm_heads(base.lm_head.weight.float())
        self.base = _with_adapter(base, config) if config.medusa2.enabled else base.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self._param_groups(), weight_decay=t.weight_decay)
        self.total_steps = self._count_steps()
        # total_steps counts this process's optimizer steps; the prepared scheduler is called num_processes times
        # for each (two processes ran the cosine out at half the run before)
        self.scheduler = cosine_with_warmup(self.optimizer, int(t.warmup_ratio * self.total_steps), self.total_steps,
                                            calls_per_step=self.accelerator.num_processes)
        self.heads, self.optimizer, self.scheduler = self.accelerator.prepare(self.heads, self.optimizer, self.scheduler)
        if config.medusa2.enabled:
            self.accelerator.register_for_checkpointing(_AdapterState(self.base))
        self.state = TrainState()
        self.output = Path(config.output_dir)

    def _init_heads_from(self, path: str, base: DecoderModel) -> None:
        """Copy trained heads' weights in; their shape settings must be this run's. Heads may start
        heads that read more (the root, the chain: those projections then start at zero), not fewer.
        `shipped`: the heads shipped for the default model (the Medusa-2 recipe's start)."""
        if path == "shipped":
            from medusa.default_model import default_heads_path

            if self.config.model is not None or default_heads_path() is None:
                raise ValueError("heads.init_from=shipped: the shipped heads are for the default model, and need "
                                 f"model: null and an install that has them (model is {self.config.model!r})")
            path = str(default_heads_path())
        trained = MedusaHeads.from_pretrained(path, lm_head_weight=base.lm_head.weight)
        mine, theirs = self.heads.config, trained.config
        for key in ("num_heads", "num_layers", "lm_head", "lora_rank"):
            if getattr(mine, key) != getattr(theirs, key) and (key != "lora_rank" or mine.lm_head == "lora"):
                raise ValueError(f"heads.init_from={path}: its {key} is {getattr(theirs, key)!r}, but this run's "
                                 f"heads.{key} is {getattr(mine, key)!r}; set heads.{key} to match")
        for key in ("condition_on_root", "condition_on_chain"):
            if getattr(theirs, key) and not getattr(mine, key):
                raise ValueError(f"heads.init_from={path}: those heads have {key}; set heads.{key}=true")
        missing, _ = self.heads.load_state_dict(trained.float().state_dict(), strict=False)
        assert set(missing) <= {"root_proj", "chain_proj"}, missing

    def _param_groups(self) -> list[dict]:
        groups = [{"params": list(self.heads.parameters()), "lr": self.config.train.lr}]
        if self.config.medusa2.enabled:
            lora = [p for p in self.base.parameters() if p.requires_grad]
            groups.append({"params": lora, "lr": self.config.medusa2.base_lr})
        return groups

    def _count_steps(self) -> int:
        t = self.config.train
        total = 0
        for epoch in range(t.epochs):  # batch counts differ a little between epochs
            per_epoch = self._batches_per_epoch(epoch) // self.accelerator.num_processes
            total += math.ceil(per_epoch / t.grad_accum)
        return min(total, t.max_steps) if t.max_steps else total

    def _batches_per_epoch(self, epoch: int) -> int:
        """Batches this epoch uses: a multiple of the process count, so every process runs as many
        backward passes (an extra one on one process would wait forever for the others' gradients)."""
        planned = len(batch_plan(self.data, self.config.train.max_tokens_per_batch, self.config.seed, epoch))
        return planned - planned % self.accelerator.num_processes

    # ---- the loop -----------------------------------------------------------

    def train(self, resume: bool = False) -> TrainState:
        if resume:
            self._resume()
        t, acc = self.config.train, self.accelerator
        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not acc.is_local_main_process,
                   desc="medusa-train", dynamic_ncols=True)
        for epoch in range(self.state.epoch, t.epochs):
            skip = self.state.batch_in_epoch if epoch == self.state.epoch else 0
            self.state.epoch, self.state.batch_in_epoch = epoch, skip
            used = self._batches_per_epoch(epoch)  # the last few batches of an epoch may be left out
            for index, batch in enumerate(batches(self.data, t.max_tokens_per_batch, self.config.seed, epoch, skip=skip)):
                if skip + index >= used:
                    break
                self.state.batch_in_epoch = skip + index + 1
                if (skip + index) % acc.num_processes != acc.process_index:
                    continue
                metrics = self._train_batch(batch)
                if metrics is None:
                    continue  # still accumulating gradients
                self._after_step(metrics, bar)
                if t.max_steps and self.state.step >= t.max_steps:
                    return self._finish(bar)
            self.state.batch_in_epoch = 0
            self.state.epoch = epoch + 1
        return self._finish(bar)

    def _train_batch(self, batch) -> dict | None:
        acc = self.accelerator
        ids, mask = batch.input_ids.to(acc.device), batch.loss_mask.to(acc.device)
        with acc.accumulate(self.heads):
            with acc.autocast():
                loss, metrics = self._loss(ids, mask)
            if not self._finite_everywhere(loss):
                raise TrainingDivergedError(
                    f"loss became {loss.item()} at step {self.state.step + 1} (epoch {self.state.epoch}); "
                    f"stopped before updating weights. Last good checkpoint: {latest_checkpoint(self.output)}. "
                    "Try a lower train.lr or train.max_grad_norm.")
            acc.backward(loss)
            if acc.sync_gradients:
                self._average_adapter_grads()
                acc.clip_grad_norm_(self._trainable(), self.config.train.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        return metrics if acc.sync_gradients else None

    def _finite_everywhere(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every process: all stop together, or none (no process left waiting)."""
        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=loss.device)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        return bad.item() == 0

    def _average_adapter_grads(self) -> None:
        """Medusa-2: average the LoRA gradients over processes. Only the heads are wrapped for
        data parallelism, so without this each process's adapter would drift its own way."""
        if not self.config.medusa2.enabled or self.accelerator.num_processes == 1:
            return
        grads = [p.grad for p in self.base.parameters() if p.requires_grad and p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for the whole adapter
        torch.distributed.all_reduce(flat)
        flat /= self.accelerator.num_processes
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _loss(self, ids: torch.Tensor, mask: torch.Tensor):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        m2 = self.config.medusa2
        soft = self.config.train.soft_targets
        if m2.enabled:
            hidden = self.base(ids, positions, CausalAttention())
            with torch.no_grad(), self.base.disable_adapter():
                teacher = self.base(ids, positions, CausalAttention())
            lm_head = self.base.get_base_model().lm_head
            teacher_logits = lm_head(teacher)  # [B, T, V] the frozen base: KL target and soft head target
            kl = kl_distillation(lm_head(hidden), teacher_logits, mask)
        else:
            with torch.no_grad():
                hidden = self.base(ids, positions, CausalAttention())
            lm_head = self.base.lm_head
            teacher_logits = None
            if soft:
                with torch.no_grad():
                    teacher_logits = lm_head(hidden)  # [B, T, V]
        chain = chain_tokens(ids, self.config.heads.num_heads) if self.config.heads.condition_on_chain else None
        head_logits = self.heads(hidden, lm_head.weight, roots=next_tokens(ids), chain=chain)  # [K, B, T, V]
        heads = medusa_loss(head_logits, ids, mask, self.config.train.decay, base_logits=teacher_logits,
                            soft_weight=soft)
        metrics = {"heads_loss": heads.loss.item(), **{f"top1_{k}": v for k, v in enumerate(heads.per_head_top1.tolist())}}
        if not m2.enabled:
            return heads.loss, metrics
        weight = m2.heads_weight * min(1.0, (self.state.step + 1) / max(m2.heads_weight_warmup_steps, 1))
        metrics["kl"] = kl.item()
        return kl + weight * heads.loss, metrics

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _after_step(self, metrics: dict, bar) -> None:
        self.state.step += 1
        t = self.config.train
        if self.state.step % t.log_every == 0 or self.state.step == 1:
            metrics = {"step": self.state.step, "lr": self.scheduler.get_last_lr()[0], **metrics}
            self.state.history.append(metrics)
            bar.set_postfix(progress_postfix(metrics))
        bar.update(1)
        if t.save_every and self.state.step % t.save_every == 0:
            self.save_checkpoint()

    def _finish(self, bar) -> TrainState:
        bar.close()
        self.save_checkpoint()
        return self.state

    # ---- checkpoints -------------------------------------------------------

    def save_checkpoint(self) -> Path:
        path = self.output / "checkpoints" / f"step-{self.state.step:07d}"
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(path))
        if self.accelerator.is_main_process:
            state = {"epoch": self.state.epoch, "batch_in_epoch": self.state.batch_in_epoch, "step": self.state.step}
            (path / "trainer_state.json").write_text(json.dumps(state))
            (path / "train_config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
            self._prune_checkpoints()
        return path

    def _prune_checkpoints(self) -> None:
        """train.save_total_limit: drop all but the newest checkpoints (each holds the optimizer's state too)."""
        keep = self.config.train.save_total_limit
        if keep is None:
            return
        found = sorted((self.output / "checkpoints").glob("step-*"))
        for path in found[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def _resume(self) -> None:
        path = latest_checkpoint(self.output)
        if path is None:
            raise FileNotFoundError(no_checkpoint_message(self.output))
        self.accelerator.load_state(str(path))
        saved = json.loads((path / "trainer_state.json").read_text())
        self.state = TrainState(epoch=saved["epoch"], batch_in_epoch=saved["batch_in_epoch"], step=saved["step"])

    def unwrapped_heads(self) -> MedusaHeads:
        return self.accelerator.unwrap_model(self.heads)


def progress_postfix(metrics: dict) -> dict:
    """The progress bar's numbers: losses to 3 decimals, but lr in scientific notation, since rates such as
    2e-4 (or the cosine tail, or Medusa-2's base_lr) would round to 0."""
    shown = {}
    for key, value in metrics.items():
        if key == "step":
            continue
        if isinstance(value, float):
            value = f"{value:.1e}" if key == "lr" else round(value, 3)
        shown[key] = value
    return shown


class _AdapterState:
    """Lets accelerate save and restore the LoRA weights (only those) in a checkpoint."""

    def __init__(self, model) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return {k: v for k, v in self.model.state_dict().items() if "lora_" in k}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state, strict=False)


def _with_adapter(base: DecoderModel, config: TrainConfig):
    from peft import LoraConfig, get_peft_model

    m2 = config.medusa2
    base.requires_grad_(False)
    lora = LoraConfig(r=m2.lora_r, lora_alpha=m2.lora_alpha, target_modules=list(m2.target_modules), lora_dropout=0.0)
    return get_peft_model(base, lora)


def latest_checkpoint(output: Path) -> Path | None:
    """The newest complete checkpoint under output/checkpoints (one whose trainer_state.json was written)."""
    found = sorted((Path(output) / "checkpoints").glob("step-*"))
    found = [p for p in found if (p / "trainer_state.json").is_file()]
    return found[-1] if found else None


def no_checkpoint_message(output: Path) -> str:
    return (f"--resume: no checkpoint under {Path(output) / 'checkpoints'} (check output_dir, or train "
            "without --resume to start afresh)")
