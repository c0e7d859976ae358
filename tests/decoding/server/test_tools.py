"""OpenAI's tools on /v1/chat/completions, as a vLLM server serves them: a named function's arguments and tool_choice
"required"'s calls guided by the tools' schemas (the same calls with Medusa trees and plain steps, streamed or not),
tool_choice "auto" through the hermes parser, "none", conversations that carry earlier calls and their answers to a
template that knows tools, and a 400 naming the field for each bad tool request."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from medusa.decoding.engine import EngineConfig
from medusa.decoding.server import build_app
from medusa.medusa_model import MedusaModel

AUTH = {"Authorization": "Bearer secret"}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: it takes no arguments
TEMPLATE = Path(__file__).resolve().parents[3] / "configs" / "chat_templates" / "chatml-tools.jinja"


@pytest.fixture(scope="module")
def client(tiny_model):
    app = build_app(tiny_model, "tiny", api_key="secret", engine_config=EngineConfig(num_blocks=128))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def hermes_client(tiny_model):
    """A tiny model with room for the tools in its prompt and its own copy of the tokenizer under the shipped tools
    template, served with the hermes parser (as `medusa serve --chat-template chatml-tools
    --enable-auto-tool-choice --tool-call-parser hermes`)."""
    from tiny_models import tiny_decoder

    base, heads = tiny_decoder(vocab=49152, max_positions=512, num_heads=3, logit_scale=3)
    tokenizer = copy.deepcopy(tiny_model.tokenizer)
    tokenizer.chat_template = TEMPLATE.read_text()
    model = MedusaModel(base, tokenizer, heads, system_prompt=tiny_model.system_prompt)
    app = build_app(model, "tiny", api_key="secret", engine_config=EngineConfig(num_blocks=128), tool_parser="hermes")
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def chat(client, **body):
    resp = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 60, **body}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def streamed(client, **body):
    """(content, tool-call deltas, finish_reason) of a streamed chat completion."""
    content, deltas, finish = "", [], None
    with client.stream("POST", "/v1/chat/completions", json={"messages": MSG, "max_tokens": 60, "stream": True,
                                                              **body}, headers=AUTH) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                content += choice["delta"].get("content") or ""
                deltas += choice["delta"].get("tool_calls", [])
                finish = choice["finish_reason"] or finish
    return content, deltas, finish


def rebuilt(deltas):
    """[(name, arguments)] as a streaming client rebuilds the calls."""
    calls = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], ["", ""])
        if "id" in delta:
            call[0] = delta["function"]["name"]
        call[1] += delta["function"]["arguments"]
    return [tuple(call) for _, call in sorted(calls.items())]


def weather_args_ok(arguments: str) -> bool:
    args = json.loads(arguments)
    return set(args) == {"city", "unit"} and len(args["city"]) <= 12 and args["unit"] in ("celsius", "fahrenheit")


def test_a_named_function_answers_with_one_call_valid_under_its_schema(client):
    said = set()
    for speculative in (True, False):
        choice = chat(client, tools=[WEATHER, NOW], temperature=0, speculative=speculative,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        message = choice["message"]
        assert message["content"] is None and choice["finish_reason"] == "stop"  # vLLM's: the call was forced
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"]["name"] == "get_weather" and weather_args_ok(call["function"]["arguments"])
        said.add(call["function"]["arguments"])
    assert len(said) == 1  # Medusa trees and plain steps write the same call
    content, deltas, finish = streamed(client, tools=[WEATHER], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert content == "" and rebuilt(deltas) == [("get_weather", said.pop())] and finish == "stop"
    no_args = chat(client, tools=[WEATHER, NOW], temperature=0.8, seed=3,
                   tool_choice={"type": "function", "function": {"name": "now"}})
    assert no_args["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_required_answers_with_calls_of_the_given_tools(client):
    said = set()
    for speculative in (True, False):
        choice = chat(client, tools=[WEATHER, NOW], tool_choice="required", temperature=0, speculative=speculative)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        assert calls and choice["message"]["content"] is None and choice["finish_reason"] in ("stop", "length")
        whole = calls if choice["finish_reason"] == "stop" else calls[:-1]  # max_tokens may cut the last one
        for name, arguments in whole:
            assert name == "now" and arguments == "{}" or name == "get_weather" and weather_args_ok(arguments)
        said.add(json.dumps(calls))
    assert len(said) == 1
    content, deltas, _ = streamed(client, tools=[WEATHER, NOW], tool_choice="required", temperature=0)
    assert content == "" and json.dumps(rebuilt(deltas)) == said.pop()
    for seed in range(4):  # sampled: one call each time when parallel calls are off
        one = chat(client, tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False,
                   temperature=1.0, seed=seed)
        assert len(one["message"]["tool_calls"]) == 1 and one["finish_reason"] == "stop"
        assert one["message"]["tool_calls"][0]["function"]["name"] in ("get_weather", "now")


def test_required_cut_before_any_parameters_answers_with_the_text_written(client):
    """max_tokens ends the array inside its first element: no call, and the text is the answer's content."""
    choice = chat(client, tools=[WEATHER, NOW], tool_choice="required", temperature=0, max_tokens=3)
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"].startswith("[")
    content, deltas, finish = streamed(client, tools=[WEATHER, NOW], tool_choice="required", temperature=0,
                                       max_tokens=3)
    assert (content, deltas, finish) == (choice["message"]["content"], [], "length")


def test_none_answers_in_text_and_the_tools_reach_the_template(client, hermes_client):
    plain = chat(client, temperature=0)
    with_tools = chat(client, tools=[WEATHER], tool_choice="none", temperature=0)
    assert with_tools["message"] == plain["message"] and plain["message"]["tool_calls"] == []  # SmolLM2's
    # template ignores tools; the tools template shows them
    for c, grows in ((client, False), (hermes_client, True)):
        base = c.post("/tokenize", json={"messages": MSG}).json()["count"]
        shown = c.post("/tokenize", json={"messages": MSG, "tools": [WEATHER]}).json()["count"]
        assert (shown > base) == grows


CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}</tool_call>'


