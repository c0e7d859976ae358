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
