"""Bad input to the engine's API is refused at once, with an error that names the problem
(not a TypeError from deep inside, a silent default, or a device-side index error later)."""

import numpy as np
import pytest

from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from tiny_models import tiny_decoder

VOCAB = 24


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=1.5), "max_tokens must be an integer, got 1.5"),
    (dict(max_tokens=True), "max_tokens must be an integer, got True"),
    (dict(seed="7"), "seed must be an integer, got '7'"),
    (dict(n=2.0), "n must be an integer"),
    (dict(top_k=None), "top_k must be an integer"),
    (dict(logprobs=1.0), "logprobs must be an integer"),
    (dict(temperature="0.7"), "temperature must be a number, got '0.7'"),
    (dict(stop=[""]), "stop strings must be non-empty strings, got ''"),
    (dict(stop=["end", 3]), "stop strings must be non-empty strings, got 3"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be token ids \(integers >= 0\), got -1"),
    (dict(stop_token_ids=["2"]), "stop_token_ids must be token ids"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be a bool, got 1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(min_p="0.1"), "min_p must be a number"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool, got 'yes'"),
    (dict(speculative="no"), "speculative must be a bool, got 'no'"),  # "no" is truthy: it would speculate
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids, got 5"),
    (dict(top_k=-2), r"top_k must be >= 0 \(0, or -1 as vLLM has it, is off\), got -2"),
])
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_what_clients_send():
    assert SamplingParams(stop="###").stop == ("###",)  # one string, as the OpenAI API allows
    params = SamplingParams(max_tokens=np.int64(8), seed=np.int32(3), stop_token_ids=[np.int64(5)], temperature=1)
    assert params.stop_token_ids == (5,) and type(params.stop_token_ids[0]) is int
    vllm_defaults = SamplingParams(top_k=-1, stop_token_ids=None, temperature=np.float32(0.5))  # vLLM's "off"s
    assert (vllm_defaults.top_k, vllm_defaults.stop_token_ids) == (0, ())
    assert vllm_defaults.temperature == 0.5 and type(vllm_defaults.temperature) is float


def test_generate_refuses_one_string_as_guided_choice():
    """guided_choice="yes" became the choices y, e, s (a one-letter answer): refused as SamplingParams refuses it."""
    from medusa.medusa_model import generate_params

    with pytest.raises(ValueError, match="guided_choice must be a list"):
        generate_params(guided_choice="yes")
    assert generate_params(guided_choice=["yes", "no"]).guided_choice == ("yes", "no")


@pytest.mark.parametrize("kwargs, message", [
    (dict(trees=()), "trees is empty"),
    (dict(max_graph_tokens=0), "max_graph_tokens must be an integer >= 1, got 0"),
    (dict(apply_interval=0), "apply_interval must be an integer >= 1, got 0"),
    (dict(apply_interval=True), "apply_interval must be an integer >= 1, got True"),
    (dict(apply_interval=2.0), "apply_interval must be an integer >= 1, got 2.0"),
])
def test_engine_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.fixture(scope="module")
def engine():
    model, heads = tiny_decoder(VOCAB, num_heads=2)
    return LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4))


@pytest.mark.parametrize("prompt, message", [
    ([1, 2, VOCAB], rf"prompt token id {VOCAB} is outside the model's vocabulary \[0, {VOCAB}\)"),
    ([3, -1], r"prompt token id -1 is outside"),
    ([1, 2.5], "prompt token ids must be integers, got 2.5"),
    ([[1, 2]], "prompt token ids must be integers"),
])
def test_engine_rejects_prompt_ids_outside_the_vocabulary(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    assert not engine.has_unfinished()  # nothing half-added


def test_engine_rejects_stop_token_ids_past_the_vocabulary(engine):
    with pytest.raises(ValueError, match=rf"stop_token_ids names token ids \[{VOCAB + 1}\] past the model's vocab"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[2, VOCAB + 1]))
    with pytest.raises(ValueError, match=rf"logit_bias names token ids \[{VOCAB}\] past the model's vocabulary"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, logit_bias={1: 5.0, VOCAB: -5.0}))
    with pytest.raises(ValueError, match=rf"allowed_token_ids names token ids \[{VOCAB + 1}\] past the model's"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, allowed_token_ids=[2, VOCAB + 1]))
    assert not engine.has_unfinished()


