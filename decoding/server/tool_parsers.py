"""Tool calls found in an answer's text as it streams.

A parser takes the answer's text deltas and gives back, for each, the content
text to show and the tool-call deltas in OpenAI's streaming shape: a call's
first delta carries its index, id, type and function name, later ones more of
its `arguments` text. Fed all at once or a character at a time, a parser
gives the same content and calls; a full response is the sum of its deltas.

- NamedCall: the whole answer is one call's arguments (tool_choice naming a
  function; the answer was guided by its parameters' schema).
- CallArray: the answer is a JSON array of {"name": ..., "parameters": {...}}
  (tool_choice "required"); each element's parameters stream as they come.
- HermesCalls: calls written as `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` anywhere in free text (tool_choice "auto" with
  `--tool-call-parser hermes`: Hermes, Qwen 2.5 / 3 and SmolLM3 write so). Text
  outside the tags is content; a block that does not parse stays content too,
  so nothing the model wrote is lost.
- Llama3Json: an answer that is JSON calls, `{"name": ..., "parameters": {...}}`
  (or "arguments"), several separated by ";", perhaps after `<|python_tag|>`
  (tool_choice "auto" with `--tool-call-parser llama3_json`: Llama 3.1-3.3
  write so). An answer that starts otherwise streams as content; one that
  starts as JSON is held to its end, then becomes calls, or content where it
  does not parse.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

TOOL_PARSERS = ("hermes", "llama3_json")  # --tool-call-parser choices (here, where `medusa generate` may import them)

Delta = tuple[str, list[dict[str, Any]]]  # (content text, tool-call deltas)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallParser:
    """Base: keeps the calls found so far as {"id", "name", "arguments"} dicts."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        """What was held back once the answer has ended."""
        return "", []

    def _new_call(self, name: str, arguments: str = "") -> dict[str, Any]:
        self.calls.append({"id": new_call_id(), "name": name, "arguments": ""})
        return self._more(len(self.calls) - 1, arguments, first=True)

    def _more(self, index: int, arguments: str, first: bool = False) -> dict[str, Any]:
        """The delta adding `arguments` to call `index` (its first delta also names it)."""
        call = self.calls[index]
        call["arguments"] += arguments
        if first:
            return {"index": index, "id": call["id"], "type": "function",
                    "function": {"name": call["name"], "arguments": arguments}}
        return {"index": index, "function": {"arguments": arguments}}


class NamedCall(ToolCallParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Delta:
        if not self.calls:
            return "", [self._new_call(self.name, text)]
        return "", [self._more(0, text)] if text else []

    def finish(self) -> Delta:
        return "", [] if self.calls else [self._new_call(self.name)]  # an empty answer is still the call


class CallArray(ToolCallParser):
    """Reads `[{"name": "f", "parameters": {...}}, ...]` one character at a time: JSON nesting depth, strings
    and escapes, the key of each value inside an element (depth 2); `name` precedes `parameters` (the guiding
    schema orders them so), and the parameters object's characters are the call's arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.in_string = self.escaped = False
        self.string = ""  # the string being read at depth 2 (a key or the name), closing quote included
        self.key: str | None = None  # the element's key whose value comes next
        self.name: str | None = None
        self.in_arguments = False
        self.unused = ""  # the text since the last character that went into a call's arguments

    def feed(self, text: str) -> Delta:
        added: dict[int, str] = {}  # call index -> its arguments text in this delta (in order)
        new: set[int] = set()
        for char in text:
            was_in = self.in_arguments
            self._step(char)
            if self.in_arguments and not was_in:  # this "{" opens an element's parameters
                self.calls.append({"id": new_call_id(), "name": self.name or "", "arguments": ""})
                new.add(len(self.calls) - 1)
            if self.in_arguments or was_in:  # from the opening "{" to the closing "}" included
                index = len(self.calls) - 1
                added[index] = added.get(index, "") + char
                self.unused = ""
            else:
                self.unused += char
        return "", [self._more(index, arguments, first=index in new) for index, arguments in added.items()]

    def finish(self) -> Delta:
        """An array cut short (max_tokens) outside any parameters, e.g. inside a name, ends with text that is
        no call: it becomes content, so the answer keeps what the model wrote."""
        return (self.unused, []) if self.depth > 0 and self.unused.strip() else ("", [])

    def _step(self, char: str) -> None:
        if self.in_string:
            if self.depth == 2 and not self.in_arguments:
                self.string += char
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 2 and not self.in_arguments:
                    self._string_done(_json_string('"' + self.string))
            return
        if char == '"':
            self.in_string, self.string = True, ""
        elif char in "[{":
            self.depth += 1
            if self.depth == 2:  # a new element
                self.key = self.name = None
            elif self.depth == 3 and self.key == "parameters":
                self.in_arguments = True
        elif char in "]}":
            self.depth -= 1
            if self.depth == 2 and self.in_arguments:
                self.in_arguments = False
        elif char == "," and self.depth == 2:
            self.key = None

    def _string_done(self, value: str) -> None:
        if self.key is None:
            self.key = value
        elif self.key == "name":
            self.name = value