def test_auto_needs_a_parser_and_finds_the_calls_the_model_writes(client, hermes_client):
    resp = client.post("/v1/chat/completions", json={"messages": MSG, "tools": [WEATHER]}, headers=AUTH)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in resp.json()["error"]["message"]
    choice = chat(hermes_client, tools=[WEATHER], temperature=0)  # "auto" by default with tools
    assert choice["message"]["tool_calls"] == [] and choice["finish_reason"] in ("stop", "length")
    content, deltas, _ = streamed(hermes_client, tools=[WEATHER], temperature=0)
    assert content == choice["message"]["content"] and deltas == []
    # a random model writes no calls by itself: a guide makes it write one after some text
    for speculative in (True, False):
        choice = chat(hermes_client, tools=[WEATHER], temperature=0, guided_regex="Sure[.] " + CALL,
                      speculative=speculative, max_tokens=300)
        (call,) = choice["message"]["tool_calls"]
        assert choice["message"]["content"] == "Sure. " and choice["finish_reason"] == "tool_calls"
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
            "get_weather", {"city": "Paris", "unit": "celsius"})
    content, deltas, finish = streamed(hermes_client, tools=[WEATHER], temperature=0, guided_regex=CALL,
                                       max_tokens=300)
    assert content == "" and rebuilt(deltas) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert finish == "tool_calls"


def test_a_conversation_carries_earlier_calls_and_their_answers(hermes_client):
    messages = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "21 degrees, sunny"}]
    resp = hermes_client.post("/tokenize", json={"messages": messages, "tools": [WEATHER], "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    text = hermes_client.post("/detokenize", json={"tokens": resp.json()["tokens"]}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text  # an object again
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in text
    assert chat(hermes_client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4)["message"]


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice",
     "names function 'nope', which is not in tools (get_weather)"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": "required", "tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools",
     "must be 1-64 letters"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}}]},
     "tools", "tools[0].function.parameters: guided_json: keyword 'minimum' is not supported"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools", "must be an object schema"),
    ({"tool_choice": "required", "tools": [WEATHER], "guided_json": {"type": "object"}}, "guided_json",
     "cannot be given too"),
    ({"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format",
     "cannot be given too"),
    ({"tool_choice": "maybe", "tools": [WEATHER]}, "tool_choice", None),
    ({"tools": [{"type": "function"}]}, "tools", None),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 3}, "min_tokens", "cannot be combined"),
    ({"messages": [{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "x", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages", "only an assistant message"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages", "messages[0].content must be text"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(client, body, param, message):
    resp = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **body}, headers=AUTH)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and (message is None or message in error["message"]), error


def test_required_with_shared_definitions(client):
    """Tools whose schemas use $defs: their references still resolve inside the array of calls."""
    point = {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}},
             "type": "object", "properties": {"at": {"$ref": "#/$defs/p"}}, "required": ["at"]}
    tools = [{"type": "function", "function": {"name": "go", "parameters": point}}]
    choice = chat(client, tools=tools, tool_choice="required", temperature=0, parallel_tool_calls=False)
    for call in choice["message"]["tool_calls"]:
        assert isinstance(json.loads(call["function"]["arguments"])["at"]["x"], bool)
    clash = copy.deepcopy(point)
    clash["$defs"]["p"]["required"] = []
    resp = client.post("/v1/chat/completions", json={"messages": MSG, "tool_choice": "required", "tools": tools + [
        {"type": "function", "function": {"name": "other", "parameters": clash}}]}, headers=AUTH)
    assert resp.status_code == 400 and "$defs/p unlike an earlier tool" in resp.text


@pytest.mark.parametrize("args,message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice and --tool-call-parser go together"),
    (["--tool-call-parser", "hermes"], "--enable-auto-tool-choice and --tool-call-parser go together"),
    (["--chat-template", "no-such-template"], r"not a file, a shipped template \(chatml-tools\) or a Jinja"),
])
def test_serve_names_a_bad_tool_setting_before_loading_the_model(args, message):
    import argparse

    from medusa.decoding.server import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        cli.serve(parser.parse_args(args))
    with pytest.raises(SystemExit):  # argparse: only the parsers there are
        parser.parse_args(["--tool-call-parser", "mistral"])


def test_serve_reads_a_shipped_template_by_name_or_a_file_or_the_text(tmp_path):
    from medusa.decoding.server.cli import _chat_template

    assert _chat_template("chatml-tools") == TEMPLATE.read_text()
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert _chat_template(str(path)) == _chat_template("{{ messages[0]['content'] }}") == path.read_text()
    with pytest.raises(ValueError, match="build_app|tool_parser must be one of"):
        build_app(None, "x", tool_parser="mistral")
