"""Sampling settings and the target distribution they define.

Every acceptance rule is judged against this distribution: lossless sampling
means emitted tokens follow exactly `target_probs(base_logits)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        # below 1e-5 the softmax of logits / T overflows to NaN; it is argmax in all but name
        return self.temperature < 1e-5


def target_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1:
        logits = _top_p_filter(logits, config.top_p)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class TokenSampler:
    """Draws one token per row of probabilities.

    With a seed, the draw for output position p uses a uniform that depends only
    on (seed, p) (inverse-CDF sampling), so a seeded request gives the same text
    whatever tree it was verified with and whatever else shares its batch, and
    the same text as plain decoding with that seed. Each emitted token still
    gets a fresh uniform (one per output position), so sampling stays exact.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed

    def __call__(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """probs [N, V]; positions [N] output index of each row's token -> tokens [N]."""
        if self.seed is None:
            return torch.multinomial(probs, 1).squeeze(-1)
        uniforms = self.uniforms(self.seed, positions).to(probs.device)
        cdf = probs.double().cumsum(-1)  # [N, V]
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None]).squeeze(-1)
        return tokens.clamp(max=probs.shape[-1] - 1)

    @staticmethod
    def uniforms(seed: int, positions: torch.Tensor) -> torch.Tensor:
        """[N] float64: the uniform behind output position p's draw, a function of (seed, p) only."""
        return torch.tensor([np.random.default_rng([seed, p]).random() for p in positions.tolist()],
                            dtype=torch.float64)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] -> [N] one independent draw per row from a torch generator (batched self-distillation)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
