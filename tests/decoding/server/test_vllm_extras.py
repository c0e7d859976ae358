"""What a vLLM endpoint has beyond OpenAI's API: /tokenize, /detokenize and /version; the chat template options of
/v1/chat/completions; include_stop_str_in_output, truncate_prompt_tokens, continuous usage, stop_reason; OpenAI's
echo with logprobs (the prompt's logprobs, as evaluation harnesses score) and vLLM's prompt_logprobs. Text prompts
get the tokenizer's own special tokens (a BOS where it adds one) wherever they enter."""

from __future__ import annotations

import json
import re

import pytest
import torch
from fastapi.testclient import TestClient

import medusa
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.sampling_params import SamplingParams
from medusa.attention import CausalAttention
from medusa.decoding.server import build_app

MSG = [{"role": "user", "content": "Name a colour."}]
STARTED = MSG + [{"role": "assistant", "content": "The colour is"}]


def post(client, path, body):
    raw = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def error_param(resp, status):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]["param"]


@pytest.fixture(scope="module")
def client(tiny_model):
    app = build_app(tiny_model, "tiny", api_key="secret", engine_config=EngineConfig(num_blocks=128))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def served_prompt_tokens(client, path, body):
    """The prompt tokens a completion request ran (its usage)."""
    resp = client.post(path, json={**body, "max_tokens": 1}, headers={"Authorization": "Bearer secret"})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def test_a_prompt_tokenizes_to_what_a_completion_runs(client, tiny_model):
    resp = post(client, "/tokenize", {"prompt": "Hello there, world"})  # no API key, as on a vLLM server
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tiny_model.encode("Hello there, world") and body["count"] == len(body["tokens"])
    assert body["token_strs"] is None and body["max_model_len"] == client.app.state.server.max_model_len
    assert served_prompt_tokens(client, "/v1/completions", {"prompt": "Hello there, world"}) == body["count"]
    strs = post(client, "/tokenize", {"prompt": "Hello there", "return_token_strs": True}).json()["token_strs"]
    assert strs == tiny_model.tokenizer.convert_ids_to_tokens(tiny_model.encode("Hello there")) == ["Hello", "Ġthere"]


def test_messages_tokenize_to_what_a_chat_completion_runs(client, tiny_model):
    resp = post(client, "/tokenize", {"messages": MSG})
    ids = resp.json()["tokens"]
    text = tiny_model.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.") and text.endswith("<|im_start|>assistant\n")
    assert served_prompt_tokens(client, "/v1/chat/completions", {"messages": MSG}) == len(ids)


def test_the_chat_template_options_shape_the_prompt(client, tiny_model):
    decode = tiny_model.tokenizer.decode
    closed = post(client, "/tokenize", {"messages": MSG, "add_generation_prompt": False}).json()["tokens"]
    assert decode(closed).endswith("Name a colour.<|im_end|>\n")
    options = {"messages": STARTED, "add_generation_prompt": False, "continue_final_message": True}
    continued = post(client, "/tokenize", options).json()["tokens"]
    assert decode(continued).endswith("<|im_start|>assistant\nThe colour is")  # the reply goes on from there
    assert served_prompt_tokens(client, "/v1/chat/completions", options) == len(continued)
    both = {"messages": STARTED, "continue_final_message": True}  # add_generation_prompt is true by default
    assert error_param(post(client, "/tokenize", both), 400) == "messages"
    chat = {"messages": STARTED, "continue_final_message": True, "max_tokens": 1}
    assert error_param(client.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer secret"}),
                       400) == "messages"


def test_detokenize_gives_the_text_back(client, tiny_model):
    ids = post(client, "/tokenize", {"messages": MSG}).json()["tokens"]
    resp = post(client, "/detokenize", {"tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": tiny_model.tokenizer.decode(ids)}
    assert "<|im_start|>" in resp.json()["prompt"]  # special tokens are kept: the ids round-trip
    assert error_param(post(client, "/detokenize", {"tokens": [5, 10**9]}), 400) == "tokens"


@pytest.mark.parametrize("path,body,status", [
    ("/tokenize", "{", 400), ("/tokenize", {}, 400), ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"messages": []}, 400), ("/tokenize", {"prompt": "x", "model": "other"}, 404),
    ("/detokenize", {"tokens": "abc"}, 400), ("/detokenize", {"tokens": [1], "model": "other"}, 404),
])
def test_bad_tokenize_requests_get_error_objects(client, path, body, status):
    resp = post(client, path, body)
    assert resp.status_code == status and set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_version(client):
    assert client.get("/version").json() == {"version": medusa.__version__}