class HermesCalls(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""  # text not yet shown: a possible start of OPEN, or a call's body
        self.inside = False

    def feed(self, text: str) -> Delta:
        self.pending += text
        content, deltas = "", []
        while True:
            if self.inside:
                end = self.pending.find(self.CLOSE)
                if end < 0:
                    return content, deltas
                body, self.pending = self.pending[:end], self.pending[end + len(self.CLOSE):]
                self.inside = False
                content += self._call(body, deltas, closed=True)
            else:
                start = self.pending.find(self.OPEN)
                if start < 0:
                    keep = _partial_suffix(self.pending, self.OPEN)
                    content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    return content, deltas
                content += self.pending[:start]
                self.pending, self.inside = self.pending[start + len(self.OPEN):], True

    def finish(self) -> Delta:
        deltas: list[dict[str, Any]] = []
        if self.inside:  # the answer ended inside a call (max_tokens, or no closing tag): parse what is there
            content = self._call(self.pending, deltas, closed=False)
        else:
            content = self.pending
        self.pending, self.inside = "", False
        return content, deltas

    def _call(self, body: str, deltas: list[dict[str, Any]], closed: bool) -> str:
        """A call's delta for a body that parses as {"name": str, "arguments": object}; else the text as content."""
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return self.OPEN + body + (self.CLOSE if closed else "")
        deltas.append(self._new_call(call["name"], json.dumps(arguments, ensure_ascii=False)))
        return ""


class Llama3Json(ToolCallParser):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""
        self.mode: str | None = None  # "text" or "calls", once the answer's start tells

    def feed(self, text: str) -> Delta:
        if self.mode == "text":
            return text, []
        self.pending += text
        start = self.pending.lstrip()
        if not start or self.TAG.startswith(start):  # not yet known
            return "", []
        self.mode = "calls" if start.startswith((self.TAG, "{")) else "text"
        if self.mode == "text":
            text, self.pending = self.pending, ""
            return text, []
        return "", []

    def finish(self) -> Delta:
        text, self.pending = self.pending, ""
        calls = _json_calls(text.strip().removeprefix(self.TAG)) if self.mode == "calls" else None
        if calls is None:
            return text, []
        return "", [self._new_call(name, arguments) for name, arguments in calls]


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of `{"name", "parameters" | "arguments"}` objects separated by ";", or None."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            call, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        arguments = call.get("parameters", call.get("arguments", {})) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return None
        calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())


def _json_string(text: str) -> str:
    """A JSON string literal's value (the text between the quotes where it does not parse)."""
    try:
        return json.loads(text)
    except ValueError:
        return text[1:-1]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (text to hold back: the marker may follow)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def make_parser(mode: str, function: str | None = None) -> ToolCallParser:
    """The parser of a tool plan's mode: "named" (with the function's name), "required", or a parser's name
    (TOOL_PARSERS)."""
    if mode == "named":
        return NamedCall(function or "")
    if mode == "required":
        return CallArray()
    if mode == "hermes":
        return HermesCalls()
    if mode == "llama3_json":
        return Llama3Json()
    raise ValueError(f"unknown tool call mode {mode!r}")
