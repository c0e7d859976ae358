"""Gumbel-max sampling: the Triton kernels against the PyTorch reference, and both against softmax."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.kernels.gumbel_sample import (  # noqa: E402
    fmix32,
    gumbel_argmax,
    gumbel_argmax_reference,
    gumbel_noise,
    gumbel_top_k,
    gumbel_top_k_reference,
    perturbed_scores,
)
from medusa.kernels.gumbel_sample_triton import gumbel_argmax_triton, gumbel_top_k_triton  # noqa: E402

from kernel_inputs import DEVICE, rand  # noqa: E402


def inputs(seed, rows, width, dtype=torch.float32, filtered=True):
    """Logits scaled to give peaked but not degenerate distributions; temperatures in [0.3, 1.5); every
    third row filtered to its 10 best logits (when `filtered`); uniforms from a float64 generator."""
    g = torch.Generator().manual_seed(seed)
    x = (rand(g, rows, width) * 6).to(dtype)
    temperature = (torch.rand(rows, generator=g) * 1.2 + 0.3).to(DEVICE)
    cutoff = torch.full((rows,), float("-inf"), device=DEVICE)
    if filtered:
        top10 = x.float().sort(dim=-1, descending=True).values[:, 9]
        cutoff[::3] = top10[::3]
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64).to(DEVICE)
    return x, temperature, cutoff, uniforms


reference_scores = perturbed_scores


# widths within one chunk, over several, a ragged last chunk; float32, bfloat16 (many equal logits)
@pytest.mark.parametrize("seed,rows,width,dtype", [(0, 5, 700, torch.float32), (1, 4, 2500, torch.float32),
                                                   (2, 6, 3000, torch.bfloat16), (3, 3, 1024, torch.float16)])
def test_kernel_draws_what_the_reference_draws(seed, rows, width, dtype):
    x, temperature, cutoff, uniforms = inputs(seed, rows, width, dtype)
    got = gumbel_argmax_triton(x, temperature, cutoff, uniforms)
    want = gumbel_argmax_reference(x, temperature, cutoff, uniforms)
    assert got.shape == (rows,) and got.dtype == torch.long
    scores = reference_scores(x, temperature, cutoff, uniforms)
    # the same token, or (a logarithm's last bit apart on a GPU) one whose score ties the best
    best = scores.max(-1).values
    assert torch.all((got == want) | (scores.gather(1, got[:, None])[:, 0] >= best - 1e-5 * best.abs()))
    assert (got == want).float().mean() >= 0.8
    assert torch.all(x.float().gather(1, got[:, None])[:, 0] >= cutoff)  # never a filtered token


@pytest.mark.parametrize("seed,width,k", [(8, 700, 4), (9, 2500, 10)])
def test_top_k_of_perturbed_scores_matches_a_stable_sort(seed, width, k):
    """gumbel_top_k, a sampled row's head proposals: the k best of x / T + G, best first."""
    x, temperature, cutoff, uniforms = inputs(seed, 5, width, filtered=False)
    got = gumbel_top_k_triton(x, temperature, cutoff, uniforms, k)
    want = gumbel_top_k_reference(x, temperature, cutoff, uniforms, k)
    assert got.shape == (5, k)
    scores = reference_scores(x, temperature, cutoff, uniforms)
    # the same tokens, or (a logarithm's last bit apart on a GPU) ones whose scores tie the reference's
    assert torch.allclose(scores.gather(1, got), scores.gather(1, want), rtol=1e-5)
    assert torch.equal(got[:, 0], gumbel_argmax_triton(x, temperature, cutoff, uniforms))
    with pytest.raises(ValueError, match="k must be in"):
        gumbel_top_k(x, temperature, cutoff, uniforms, width + 1)


def test_a_rows_draw_depends_on_its_logits_and_uniform_only():
    """Rows moved, or drawn alone: the same token (a seeded request's draw whatever its batch)."""
    x, temperature, cutoff, uniforms = inputs(4, 6, 1500)
    together = gumbel_argmax_triton(x, temperature, cutoff, uniforms)
    order = torch.tensor([3, 0, 5, 1, 4, 2], device=DEVICE)
    moved = gumbel_argmax_triton(x[order], temperature[order], cutoff[order], uniforms[order])
    assert torch.equal(moved, together[order])
    alone = gumbel_argmax_triton(x[2:3], temperature[2:3], cutoff[2:3], uniforms[2:3])
    assert alone.item() == together[2].item()


