"""The captured decode step on the GPU: same tokens as eager plain greedy, and a clean pool afterwards.

float32 so that greedy equality is exact (bf16 argmax ties depend on matmul shapes).
"""

import json

import pytest
import torch

from engine_driver import run_staggered
from medusa.decoding.sampling_params import SamplingParams
from medusa.medusa_model import MedusaModel
from medusa.training.data import DATA_DIR

pytestmark = pytest.mark.gpu


def test_graph_engine_matches_batch1_plain_greedy(default_model_dir):
    model = MedusaModel.from_pretrained(device="cuda", dtype=torch.float32)
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
    prompts = [model.encode([{"role": "user", "content": r["turns"][0][:600]}]) for r in rows[::40][:12]]
    params = [SamplingParams(max_tokens=24 + 8 * (i % 5)) for i in range(len(prompts))]
    references = [model.generate(p, max_new_tokens=sp.max_tokens, speculative=False).token_ids
                  for p, sp in zip(prompts, params)]

    engine = model.engine()
    assert engine.runner.decode.use_graphs
    engine.warmup()
    heads = engine.policy.heads_cost  # timed per bucket: what the heads add to a plain step
    assert set(heads) == set(engine.policy.step_cost) and max(heads.values()) > 0
    done = run_staggered(engine, prompts, params)  # the batch bucket changes from step to step
    for i, ref in enumerate(references):
        assert done[i].token_ids == ref, i
    assert sum(d.stats.accepted_tokens for d in done.values()) > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_graph_engine_seeded_sampling_is_batch_invariant(default_model_dir):
    model = MedusaModel.from_pretrained(device="cuda", dtype=torch.float32)
    prompt = model.encode([{"role": "user", "content": "Write a haiku about the sea."}])
    seeded = SamplingParams(max_tokens=32, temperature=0.8, seed=7)
    alone = model.engine().generate([prompt], seeded)[0].token_ids
    mixed = model.engine().generate([prompt] * 3 + [prompt], [SamplingParams(max_tokens=32)] * 3 + [seeded])
    assert mixed[-1].token_ids == alone


def test_graph_engine_with_prompt_lookup_matches_plain_greedy(default_model_dir):
    """The lookup chain's tokens travel in the step's input copy and are read inside the graphs."""
    model = MedusaModel.from_pretrained(device="cuda", dtype=torch.float32, prompt_lookup=4)
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
    copy = "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog by the river bank."
    texts = [copy] + [r["turns"][0][:600] for r in rows[::60][:7]]
    prompts = [model.encode([{"role": "user", "content": t}]) for t in texts]
    params = [SamplingParams(max_tokens=48)] + [SamplingParams(max_tokens=24 + 8 * (i % 5)) for i in range(7)]
    references = [model.generate(p, max_new_tokens=sp.max_tokens, speculative=False).token_ids
                  for p, sp in zip(prompts, params)]

    engine = model.engine()
    assert all(t.lookup == 4 for t in engine.scheduler.trees if t.num_nodes > 1)
    engine.warmup()
    done = run_staggered(engine, prompts, params)
    for i, ref in enumerate(references):
        assert done[i].token_ids == ref, i
    assert engine.stats().totals.accepted_from_lookup > 0  # the repeated sentence, at least
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks

    seeded = SamplingParams(max_tokens=32, temperature=0.8, seed=7)
    alone = engine.generate([prompts[0]], seeded)[0].token_ids
    mixed = engine.generate(prompts[:3] + [prompts[0]], [SamplingParams(max_tokens=32)] * 3 + [seeded])
    assert mixed[-1].token_ids == alone
