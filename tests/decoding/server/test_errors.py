"""Malformed requests get the right status and an OpenAI error object, never a 500 or a trace,
and the server keeps serving afterwards (a fuzz over request bodies included)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from medusa.decoding.engine import EngineConfig
from medusa.decoding.server import build_app

MSG = [{"role": "user", "content": "Say hi."}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


def chat(**fields):
    return {"messages": MSG, "max_tokens": 4, **fields}


def comp(**fields):
    return {"prompt": "Hello", "max_tokens": 4, **fields}


# (endpoint, body: dict or raw text, status, the error's param when it names one)
BAD = [
    (CHAT, '{"messages": [', 400, None),
    (CHAT, "[1, 2]", 400, None),
    (CHAT, "", 400, None),
    (CHAT, {"max_tokens": 4}, 400, "messages"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages"),
    (CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens="8"), 400, "max_tokens"),
    (CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    (CHAT, chat(max_tokens=10**6), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=-5), 400, "max_completion_tokens"),
    (CHAT, chat(temperature=-0.5), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature"),
    (CHAT, chat(top_p=0), 400, "top_p"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(top_k=-2), 400, "top_k"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(n=65), 400, "n"),
    (CHAT, chat(stop=5), 400, "stop"),
    (CHAT, chat(stop=[""]), 400, "stop"),
    (CHAT, chat(seed="x"), 400, "seed"),
    (CHAT, chat(seed=2**70), 400, "seed"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(presence_penalty=-2.5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=3), 400, "frequency_penalty"),
    (CHAT, chat(presence_penalty="1"), 400, "presence_penalty"),
    (CHAT, chat(min_p=1.5), 400, "min_p"),
    (COMP, comp(min_p=-0.1), 400, "min_p"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(repetition_penalty="1.2"), 400, "repetition_penalty"),
    (CHAT, chat(logprobs=5), 400, "logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    (CHAT, chat(min_tokens=9), 400, None),
    (CHAT, chat(logit_bias={"one": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"99999999": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"-1": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"1": "5"}), 400, "logit_bias"),
    (CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice"),  # "auto": no parser
    (CHAT, chat(messages=[{"role": "user", "content": "hello " * 5000}]), 400, None),
    (CHAT, chat(model="gpt-17"), 404, "model"),
    (COMP, {"max_tokens": 4}, 400, "prompt"),
    (COMP, comp(prompt=[]), 400, "prompt"),
    (COMP, comp(prompt=""), 400, "prompt"),
    (COMP, comp(prompt=[[]]), 400, "prompt"),
    (COMP, comp(prompt=[99999999]), 400, "prompt"),
    (COMP, comp(prompt=[1, "a"]), 400, "prompt"),
    (COMP, comp(prompt="hello " * 5000), 400, None),
    (COMP, comp(logprobs=21), 400, "logprobs"),
    (COMP, comp(echo=True, logprobs=1, stream=True), 400, "echo"),
    (COMP, comp(suffix="x"), 400, "suffix"),
    (COMP, comp(best_of=3), 400, "best_of"),
    (COMP, comp(frequency_penalty=2.001), 400, "frequency_penalty"),
    (COMP, comp(presence_penalty=-7), 400, "presence_penalty"),
    (COMP, comp(model="nope"), 404, "model"),
    # vLLM's fields that would change the answer and are not implemented: refused, never ignored
    (CHAT, chat(guided_json={"type": "integer", "minimum": 1}), 400, "guided_json"),
    (CHAT, chat(guided_json="{"), 400, "guided_json"),
    (CHAT, chat(guided_grammar="root ::= answer"), 400, "guided_grammar"),  # answer is not defined
    (CHAT, chat(guided_regex=[]), 400, "guided_regex"),  # not a string (was a 500: unhashable in the cache)
    (CHAT, chat(structured_outputs={"grammar": 5}), 400, "structured_outputs"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}), 400,
     "response_format"),
    (CHAT, chat(response_format={"type": "yaml"}), 400, "response_format"),
    (CHAT, chat(response_format={"type": "json_object"}, guided_regex="a"), 400, "guided_json"),
    (COMP, comp(structured_outputs={"json": {"type": "object", "patternProperties": {}}}), 400,
     "structured_outputs"),
    (CHAT, chat(guided_choice=[]), 400, "guided_choice"),
    (CHAT, chat(guided_choice=["yes", ""]), 400, "guided_choice"),
    (CHAT, chat(guided_choice="yes"), 400, "guided_choice"),
    (CHAT, chat(guided_choice=["yes", "no"], ignore_eos=True), 400, "guided_choice"),
    (COMP, comp(structured_outputs={"choice": [1]}), 400, "structured_outputs"),
    (COMP, comp(structured_outputs={"grammar": "x"}), 400, "structured_outputs"),
    (COMP, comp(guided_regex="[0-9"), 400, "guided_regex"),
    (COMP, comp(guided_regex="a(?=b)"), 400, "guided_regex"),
    (COMP, comp(guided_regex=7), 400, "guided_regex"),
    (CHAT, chat(guided_regex="[0-9]+", ignore_eos=True), 400, "guided_regex"),
    (CHAT, chat(guided_regex="[0-9]+", guided_choice=["1"]), 400, "guided_regex"),
    (COMP, comp(structured_outputs={"regex": "(a"}), 400, "structured_outputs"),
    (COMP, comp(structured_outputs={"regex": "a", "choice": ["a"]}), 400, "structured_outputs"),
    (CHAT, chat(use_beam_search=True), 400, "use_beam_search"),
    (CHAT, chat(chat_template="{{ messages[0].content }}"), 400, "chat_template"),
    (CHAT, chat(chat_template_kwargs={"add_generation_prompt": False}), 400, "chat_template_kwargs"),
    (CHAT, chat(echo=True), 400, "echo"),
    (CHAT, chat(functions=[{"name": "f", "parameters": {}}]), 400, "functions"),
    (CHAT, chat(function_call="auto"), 400, "function_call"),
    (COMP, comp(prompt="hello " * 9000), 400, "prompt"),  # past the real model's context too
    (CHAT, chat(messages=[{"role": "user", "content": "hello " * 9000}]), 400, "messages"),
    (COMP, comp(bad_words=["the", " "]), 400, "bad_words"),
    (COMP, comp(bad_words="the"), 400, "bad_words"),
    (COMP, comp(allowed_token_ids=[1, 99999999]), 400, "allowed_token_ids"),
    (CHAT, chat(allowed_token_ids=[1, -1]), 400, "allowed_token_ids"),
    (CHAT, chat(allowed_token_ids="1"), 400, "allowed_token_ids"),
]


def post(client, path, body):
    raw = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    if param is not None:
        assert error["param"] == param, error


@pytest.fixture(scope="module")
def tiny_client(tiny_model):
    app = build_app(tiny_model, "tiny", engine_config=EngineConfig(num_blocks=128))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{c[0][4:8]}" for i, c in enumerate(BAD)])
def test_bad_request_gets_error_object(tiny_client, path, body, status, param):
    assert_error(post(tiny_client, path, body), status, param)


def test_server_keeps_serving_and_ignores_unknown_fields(tiny_client):
    for path, body, _, _ in BAD:
        post(tiny_client, path, body)
    ok = post(tiny_client, CHAT, chat(whatever={"nested": [1]}, user="u", max_tokens=3))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert_error(tiny_client.get("/v1/nothing"), 404)
    assert_error(tiny_client.get(CHAT), 405)


def test_penalties_are_served(tiny_client):
    """presence / frequency penalties in [-2, 2] (ints too), repetition_penalty and logit_bias run; the engine
    applies them per tree node."""
    for path, body in [(CHAT, chat(presence_penalty=0.5, frequency_penalty=-1.5, temperature=0)),
                       (CHAT, chat(presence_penalty=2, frequency_penalty=-2, stream=True)),
                       (COMP, comp(frequency_penalty=1, seed=3)),
                       (CHAT, chat(repetition_penalty=1.3, logit_bias={"42": 250, "7": -100})),
                       (COMP, comp(repetition_penalty=0.8, logit_bias={"3": 1}, stream=True)),
                       (CHAT, chat(min_p=0.1, temperature=1.0, seed=1))]:
        resp = post(tiny_client, path, body)
        assert resp.status_code == 200, resp.text


def test_any_64_bit_seed_is_served(tiny_client):
    """OpenAI clients send int64 seeds (-1 too); the protocol takes [-2**63, 2**64), and every such seed samples."""
    for seed in (-1, -2**63, 2**63 + 5, 2**64 - 1):
        resp = post(tiny_client, CHAT, chat(seed=seed, temperature=1.0, max_tokens=3))
        assert resp.status_code == 200, (seed, resp.text)


@pytest.mark.parametrize("path", [CHAT, COMP])
@pytest.mark.parametrize("seed", [-1, 2**63 - 1, 2**64 - 1])
def test_n_choices_at_the_top_seeds_answer(tiny_server, path, seed):
    """Choice j is seeded seed + j; near the top of the seed range that must wrap, not leave a choice unanswered
    (the request used to hang)."""
    url, _ = tiny_server
    body = (chat if path == CHAT else comp)(n=2, seed=seed, temperature=1.0, max_tokens=3)
    resp = httpx.post(url + path, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert sorted(c["index"] for c in resp.json()["choices"]) == [0, 1]
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)


def test_n_choices_wrap_seeds_as_the_engine_does(tiny_server, tiny_model):
    """Choice j of a served request seeded s samples as sequence j of an engine request seeded s: both wrap
    s + j into [0, 2**63) (seed -1 reaches the engine as 2**63 - 1)."""
    from medusa.decoding.sampling_params import SamplingParams

    ids = [1, 2, 3, 4]
    params = SamplingParams(n=2, seed=2**63 - 1, max_tokens=4, temperature=1.0, ignore_eos=True)
    texts = [o.text for o in tiny_model.engine(speculative=False).generate([ids], params)]
    body = {"prompt": ids, "n": 2, "seed": -1, "temperature": 1.0, "max_tokens": 4, "ignore_eos": True}
    served = httpx.post(tiny_server[0] + COMP, json=body, timeout=30).json()["choices"]
    assert [c["text"] for c in sorted(served, key=lambda c: c["index"])] == texts and texts[0] != texts[1]


def test_a_choice_whose_params_cannot_be_built_fails_the_request(tiny_server, monkeypatch):
    """Whatever goes wrong in a choice's pump, before its engine request too, reaches the reader as an error."""
    from medusa.decoding.server import responses

    real = responses.replace

    def failing(params, **changes):
        if changes.get("seed") == 4:  # choice 1 of seed 3
            raise RuntimeError("cannot build this choice's params")
        return real(params, **changes)

    monkeypatch.setattr(responses, "replace", failing)
    url, _ = tiny_server
    resp = httpx.post(url + CHAT, json=chat(n=2, seed=3, temperature=1.0), timeout=30)
    assert_error(resp, 500)
    with httpx.stream("POST", url + CHAT, json=chat(n=2, seed=3, stream=True), timeout=30) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"


