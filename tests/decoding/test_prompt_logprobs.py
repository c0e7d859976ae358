"""SamplingParams.prompt_logprobs: each prompt token's log-probability under the model, from the prefill's hidden
states, equal to a full forward's whatever the chunking, the prefix cache, speculation or a preemption."""

import pytest
import torch

from engine_driver import force_overlap, random_prompts, single_thread
from medusa.attention import CausalAttention
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from tiny_models import tiny_decoder

VOCAB = 40


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch):
    return force_overlap(request, monkeypatch)


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=3)


@torch.no_grad()
def reference(model, prompt, k):
    """(logprob, rank, top-k ids) of prompt[q + 1] from one causal forward over the whole prompt."""
    ids = torch.tensor(prompt)
    logp = torch.log_softmax(model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention())).float(), -1)
    return [(logp[q, prompt[q + 1]].item(), 1 + int((logp[q] > logp[q, prompt[q + 1]]).sum()),
             logp[q].topk(k).indices.tolist()) for q in range(len(prompt) - 1)]


def check(out, model, prompt, k):
    noted = out.prompt_logprobs
    assert len(noted) == len(prompt) and noted[0] is None
    for q, (entry, (logprob, rank, top)) in enumerate(zip(noted[1:], reference(model, prompt, k))):
        assert entry.token_id == prompt[q + 1] and entry.logprob == pytest.approx(logprob, abs=1e-4), q
        assert entry.rank == rank, q
        assert [t for t, _ in entry.top] == top and len(entry.top) == k


@pytest.mark.parametrize("chunk", [4096, 9])  # the whole prompt in one prefill, or chunks of at most 9 tokens
@pytest.mark.parametrize("speculate", [False, True])
def test_prompt_logprobs_equal_a_full_forwards(tiny, chunk, speculate):
    model, heads = tiny
    config = EngineConfig(num_blocks=64, block_size=4, scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=3))
    engine = LLMEngine(model, heads if speculate else None, config)
    prompts = random_prompts(3, VOCAB, 40, seed=1)
    params = [SamplingParams(max_tokens=5, prompt_logprobs=3), SamplingParams(max_tokens=5),
              SamplingParams(max_tokens=5, prompt_logprobs=0, logprobs=1)]
    outs = engine.generate(prompts, params)
    check(outs[0], model, prompts[0], 3)
    check(outs[2], model, prompts[2], 0)
    assert outs[1].prompt_logprobs is None and len(outs[2].new_logprobs or []) <= 5


def test_the_prefix_cache_is_not_read_for_prompt_logprobs(tiny):
    """A cached prefix has no hidden states: such a request computes its prompt whole (and still leaves its
    own blocks for others to share)."""
    model, _ = tiny
    engine = LLMEngine(model, None, EngineConfig(num_blocks=64, block_size=4))
    prompt = random_prompts(1, VOCAB, 30, seed=2)[0] + [1] * 20
    engine.generate([prompt], SamplingParams(max_tokens=2))  # fills the cache
    out = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    check(out, model, prompt, 1)
    assert out.stats is not None and engine.blocks.num_free_blocks == 64
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.step()
    assert engine.requests[rid].seq.num_cached_prefix_tokens > 0  # the plain request does read the cache
    while engine.has_unfinished():
        engine.step()


def test_preemption_notes_each_prompt_position_once(tiny):
    """A pool too small for the load preempts (recompute); the recomputed prompt adds no second entry."""
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=24, block_size=4))
    preempted, schedule = [], engine.scheduler.schedule

    def counting(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        preempted.extend(plan.preempted if plan is not None else [])
        return plan
    engine.scheduler.schedule = counting
    prompts = random_prompts(6, VOCAB, 24, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, prompt_logprobs=2, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        check(out, model, prompt, 2)
    assert preempted and engine.blocks.num_free_blocks == 24


@pytest.mark.parametrize("value", [-1, 21, 1.0])
def test_prompt_logprobs_validation_names_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
