"""The public face on the real default model: inputs, streaming, stops, errors, and logits vs transformers."""

import numpy as np
import pytest
import torch

from medusa.attention import CausalAttention
from medusa.medusa_model import MedusaModel, written_lengths

pytestmark = pytest.mark.slow
QUESTION = "A baker makes 24 muffins and sells them in boxes of 4. How many boxes does she sell?"


@pytest.fixture(scope="module")
def model(default_model_dir):
    return MedusaModel.from_pretrained(device="cpu", tree="tree-8")


def test_default_model_logits_match_transformers(model, default_model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([model.encode([{"role": "user", "content": QUESTION}])])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        ours = model.base.compute_logits(model.base(ids, positions, CausalAttention()))
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-3


def test_shipped_heads_and_system_prompt_are_used(model):
    assert model.heads is not None and model.heads.config.base_model == "SmolLM2-135M-Instruct"
    text = model.tokenizer.decode(model.encode([{"role": "user", "content": "hi"}]))
    assert "You are a helpful AI assistant named SmolLM" in text


def test_stream_equals_non_stream_and_reports_stats(model):
    full = model.chat(QUESTION, max_new_tokens=40)
    stream = model.chat(QUESTION, max_new_tokens=40, stream=True)
    deltas = list(stream)
    assert "".join(deltas) == full.text == stream.result.text
    assert stream.result.token_ids == full.token_ids
    assert len(full.token_ids) <= 40 and full.steps == len(full.accepted_lengths)
    assert full.mean_accepted_length == pytest.approx(sum(full.accepted_lengths) / full.steps)
    assert full.mean_accepted_length > 1.0  # the shipped heads do accept on a math prompt
    assert full.tokens_per_second > 0
    # the steps' lengths sum to the tokens written (plus the EOS that ended it), whatever the last step verified;
    # the engine's steps leave out the first token (its prefill's), the batch-1 decoder's first step counts it
    batch = model.generate([QUESTION, "Say yes."], max_new_tokens=9)
    overshot = model.chat("Say yes.", max_new_tokens=40, tree="tree-16")  # its last step verified 43 tokens
    for result, prefill_token in ((full, 0), (overshot, 0), (batch[0], 1), (batch[1], 1)):
        written = len(result.token_ids) + (result.finish_reason == "stop") - prefill_token
        assert sum(result.accepted_lengths) == written


def test_written_lengths_cut_what_the_last_steps_verified_past_the_end():
    assert written_lengths([3, 4, 4], 9) == [3, 4, 2]
    assert written_lengths([3, 4], 7) == [3, 4] and written_lengths([3, 4, 1], 7) == [3, 4]


def test_a_plain_answer_that_ends_accepts_one_token_a_step(model):
    """Its last step writes the end-of-sequence token, which token_ids leaves out: still 1 token a step."""
    plain = model.chat("Say hello.", max_new_tokens=40, speculative=False)
    assert plain.finish_reason == "stop" and plain.steps == len(plain.token_ids) + 1
    assert plain.mean_accepted_length == 1.0


def test_plain_and_medusa_agree_and_inputs_are_equivalent(model):
    medusa = model.chat(QUESTION, max_new_tokens=32)
    plain = model.chat(QUESTION, max_new_tokens=32, speculative=False)
    assert medusa.token_ids == plain.token_ids and plain.mean_accepted_length == 1.0
    ids = model.encode([{"role": "user", "content": QUESTION}])
    assert model.generate(ids, max_new_tokens=32).token_ids == medusa.token_ids
    assert model.generate(torch.tensor([ids]), max_new_tokens=32).token_ids == medusa.token_ids
    assert model.generate(np.array(ids), max_new_tokens=32).token_ids == medusa.token_ids  # NumPy ids too
    assert model.generate([np.int64(t) for t in ids], max_new_tokens=32).token_ids == medusa.token_ids


def test_stop_strings_length_and_eos(model):
    free = model.chat(QUESTION, max_new_tokens=48)
    word = free.text.split()[3]
    cut = model.chat(QUESTION, max_new_tokens=48, stop=[word])
    assert cut.finish_reason == "stop" and word not in cut.text and free.text.startswith(cut.text)
    short = model.chat(QUESTION, max_new_tokens=5)
    assert short.finish_reason == "length" and len(short.token_ids) == 5
    done = model.chat("Say only the word yes.", max_new_tokens=64)
    assert done.finish_reason == "stop" and len(done.token_ids) < 64  # ended at <|im_end|>


def test_seeded_sampling_is_reproducible_and_typical_runs(model):
    a = model.chat(QUESTION, max_new_tokens=24, temperature=0.8, seed=3)
    b = model.chat(QUESTION, max_new_tokens=24, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids
    typical = model.chat(QUESTION, max_new_tokens=24, temperature=0.8, seed=3, acceptance="typical")
    assert len(typical.token_ids) == 24 or typical.finish_reason == "stop"


def test_min_p_reaches_both_paths_and_stays_lossless(model):
    """Seeded sampling with min_p: speculation gives plain decoding's text on the batch-1 decoder and on the
    engine (a list of prompts), and a strict min_p changes what a loose temperature samples."""
    options = dict(max_new_tokens=20, temperature=1.5, seed=5, min_p=0.2)
    medusa = model.chat(QUESTION, **options)
    assert medusa.token_ids == model.chat(QUESTION, speculative=False, **options).token_ids
    assert medusa.token_ids != model.chat(QUESTION, max_new_tokens=20, temperature=1.5, seed=5).token_ids
    batch = model.generate(["Hello", "The capital of France is"], **options)
    alone = model.generate(["The capital of France is"], speculative=False, **options)
    assert batch[1].token_ids == alone[0].token_ids


def test_list_of_prompts_returns_a_list(model):
    outs = model.generate(["Hello", "The capital of France is"], max_new_tokens=4)
    assert isinstance(outs, list) and len(outs) == 2 and all(len(o.token_ids) == 4 for o in outs)


def test_a_list_of_conversations_or_of_id_lists_is_a_batch(model):
    """Each prompt of a batch may be a conversation or token ids, as one prompt may: the same tokens as alone."""
    chats = [[{"role": "user", "content": "Hello"}], [{"role": "user", "content": QUESTION}]]
    batch = model.generate(chats, max_new_tokens=6)
    assert [o.token_ids for o in batch] == [model.chat(c, max_new_tokens=6).token_ids for c in chats]
    ids = [model.encode(c) for c in chats]
    assert [o.token_ids for o in model.generate(ids, max_new_tokens=6)] == [o.token_ids for o in batch]


@pytest.mark.parametrize("bad, error", [
    ([{"role": "wizard", "content": "x"}], "role"),
    ([], "empty"),
    ([10**9], "outside the vocabulary"),
    ({"prompt": "x"}, "prompt string"),
    ([True, False], "prompt string"),  # no token ids (it failed deep in the embedding)
])
def test_bad_inputs_are_named(model, bad, error):
    with pytest.raises((ValueError, TypeError), match=error):
        model.generate(bad, max_new_tokens=2)


def test_bad_settings_are_named(model):
    with pytest.raises(ValueError, match="temperature"):
        model.chat("x", temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.chat("x", top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.chat("x", max_new_tokens=0)
    with pytest.raises(ValueError, match="context"):
        model.chat("x", max_new_tokens=10**6)
    with pytest.raises(ValueError, match="acceptance"):
        model.chat("x", acceptance="optimistic")


@pytest.mark.parametrize("kwargs, error", [
    (dict(tree="tree-999"), "unknown tree 'tree-999'; available: "),
    (dict(dtype="float8"), "dtype must be one of float32, bfloat16, float16 .or 'auto'., got 'float8'"),
    (dict(dtype=torch.int8), "dtype must be one of"),
])
def test_bad_load_settings_are_named_before_the_weights_load(kwargs, error):
    with pytest.raises(ValueError, match=error):
        MedusaModel.from_pretrained("/no/such/model", **kwargs)  # the path is never read


def test_heads_of_a_wrong_type_are_named_before_the_weights_load():
    with pytest.raises(TypeError, match="heads must be a heads folder or file, a MedusaHeads or None, got int"):
        MedusaModel.from_pretrained("/no/such/model", heads=123)


@pytest.mark.parametrize("kwargs, error", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer, got True"),
    (dict(seed=-1), r"seed must be in \[0, 2\*\*63\), got -1"),
    (dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(stop=5), "stop must be a string or a list of strings, got 5"),
])
def test_generate_names_a_bad_setting_on_the_batch1_path_too(model, kwargs, error):
    """The batch-1 decoder (a pinned tree on any device) runs on settings checked as the engine's are."""
    with pytest.raises((TypeError, ValueError), match=error):
        model.generate("x", **kwargs)


def test_dtype_by_name(default_model_dir):
    assert MedusaModel.from_pretrained(device="cpu", dtype="bfloat16").base.embed_tokens.weight.dtype == torch.bfloat16


def test_the_tree_measured_here_is_gated_and_a_pinned_one_is_not(model, monkeypatch):
    """Only the automatic choice may fall back to plain steps (speculation_gate.py): a tree the
    caller named runs as named."""
    import medusa.medusa_model as medusa_model
    from medusa.tree import TreeSpec

    assert model.decoder().gate is None  # the fixture pins tree-8
    monkeypatch.setattr(medusa_model, "choose_tree", lambda base, heads: TreeSpec.load("tree-4"))
    monkeypatch.setattr(model, "_tree_choice", None)
    monkeypatch.setattr(model, "_auto_choice", None)
    auto = model.decoder()
    assert auto.gate is not None and auto.tree.spec == TreeSpec.load("tree-4").with_lookup(model.prompt_lookup)
    assert model.decoder(model.resolve_tree()) is auto  # the CLI passes the resolved tree back
    assert model.decoder("tree-4").gate is None and model.decoder("single").gate is None
    medusa = model.chat(QUESTION, max_new_tokens=24)
    assert medusa.token_ids == model.chat(QUESTION, max_new_tokens=24, speculative=False).token_ids
    # on a GPU an unpinned prompt runs on the engine: measuring the tree once must not pin it
    assert not model._pinned(None) and not model._pinned(model.resolve_tree()) and not model._pinned("auto")
    assert model._pinned("tree-4") and model._pinned(TreeSpec.load("tree-4"))
    monkeypatch.setattr(model, "_tree_choice", "tree-8")
    assert model._pinned(None)


def test_guided_generation_answers_in_the_pattern_or_schema(model):
    """guided_regex / guided_json / guided_grammar / guided_choice run on the engine (even with a tree pinned at load
    time)."""
    import json
    import re

    phone = model.generate("Give me a phone number.", max_new_tokens=24, guided_regex=r"\(\d{3}\) \d{3}-\d{4}")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    cat = model.generate("Give me a JSON object with a cat's name and age.", max_new_tokens=48, guided_json=schema)
    assert set(json.loads(cat.text)) == {"name", "age"}
    plain = model.generate("Give me a phone number.", max_new_tokens=24, guided_regex=r"\(\d{3}\) \d{3}-\d{4}",
                           speculative=False)
    assert plain.token_ids == phone.token_ids
    [yes_no] = model.generate(["Is the sea salty?"], max_new_tokens=4, guided_choice=["Yes", "No"])
    assert yes_no.text in ("Yes", "No")
    grammar = 'root ::= num " + " num " = " [0-9]{1,2}\nnum ::= [0-9] num | [0-9]'
    sum_ = model.generate("What is 2 + 3?", max_new_tokens=16, guided_grammar=grammar)
    assert re.fullmatch(r"\d+ \+ \d+ = \d{1,2}", sum_.text) and sum_.finish_reason == "stop"
    with pytest.raises(ValueError, match="leave tree= and acceptance= out"):
        model.generate("Hi", guided_regex="a+", tree="tree-4")


def test_heads_none_loads_the_default_model_without_heads(model):
    plain = MedusaModel.from_pretrained(device="cpu", heads="none")
    assert plain.heads is None
    ids = model.encode([{"role": "user", "content": QUESTION}])
    assert plain.generate(ids, max_new_tokens=8).token_ids == model.generate(ids, max_new_tokens=8).token_ids


def test_medusa2_heads_merge_their_adapter_and_say_so(model, tmp_path):
    import json
    import shutil

    from safetensors.torch import save_file

    from medusa.cli import adapter_note
    from medusa.default_model import default_heads_path

    heads = tmp_path / "heads"
    shutil.copytree(default_heads_path(), heads)
    name = next(n for n, _ in model.base.named_modules() if n.endswith("down_proj"))
    weight = model.base.get_submodule(name).weight  # [out, in]
    a, b = torch.ones(2, weight.shape[1]), torch.full((weight.shape[0], 2), 1e-3)
    save_file({f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b}, str(heads / "adapter.safetensors"))
    (heads / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["down_proj"]}))
    adapted = MedusaModel.from_pretrained(device="cpu", heads=heads)
    assert adapted.merged_adapter == heads and model.merged_adapter is None
    moved = adapted.base.get_submodule(name).weight - weight
    assert torch.allclose(moved, torch.full_like(weight, 2 * 2e-3), atol=1e-5)
    assert "Medusa-2 LoRA adapter" in adapter_note(adapted.merged_adapter) and adapter_note(None) == ""


def test_chat_takes_a_batch_of_user_messages_or_of_conversations(model):
    """chat() with a list of strings: each one user message, chat-templated (it ran each as raw text), as vLLM's
    LLM.chat takes a batch; a list of conversations is a batch too."""
    questions = ["Hello", QUESTION]
    batch = model.chat(questions, max_new_tokens=6)
    assert [o.token_ids for o in batch] == [model.chat(q, max_new_tokens=6).token_ids for q in questions]
    assert batch[0].prompt_tokens == len(model.encode([{"role": "user", "content": "Hello"}]))
    conversations = [[{"role": "user", "content": q}] for q in questions]
    assert [o.token_ids for o in model.chat(conversations, max_new_tokens=6)] == [o.token_ids for o in batch]


def test_vllm_and_hugging_face_settings_reach_generate(model):
    """top_k=-1 is off on every path (the batch-1 decoder refused it); do_sample is Hugging Face's switch;
    penalties, stop_token_ids and min_tokens run on the engine, alone or in a batch, as SamplingParams' do."""
    from medusa.decoding.sampling_params import SamplingParams

    greedy = model.chat(QUESTION, max_new_tokens=8)
    assert model.chat(QUESTION, max_new_tokens=8, top_k=-1).token_ids == greedy.token_ids  # greedy: top_k is moot
    assert model.chat(QUESTION, max_new_tokens=8, do_sample=False, temperature=0.9).token_ids == greedy.token_ids
    sampled = model.chat(QUESTION, max_new_tokens=8, do_sample=True, seed=3)  # temperature 1
    assert sampled.token_ids == model.chat(QUESTION, max_new_tokens=8, temperature=1.0, seed=3).token_ids
    assert model.chat(QUESTION, max_new_tokens=8, temperature=0.8, top_k=-1, seed=3).token_ids \
        == model.chat(QUESTION, max_new_tokens=8, temperature=0.8, top_k=0, seed=3).token_ids
    ids = model.encode([{"role": "user", "content": QUESTION}])
    engine_out = model.engine().generate(ids, SamplingParams(max_tokens=12, repetition_penalty=1.3))[0]
    assert model.generate(ids, max_new_tokens=12, repetition_penalty=1.3).token_ids == engine_out.token_ids
    stop_at = greedy.token_ids[3]
    cut = model.chat(QUESTION, max_new_tokens=8, stop_token_ids=[stop_at])
    assert cut.token_ids == greedy.token_ids[:greedy.token_ids.index(stop_at)] and cut.finish_reason == "stop"
    [short] = model.chat([QUESTION], max_new_tokens=8, stop_token_ids=[stop_at], min_tokens=6)
    assert len(short.token_ids) >= 6
    with pytest.raises(ValueError, match="repetition_penalty runs on the batching engine"):
        model.chat(QUESTION, repetition_penalty=1.2, tree="tree-4")


@pytest.mark.parametrize("kwargs, error", [
    (dict(stream="yes"), "stream must be a bool, got 'yes'"),
    (dict(speculative="no"), "speculative must be a bool, got 'no'"),  # truthy: it speculated
    (dict(tree=5), "tree must be a tree's name"),
    (dict(do_sample="yes"), "do_sample must be a bool or None"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
])
def test_generate_checks_its_own_arguments(model, kwargs, error):
    with pytest.raises(ValueError, match=error):
        model.generate("x", max_new_tokens=2, **kwargs)


def test_a_stream_keeps_its_result_when_iterated_again(model):
    stream = model.chat("Say yes.", max_new_tokens=6, stream=True)
    text = "".join(stream)
    assert list(stream) == [] and stream.result is not None and stream.result.text == text


def test_a_tree_is_a_name_a_file_or_a_spec_and_anything_else_is_refused_at_once(model, tmp_path):
    """generate(tree=...) takes a name, a JSON file's path (str or Path) or a TreeSpec; a dict, a list or a
    number fails at the call, by name, and a tree whose ranks pass the heads' vocabulary before any step."""
    from medusa.tree import TreeSpec

    for bad in ({"paths": [[0]]}, [[0]], 5):
        with pytest.raises(ValueError, match="tree must be a tree's name.*a JSON file's path"):
            model.generate(QUESTION, tree=bad, max_new_tokens=2)
    file = tmp_path / "two.json"
    TreeSpec.chain(2, name="two").save(file)
    want = model.generate(QUESTION, max_new_tokens=4, speculative=False).token_ids
    assert model.generate(QUESTION, tree=file, max_new_tokens=4).token_ids == want
    wide = TreeSpec.from_paths([(100_000,)], name="wide")
    with pytest.raises(ValueError, match="uses rank 100000, but the heads rank a vocabulary of 49152 tokens"):
        model.generate(QUESTION, tree=wide, max_new_tokens=2)