def test_text_prompts_get_the_tokenizers_bos(tiny_model, default_model_dir):
    """A tokenizer that adds a BOS (Llama's) gets it on text prompts, through MedusaModel, the engine and
    /tokenize alike, and not a second one on a chat template's text."""
    from transformers import AutoTokenizer

    from medusa.medusa_model import MedusaModel

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir), add_bos_token=True)
    bos = tokenizer.bos_token_id
    model = MedusaModel(tiny_model.base, tokenizer, tiny_model.heads, system_prompt="Be brief.")
    ids = model.encode("Hello there")
    assert ids[0] == bos and ids[1:] == tiny_model.encode("Hello there")
    assert model.encode(MSG).count(bos) == tiny_model.encode(MSG).count(bos)  # the template's own, nothing added
    engine = LLMEngine(model.base, None, EngineConfig(num_blocks=64), tokenizer)
    rid = engine.add_request("Hello there", SamplingParams(max_tokens=2))
    assert engine.requests[rid].seq.prompt_token_ids == ids and engine.abort(rid)
    with TestClient(build_app(model, "tiny", engine_config=EngineConfig(num_blocks=64))) as client:
        assert post(client, "/tokenize", {"prompt": "Hello there"}).json()["tokens"] == ids
        plain = post(client, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()["tokens"]
        assert plain == ids[1:]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, tiny_model):
    long = "one two three four five six seven eight nine ten"
    assert served_prompt_tokens(client, "/v1/completions", {"prompt": long, "truncate_prompt_tokens": 4}) == 4
    assert served_prompt_tokens(client, "/v1/chat/completions", {"messages": MSG, "truncate_prompt_tokens": 3}) == 3
    whole = len(tiny_model.encode(long))
    assert served_prompt_tokens(client, "/v1/completions", {"prompt": long, "truncate_prompt_tokens": -1}) == whole
    assert served_prompt_tokens(client, "/v1/completions", {"prompt": long, "truncate_prompt_tokens": 500}) == whole
    for bad in (0, -2):
        resp = client.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": bad},
                           headers={"Authorization": "Bearer secret"})
        assert error_param(resp, 400) == "truncate_prompt_tokens"


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    auth = {"Authorization": "Bearer secret"}
    free = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 12, "temperature": 0},
                       headers=auth).json()["choices"][0]["text"]
    stop = free[len(free) // 2: len(free) // 2 + 2]  # two characters from the middle of the greedy text
    assert stop.strip() and stop in free
    body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "stop": [stop]}
    cut = client.post("/v1/completions", json=body, headers=auth).json()["choices"][0]
    kept = client.post("/v1/completions", json={**body, "include_stop_str_in_output": True},
                       headers=auth).json()["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop and free.startswith(kept["text"])
    assert cut["stop_reason"] == kept["stop_reason"] == stop


def test_stop_reason_names_the_stop_string_or_token(client, tiny_model):
    """vLLM's stop_reason: the stop string or stop_token_ids token that ended a choice; None for the length (and
    EOS); on a full response and on a stream's last chunk, chat and completions alike."""
    auth = {"Authorization": "Bearer secret"}
    free = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 12, "temperature": 0},
                       headers=auth).json()["choices"][0]
    ids = tiny_model.tokenizer("Once upon" + free["text"], add_special_tokens=False)["input_ids"]
    token = ids[-6]  # a token of the greedy answer's middle
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    stop = free["text"][len(free["text"]) // 2:][:2]
    cases = [({"stop": ["zzzz-never", stop]}, stop), ({"stop_token_ids": [token]}, token)]
    for extra, reason in cases:
        body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, **extra}
        choice = client.post("/v1/completions", json=body, headers=auth).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == reason, extra
        last = sse_payloads(client.post("/v1/completions", json={**body, "stream": True}, headers=auth))[-1]
        assert last["choices"][0]["stop_reason"] == reason
    chat = {"messages": MSG, "max_tokens": 8, "temperature": 0}
    said = client.post("/v1/chat/completions", json=chat, headers=auth).json()["choices"][0]["message"]["content"]
    stop = said[len(said) // 2:][:2]
    choice = client.post("/v1/chat/completions", json={**chat, "stop": [stop]}, headers=auth).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    chunks = sse_payloads(client.post("/v1/chat/completions", json={**chat, "stop": [stop], "stream": True},
                                      headers=auth))
    assert [c["choices"][0]["stop_reason"] for c in chunks if c["choices"]][-1] == stop


def sse_payloads(resp):
    assert resp.status_code == 200, resp.text
    lines = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Once upon"}),
                                       ("/v1/chat/completions", {"messages": MSG})])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, path, body):
    auth = {"Authorization": "Bearer secret"}
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**body, "max_tokens": 8, "stream": True, "ignore_eos": True}
    chunks = sse_payloads(client.post(path, json={**body, "stream_options": options}, headers=auth))
    used = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] is not None for c in chunks) and used == sorted(used) and used[-1] == 8
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1 and chunks[-1]["choices"] == []
    plain = sse_payloads(client.post(path, json={**body, "stream_options": {"include_usage": True}}, headers=auth))
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 8


