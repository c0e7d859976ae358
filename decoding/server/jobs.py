"""Turn a parsed OpenAI request into a Job: prompt token ids and engine SamplingParams.

All the semantic checks live here (context length, vocabulary, options the
engine cannot honour), so the engine only ever sees requests it can run.

logit_bias, allowed_token_ids, bad_words, guided_choice / regex / json / grammar (and
OpenAI's response_format), repetition_penalty, presence_penalty and
frequency_penalty go to the engine, which applies them along every tree node's
own path, so they stay lossless with Medusa; so do tool_choice "required" and
named functions, guided by the tools' schemas (tools.py). Beam search, `suffix` and
vLLM's other fields that change the output but are not implemented
(`UNSERVED`) are refused with a 400 rather than silently ignored."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from jinja2 import TemplateError

from medusa.chat import chat_prompt_ids
from medusa.decoding.engine import EngineConfig
from medusa.decoding.grammar import grammar_dfa
from medusa.decoding.json_schema import schema_dfa
from medusa.decoding.regex_dfa import compile_regex
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.server.errors import APIError, bad_request, unsupported
from medusa.decoding.server.protocol import (ChatCompletionRequest, CompletionRequest, TokenizeChatRequest,
                                             _SamplingRequest)
from medusa.decoding.server.tools import ToolPlan, template_tools, tool_plan

# LLMEngine.add_request keeps this many positions spare beyond prompt + max_tokens.
ENGINE_CONTEXT_MARGIN = 8
# Below this a temperature only amplifies float error: treat it as greedy (vLLM does the same).
GREEDY_BELOW = 1e-5
# vLLM's request fields this server does not implement, each refused when set (not null, false or empty)
UNSERVED = {"use_beam_search": "beam search is not implemented",
            "logits_processors": "custom logits processors are not served",
            "prompt_embeds": "prompts are served as text or token ids only"}
CHAT_UNSERVED = {"echo": "a chat answer does not repeat the conversation (use /v1/completions with echo)",
                 "functions": "the legacy function-calling API is not served: give tools (and tool_choice)",
                 "function_call": "the legacy function-calling API is not served: give tools and tool_choice"}
# /v1/chat/completions' and /tokenize's
TEMPLATE_UNSERVED = {"chat_template": "a request's own chat template is not trusted (vLLM's default too); the "
                                      "server's is set with `medusa serve --chat-template`"}


def context_limit(model: Any, config: EngineConfig) -> int:
    """Prompt + output tokens one request may hold: the model's context, and no more than the KV
    pool leaves beside a tree's lookahead slots (a request that can never fit would wait forever)."""
    kv_tokens = config.num_blocks * config.block_size - config.scheduler.max_tree_tokens
    return min(model.base.config.max_position_embeddings, kv_tokens) - ENGINE_CONTEXT_MARGIN


@dataclass(frozen=True)
class Job:
    kind: str  # "chat" or "completion"
    request_id: str
    prompts: list[list[int]]  # token ids of each prompt
    params: SamplingParams
    speculative: bool
    stream: bool
    include_usage: bool
    echo: list[str] | None = None  # prompt texts to prepend (completions with echo=true)
    continuous_usage: bool = False  # every streamed chunk carries the usage so far (vLLM's continuous_usage_stats)
    prompt_logprobs: int | None = None  # vLLM's: the response carries each prompt token's logprob and top k
    tools: ToolPlan | None = None  # chat: how the answer becomes tool calls (None: it is text)
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n


