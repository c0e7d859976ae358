"""Sampling settings and the target distribution they define.

Every acceptance rule is judged against this distribution: lossless sampling
means emitted tokens follow exactly `target_probs(base_logits)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from medusa.kernels.gumbel_sample import gumbel_argmax


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    min_p: float = 0.0  # keep tokens at least this fraction of the most likely one's probability (0 = off)

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # NaN fails too; an infinite one would make NaN probabilities
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0, or -1 as vLLM has it, is off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def filters(self) -> bool:
        """Whether min-p, top-k or top-p removes tokens (a sort of the vocabulary finds which)."""
        return bool(self.top_k) or self.top_p < 1 or self.min_p > 0

    @property
    def greedy(self) -> bool:
        # below 1e-5 the softmax of logits / T overflows to NaN; it is argmax in all but name
        return self.temperature < 1e-5


def target_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, min-p, top-k and top-p."""
    x = logits.float()
    if not config.filters:
        return torch.softmax(x / config.temperature, dim=-1)
    rows = x.reshape(-1, x.shape[-1])
    cutoff = filter_cutoffs(rows, *_per_row(config, rows.shape[0], rows.device)).view(*x.shape[:-1], 1)
    return torch.softmax((x / config.temperature).masked_fill(x < cutoff, float("-inf")), dim=-1)


def filter_cutoffs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V]; temperature, top_p, min_p [R] float; top_k [R] long (0: off) -> [R] float32: the
    lowest logit each row's filters keep (-inf where none filters), so that a token is kept when its logit
    is at least that. vLLM's order: min-p keeps the tokens whose probability at this temperature is at least
    min_p times the most likely one's (a logit at least the top one's + T log min_p); then top-k; then
    top-p keeps the most likely tokens, in order, until the mass before the next one reaches top_p, on the
    distribution the other two left. A token tied with the last one kept is kept too (which of equal
    logits a sort puts first is arbitrary)."""
    x = logits.float()
    vocab = x.shape[-1]
    ordered = x.sort(dim=-1, descending=True).values  # [R, V]; 1 / T keeps the order
    kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])[:, 0]
    k_cut = torch.where((top_k > 0) & (top_k < vocab), kth, float("-inf"))
    if min_p is not None:  # both cut a prefix of the order: the stricter one holds
        m_cut = ordered[:, 0] + temperature.float() * torch.log(min_p.float().clamp(min=1e-30))
        k_cut = torch.maximum(k_cut, torch.where(min_p > 0, m_cut, float("-inf")))
    scaled = (ordered / temperature[:, None].float()).masked_fill(ordered < k_cut[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ahead in the order
    kept = (before < top_p[:, None]).int().cumprod(-1).sum(-1)  # leading tokens kept
    # >= 1 for a real row; 0 where the logits are NaN (a graph's warmup runs on padding): clamped, junk but in range
    p_cut = ordered.gather(1, (kept.clamp(min=1) - 1)[:, None])[:, 0]
    return torch.maximum(k_cut, torch.where(top_p < 1, p_cut, float("-inf")))


def _per_row(config: SamplingConfig, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """config's temperature, top_k, top_p, min_p as [rows] tensors (filter_cutoffs' arguments)."""
    return (torch.full((rows,), config.temperature, device=device),
            torch.full((rows,), config.top_k, dtype=torch.long, device=device),
            torch.full((rows,), config.top_p, device=device),
            torch.full((rows,), config.min_p, device=device))


class TokenSampler:
    """Draws one token per row of logits, by the Gumbel-max trick (`kernels/gumbel_sample.py`).

    With a seed, the draw for output position p uses noise that depends only on
    (seed, p) and the token, so a seeded request gives the same text whatever
    tree it was verified with and whatever else shares its batch, and the same
    text as plain decoding with that seed. Each emitted token still gets fresh
    noise (one uniform per output position keys it), so sampling stays exact.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._block: tuple[int, np.ndarray] = (0, np.empty(0))  # (first position, its uniforms): see `window`

    def window(self, start: int, count: int) -> np.ndarray:
        """[count] uniforms of output positions start.. (a seeded sampler's), from a cached block of
        UNIFORM_BLOCK positions: a request's steps ask for overlapping windows that move forward a few
        positions a step, so the block is computed once per UNIFORM_BLOCK outputs, not every step."""
        first, block = self._block
        if not (first <= start and start + count <= first + len(block)):
            first, block = start, seeded_uniforms(self.seed, np.arange(start, start + max(count, UNIFORM_BLOCK)))
            self._block = (first, block)
        return block[start - first: start - first + count]

    def __call__(self, logits: torch.Tensor, config: SamplingConfig, positions: torch.Tensor) -> torch.Tensor:
        """logits [N, V] (before temperature and filters); positions [N] output index of each row's token
        -> tokens [N], drawn from `target_probs(logits, config)` row by row."""
        rows = logits.shape[0]
        if self.seed is None:
            uniforms = torch.rand(rows, dtype=torch.float64, device=logits.device)  # no copy up from the host
        else:
            uniforms = self.uniforms(self.seed, positions)
        temperature, top_k, top_p, min_p = _per_row(config, rows, logits.device)
        cutoff = filter_cutoffs(logits, temperature, top_k, top_p, min_p) if config.filters else \
            torch.full((rows,), float("-inf"), device=logits.device)
        return gumbel_argmax(logits, temperature, cutoff, uniforms.to(logits.device))

    @staticmethod
    def uniforms(seed: int, positions: torch.Tensor) -> torch.Tensor:
        """[N] float64: the uniform that keys output position p's noise, a function of (seed, p) only."""
        return torch.from_numpy(seeded_uniforms(seed, positions.cpu().numpy()))  # positions may be on the GPU


UNIFORM_BLOCK = 256  # positions a seeded sampler computes at once (`TokenSampler.window`)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment: 2^64 / the golden ratio


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64 (wrapping arithmetic): a bijection that scrambles every bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seed: int, positions: np.ndarray) -> np.ndarray:
    """[N] float64 in [0, 1): output p's uniform for a seeded request, element p of the SplitMix64 stream
    that starts from the scrambled seed (a counter-based generator: any positions, in any order, at once).

    Every step of a seeded request needs the uniforms of its tree's depths and its steps in flight
    (~18 positions a row for a 16-token tree); a NumPy generator seeded per position cost the host
    ~20 us each, 0.4 ms a row and step on a 2-core CI machine, more than the GPU's whole step (session 22)."""
    start = _mix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    counters = np.asarray(positions, dtype=np.int64).astype(np.uint64) + np.uint64(1)
    bits = _mix64(start + counters * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] -> [N] one independent draw per row from a torch generator (batched self-distillation)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