def test_echo_with_logprobs_scores_the_prompt(client, tiny_model):
    """What an evaluation harness sends to score a text: echo, logprobs, one token. The prompt's tokens come back
    with their log-probabilities under the model (the first has none), then the output's."""
    prompt = "The cat sat on the mat"
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    resp = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    ids = tiny_model.encode(prompt)
    logprobs, decode = choice["logprobs"], tiny_model.tokenizer.decode
    assert logprobs["tokens"][:len(ids)] == [decode([t]) for t in ids] and len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    with torch.no_grad():
        x = torch.tensor(ids)
        logp = torch.log_softmax(tiny_model.base.compute_logits(
            tiny_model.base(x, torch.arange(len(ids)), CausalAttention())).float(), -1)
    for q in range(1, len(ids)):
        assert logprobs["token_logprobs"][q] == pytest.approx(logp[q - 1, ids[q]].item(), abs=1e-4)
        top = logprobs["top_logprobs"][q]  # the 2 likeliest, and the prompt's own token where it is not one of them
        assert len(top) <= 3 and top[logprobs["tokens"][q]] == logprobs["token_logprobs"][q]
    assert choice["text"].startswith(prompt) and logprobs["text_offset"][len(ids)] == len(prompt)
    assert logprobs["text_offset"][:3] == [0, len(decode([ids[0]])), len(decode(ids[:2]))]


def test_skip_special_tokens_false_keeps_their_text(client):
    """A bias makes the model write <|im_start|> (a special token, not an end): its text shows only when asked."""
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "logit_bias": {"1": 100}}
    auth = {"Authorization": "Bearer secret"}
    skipped = client.post("/v1/completions", json=body, headers=auth).json()["choices"][0]["text"]
    kept = client.post("/v1/completions", json={**body, "skip_special_tokens": False}, headers=auth).json()
    assert skipped == "" and kept["choices"][0]["text"] == "<|im_start|>" * 3
    assert kept["usage"]["completion_tokens"] == 3


def full_logprobs(model, ids):
    """[len(ids), V] log-probabilities of one eager forward: row q - 1 is token q's distribution."""
    with torch.no_grad():
        x = torch.tensor(ids)
        return torch.log_softmax(model.base.compute_logits(
            model.base(x, torch.arange(len(ids)), CausalAttention())).float(), -1)


def check_prompt_logprobs(rows, ids, logp, k, decode):
    """vLLM's shape: None, then per token a dict by id of its own entry (logprob, rank, decoded_token) and its k
    most likely alternatives ranked 1..k."""
    assert len(rows) == len(ids) and rows[0] is None
    for q in range(1, len(ids)):
        row, dist = rows[q], logp[q - 1]
        own = row[str(ids[q])]
        assert own["logprob"] == pytest.approx(dist[ids[q]].item(), abs=1e-4)
        assert own["rank"] == 1 + int((dist > dist[ids[q]]).sum()) and own["decoded_token"] == decode([ids[q]])
        top = dist.topk(k).indices.tolist()
        assert set(row) == {str(t) for t in top} | {str(ids[q])}
        assert [row[str(t)]["rank"] for t in top] == list(range(1, k + 1))