def test_models_retrieve_finds_the_served_model_only(tiny_server):
    """The OpenAI SDK's models.retrieve() reads GET /v1/models/{id}: the served model's card, a 404 for any other."""
    import openai

    url, _ = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=30, max_retries=0)
    card = client.models.retrieve("tiny")
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "medusa") and card.max_model_len > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert_error(httpx.get(url + "/v1/models/org/other-model", timeout=30), 404, "model")


def test_impossible_schema_bounds_are_named_not_shown_as_regex(tiny_client):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    resp = post(tiny_client, CHAT, chat(response_format=fmt))
    assert_error(resp, 400)
    message = resp.json()["error"]["message"]
    assert "minLength 5 > maxLength 2" in message and "{5,2}" not in message, message


def test_penalties_reach_the_engine(tiny_model):
    from medusa.decoding.server.jobs import chat_job, completion_job
    from medusa.decoding.server.protocol import ChatCompletionRequest, CompletionRequest

    req = ChatCompletionRequest.model_validate_json(json.dumps(chat(presence_penalty=0.5, frequency_penalty=-1)))
    params = chat_job(req, tiny_model, 96).params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0) and params.has_penalties
    params = completion_job(CompletionRequest.model_validate_json(json.dumps(comp())), tiny_model, 96).params
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0) and not params.has_penalties
    body = chat(repetition_penalty=1.25, logit_bias={"42": 250, "7": -3.5})
    params = chat_job(ChatCompletionRequest.model_validate_json(json.dumps(body)), tiny_model, 96).params
    assert params.repetition_penalty == 1.25 and params.logit_bias == ((7, -3.5), (42, 100.0))  # clamped, as vLLM
    params = completion_job(CompletionRequest.model_validate_json(json.dumps(comp(min_p=0.25, temperature=0.9))),
                            tiny_model, 96).params
    assert params.min_p == 0.25 and params.sampling().filters