def chat_job(req: ChatCompletionRequest, model: Any, max_model_len: int, tool_parser: str | None = None) -> Job:
    """`tool_parser`: the server's parser of tool calls in free text (tool_choice "auto"), or None."""
    _refuse_unserved(req, CHAT_UNSERVED)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    plan = tool_plan(req, tool_parser)
    ids = _truncated(chat_prompt(req, model), req, max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling_params(req, [ids], max_tokens, logprobs, model, max_model_len,
                              plan.schema if plan is not None else None)
    if plan is not None and plan.schema is None:  # a parser reads the text: tags that are special tokens stay in it
        params = replace(params, skip_special_tokens=False)
    return replace(_job("chat", req, [ids], params), tools=plan)


def chat_prompt(req: ChatCompletionRequest | TokenizeChatRequest, model: Any) -> list[int]:
    """The conversation's token ids through the model's chat template (its system prompt where the conversation
    has none), as the request's template options say."""
    _refuse_unserved(req, TEMPLATE_UNSERVED)
    messages = [_template_message(i, message) for i, message in enumerate(req.messages)]
    return _encode(lambda: chat_prompt_ids(model.tokenizer, messages, model.system_prompt,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           tools=template_tools(req.tools),
                                           template_kwargs=req.chat_template_kwargs), "messages",
                   ("chat_template_kwargs",))


def _template_message(i: int, message: Any) -> dict[str, Any]:
    """A request message as chat templates read it: an assistant's earlier calls with their arguments as objects
    (Llama's and Qwen's templates write them so), a tool message with the id of the call it answers."""
    text = message.text()
    if text is None and not message.tool_calls:
        raise bad_request(f"messages[{i}].content must be text", "messages")
    entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": text or ""}
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request(f"messages[{i}] has tool_calls, which only an assistant message may have", "messages")
        entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    if message.role == "tool":
        entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
    return entry


def _arguments(text: str) -> Any:
    """A call's arguments text as the object it encodes (the text itself where it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def completion_job(req: CompletionRequest, model: Any, max_model_len: int) -> Job:
    if req.suffix:
        raise unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise unsupported("best_of", "only best_of == n is served")
    if req.echo and req.logprobs is not None and req.stream:
        raise unsupported("echo", "echo with logprobs (the prompt's logprobs) is served without streaming only")
    prompts = _prompt_list(req.prompt)
    ids = [_truncated(_encode(lambda: model.encode(p), "prompt"), req, max_model_len) for p in prompts]
    params = _sampling_params(req, ids, req.max_tokens, req.logprobs, model, max_model_len)
    if req.echo and req.logprobs is not None:  # the echoed prompt gets logprobs too (evaluation harnesses score so)
        params = replace(params, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
    echo = [p if isinstance(p, str) else model.tokenizer.decode(p) for p in prompts] if req.echo else None
    return _job("completion", req, ids, params, echo)


def _job(kind: str, req: _SamplingRequest, prompts: list[list[int]], params: SamplingParams,
         echo: list[str] | None = None) -> Job:
    _refuse_unserved(req, UNSERVED)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise unsupported("prompt_logprobs", "prompt logprobs are served without streaming only")
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return Job(kind, f"{prefix}-{uuid.uuid4().hex}", prompts, params, req.speculative is not False,
               bool(req.stream), include_usage, echo, include_usage and bool(options.continuous_usage_stats),
               req.prompt_logprobs, tokens_as_ids=bool(req.return_tokens_as_token_ids))


def _refuse_unserved(req: Any, fields: dict[str, str]) -> None:
    """A 400 for the first of `fields` the request sets (vLLM clients send them at their defaults)."""
    for name, why in fields.items():
        if getattr(req, name) not in (None, False, "", [], {}):
            raise unsupported(name, why)


def _prompt_list(prompt: Any) -> list[Any]:
    """The four OpenAI prompt forms -> a list of prompts (each a string or token ids)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


def _encode(encode: Callable[[], list[int]], param: str, own: tuple[str, ...] = ()) -> list[int]:
    """`encode()`'s token ids, its errors (bad input) a 400 naming `param`, or the field of `own` that the
    error's message starts with."""
    try:
        ids = encode()
    except (ValueError, TypeError, TemplateError) as err:  # out-of-vocabulary ids, no chat template,
        named = [field for field in own if str(err).startswith(field)]  # a template refusing the conversation
        raise bad_request(str(err), named[0] if named else param) from None
    if not ids:
        raise bad_request(f"{param} encodes to no tokens", param)
    return ids


def _sampling_params(req: _SamplingRequest, prompts: list[list[int]], max_tokens: int | None,
                     logprobs: int | None, model: Any, max_model_len: int,
                     tool_schema: dict | None = None) -> SamplingParams:
    room = _room(prompts, max_model_len, "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    if max_tokens is None:
        max_tokens = room  # OpenAI's chat default: as long as the context allows
    elif max_tokens > room:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{max_tokens} output tokens and your prompt has {max_model_len - room} tokens: max_tokens "
                          f"may be at most {room}.", "max_tokens", "context_length_exceeded")
    _check_token_ids(req.stop_token_ids or [], model, "stop_token_ids")
    temperature = 1.0 if req.temperature is None else req.temperature
    guides = _guided(req, tool_schema)
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens or 0,
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0,
            seed=None if req.seed is None else req.seed % 2**63,  # any int64 or uint64 -> the sampler's [0, 2**63)
            stop=req.stop_list(), stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            ignore_eos=bool(req.ignore_eos), n=req.n or 1, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0, logit_bias=_logit_bias(req.logit_bias, model),
            allowed_token_ids=_allowed_token_ids(req.allowed_token_ids, model), bad_words=tuple(req.bad_words or ()),
            **guides,
            speculative=req.speculative is not False,
            output_kind="delta" if req.stream else "final")  # a full response is read once, at the end
    except ValueError as err:  # e.g. min_tokens > max_tokens; SamplingParams' messages start with the field
        field = str(err).split(maxsplit=1)[0]
        raise bad_request(str(err), field if field in type(req).model_fields else None) from None