def test_prompt_logprobs_come_back_in_vllms_shape(client, tiny_model):
    """vLLM's `prompt_logprobs`: on each completions choice, and at the top of a chat response, for the prompt the
    model ran (the chat template's tokens)."""
    auth, decode = {"Authorization": "Bearer secret"}, tiny_model.tokenizer.decode
    prompt = "The cat sat on the mat"
    resp = client.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 3, "max_tokens": 2,
                                                "temperature": 0, "n": 2}, headers=auth)
    assert resp.status_code == 200, resp.text
    ids = tiny_model.encode(prompt)
    logp = full_logprobs(tiny_model, ids)
    for choice in resp.json()["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], ids, logp, 3, decode)
        assert choice["logprobs"] is None
    chat = client.post("/v1/chat/completions", json={"messages": MSG, "prompt_logprobs": 0, "max_tokens": 2},
                       headers=auth).json()
    chat_ids = client.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    check_prompt_logprobs(chat["prompt_logprobs"], chat_ids, full_logprobs(tiny_model, chat_ids), 0, decode)
    plain = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=auth).json()
    assert plain["prompt_logprobs"] is None


def test_prompt_logprobs_beside_echo_keep_each_count(client, tiny_model):
    """echo + logprobs=1 scores the prompt with one alternative a token; prompt_logprobs=4 asks for four: each
    part of the response keeps its own count, from one pass over the prompt."""
    prompt = "The cat sat on the mat"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "prompt_logprobs": 4, "max_tokens": 1, "temperature": 0}
    choice = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"}).json()["choices"][0]
    ids = tiny_model.encode(prompt)
    rows = zip(choice["logprobs"]["tokens"][1:], choice["logprobs"]["top_logprobs"][1:])
    assert all(len(top) <= 2 and token in top for token, top in rows)  # the likeliest and the token itself
    check_prompt_logprobs(choice["prompt_logprobs"], ids, full_logprobs(tiny_model, ids), 4,
                          tiny_model.tokenizer.decode)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_prompt_logprobs_requests_refused_name_it(client, path, body, param):
    resp = client.post(path, json=body, headers={"Authorization": "Bearer secret"})
    assert error_param(resp, 400) == param


def test_allowed_token_ids_limit_what_is_written(client, tiny_model):
    """vLLM's allowed_token_ids: every output token is one of them, under Medusa trees as in plain steps."""
    allowed = tiny_model.tokenizer(" red green blue", add_special_tokens=False)["input_ids"]
    for speculative in (True, False):
        body = {"prompt": "Name a colour:", "max_tokens": 8, "temperature": 0, "allowed_token_ids": allowed,
                "speculative": speculative, "logprobs": 0}
        resp = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
        assert resp.status_code == 200, resp.text
        tokens = resp.json()["choices"][0]["logprobs"]["tokens"]  # each output token's text
        assert len(tokens) == 8 and set(tokens) <= {tiny_model.tokenizer.decode([t]) for t in allowed}


def test_bad_words_change_the_answer_that_wrote_them(client, tiny_model):
    auth = {"Authorization": "Bearer secret"}
    body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0}
    free = client.post("/v1/completions", json=body, headers=auth).json()["choices"][0]["text"]
    word = max(free.split(), key=len)
    said = {}
    for speculative in (True, False):
        resp = client.post("/v1/completions", json={**body, "bad_words": [word], "speculative": speculative},
                           headers=auth)
        assert resp.status_code == 200, resp.text
        said[speculative] = resp.json()["choices"][0]["text"]
    assert said[True] == said[False] != free


def test_guided_choice_answers_with_one_of_the_choices(client):
    """vLLM's guided_choice (and structured_outputs={"choice": ...}): the answer is one of the strings, then ends;
    Medusa trees and plain steps give the same one."""
    auth = {"Authorization": "Bearer secret"}
    choices = ["red", "green", "dark blue", "dark red"]
    said = set()
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        for speculative in (True, False):
            body = {"messages": MSG, "max_tokens": 10, "temperature": 0, "speculative": speculative, **extra}
            resp = client.post("/v1/chat/completions", json=body, headers=auth)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["message"]["content"] in choices and choice["finish_reason"] == "stop"
            said.add(choice["message"]["content"])
        completion = client.post("/v1/completions", json={"prompt": "My favourite colour is", "max_tokens": 10,
                                                          "temperature": 0.9, "seed": 1, **extra}, headers=auth)
        assert completion.json()["choices"][0]["text"] in choices
    assert len(said) == 1
    refused = client.post("/v1/chat/completions", json={"messages": MSG, "guided_choice": choices,
                                                         "allowed_token_ids": [5]}, headers=auth)
    assert refused.status_code == 400 and "allowed_token_ids leaves no guided_choice" in refused.text