def test_api_key(tiny_model):
    app = build_app(tiny_model, "tiny", api_key="sekret", engine_config=EngineConfig(num_blocks=64))
    with TestClient(app) as client:
        assert_error(post(client, CHAT, chat()), 401)
        assert_error(client.post(CHAT, json=chat(), headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(client.get("/v1/models"), 401)
        assert_error(client.get("/v1/models/tiny"), 401)
        assert client.get("/health").status_code == 200  # probes and scrapers need no key
        good = client.post(CHAT, json=chat(), headers={"Authorization": "Bearer sekret"})
        assert good.status_code == 200 and good.json()["object"] == "chat.completion"


def test_full_queue_is_503(tiny_model):
    app = build_app(tiny_model, "tiny", max_waiting=0, engine_config=EngineConfig(num_blocks=64))
    with TestClient(app) as client:
        assert_error(post(client, CHAT, chat()), 503)


# ---- fuzz -----------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "seed", "stream", "stream_options", "presence_penalty", "frequency_penalty", "logprobs",
          "top_logprobs", "ignore_eos", "min_tokens", "speculative", "echo", "stop_token_ids", "logit_bias",
          "repetition_penalty", "min_p", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
          "add_generation_prompt", "continue_final_message", "prompt_logprobs", "allowed_token_ids", "bad_words",
          "guided_choice", "guided_regex", "guided_json", "structured_outputs", "response_format", "guided_grammar",
          "tools", "tool_choice", "parallel_tool_calls"]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}
