"""Medusa heads: K small residual stacks on the base model's last hidden state.

Head k predicts the token k+2 positions ahead (the base lm_head predicts k+1).
Each head is `num_layers` ResBlocks followed by a vocab projection, which is
one of:

- "shared": the base model's frozen lm_head (parameter-efficient; all heads'
  hidden states go through ONE matmul against it),
- "lora": the shared lm_head plus a per-head low-rank update `B @ A`
  (B zero-initialised, so training starts from "shared"),
- "full": a per-head [vocab, hidden] matrix, as in the original Medusa-1.

With `condition_on_root`, every head also reads the root: the token the base
emits at the same position (its argmax, or its draw when sampling), which is
known before the heads run, both in training (the next token of the sequence)
and at decoding time (the next tree's root). Its embedding (the row of the
lm_head matrix, RMS-normalised) enters each head through a per-head [H, H]
projection added to the hidden state; the projection starts at zero, so a fresh
head is a plain Medusa head. Head k at position t still predicts token t+k+2,
but no longer has to guess token t+1 on the way: the feature-plus-token input
that EAGLE and Hydra showed to lift draft accuracy, for the cost of one small
batched matmul.

With `condition_on_chain` as well (Hydra's sequentially dependent heads), head k
also reads the tokens of heads 0..k-1's greedy chain: in training the sequence's
tokens t+2..t+k+1 (teacher forcing), when proposing each earlier head's top-1
token, so the heads run one after another. Every tree node of depth k+1 still
draws from head k's one top-k list (the tree stays a Medusa tree); the list is
the one that fits the top-1 path, the path that is accepted most often. On the
default model (H200, session 7) chaining added 0.09 to the held-out accepted
length but nothing on Spec-Bench with lookup, at a dearer step: it is off by default.

Checkpoints: `save_pretrained` writes `config.json` + `heads.safetensors`;
`from_pretrained` also reads the FasterDecoding/Medusa, text-generation-inference
and Medusa-2 full-model layouts (see `medusa.heads_formats`).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from medusa.heads_formats import CONFIG_FILE, OUR_FORMAT, WEIGHTS_FILE, read_heads
from medusa.kernels import skinny_matmul
from medusa.kernels.heads_stack import heads_stack, unit_rms

FORMAT_VERSION = 1
LM_HEAD_KINDS = ("shared", "lora", "full")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HeadsConfig.{name} must be an int >= 1, got {value!r}")


def _normalise_tree(tree: Any, num_heads: int) -> list[list[int]]:
    """Paths of top-k ranks, one rank per depth; a prefix-closed set."""
    if not isinstance(tree, (list, tuple)):
        raise ValueError(f"HeadsConfig.tree must be a list of paths, got {type(tree).__name__}")
    paths: list[list[int]] = []
    for path in tree:
        ok = isinstance(path, (list, tuple)) and 1 <= len(path) <= num_heads
        if not ok or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in path):
            raise ValueError(
                f"HeadsConfig.tree: path {path!r} must be 1..{num_heads} (num_heads) non-negative ints"
            )
        paths.append([int(r) for r in path])
    seen = {tuple(p) for p in paths}
    if len(seen) != len(paths):
        raise ValueError("HeadsConfig.tree has duplicate paths")
    for p in paths:
        if len(p) > 1 and tuple(p[:-1]) not in seen:
            raise ValueError(f"HeadsConfig.tree: path {p} has no parent {p[:-1]} in the tree")
    return paths


def _normalise_accuracies(acc: Any, num_heads: int) -> list[list[float]]:
    """[num_heads][K] measured top-k accuracies, each in [0, 1]."""
    if not isinstance(acc, (list, tuple)) or len(acc) != num_heads:
        raise ValueError(f"HeadsConfig.accuracies must have one row per head ({num_heads}), got {acc!r}")
    rows: list[list[float]] = []
    for row in acc:
        if not isinstance(row, (list, tuple)) or not row:
            raise ValueError(f"HeadsConfig.accuracies: row {row!r} must be a non-empty list")
        if any(isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0 for a in row):
            raise ValueError(f"HeadsConfig.accuracies: row {row!r} must hold numbers in [0, 1]")
        rows.append([float(a) for a in row])
    return rows


@dataclass(frozen=True)
class HeadsConfig:
    """Shape and provenance of a set of Medusa heads (stored as config.json)."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    lm_head: str = "shared"  # one of LM_HEAD_KINDS
    lora_rank: int = 16
    base_model: str | None = None  # name or path of the base the heads were trained for
    tree: list[list[int]] | None = None  # a tree tuned for these heads
    accuracies: list[list[float]] | None = None  # [num_heads][K] top-k accuracies
    condition_on_root: bool = False  # heads also read the embedding of the root token (module docstring)
    condition_on_chain: bool = False  # head k also reads the greedy chain of heads 0..k-1 (needs the root)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers", "lora_rank"):
            _positive_int(name, getattr(self, name))
        for name in ("condition_on_root", "condition_on_chain"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HeadsConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.condition_on_chain and not self.condition_on_root:
            raise ValueError("HeadsConfig.condition_on_chain needs condition_on_root: the chain starts at the root")
        if self.lm_head not in LM_HEAD_KINDS:
            raise ValueError(f"HeadsConfig.lm_head must be one of {LM_HEAD_KINDS}, got {self.lm_head!r}")
        if self.base_model is not None:
            if not isinstance(self.base_model, (str, Path)) or not str(self.base_model):
                raise ValueError(f"HeadsConfig.base_model must be a non-empty str, got {self.base_model!r}")
            object.__setattr__(self, "base_model", str(self.base_model))
        if self.tree is not None:
            object.__setattr__(self, "tree", _normalise_tree(self.tree, self.num_heads))
        if self.accuracies is not None:
            object.__setattr__(self, "accuracies", _normalise_accuracies(self.accuracies, self.num_heads))

    def to_dict(self) -> dict[str, Any]:
        return {"format": OUR_FORMAT, "version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadsConfig:
        """Inverse of `to_dict`; unknown keys are dropped with a warning."""
        fmt, version = data.get("format", OUR_FORMAT), data.get("version", FORMAT_VERSION)
        if fmt != OUR_FORMAT:
            raise ValueError(f"HeadsConfig: key 'format' is {fmt!r}, expected {OUR_FORMAT!r}")
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
            raise ValueError(
                f"HeadsConfig: key 'version' is {version!r}; this library reads 1..{FORMAT_VERSION}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"format", "version"})
        if unknown:
            warnings.warn(f"HeadsConfig: ignoring unknown keys {unknown}", stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})


class ResBlock(nn.Module):
    """`x + SiLU(W x + b)` with W zero-initialised: a fresh block is x + SiLU(b)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # bias keeps nn.Linear's default init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads. `forward(hidden [..., H], lm_head_weight [V, H], roots [...]) -> [K, ..., V]`."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        k, h, v, r = config.num_heads, config.hidden_size, config.vocab_size, config.lora_rank
        # One fresh ResBlock per (head, layer): never `[ResBlock(h)] * n`,
        # which would make every layer the same module.
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(h) for _ in range(config.num_layers))) for _ in range(k)
        )
        # Per-head matrices are stacked so each kind is one batched matmul;
        # head i owns slice [i] and only its logits send gradient into it.
        bound = h**-0.5  # nn.Linear's default init range for fan_in = H
        if config.lm_head == "lora":
            self.lora_A = nn.Parameter(torch.empty(k, r, h).uniform_(-bound, bound))  # [K, r, H]
            self.lora_B = nn.Parameter(torch.zeros(k, v, r))  # [K, V, r]
        elif config.lm_head == "full":
            self.lm_heads = nn.Parameter(torch.empty(k, v, h).uniform_(-bound, bound))  # [K, V, H]
        if config.condition_on_root:
            self.root_proj = nn.Parameter(torch.zeros(k, h, h))  # [K, H_in, H_out], zero: starts as plain Medusa
        if config.condition_on_chain:
            # one [H, H] projection per (head k, chain token j < k), flattened: index k (k - 1) / 2 + j
            self.chain_proj = nn.Parameter(torch.zeros(k * (k - 1) // 2, h, h))

    def hidden_states(self, hidden: torch.Tensor, roots: torch.Tensor | None = None,
                      lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Residual stacks only: [..., H] -> [num_heads, ..., H]. Heads that read the root token also
        take its ids roots [...] and the lm_head matrix [V, H] that embeds them."""
        h, k = self.config.hidden_size, self.config.num_heads
        if hidden.shape[-1] != h:
            raise ValueError(f"hidden has last dim {hidden.shape[-1]}, expected hidden_size={h}")
        x = hidden.to(self.heads[0][0].linear.weight.dtype)
        embed = self._check_roots(hidden, lm_head_weight, roots)
        if torch.is_grad_enabled():  # training: the modules themselves, so every weight gets its gradient
            flat = x.reshape(1, -1, h).expand(k, -1, -1)  # [K, N, H]
            if embed is not None:
                e = unit_rms(F.embedding(roots, embed).to(x.dtype)).reshape(1, -1, h).expand(k, -1, -1)
                flat = flat + torch.bmm(e, self.root_proj)  # [K, N, H]
            return torch.stack([head(flat[i]) for i, head in enumerate(self.heads)]).reshape(k, *x.shape)
        # Inference: each stage of all K heads at once (`kernels/heads_stack.py`: one Triton launch a stage
        # on a GPU, a batched matmul with its bias and activation on the CPU); the decode step runs this
        # every step, where launches, not FLOPs, cost the time.
        layers, root_proj_t = self._stacked_weights()
        root = (roots.reshape(-1), embed, root_proj_t) if embed is not None else None
        return heads_stack(x.reshape(-1, h), layers, k, root).reshape(k, *x.shape)

    def _stacked_weights(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """Per layer the K heads' weights [K, H_out, H_in] and biases [K, H]; the root projection as
        [K, H_out, H_in] (or None): rebuilt when a weight changes."""
        linears = [[head[i].linear for head in self.heads] for i in range(self.config.num_layers)]
        params = [p for row in linears for lin in row for p in (lin.weight, lin.bias)]
        if self.config.condition_on_root:
            params.append(self.root_proj)
        key = tuple((p.data_ptr(), p._version) for p in params)
        if getattr(self, "_stack_key", None) != key:
            layers = [(torch.stack([lin.weight for lin in row]), torch.stack([lin.bias for lin in row]))
                      for row in linears]
            root_proj_t = self.root_proj.transpose(1, 2).contiguous() if self.config.condition_on_root else None
            self._stack = (layers, root_proj_t)
            self._stack_key = key
        return self._stack

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor | None = None,
                roots: torch.Tensor | None = None, chain: torch.Tensor | None = None) -> torch.Tensor:
        """Head logits [num_heads, ..., V].

        lm_head_weight [V, H] is ignored for "full" heads that do not condition on the root.
        roots [...] (hidden's leading shape) are the root token ids; heads that do not
        condition on the root ignore them, so callers may always pass them. chain [..., K - 1]
        (training only) gives chained heads the tokens t+2..t+K to read instead of their own
        greedy chain; other heads ignore it.
        """
        cfg = self.config
        if cfg.condition_on_chain:
            embed = self._check_roots(hidden, lm_head_weight, roots)
            return self._chained(hidden, lm_head_weight, F.embedding(roots, embed), chain)
        states = self.hidden_states(hidden, roots, lm_head_weight)  # [K, ..., H]
        lead = states.shape[1:-1]
        logits = self._project(states.reshape(cfg.num_heads, -1, cfg.hidden_size), lm_head_weight)
        return logits.reshape(cfg.num_heads, *lead, cfg.vocab_size)

    def _project(self, flat: torch.Tensor, lm_head_weight: torch.Tensor | None,
                 heads: slice = slice(None)) -> torch.Tensor:
        """The vocabulary projection of `heads`' states [k, N, H] -> logits [k, N, V]."""
        cfg = self.config
        if cfg.lm_head == "full":
            return torch.bmm(flat, self.lm_heads[heads].transpose(1, 2))  # [k, N, V]
        weight = self._check_lm_head(lm_head_weight)
        # All heads against the shared matrix in ONE matmul: [k*N, H] x [H, V].
        logits = skinny_matmul.linear(flat.to(weight.dtype), weight)  # [k, N, V]
        if cfg.lm_head == "lora":
            low = torch.bmm(flat, self.lora_A[heads].transpose(1, 2))  # [k, N, r]
            delta = torch.bmm(low, self.lora_B[heads].transpose(1, 2))  # [k, N, V]
            logits = logits + delta.to(logits.dtype)
        return logits

    def _chained(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, root_embeds: torch.Tensor,
                 chain: torch.Tensor | None) -> torch.Tensor:
        """Heads one after another, head k reading the root and chain tokens 0..k-1 -> [K, ..., V]."""
        cfg = self.config
        k_heads, h = cfg.num_heads, cfg.hidden_size
        lead = hidden.shape[:-1]
        if chain is not None and tuple(chain.shape) != (*lead, k_heads - 1):
            raise ValueError(f"chain has shape {tuple(chain.shape)}, expected {(*lead, k_heads - 1)}")
        x = hidden.to(self.heads[0][0].linear.weight.dtype).reshape(-1, h)  # [N, H]
        root = unit_rms(root_embeds.to(x.dtype).reshape(-1, h))  # [N, H]
        read: list[torch.Tensor] = []  # unit-RMS embeddings [N, H] of the chain tokens so far
        out = []
        for k, head in enumerate(self.heads):
            inputs = x + root @ self.root_proj[k]
            for j, e in enumerate(read):
                inputs = inputs + e @ self.chain_proj[k * (k - 1) // 2 + j]
            logits = self._project(head(inputs)[None], lm_head_weight, slice(k, k + 1))[0]  # [N, V]
            out.append(logits)
            if k + 1 < k_heads:
                token = chain.reshape(-1, k_heads - 1)[:, k] if chain is not None else logits.argmax(-1)
                read.append(unit_rms(F.embedding(token, lm_head_weight).to(x.dtype)))
        return torch.stack(out).reshape(k_heads, *lead, cfg.vocab_size)

    def _check_roots(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor | None,
                     roots: torch.Tensor | None) -> torch.Tensor | None:
        """The lm_head matrix [V, H] that embeds the roots, or None for heads that do not read them."""
        if not self.config.condition_on_root:
            return None
        if roots is None:
            raise ValueError("these heads condition on the root token (condition_on_root): pass roots=")
        if tuple(roots.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"roots has shape {tuple(roots.shape)}, expected hidden's leading shape "
                             f"{tuple(hidden.shape[:-1])}")
        if lm_head_weight is None:
            raise ValueError("these heads condition on the root token: they need lm_head_weight [V, H] to embed it")
        return self._check_lm_head(lm_head_weight)

    def _check_lm_head(self, weight: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        if weight is None:
            raise ValueError(f'lm_head="{cfg.lm_head}" heads need the base lm_head_weight [V, H]')
        if tuple(weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"lm_head_weight has shape {tuple(weight.shape)}, expected "
                f"(vocab_size, hidden_size) = ({cfg.vocab_size}, {cfg.hidden_size})"
            )
        return weight

    @torch.no_grad()
    def init_full_lm_heads(self, lm_head_weight: torch.Tensor) -> None:
        """Start every full head from the base lm_head (the original Medusa init)."""
        if self.config.lm_head != "full":
            raise ValueError(f'init_full_lm_heads needs lm_head="full", not "{self.config.lm_head}"')
        weight = self._check_lm_head(lm_head_weight)
        self.lm_heads.copy_(weight.unsqueeze(0).expand_as(self.lm_heads))  # [K, V, H]

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json (HeadsConfig) and heads.safetensors."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        metadata = {"format": OUR_FORMAT, "version": str(FORMAT_VERSION)}
        save_file(state, str(out / WEIGHTS_FILE), metadata=metadata)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        hidden_size: int | None = None,
        vocab_size: int | None = None,
        lm_head_weight: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> MedusaHeads:
        """Load heads from our format, FasterDecoding/Medusa, TGI or a Medusa-2 model.

        `hidden_size` / `vocab_size` / `lm_head_weight` are cross-checked against
        the checkpoint, and supply the vocab size that shared-lm_head foreign
        checkpoints do not record. `dtype=None` keeps the stored dtype.
        """
        if lm_head_weight is not None:
            if lm_head_weight.dim() != 2:
                raise ValueError(f"lm_head_weight must be [V, H], got shape {tuple(lm_head_weight.shape)}")
            vocab_size = _agree("vocab_size", vocab_size, lm_head_weight.shape[0], "lm_head_weight")
            hidden_size = _agree("hidden_size", hidden_size, lm_head_weight.shape[1], "lm_head_weight")
        raw = read_heads(path, vocab_size=vocab_size)
        try:
            config = HeadsConfig.from_dict(raw.config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{raw.source}: bad heads config: {e}") from e
        _agree("hidden_size", hidden_size, config.hidden_size, raw.source)
        _agree("vocab_size", vocab_size, config.vocab_size, raw.source)
        model = _build(cls, config, raw.state_dict, raw.source, dtype)
        return model.to(device=device) if device is not None else model


def _agree(name: str, given: int | None, found: int, source: str) -> int:
    if given is not None and given != found:
        raise ValueError(f"{source}: {name} is {found}, but {name}={given} was given")
    return found


def _build(
    cls: type[MedusaHeads],
    config: HeadsConfig,
    state: dict[str, torch.Tensor],
    source: str,
    dtype: torch.dtype | None,
) -> MedusaHeads:
    """Build on the meta device (no init cost) and adopt the checked tensors."""
    with torch.device("meta"):
        model = cls(config)
    expected = model.state_dict()
    why = f"(config: {config.num_heads} heads, {config.lm_head} lm_head)"
    for key in expected:
        if key not in state:
            raise ValueError(f"{source}: missing key {key!r} {why}")
    for key, tensor in state.items():
        if key not in expected:
            raise ValueError(f"{source}: unexpected key {key!r} {why}")
        if tensor.shape != expected[key].shape:
            shapes = f"{tuple(tensor.shape)}, expected {tuple(expected[key].shape)}"
            raise ValueError(f"{source}: key {key!r} has shape {shapes}")
    # One dtype for the whole module (checkpoints can mix fp16 and fp32).
    target = dtype or state["heads.0.0.linear.weight"].dtype
    model.load_state_dict({k: v.to(target) for k, v in state.items()}, assign=True)
    return model