def test_ties_go_to_the_lowest_token_and_minus_infinity_is_never_drawn():
    x = torch.full((2, 1200), float("-inf"), device=DEVICE)
    x[0, [7, 900]] = 2.0  # two finite logits: only they can be drawn
    ones = torch.ones(2, device=DEVICE)
    none = torch.full((2,), float("-inf"), device=DEVICE)
    for u in torch.linspace(0.01, 0.99, 9, dtype=torch.float64):
        got = gumbel_argmax_triton(x, ones, none, u.repeat(2).to(DEVICE))
        assert got[0].item() in (7, 900) and got[1].item() == 0  # all -inf: the first maximum, as argmax
        assert torch.equal(got, gumbel_argmax_reference(x, ones, none, u.repeat(2).to(DEVICE)))


def test_draws_follow_softmax_of_logits_over_temperature():
    """2,000 uniforms against fixed logits: the frequencies match softmax(x / T) (chi-square, 5 tokens
    of 8 kept by the cutoff), through the kernel and the reference alike."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, -3.0], device=DEVICE)
    n, t = 2000, 0.8
    x = logits.repeat(n, 1)
    temperature = torch.full((n,), t, device=DEVICE)
    cutoff = torch.full((n,), 0.0, device=DEVICE)  # keeps 1.0, 0.5, 0.0, 2.0, 0.2
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    kept = logits >= 0
    probs = torch.softmax((logits / t).masked_fill(~kept, float("-inf")), -1)
    for draw in (gumbel_argmax_triton, gumbel_argmax_reference):
        counts = torch.bincount(draw(x, temperature, cutoff, uniforms), minlength=8).double()
        assert counts[~kept].sum() == 0
        expected = probs[kept].double() * n
        stat = ((counts[kept] - expected) ** 2 / expected).sum()
        assert stat < 20.5, (draw.__name__, counts.tolist())  # chi-square, 4 dof: p ~ 4e-4


def murmur3_fmix32(h: int) -> int:
    """MurmurHash3's finalizer in Python's exact integers."""
    h ^= h >> 16
    h = h * 0x85EBCA6B % 2 ** 32
    h ^= h >> 13
    h = h * 0xC2B2AE35 % 2 ** 32
    return h ^ (h >> 16)


def test_noise_is_standard_gumbel_and_fmix32_is_murmur3s():
    values = [0, 1, 12345, 0xDEADBEEF, 2 ** 32 - 1, 0x80000000]  # products past 2^63 wrap in int64
    assert fmix32(torch.tensor(values)).tolist() == [murmur3_fmix32(v) for v in values]
    noise = gumbel_noise(torch.rand(400, generator=torch.Generator().manual_seed(6), dtype=torch.float64), 500)
    assert abs(noise.mean().item() - 0.5772) < 0.01 and abs(noise.std().item() - 1.2825) < 0.01  # Euler, pi/sqrt6
    assert noise.isfinite().all()


def test_wrapper_checks_shapes_and_dtypes():
    x = torch.zeros(2, 8, device=DEVICE)
    ok = (torch.ones(2, device=DEVICE), torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"logits must be \[R, V\]"):
        gumbel_argmax(x, ok[0][:1], ok[1], ok[2])
    with pytest.raises(ValueError, match="uniforms must be float64"):
        gumbel_argmax(x, ok[0], ok[1], ok[2].float())
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        gumbel_argmax_triton(x.long(), *ok)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,dtype", [(512, 49152, torch.float32), (36, 49152, torch.bfloat16),
                                              (8, 128256, torch.float32)])
def test_full_size_vocabularies(rows, width, dtype):
    x, temperature, cutoff, uniforms = inputs(7, rows, width, dtype)
    with torch.inference_mode():  # where the kernels run
        got = gumbel_argmax(x, temperature, cutoff, uniforms)
    want = gumbel_argmax_reference(x, temperature, cutoff, uniforms)
    scores = reference_scores(x, temperature, cutoff, uniforms)
    best = scores.max(-1).values
    assert torch.all((got == want) | (scores.gather(1, got[:, None])[:, 0] >= best - 1e-5 * best.abs()))
    assert (got == want).float().mean() >= 0.99
