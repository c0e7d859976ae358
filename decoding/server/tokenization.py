"""/tokenize and /detokenize, as a vLLM server has them: the token ids the server would run for a prompt or a
conversation (so a client can count a request's tokens before sending it), and the text of token ids."""

from __future__ import annotations

from typing import Any

from medusa.decoding.server.errors import bad_request
from medusa.decoding.server.jobs import chat_prompt
from medusa.decoding.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                             TokenizeCompletionRequest, TokenizeResponse)


def tokenize_request_type(body: Any) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """A body with `messages` is a conversation, any other a prompt (vLLM tells the two forms apart so)."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest


def tokenize(req: TokenizeChatRequest | TokenizeCompletionRequest, model: Any, max_model_len: int) -> TokenizeResponse:
    tokenizer = model.tokenizer
    if isinstance(req, TokenizeChatRequest):
        ids = chat_prompt(req, model)
    else:
        ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(req: DetokenizeRequest, model: Any) -> DetokenizeResponse:
    """The text of the ids, special tokens included (the ids of /tokenize come back as its text)."""
    vocab = model.base.config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", "tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(req.tokens))