def _truncated(ids: list[int], req: _SamplingRequest, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's; -1: as many as the context holds)."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be >= 1, or -1 for the context's length",
                          "truncate_prompt_tokens")
    return ids[-(max_model_len if keep == -1 else keep):]


def _logit_bias(bias: dict[str, float] | None, model: Any) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON keys) -> {id: bias}, each bias clamped to [-100, 100] as vLLM does."""
    try:
        ids = {int(key): value for key, value in (bias or {}).items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
    _check_token_ids(list(ids), model, "logit_bias")
    return {token: min(max(value, -100.0), 100.0) for token, value in ids.items()}


def _guided(req: _SamplingRequest, tool_schema: dict | None = None) -> dict[str, Any]:
    """vLLM's guided_choice, guided_regex, guided_json and guided_grammar, or structured_outputs={"choice" |
    "regex" | "json" | "grammar": ...} (its newer spelling), or OpenAI's response_format (chat), or the schema of
    the tool calls a chat's tool_choice asks for: SamplingParams' guided_* fields."""
    guides = {"guided_choice": req.guided_choice, "guided_regex": req.guided_regex, "guided_json": req.guided_json,
              "guided_grammar": req.guided_grammar}
    named = {name: name for name in guides}
    if tool_schema is not None:
        given = [name for name in (*guides, "structured_outputs", "response_format")
                 if _guide_set(getattr(req, name, None))]
        if given:
            raise bad_request(f"tool_choice \"required\" or a named function guides the answer by the tools' "
                              f"schemas, so {given[0]} cannot be given too", given[0])
        guides["guided_json"], named["guided_json"] = tool_schema, "tools"
    if req.structured_outputs:
        outputs = req.structured_outputs
        if not isinstance(outputs, dict) or len(outputs) != 1 or \
                not set(outputs) <= {"choice", "regex", "json", "grammar"}:
            raise unsupported("structured_outputs", 'only one of {"choice": [...]}, {"regex": "..."}, '
                              '{"json": schema} or {"grammar": "..."} is implemented')
        (key, value), = outputs.items()
        guides[f"guided_{key}"], named[f"guided_{key}"] = value, "structured_outputs"
    schema = _response_format_schema(getattr(req, "response_format", None))
    if schema is not None:
        guides["guided_json"], named["guided_json"] = schema, "response_format"
    choice = guides["guided_choice"]
    if choice is not None and (not isinstance(choice, list) or not choice
                               or any(not isinstance(c, str) or not c for c in choice)):
        raise bad_request(f"{named['guided_choice']} must be a non-empty list of non-empty strings",
                          named["guided_choice"])
    guides["guided_choice"] = tuple(choice or ())
    for name, check in (("guided_regex", compile_regex), ("guided_json", schema_dfa),
                        ("guided_grammar", grammar_dfa)):
        if guides[name] is not None:
            if name != "guided_json" and not isinstance(guides[name], str):
                raise bad_request(f"{named[name]} must be a string", named[name])
            try:
                check(guides[name])
            except ValueError as err:
                raise bad_request(str(err), named[name]) from None
    # with ignore_eos or min_tokens, or two guides, SamplingParams refuses them (naming the field)
    return guides


def _guide_set(value: Any) -> bool:
    """A guide field a client really set (vLLM clients send them at their defaults; text is no guide)."""
    return value not in (None, [], {}, "") and value != {"type": "text"}


def _response_format_schema(response_format: Any) -> Any:
    """OpenAI's response_format as a JSON Schema: None for text, any object for json_object, the given schema for
    json_schema."""
    if not response_format:
        return None
    if not isinstance(response_format, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if kind != "json_schema" or not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad_request('response_format must be {"type": "text" | "json_object"} or {"type": "json_schema", '
                          '"json_schema": {"name": ..., "schema": {...}}}', "response_format")
    return spec.get("schema", {})


def _allowed_token_ids(allowed: list[int] | None, model: Any) -> tuple[int, ...] | None:
    """vLLM's allowed_token_ids: None or [] (its default) allows every token."""
    if not allowed:
        return None
    _check_token_ids(allowed, model, "allowed_token_ids")
    return tuple(allowed)


def _room(prompts: list[list[int]], max_model_len: int, param: str) -> int:
    """Output tokens left after the longest prompt (400 naming `param`, the prompt's field, if none)."""
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:  # vLLM's words: clients (litellm) spot a context overflow by them
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                       f"has {longest} tokens, which leaves no room for the output.", param,
                       code="context_length_exceeded")
    return max_model_len - longest


def _check_token_ids(ids: list[int], model: Any, param: str) -> None:
    vocab = model.base.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"{param} must be token ids in [0, {vocab})", param)
