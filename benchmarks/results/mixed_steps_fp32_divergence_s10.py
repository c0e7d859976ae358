# Which engine configuration's greedy outputs part from batch-1 plain greedy on the GPU (fp32), and the
# reference's top-2 logit margin where they part (a near-tie, or a bug)
import json
import sys
from dataclasses import replace

import torch

sys.path.insert(0, "tests")
from engine_driver import run_staggered
from medusa.attention import CausalAttention
from medusa.decoding.engine import LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.medusa_model import MedusaModel
from medusa.training.data import DATA_DIR

model = MedusaModel.from_pretrained(device="cuda", dtype=torch.float32)
rows = [json.loads(line) for line in (DATA_DIR / "spec_bench.jsonl").read_text().splitlines()]
prompts = [model.encode([{"role": "user", "content": r["turns"][0][:400]}]) for r in rows[7::50][:9]]
params = [SamplingParams(max_tokens=16 + 8 * (i % 3)) for i in range(len(prompts))]
refs = [model.generate(p, max_new_tokens=sp.max_tokens, speculative=False).token_ids for p, sp in zip(prompts, params)]


@torch.inference_mode()
def margin(prompt, out, j):
    ids = torch.tensor(prompt + out[:j], device="cuda")
    hidden = model.base(ids, torch.arange(len(ids), device="cuda"), CausalAttention())
    top = model.base.compute_logits(hidden[-1:]).float().topk(2).values[0]
    return float(top[0] - top[1])


for mixed, overlap, spec, graphs in [(0, False, True, True), (0, True, True, True), (512, True, True, True),
                                     (512, False, True, True), (512, True, False, True), (0, True, False, True),
                                     (512, False, True, False)]:
    config = replace(model.engine_config(), mixed_prompt_tokens=mixed, overlap=overlap, cuda_graphs=graphs)
    engine = LLMEngine(model.base, model.heads if spec else None, config, model.tokenizer, sorted(model.eos_token_ids))
    done = run_staggered(engine, prompts, params, per_step=1)
    bad = []
    for i, ref in enumerate(refs):
        got = done[i].token_ids
        if got != ref:
            j = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            bad.append((i, j, len(got), len(ref), round(margin(prompts[i], ref, j), 5) if j < len(ref) else None))
    mixed_graphs = sum(1 for key in engine.runner.decode._graphs if key[-1] > 0)
    print(f"mixed={mixed} overlap={overlap} spec={spec} graphs={graphs} mixed_graphs={mixed_graphs} "
          f"differ={bad}", flush=True)
