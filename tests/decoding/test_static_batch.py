"""Batched padded generation gives each prompt its own batch-1 output."""

import torch

from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.decoding.static_batch import generate_padded
from medusa.tree import TreeSpec
from tiny_models import tiny_decoder


def tiny_model(vocab=64):
    return tiny_decoder(vocab, logit_scale=4, max_positions=128)[0]


def batch1_greedy(model, prompt, n):
    out = []
    for chunk in TreeDecoder(model, None, TreeSpec.load("single")).decode(prompt, n, SamplingConfig()):
        out += chunk
    return out[:n]


def test_padded_batch_matches_batch1_greedy():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(64, (n,), generator=g).tolist() for n in (3, 11, 7, 1, 20)]
    outs = generate_padded(model, prompts, 24, SamplingConfig())
    for prompt, out in zip(prompts, outs):
        assert out == batch1_greedy(model, prompt, 24)


def test_rows_stop_at_their_eos_and_keep_it():
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    free = generate_padded(model, prompts, 20, SamplingConfig())
    eos = free[0][5]  # pretend the 6th token of row 0 is EOS
    outs = generate_padded(model, prompts, 20, SamplingConfig(), eos_ids=[eos])
    assert outs[0] == free[0][:6]
    first = free[1].index(eos) if eos in free[1] else None
    assert outs[1] == (free[1][: first + 1] if first is not None else free[1])


def test_seeded_sampling_is_reproducible():
    model = tiny_model()
    prompts = [[1, 2, 3], [9, 8]]
    runs = [generate_padded(model, prompts, 12, SamplingConfig(temperature=1.0),
                            generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_key_bucket_does_not_change_the_output(monkeypatch):
    from medusa.decoding import static_batch

    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(64, (n,), generator=g).tolist() for n in (5, 13, 2)]
    expected = generate_padded(model, prompts, 30, SamplingConfig())  # keys padded to the whole cache
    for bucket in (1, 7, 16):  # exact growth, and buckets crossed several times
        monkeypatch.setattr(static_batch, "KEY_BUCKET", bucket)
        assert generate_padded(model, prompts, 30, SamplingConfig()) == expected
