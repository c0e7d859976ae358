"""OpenAI-compatible request and response shapes (what a vLLM endpoint serves).

Requests are parsed from the raw body in pydantic's strict JSON mode (a string
is not a number, `true` is not a temperature, NaN is not a float) and ignore
unknown fields, as vLLM does. Every range the engine relies on is checked here,
so a request the server accepts can never fail inside an engine step.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 64  # completions per prompt (SamplingParams' limit)
MAX_LOGPROBS = 20  # top alternatives per token (SamplingParams' limit)
_INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far


class _SamplingRequest(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None  # None: the served model (vLLM allows leaving it out)
    max_tokens: int | None = Field(None, ge=1, lt=_INT64)
    temperature: float | None = Field(None, ge=0)  # None: OpenAI's default, 1
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=_INT64)  # -1 or 0: no top-k filter (vLLM's convention)
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's: 0 is off
    n: int | None = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text in the output
    truncate_prompt_tokens: int | None = Field(None, ge=-1, lt=_INT64)  # vLLM's: keep the prompt's last k tokens
    seed: int | None = Field(None, ge=-_INT64, lt=2 * _INT64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0, lt=_INT64)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be output
    bad_words: list[str] | None = None  # vLLM's: words the output may not complete
    guided_choice: Any = None  # vLLM's: the output is one of these strings (checked in jobs, as structured_outputs)
    guided_regex: Any = None  # vLLM's: the output's text matches this regular expression (checked in jobs)
    guided_json: Any = None  # vLLM's: the output is JSON valid under this schema (checked in jobs)
    guided_grammar: Any = None  # vLLM's: the output matches this GBNF grammar (checked in jobs)
    structured_outputs: Any = None  # vLLM's newer spelling: {"choice" | "regex" | "json" | "grammar": ...}
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each prompt token's logprob + top k
    speculative: bool | None = True  # Medusa tree verification; False: plain one-token steps
    # vLLM's fields that change the output and that this server does not implement: read so that a request
    # setting one is refused (jobs.UNSERVED) rather than answered as if it had not
    use_beam_search: Any = None
    logits_processors: Any = None
    prompt_embeds: Any = None
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprobs name tokens "token_id:<id>"

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON text, as the assistant wrote it


class ToolCallIn(_Strict):
    """An assistant message's earlier call, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str | None:
        if isinstance(self.content, list):  # OpenAI's content parts: only text ones are served
            return "\n".join(part.text for part in self.content)
        return self.content


class _ChatTemplateOptions(_Strict):
    """How the conversation meets the chat template (vLLM's names): a new assistant turn is started, or the last
    (assistant) message is continued."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)
    chat_template: Any = None  # vLLM's per-request template: refused, as vLLM refuses an untrusted one (jobs)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: the function takes no arguments
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice naming the function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=_INT64)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without (OpenAI's defaults)
    parallel_tool_calls: bool | None = True  # False: tool_choice "required" makes exactly one call
    response_format: dict[str, Any] | None = None
    # fields read so that a request setting one is refused (jobs.CHAT_UNSERVED), not answered as if unset
    echo: Any = None  # vLLM's chat echo (the last message repeated in the answer)
    functions: Any = None  # OpenAI's legacy function calling
    function_call: Any = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, lt=_INT64)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class TokenizeCompletionRequest(_Strict):
    """/tokenize with a prompt: its token ids as /v1/completions would run them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own BOS and the like, as /v1/completions adds them
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateOptions):
    """/tokenize with messages: the token ids /v1/chat/completions would run."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None  # given to the chat template, as a chat completion gives them
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`, keyed by token id: a prompt token's or one of its top alternatives'."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token; None for the first (nothing before it)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer is only tool calls
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop_token_ids token or stop string that ended it


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra field: the prompt's, as asked


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": text} and / or {"tool_calls": [...]}, whose
    # entries carry their index, and id, type and function name the first time, then arguments text
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop_token_ids token or stop string that ended it
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra field: the prompt's, as asked


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set on a full response; only on the last chunk when streaming


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "medusa"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's vocabulary entry, when asked for


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