def test_engine_rejects_trees_deeper_than_the_heads():
    model, heads = tiny_decoder(VOCAB, num_heads=2)
    with pytest.raises(ValueError, match="no tree in config.trees fits the heads: each needs more than their 2 heads"):
        LLMEngine(model, heads, EngineConfig(trees=("chain-3", "chain-4")))
    # a tree the user gave is refused by name, not dropped beside ones that fit; the defaults deeper are dropped
    with pytest.raises(ValueError, match=r"config.trees: tree chain-3: path \(0, 0, 0\) has depth 3 but the heads"):
        LLMEngine(model, heads, EngineConfig(trees=("single", "chain-3")))
    assert all(t.head_depth <= 2 for t in LLMEngine(model, heads, EngineConfig()).scheduler.trees)


def test_engine_rejects_a_tree_ranking_past_the_heads_vocabulary():
    from medusa.tree import TreeSpec

    model, heads = tiny_decoder(VOCAB, num_heads=2)
    wide = TreeSpec.from_paths([(VOCAB,)], name="wide")
    with pytest.raises(ValueError, match=rf"tree wide: path \({VOCAB},\) uses rank {VOCAB}, but the heads rank a "
                                         rf"vocabulary of {VOCAB} tokens"):
        LLMEngine(model, heads, EngineConfig(trees=("single", wide)))


@pytest.mark.parametrize("trees,message", [
    ("tree-4", "trees must be a tuple of trees, got one: 'tree-4'"),
    ((5,), "trees holds 5: each tree is a name"),
    (("single", {"paths": [[0]]}), "trees holds {'paths': \\[\\[0\\]\\]}: each tree is a name"),
])
def test_engine_config_names_a_bad_trees_value(trees, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(trees=trees)


@pytest.mark.parametrize("request_id", ["", 5])
def test_engine_refuses_a_request_id_that_is_no_name(engine, request_id):
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id=request_id)
    assert not engine.has_unfinished()


def test_engine_takes_prompt_ids_as_a_list_tensor_or_array(engine):
    import torch

    outs = engine.generate([[1, 2, 3], torch.tensor([1, 2, 3]), np.array([1, 2, 3])], SamplingParams(max_tokens=3))
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    # one prompt alone as a tensor, an array or a list of NumPy integers; a 2-D tensor is a batch, a row a prompt
    params = SamplingParams(max_tokens=3)
    for one in (torch.tensor([1, 2, 3]), np.array([1, 2, 3]), [np.int64(1), np.int64(2), np.int32(3)]):
        assert [o.token_ids for o in engine.generate(one, params)] == [outs[0].token_ids]
    rows = engine.generate(torch.tensor([[1, 2, 3], [1, 2, 3]]), params)
    assert [o.token_ids for o in rows] == [outs[0].token_ids] * 2


def test_generate_checks_its_arguments_and_leaves_nothing_queued(engine):
    with pytest.raises(ValueError, match="got 2 prompts but 1 SamplingParams: give one, or one per prompt"):
        engine.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=3)])
    with pytest.raises(ValueError, match="params must be a SamplingParams .or one per prompt., got dict"):
        engine.generate([[1, 2]], {"max_tokens": 3})
    with pytest.raises(ValueError, match="a prompt is a string or a sequence of token ids, got NoneType"):
        engine.generate([[1, 2], [3, 4], None], SamplingParams(max_tokens=3))
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert [len(o.token_ids) for o in engine.generate([[1, 2], iter([3, 4])], SamplingParams(max_tokens=3))] == [3, 3]
