"""Chat helpers: validate messages and apply the model's chat template."""

from __future__ import annotations

from typing import Any, Sequence

ROLES = ("system", "user", "assistant", "tool")
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # kept for the template: an assistant's calls, a tool's answer


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check an OpenAI-style message list; return it as plain dicts (role, content and the tool keys given)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{i}] has role {message['role']!r}; expected one of {ROLES}")
        if not isinstance(message["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")
        checked.append({"role": message["role"], "content": message["content"],
                        **{key: message[key] for key in TOOL_KEYS if message.get(key) is not None}})
    return checked


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], system_prompt: str | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the conversation, ending where the assistant's reply starts (or, with
    `continue_final_message`, inside the last message, so the reply continues it; with
    add_generation_prompt=False, after the last message).

    `system_prompt` is prepended when the conversation has no system message
    (SmolLM2 answers far better with its own). The template writes any BOS itself, so
    the text is tokenized without the tokenizer's own special tokens. `tools` (OpenAI's tool
    definitions) go to the template, which shows them to the model if it knows how. `template_kwargs`: more
    variables for the template (vLLM's chat_template_kwargs, say enable_thinking); they may not replace the ones
    named here.
    """
    messages = validate_messages(messages)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: the first starts a "
                         "new assistant message, the second continues the last one")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template: pass a plain prompt string or token ids instead")
    named = {"messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template"}
    clash = sorted(named & set(template_kwargs or {}))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)} (given by their own arguments)")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]
