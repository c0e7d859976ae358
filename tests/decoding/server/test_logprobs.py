"""Logprobs as OpenAI shapes them: chat's `bytes` are each token's own bytes (so a character split over
byte-level tokens can be rebuilt), and completions' `top_logprobs` always hold the sampled token."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from medusa.decoding.engine import EngineConfig
from medusa.decoding.server import build_app

EMOJI = "😀🎉🔥"


@pytest.fixture(scope="module")
def client(tiny_model):
    app = build_app(tiny_model, "tiny", engine_config=EngineConfig(num_blocks=128))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_chat_logprob_bytes_rebuild_characters_split_over_tokens(client, tiny_model):
    """The default model's byte-level tokenizer spells each emoji in several tokens, each alone decoding to U+FFFD;
    their `bytes` joined are the emoji's UTF-8."""
    body = {"messages": [{"role": "user", "content": "Emojis?"}], "max_tokens": 20, "logprobs": True,
            "top_logprobs": 3, "guided_choice": [EMOJI]}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["message"]["content"] == EMOJI
    content = choice["logprobs"]["content"]
    assert any(entry["token"] == "\ufffd" for entry in content)  # the split this test is about
    assert bytes(b for entry in content for b in entry["bytes"]) == EMOJI.encode()
    for entry in content:
        for top in entry["top_logprobs"]:  # each alternative's bytes are its own too
            assert bytes(top["bytes"]).decode("utf-8", "replace") == top["token"]


def test_bytes_fall_back_to_the_texts_utf8_without_a_byte_table(tiny_model):
    """A tokenizer that is not a fast byte-level one has no byte table: the token's text's UTF-8 stands in."""
    from medusa.decoding.server.jobs import chat_job
    from medusa.decoding.server.protocol import ChatCompletionRequest
    from medusa.decoding.server.responses import Formatter

    class Plain:  # a slow tokenizer: no Rust backend
        def decode(self, ids):
            return "é"

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True})
    job = chat_job(req, tiny_model, 96)
    assert Formatter(job, "tiny", Plain())._bytes(7) == [0xC3, 0xA9]
    end = tiny_model.tokenizer.convert_tokens_to_ids("<|im_end|>")  # special tokens: their text, as `token` shows
    assert Formatter(job, "tiny", tiny_model.tokenizer)._bytes(end) == list(b"<|im_end|>")


@pytest.mark.parametrize("k", [0, 1])
def test_completion_top_logprobs_hold_the_sampled_token(client, k):
    """A hot sample often writes a token outside the top k: its row still has it, so up to k + 1 entries
    (logprobs=0: the token alone), streamed or not."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.5, "seed": 5, "logprobs": k,
            "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    joined = [t for lp in streamed for t in lp["top_logprobs"]]
    # the same tokens; a logprob may differ in float rounding (the two runs' steps may verify other trees)
    assert [list(row) for row in joined] == [list(row) for row in full["top_logprobs"]]
    assert all(row[t] == pytest.approx(other[t], abs=1e-4) for row, other in zip(joined, full["top_logprobs"])
               for t in row)
    rows = list(zip(full["tokens"], full["token_logprobs"], full["top_logprobs"]))
    assert len(rows) == 12
    for token, logprob, top in rows:
        assert top[token] == logprob and len(top) <= k + 1
    assert any(len(top) == k + 1 for _, _, top in rows)  # some sampled token lay outside the top k
