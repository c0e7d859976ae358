"""The tool-call parsers give the same content and calls whether the answer's text comes at once or in any pieces,
and never lose text that is not a call."""

from __future__ import annotations

import json

import pytest

from medusa.decoding.server.tool_parsers import CallArray, HermesCalls, NamedCall, make_parser


def run(parser, pieces):
    """(content, [(name, arguments)], deltas) after feeding `pieces` and finishing."""
    content, deltas = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, deltas = content + text, deltas + new
    text, new = parser.finish()
    return content + text, [(c["name"], c["arguments"]) for c in parser.calls], deltas + new


def splits(text):
    """The text whole, one character at a time, and cut at every point into two."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def summed(deltas):
    """Each call's (name, arguments) as a streaming client rebuilds them from the deltas."""
    calls = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"name": None, "arguments": "", "id": None})
        if "id" in delta:
            assert call["id"] is None and delta["type"] == "function", "a call is named once, in its first delta"
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    assert all(call["id"] for call in calls.values())
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


ARRAY = ('[{"name": "get_\\u0077eather", "parameters": {"city": "Pa}{ris\\"", "days": [1, {"x": null}]}}, '
         '{"name":"now","parameters":{}}]')


def test_a_call_array_streams_each_elements_parameters_as_its_arguments():
    want = [("get_weather", '{"city": "Pa}{ris\\"", "days": [1, {"x": null}]}'), ("now", "{}")]
    for pieces in splits(ARRAY):
        content, calls, deltas = run(CallArray(), pieces)
        assert content == "" and calls == want and summed(deltas) == want
    assert [json.loads(args) for _, args in want]  # the arguments are the JSON the model wrote


def test_a_call_array_cut_short_keeps_the_arguments_written():
    cut = ARRAY.index('"Pa}') + 2
    content, calls, _ = run(CallArray(), [ARRAY[:cut]])
    assert calls == [("get_weather", '{"city": "P')] and content == ""


FIRST = ("get_weather", '{"city": "Pa}{ris\\"", "days": [1, {"x": null}]}')


@pytest.mark.parametrize("cut, calls_before, content", [
    ('"get_', [], '[{"name": "get_'),  # inside the first name: no call yet
    (', {"name"', [FIRST], '}, {"name"'),  # the second element started
    ('"now"', [FIRST], '}, {"name":"now"'),  # its name written, its parameters not
])
def test_a_call_array_cut_outside_parameters_keeps_the_rest_as_content(cut, calls_before, content):
    text = ARRAY[:ARRAY.index(cut) + len(cut)]
    for pieces in splits(text):
        got_content, calls, deltas = run(CallArray(), pieces)
        assert (got_content, calls, summed(deltas)) == (content, calls_before, calls_before)
    assert run(CallArray(), [ARRAY])[0] == ""  # a closed array leaves no content


def test_a_named_call_is_the_whole_answer():
    for pieces in splits('{"a": 1}'):
        assert run(NamedCall("f"), pieces)[1:2] == ([("f", '{"a": 1}')],)
    assert run(NamedCall("f"), [])[1] == [("f", "")]  # no text at all is still the call


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "now", "arguments": {}}</tool_call> a < b <tool_call>not json</tool_call> end')


def test_hermes_calls_are_taken_out_of_the_text_and_the_rest_is_content():
    want = [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    for pieces in splits(HERMES):
        content, calls, deltas = run(HermesCalls(), pieces)
        assert calls == want and summed(deltas) == want
        assert content == "Let me check. \n a < b <tool_call>not json</tool_call> end"  # a bad block stays text


@pytest.mark.parametrize("text,content,calls", [
    ("ends with <tool_c", "ends with <tool_c", []),  # held back while it could be a tag, given back at the end
    ('<tool_call>{"name": "f", "arguments": {"x": 2}}', "", [("f", '{"x": 2}')]),  # cut before the closing tag
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # cut inside the call: text
    ('<tool_call>{"name": "f", "parameters": {"y": 1}}</tool_call>', "", [("f", '{"y": 1}')]),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     []),
])
def test_hermes_answers_that_end_early_or_write_odd_calls(text, content, calls):
    for pieces in splits(text):
        assert run(HermesCalls(), pieces)[:2] == (content, calls)


def test_make_parser_names_an_unknown_mode():
    assert isinstance(make_parser("required"), CallArray)
    with pytest.raises(ValueError, match="unknown tool call mode 'xml'"):
        make_parser("xml")


@pytest.mark.parametrize("text,content,calls", [
    ('{"name": "f", "parameters": {"x": 1}}', "", [("f", '{"x": 1}')]),
    ('<|python_tag|>{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"y": "a;b"}}', "",
     [("f", "{}"), ("g", '{"y": "a;b"}')]),
    ('  {"name": "f", "parameters": {}} trailing words', '  {"name": "f", "parameters": {}} trailing words', []),
    ('{"name": "f", "parame', '{"name": "f", "parame', []),  # cut short: the text, not a broken call
    ("The answer is {x}.", "The answer is {x}.", []),  # text first: streamed as content
    ("<|python", "<|python", []),
])
def test_llama3_json_calls_are_the_whole_answer_or_it_is_text(text, content, calls):
    for pieces in splits(text):
        got = run(make_parser("llama3_json"), pieces)
        assert got[:2] == (content, calls) and summed(got[2]) == calls


def test_llama3_json_streams_text_answers_as_they_come():
    parser = make_parser("llama3_json")
    assert parser.feed("Hel") == ("Hel", []) and parser.feed("lo") == ("lo", [])