def test_guided_regex_answers_in_the_pattern(client):
    """vLLM's guided_regex (and structured_outputs={"regex": ...}): the answer's text is a whole match, then ends;
    Medusa trees and plain steps give the same one, streamed or not."""
    auth = {"Authorization": "Bearer secret"}
    pattern = r"(Yes|No), because [a-z ]{5,20}\."
    said = set()
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        for speculative in (True, False):
            body = {"messages": MSG, "max_tokens": 60, "temperature": 0, "speculative": speculative, **extra}
            resp = client.post("/v1/chat/completions", json=body, headers=auth)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert re.fullmatch(pattern, choice["message"]["content"]) and choice["finish_reason"] == "stop"
            said.add(choice["message"]["content"])
    assert len(said) == 1
    body = {"prompt": "Call me at", "max_tokens": 20, "temperature": 0.9, "seed": 2, "stream": True,
            "guided_regex": r" \d{3}-\d{4}"}
    with client.stream("POST", "/v1/completions", json=body, headers=auth) as resp:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in resp.iter_lines()
                       if line.startswith("data: {"))
    assert re.fullmatch(r" \d{3}-\d{4}", text), text


def test_guided_json_answers_json_valid_under_the_schema(client):
    """vLLM's guided_json, structured_outputs={"json": ...} and OpenAI's response_format json_schema: the answer
    parses and fits the schema; Medusa trees and plain steps give the same one."""
    auth = {"Authorization": "Bearer secret"}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", 3]},
                                               "note": {"type": "string", "maxLength": 8}},
              "required": ["ok", "size"]}
    said = set()
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}):
        for speculative in (True, False):
            body = {"messages": MSG, "max_tokens": 60, "temperature": 0, "speculative": speculative, **extra}
            resp = client.post("/v1/chat/completions", json=body, headers=auth)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            answer = json.loads(choice["message"]["content"])
            assert isinstance(answer["ok"], bool) and answer["size"] in ("S", "M", 3) and set(answer) <= set(schema[
                "properties"]) and len(answer.get("note", "")) <= 8 and choice["finish_reason"] == "stop"
            said.add(choice["message"]["content"])
    assert len(said) == 1


def test_guided_grammar_answers_in_the_grammar(client):
    """vLLM's guided_grammar (GBNF, and structured_outputs={"grammar": ...}): the answer is a whole derivation of
    root, then ends; Medusa trees and plain steps give the same one."""
    grammar = 'root ::= "SELECT " column " FROM " table ";"\ncolumn ::= "id" | "name" | column ", " column\n' \
              'table ::= [a-z]{3,8}'
    said = set()
    for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        for speculative in (True, False):
            body = {"messages": MSG, "max_tokens": 60, "temperature": 0, "speculative": speculative, **extra}
            resp = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer secret"})
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert re.fullmatch(r"SELECT (id|name)(, (id|name))* FROM [a-z]{3,8};", choice["message"]["content"])
            assert choice["finish_reason"] == "stop"
            said.add(choice["message"]["content"])
    assert len(said) == 1


def test_unserved_vllm_fields_at_their_defaults_are_accepted(client):
    """Clients built for vLLM send its fields at their defaults: those are served; set, they are refused
    (test_errors.BAD)."""
    defaults = {"use_beam_search": False, "guided_json": None, "guided_grammar": None, "bad_words": [],
                "allowed_token_ids": None, "structured_outputs": None, "logits_processors": None,
                "response_format": {"type": "text"}}
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MSG})):
        resp = client.post(path, json={**body, "max_tokens": 2, **defaults}, headers={"Authorization": "Bearer secret"})
        assert resp.status_code == 200, resp.text
