"""The engine on the real default model: 32 Spec-Bench prompts, staggered, mixed lengths and stops.

Greedy outputs equal each prompt's batch-1 plain greedy output.
"""

import json

import pytest

from engine_driver import count_launches, run_staggered, without_policy
from medusa.decoding.sampling_params import SamplingParams
from medusa.medusa_model import MedusaModel
from medusa.training.data import DATA_DIR

pytestmark = pytest.mark.slow


def test_32_staggered_requests_match_batch1_plain_greedy(default_model_dir):
    model = MedusaModel.from_pretrained(device="cpu")
    rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
    prompts = [model.encode([{"role": "user", "content": r["turns"][0][:400]}]) for r in rows[::15][:32]]
    params = [SamplingParams(max_tokens=6 + (i * 5) % 19, stop=(".", "\n", ",") if i % 4 == 0 else ()) for i in range(32)]
    references = [model.generate(p, max_new_tokens=sp.max_tokens, stop=list(sp.stop), speculative=False)
                  for p, sp in zip(prompts, params)]

    engine = without_policy(model.engine())  # trees every step, whatever the CPU's timings chose
    done = run_staggered(engine, prompts, params, per_step=4)
    check(done, references)
    assert sum(d.stats.accepted_tokens for d in done.values()) > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks

    # each step launched before the last one is read back (EngineConfig.overlap, a GPU's default): the
    # device places every tree after the tokens of the step still in flight
    engine = model.engine()
    engine.overlap = True
    launched = count_launches(engine)
    done = run_staggered(engine, prompts, params, per_step=4)
    check(done, references)
    assert max(launched) > 1 and len(launched) > 10  # speculative steps overlapped (plain ones: test_engine_overlap)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def check(done, references):
    for i, ref in enumerate(references):
        assert done[i].token_ids == ref.token_ids, i
        assert done[i].text == ref.text and done[i].finish_reason == ref.finish_reason
    assert any(done[i].finish_reason == "stop" for i in range(0, 32, 4))