# Plausible values mixed in, so the fuzz also reaches past the first validation error.
plausible = {"messages": st.just(MSG), "prompt": st.sampled_from(["Hi", [1, 2, 3], ["a", "b"]]),
             "max_tokens": st.integers(-2, 6), "n": st.integers(0, 3), "temperature": st.floats(-1, 3),
             "stream": st.booleans(), "logprobs": st.one_of(st.booleans(), st.integers(-1, 3)),
             "echo": st.booleans(), "logit_bias": st.dictionaries(st.sampled_from(["1", "7", "x", "-3", "99999"]),
                                                                  st.floats(-300, 300), max_size=3),
             "min_p": st.floats(-0.5, 1.5), "repetition_penalty": st.floats(-1, 3),
             "truncate_prompt_tokens": st.integers(-3, 5), "continue_final_message": st.booleans(),
             "prompt_logprobs": st.integers(-1, 3), "allowed_token_ids": st.lists(st.integers(-1, 60), max_size=3),
             "guided_regex": st.sampled_from(["[0-9]+", "(yes|no)", "a(?=b)", "[", "", "x{2,1}"]),
             "guided_json": st.sampled_from([{"type": "integer"}, {"enum": ["a", 1]}, {"minimum": 1}, "{", []]),
             "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                                                 {"type": "json_schema", "json_schema": {"schema": {"type": "null"}}}]),
             "guided_grammar": st.sampled_from(['root ::= "a" | [0-9]+', "root ::= x", "start: 'a'", "root ::= (",
                                                'root ::= "a" root | "b"', ""]),
             "tools": st.sampled_from([[TOOL], [TOOL, TOOL], [{"type": "function", "function": {"name": "g"}}],
                                       [{"type": "function", "function": {"name": "h", "parameters": {
                                           "type": "object", "properties": {"n": {"minimum": 0}}}}}]]),
             "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {
                 "name": "f"}}, {"type": "function", "function": {"name": "zz"}}, {"type": "function"}])}


