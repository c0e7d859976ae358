"""The official `openai` client against the server on the real default model.

Greedy text through the server (Medusa tree verification, continuous batching)
equals the library's own plain greedy decoding of the same input.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

SERVED_NAME = "SmolLM2-135M-Instruct"  # as the real_server fixture serves it

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three prime numbers."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def clients(real_server):
    url, _ = real_server
    sync = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return sync, url


@pytest.fixture(scope="module")
def chat_ref(real_model):
    return real_model.chat(CHAT, max_new_tokens=12, speculative=False)


@pytest.fixture(scope="module")
def prompt_ref(real_model):
    return real_model.generate(PROMPT, max_new_tokens=10, speculative=False)


def test_models_lists_the_served_name(clients):
    sync, _ = clients
    assert [m.id for m in sync.models.list().data] == [SERVED_NAME]


def test_chat_matches_library_greedy(clients, real_model, chat_ref):
    sync, _ = clients
    resp = sync.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == chat_ref.text
    assert choice.finish_reason == chat_ref.finish_reason
    assert resp.usage.prompt_tokens == len(real_model.encode(CHAT))
    assert resp.usage.completion_tokens == len(chat_ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_with_usage_and_plain_mode(clients, chat_ref):
    sync, _ = clients
    stream = sync.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_completion_tokens=12, temperature=0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"speculative": False})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat_ref.finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(chat_ref.token_ids)


def test_chat_logprobs_shape(clients, chat_ref):
    sync, _ = clients
    resp = sync.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
    assert "".join(e.token for e in content) == chat_ref.text[: len("".join(e.token for e in content))]


def test_async_completions_stream_and_not(clients, prompt_ref):
    _, url = clients

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        full = await client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
        stream = await client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                                 stream=True)
        pieces = [c async for c in stream]
        await client.close()
        return full, pieces

    full, pieces = asyncio.run(main())
    assert full.object == "text_completion" and full.choices[0].text == prompt_ref.text
    assert full.choices[0].finish_reason == prompt_ref.finish_reason
    assert "".join(c.choices[0].text for c in pieces) == prompt_ref.text
    assert pieces[-1].choices[0].finish_reason == prompt_ref.finish_reason


def test_completions_several_prompts_n_and_logprobs(clients, real_model, prompt_ref):
    sync, _ = clients
    ids = real_model.encode(PROMPT)
    resp = sync.completions.create(model=SERVED_NAME, prompt=[PROMPT, PROMPT], max_tokens=10, temperature=0, n=2,
                                   logprobs=1, extra_body={"speculative": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [prompt_ref.text] * 4
    assert resp.usage.prompt_tokens == 2 * len(ids) and resp.usage.completion_tokens == 4 * len(prompt_ref.token_ids)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt_ref.token_ids)
    token_ids = sync.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=10, temperature=0, echo=True)
    assert token_ids.choices[0].text == PROMPT + prompt_ref.text


def test_32_concurrent_streams_equal_sequential_greedy(clients, real_model):
    _, url = clients
    conversations = [[{"role": "user", "content": f"Give me one word that rhymes with number {i}."}]
                     for i in range(32)]
    sequential = [real_model.chat(c, max_new_tokens=8, speculative=False).text for c in conversations]

    async def one(client, messages):
        stream = await client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=8,
                                                      temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        texts = await asyncio.gather(*(one(client, c) for c in conversations))
        await client.close()
        return texts

    assert asyncio.run(main()) == sequential


def test_response_format_json_object_answers_one_json_object(clients):
    """OpenAI's JSON mode through the official client: the answer parses as one object, Medusa or not."""
    client, _ = clients
    said = []
    for speculative in (True, False):
        ask = [{"role": "user", "content": "Give me a JSON object with a cat's name and age."}]
        resp = client.chat.completions.create(model=SERVED_NAME, messages=ask, max_tokens=80, temperature=0,
                                              response_format={"type": "json_object"},
                                              extra_body={"speculative": speculative})
        said.append(resp.choices[0].message.content)
        assert isinstance(json.loads(said[-1]), dict) and resp.choices[0].finish_reason == "stop"
    assert said[0] == said[1]


def test_a_tool_call_round_trip_through_the_client(clients):
    """Named function calling through the official client, streamed and not (the same call), then the call and its
    answer sent back as the conversation goes on."""
    client, _ = clients
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=SERVED_NAME, messages=ask, tools=tools, tool_choice=named,
                                          max_tokens=40, temperature=0)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    arguments, names = "", []
    for chunk in client.chat.completions.create(model=SERVED_NAME, messages=ask, tools=tools, tool_choice=named,
                                                max_tokens=40, temperature=0, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
    assert names == ["get_weather"] and arguments == call.function.arguments
    follow = ask + [resp.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = client.chat.completions.create(model=SERVED_NAME, messages=follow, tools=tools, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls in (None, [])
