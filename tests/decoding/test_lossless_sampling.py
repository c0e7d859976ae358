"""Lossless sampling: tokens emitted by Medusa follow the base model's own distribution.

On a tiny model with a 12-token vocabulary we compute the exact distribution of
the first three tokens by enumeration, draw thousands of Medusa samples, and run
chi-square goodness-of-fit tests. As a control, Medusa's typical acceptance (a
deliberately lossy rule) must fail the same test: the test has teeth.
"""

import dataclasses

import pytest
import torch

from medusa.attention import CausalAttention
from medusa.config import ModelConfig
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig, target_probs
from medusa.decoding.verifier import AcceptanceConfig
from medusa.heads import HeadsConfig, MedusaHeads
from medusa.model import DecoderModel
from medusa.tree import TreeSpec

VOCAB, PROMPT, NEW = 12, [3, 7, 1, 5], 3
LOGIT_SCALE = 2.0


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small run ~20x slower when threads contend
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    model = DecoderModel(config).eval()
    heads = MedusaHeads(HeadsConfig(hidden_size=32, vocab_size=VOCAB, num_heads=2)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)  # peaked but not degenerate next-token distributions
        for p in heads.parameters():
            p.normal_(0, 0.5)  # proposals that are often, but not always, right
    yield model, heads
    torch.set_num_threads(threads)


def exact_joint(model, sampling):
    """p(t1, t2, t3 | prompt) [V, V, V] by enumerating every continuation."""
    with torch.no_grad():
        seqs = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        pos = torch.arange(seqs.shape[1]).expand_as(seqs)
        logits = model.compute_logits(model(seqs, pos, CausalAttention()))  # [V*V, P+2, V]
    p1 = target_probs(logits[0, len(PROMPT) - 1][None], sampling)[0]
    p2 = target_probs(logits[::VOCAB, len(PROMPT)], sampling)  # [V (t1), V]
    p3 = target_probs(logits[:, len(PROMPT) + 1], sampling).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def draw(model, heads, sampling, acceptance, n):
    decoder = TreeDecoder(model, heads, TreeSpec.load("tree-8"))
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    accepted_drafts = 0
    # Scattered seeds: the first draws of mt19937 seeded with consecutive small
    # integers are measurably correlated, which plain sampling shows too.
    seeds = torch.randint(2**62, (n,), generator=torch.Generator().manual_seed(1234)).tolist()
    for seed in seeds:
        params = dataclasses.replace(sampling, seed=seed)
        tokens = []
        for chunk in decoder.decode(PROMPT, NEW, params, acceptance):
            tokens += chunk
            accepted_drafts += len(chunk) - 1
            if len(tokens) >= NEW:
                break
        counts[tuple(tokens[:NEW])] += 1
    return counts, accepted_drafts


def chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit, pooling cells with expected count < 5 into one."""
    observed, expected = observed.flatten().double(), probs.flatten().double() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.7, top_k=6, top_p=0.9),
                                      SamplingConfig(temperature=1.2, min_p=0.08)])
def test_lossless_rule_matches_base_distribution(tiny, sampling):
    model, heads = tiny
    joint = exact_joint(model, sampling)
    counts, accepted = draw(model, heads, sampling, AcceptanceConfig(), 4000)
    assert accepted > 1000, "the heads must be right often, or the test proves nothing"
    assert chi_square_pvalue(counts.sum((0, 2)), joint.sum((0, 2))) > 1e-3  # second token
    assert chi_square_pvalue(counts.sum((0, 1)), joint.sum((0, 1))) > 1e-3  # third token
    assert chi_square_pvalue(counts.sum(2), joint.sum(2)) > 1e-3  # first two jointly
    assert chi_square_pvalue(counts, joint) > 1e-3  # all three jointly


def test_typical_acceptance_is_detectably_lossy(tiny):
    model, heads = tiny
    sampling = SamplingConfig(temperature=1.0)
    joint = exact_joint(model, sampling)
    counts, _ = draw(model, heads, sampling, AcceptanceConfig(rule="typical", posterior_threshold=0.3,
                                                              posterior_alpha=0.3), 2000)
    assert chi_square_pvalue(counts, joint) < 1e-6


def test_seeded_uniforms_depend_on_seed_and_position_only_and_are_uniform():
    """A seeded request's uniform for output p: the same whichever positions are asked for together, in
    whatever order; another seed gives another stream; 200k draws fill [0, 1) evenly, with no correlation
    between neighbouring positions or neighbouring seeds."""
    import numpy as np

    from medusa.decoding.sampler import seeded_uniforms

    stream = seeded_uniforms(11, np.arange(200_000))
    assert stream.dtype == np.float64 and 0.0 <= stream.min() and stream.max() < 1.0
    assert np.array_equal(seeded_uniforms(11, np.array([7, 3, 150_000])), stream[[7, 3, 150_000]])
    assert not np.array_equal(seeded_uniforms(12, np.arange(100)), stream[:100])
    assert np.array_equal(seeded_uniforms(-1, np.arange(5)), seeded_uniforms(2 ** 64 - 1, np.arange(5)))
    counts = np.bincount((stream * 20).astype(int), minlength=20)
    chi2 = ((counts - 10_000) ** 2 / 10_000).sum()
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 above 43.8
    assert abs(np.corrcoef(stream[:-1], stream[1:])[0, 1]) < 0.01
    seeds = np.array([seeded_uniforms(s, np.array([0]))[0] for s in range(20_000)])
    assert abs(np.corrcoef(seeds[:-1], seeds[1:])[0, 1]) < 0.03 and abs(seeds.mean() - 0.5) < 0.01


def test_a_seeded_samplers_windows_come_from_cached_blocks_with_the_same_values(monkeypatch):
    """Each step asks for the uniforms of the next few positions; they come from a block computed once per
    UNIFORM_BLOCK positions, and equal the per-position function whatever the window."""
    import numpy as np

    import medusa.decoding.sampler as sampler

    calls = []
    compute = sampler.seeded_uniforms
    monkeypatch.setattr(sampler, "seeded_uniforms", lambda seed, positions: calls.append(len(positions))
                        or compute(seed, positions))
    s = sampler.TokenSampler(5)
    start = 0
    while start < 3 * sampler.UNIFORM_BLOCK:
        count = 1 + start % 17
        got = s.window(start, count)
        assert np.array_equal(got, compute(5, np.arange(start, start + count))), start
        start += 1 + start % 5
    assert len(calls) <= 4 and all(n >= sampler.UNIFORM_BLOCK for n in calls)
    assert np.array_equal(s.window(10, 3), compute(5, np.arange(10, 13)))  # back to an earlier window: recomputed
    wide = s.window(0, 2 * sampler.UNIFORM_BLOCK)  # wider than a block
    assert np.array_equal(wide, compute(5, np.arange(2 * sampler.UNIFORM_BLOCK)))


def test_filter_cutoffs_keep_top_k_then_the_top_p_nucleus_and_ties():
    from medusa.decoding.sampler import filter_cutoffs

    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0001]] * 4)).float()  # probabilities at T = 1
    logits[3, 3] = logits[3, 2]  # a tie with the last token top-k keeps
    got = filter_cutoffs(logits, torch.ones(4), torch.tensor([0, 2, 0, 3]), torch.tensor([1.0, 1.0, 0.65, 1.0]))
    assert got[0] == float("-inf")  # no filter
    assert got[1] == logits[1, 1]  # top-2
    assert got[2] == logits[2, 1]  # 0.4 + 0.3 >= 0.65: the nucleus ends at the second token
    assert got[3] == logits[3, 2] and (logits[3] >= got[3]).sum() == 4  # the tie is kept
    # top-p acts on what top-k leaves: top-2 renormalised is 4/7, 3/7, so top_p 0.5 keeps one token
    one = filter_cutoffs(logits[:1], torch.ones(1), torch.tensor([2]), torch.tensor([0.5]))
    assert one[0] == logits[0, 0]


@pytest.mark.parametrize("seed", range(3))
def test_min_p_keeps_what_the_probability_rule_keeps_then_top_k_and_top_p_act_on_the_rest(seed):
    """vLLM's rule, in probabilities: at temperature T keep tokens with p >= min_p * max p; then top-k, then top-p
    renormalised over what is left."""
    from medusa.decoding.sampler import SamplingConfig, filter_cutoffs, target_probs

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=g) * 3
    temperature = torch.tensor([0.5, 1.0, 1.7, 1.0, 0.8, 1.2])
    min_p = torch.tensor([0.05, 0.2, 0.01, 0.0, 1.0, 0.1])
    top_k = torch.tensor([0, 0, 0, 0, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.7])
    cut = filter_cutoffs(logits, temperature, top_k, top_p, min_p)
    for r in range(6):
        probs = torch.softmax(logits[r] / temperature[r], -1)
        kept = probs >= min_p[r] * probs.max()
        if r == 5:  # top-k then the nucleus of the renormalised rest
            order = probs.masked_fill(~kept, 0).sort(descending=True)
            kept_k = torch.zeros_like(kept)
            kept_k[order.indices[:3]] = True
            kept &= kept_k
            rest = probs.masked_fill(~kept, 0) / probs.masked_fill(~kept, 0).sum()
            ranked = rest.sort(descending=True)
            before = ranked.values.cumsum(0) - ranked.values
            nucleus = torch.zeros_like(kept)
            nucleus[ranked.indices[before < 0.7]] = True
            kept &= nucleus
        assert torch.equal(logits[r] >= cut[r], kept), r
    assert (logits[3] >= cut[3]).all() and (logits[4] >= cut[4]).sum() == 1  # min_p 0 keeps all, 1 the top only
    config = SamplingConfig(temperature=0.9, min_p=0.3)
    probs = target_probs(logits[:1], config)[0]
    assert torch.equal(probs > 0, torch.softmax(logits[0] / 0.9, -1) >= 0.3 * torch.softmax(logits[0] / 0.9, -1).max())
    assert probs.sum().item() == pytest.approx(1.0)


def test_filter_cutoffs_survive_the_rows_a_step_pads_with():
    """A graph's warmup runs on padding, whose logits may be NaN (here: temperature 0, top_p 0): those
    cutoffs are junk nobody reads, but finding them must not index out of the vocabulary (it did on a
    GPU: a device-side assert while capturing a filtered step)."""
    from medusa.decoding.sampler import filter_cutoffs

    logits = torch.randn(3, 50)
    got = filter_cutoffs(logits, torch.tensor([0.0, 0.7, 0.0]), torch.tensor([0, 5, 0]), torch.tensor([0.0, 0.9, 1.0]))
    assert got.shape == (3,) and got[1] >= logits[1].sort(descending=True).values[4]