@st.composite
def bodies(draw):
    body = dict(draw(st.sampled_from([chat(), comp(), {}])))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=5, unique=True)):
        body[name] = draw(plausible[name] if name in plausible and draw(st.booleans()) else json_values)
    return body


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 50)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(), path=st.sampled_from([CHAT, COMP]))
def test_fuzz_never_500(tiny_client, body, path):
    resp = post(tiny_client, path, body)
    event(f"status {resp.status_code}")
    assert resp.status_code in (200, 400, 404), resp.text
    if resp.status_code != 200:
        assert_error(resp, resp.status_code)
    elif not body.get("stream") is True:
        assert resp.json()["object"] in ("chat.completion", "text_completion")


@pytest.mark.slow
def test_real_server_survives_bad_requests(real_server):
    url, _ = real_server
    with httpx.Client(base_url=url, timeout=60) as client:
        for path, body, status, param in BAD:
            assert_error(post(client, path, body), status, param)
        good = post(client, CHAT, chat(max_tokens=4, temperature=0))
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_context_overflow_speaks_vllms_words(tiny_client):
    """Clients (litellm) tell a context overflow from other 400s by vLLM's "maximum context length"."""
    for body, param in ((comp(prompt="hello " * 200), "prompt"), (chat(max_tokens=90), "max_tokens")):
        resp = post(tiny_client, COMP if "prompt" in body else CHAT, body)
        assert_error(resp, 400, param)
        error = resp.json()["error"]
        assert "maximum context length" in error["message"] and error["code"] == "context_length_exceeded", error


def test_tokens_as_token_ids_name_logprobs_tokens_by_id(tiny_client, tiny_model):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>"; completions' text offsets
    still index the text."""
    body = comp(logprobs=2, temperature=0, max_tokens=4, return_tokens_as_token_ids=True, echo=False)
    choice = post(tiny_client, COMP, body).json()["choices"][0]
    logprobs = choice["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    assert all(t.startswith("token_id:") for t in logprobs["tokens"])
    assert all(k.startswith("token_id:") for row in logprobs["top_logprobs"] for k in row)
    texts = [tiny_model.tokenizer.decode([t]) for t in ids]
    assert "".join(texts) == choice["text"]
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    plain = post(tiny_client, COMP, {**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert plain["logprobs"]["tokens"] == texts
    chat_body = chat(logprobs=True, top_logprobs=1, temperature=0, return_tokens_as_token_ids=True)
    content = post(tiny_client, CHAT, chat_body).json()["choices"][0]["logprobs"]["content"]
    assert content and all(e["token"].startswith("token_id:") and e["bytes"] for e in content)


def test_chat_template_kwargs_reach_the_template(tiny_model):
    """vLLM's chat_template_kwargs are more variables for the template (a Qwen 3 template reads enable_thinking)."""
    from medusa.decoding.server.jobs import chat_prompt
    from medusa.decoding.server.protocol import ChatCompletionRequest

    tokenizer = tiny_model.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!!{% endif %}"
    try:
        ids = {flag: chat_prompt(ChatCompletionRequest(messages=MSG, chat_template_kwargs={"shout": flag}),
                                 tiny_model) for flag in (False, True)}
    finally:
        tokenizer.chat_template = saved
    assert tokenizer.decode(ids[True]).endswith("!!") and not tokenizer.decode(ids[False]).endswith("!!")


def test_requests_are_prepared_off_the_event_loop(tiny_server, monkeypatch):
    """A request slow to tokenize (a huge prompt) must not stall the loop: /health answers meanwhile."""
    import threading

    from medusa.decoding.server import app as app_module

    started, release = threading.Event(), threading.Event()
    real = app_module.completion_job

    def slow_job(*args):
        started.set()
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(app_module, "completion_job", slow_job)
    url, _ = tiny_server
    answer = {}
    worker = threading.Thread(target=lambda: answer.update(r=httpx.post(url + COMP, json=comp(), timeout=30)))
    worker.start()
    try:
        assert started.wait(10)
        assert httpx.get(url + "/health", timeout=2).status_code == 200  # served while the job is being built
    finally:
        release.set()
        worker.join(30)
    assert answer["r"].status_code == 200, answer["r"].text
