"""OpenAI's tools and tool_choice on /v1/chat/completions, as a vLLM server serves them.

The tools always reach the chat template (a template that knows tools shows
them to the model); tool_choice says what the answer is:
- "none": text, as without tools.
- a named function: that function's arguments, guided by its parameters'
  JSON Schema, returned as one tool call (finish_reason "stop", as vLLM).
- "required": a JSON array of {"name": ..., "parameters": {...}} elements, one
  or more (exactly one with parallel_tool_calls=false), guided by a schema made
  of the tools' own, returned as tool calls.
- "auto" (the default with tools): the model decides, writing calls in its own
  format, which the server's parser (`--enable-auto-tool-choice
  --tool-call-parser hermes` or `llama3_json`) finds in the text; finish_reason "tool_calls"
  when it found one. Without a parser, "auto" is refused as vLLM refuses it.
Guided modes decode losslessly with Medusa (the guide masks every tree node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from medusa.decoding.json_schema import schema_dfa
from medusa.decoding.server.errors import bad_request
from medusa.decoding.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule


@dataclass(frozen=True)
class ToolPlan:
    """How a chat job's answer becomes tool calls: mode "named" (with `function`), "required" or a parser's name."""

    mode: str
    function: str | None = None
    schema: dict | None = None  # the JSON Schema guiding the answer (named, required)


def tool_plan(req: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """The request's plan (None: a plain text answer); a 400 naming the field for tools or a tool_choice that
    cannot be served."""
    tools = req.tools or []
    _check_tools(tools)
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice needs tools: the request lists none", "tool_choice")
    if choice != "auto":
        for name in ("ignore_eos", "min_tokens"):
            if getattr(req, name):
                raise bad_request(f"tool_choice {_shown(choice)} ends the answer once its calls are complete, so it "
                                  f"cannot be combined with {name}", name)
    if isinstance(choice, NamedToolChoice):
        index = _function_index(tools, choice.function.name)
        return ToolPlan("named", choice.function.name, _parameters(tools[index].function, index))
    if choice == "required":
        return ToolPlan("required", schema=_call_array_schema(tools, bool(req.parallel_tool_calls is not False)))
    if parser is None:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                          '(or pass tool_choice "none", "required" or a named function)', "tool_choice")
    return ToolPlan(parser)


def _shown(choice: str | NamedToolChoice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"naming {choice.function.name!r}"


def template_tools(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """The tools as chat templates read them (transformers' `tools=`)."""
    if not tools:
        return None
    return [{"type": "function", "function": tool.function.model_dump(exclude_none=True)} for tool in tools]


def _check_tools(tools: list[ToolDefinition]) -> None:
    seen = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not FUNCTION_NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                              "tools")
        if name in seen:
            raise bad_request(f"tools[{i}].function.name {name!r} is given twice", "tools")
        seen.add(name)


def _function_index(tools: list[ToolDefinition], name: str) -> int:
    for i, tool in enumerate(tools):
        if tool.function.name == name:
            return i
    raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                      f"({', '.join(t.function.name for t in tools)})", "tool_choice")


def _parameters(function: Any, index: int) -> dict:
    """The function's parameters as an object schema (none: it takes no arguments, so `{}`); 400 naming the
    keyword guided decoding cannot enforce."""
    schema = function.parameters
    if schema is None:
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
    elif schema.get("type", "object") != "object":
        raise bad_request(f"tools[{index}].function.parameters must be an object schema (\"type\": \"object\")",
                          "tools")
    else:
        schema = {"type": "object", **schema}
    try:
        schema_dfa(schema)
    except ValueError as err:
        raise bad_request(f"tools[{index}].function.parameters: {err}", "tools") from None
    return schema


def _call_array_schema(tools: list[ToolDefinition], parallel: bool) -> dict:
    """[{"name": <a tool>, "parameters": <its arguments>}, ...]: one element or more (exactly one unless parallel)."""
    calls, defs = [], {}
    for i, tool in enumerate(tools):
        parameters = _parameters(tool.function, i)
        for key in ("$defs", "definitions"):  # their $refs resolve from the array's root now
            for name, sub in parameters.get(key, {}).items():
                if defs.setdefault(f"#/{key}/{name}", sub) != sub:
                    raise bad_request(f"tools[{i}].function.parameters defines {key}/{name} unlike an earlier tool; "
                                      "tool_choice \"required\" needs shared definitions to agree", "tools")
        calls.append({"type": "object", "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    for ref, sub in defs.items():
        _, key, name = ref.split("/", 2)
        array.setdefault(key, {})[name] = sub
    return array
