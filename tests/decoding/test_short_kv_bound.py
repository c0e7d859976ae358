"""Plain steps of one or two short sequences run under a key bound (`kv_len_bound`), which sets the
attention's split count (`StepMetadata.max_kv_len`): the rule, and what the engine passes each step."""

import torch

from medusa.config import ModelConfig
from medusa.decoding.decode_step import SHORT_KV_KEYS, SHORT_KV_MAX_BATCH, bounds_tree_keys, kv_len_bound
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from engine_driver import single_thread
from tiny_models import tiny_decoder


def test_the_bound_covers_short_plain_steps_of_few_sequences_only():
    assert kv_len_bound(1, 1, 600, 8192, False) == SHORT_KV_KEYS
    assert kv_len_bound(SHORT_KV_MAX_BATCH, 1, SHORT_KV_KEYS, 8192, False) == SHORT_KV_KEYS
    assert kv_len_bound(1, 12, 600, 8192, False) is None  # a tree: its attention already runs few splits
    assert kv_len_bound(SHORT_KV_MAX_BATCH + 1, 1, 600, 8192, False) is None
    assert kv_len_bound(1, 1, SHORT_KV_KEYS + 1, 8192, False) is None  # keys past the bound
    assert kv_len_bound(1, 1, 600, 8192, True) is None  # prompt chunks in the step
    assert kv_len_bound(1, 1, 600, SHORT_KV_KEYS, False) is None  # tables no wider than the bound
    # trees whose attention takes 64-row tiles of heads of 128 (bounds_tree_keys) get the bound too
    assert kv_len_bound(1, 16, 600, 8192, False, bounds_trees=True) == SHORT_KV_KEYS
    assert kv_len_bound(SHORT_KV_MAX_BATCH + 1, 16, 600, 8192, False, bounds_trees=True) is None
    assert kv_len_bound(1, 16, 600, 8192, True, bounds_trees=True) is None


def test_trees_are_bounded_where_their_row_tiles_take_fewer_splits_under_a_bound():
    """64-row tiles (nodes x query heads per KV head >= 64) of heads of 128: an 8B shape's 16+ node trees;
    not its smaller ones, not heads of 64 (the 1B and 135M shapes), not plain steps (their own rule)."""
    shape = lambda heads, kv, dim: ModelConfig(model_type="llama", vocab_size=32, hidden_size=heads * dim,  # noqa: E731
                                               intermediate_size=64, num_layers=1, num_heads=heads,
                                               num_kv_heads=kv, head_dim=dim)
    llama_8b, llama_1b, smollm_135m = shape(32, 8, 128), shape(32, 8, 64), shape(9, 3, 64)
    assert [bounds_tree_keys(llama_8b, n) for n in (1, 8, 16, 64)] == [False, False, True, True]
    assert not any(bounds_tree_keys(c, n) for c in (llama_1b, smollm_135m) for n in (16, 64))


def test_each_decode_step_runs_under_the_bound_its_sequences_allow():
    """One request whose context crosses SHORT_KV_KEYS mid-generation, then three at once: the steps
    before the crossing carry the bound into the forward's metadata, the later ones and the steps of
    three sequences none, and every output is the one the same engine gives a request alone."""
    with single_thread():
        model, _ = tiny_decoder(24, max_positions=4096)
    engine = LLMEngine(model, None, EngineConfig(num_blocks=400, block_size=16, cuda_graphs=False))
    step, seen, in_decode = engine.runner.decode, [], []
    forward, part1 = step.cache.forward, step._part1

    def recording(model_, ids, positions, meta):  # (step tokens, longest sequence's keys, bound) of decode steps
        if in_decode:
            seen.append((ids.shape[0], int(meta.kv_lens.max()), meta.max_kv_len))
        return forward(model_, ids, positions, meta)

    def decoding(*args, **kw):
        in_decode.append(True)
        try:
            return part1(*args, **kw)
        finally:
            in_decode.clear()

    step._part1, step.cache.forward = decoding, recording
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(0, 24, (SHORT_KV_KEYS - 10,), generator=g).tolist()
    alone = engine.generate([long_prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    assert [b for n, kv, b in seen if kv <= SHORT_KV_KEYS] == [SHORT_KV_KEYS] * 10
    assert {b for n, kv, b in seen if kv > SHORT_KV_KEYS} == {None}
    seen.clear()
    short = [torch.randint(0, 24, (30,), generator=g).tolist() for _ in range(3)]
    singles = [engine.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids for p in short]
    assert {b for n, kv, b in seen} == {SHORT_KV_KEYS}
    seen.clear()
    together = engine.generate(short, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in together] == singles
    assert {b for n, kv, b in seen if n == 3} == {None} and len(seen) > 0
    assert alone and len(alone) == 20
