"""guided_json: a JSON Schema as a regex, checked with Python's `re` on texts valid and invalid under the schema,
and on the engine (the default model answers valid JSON, with Medusa as without)."""

import json
import re

import pytest

from medusa.decoding.json_schema import any_json_regex, any_object_regex, schema_dfa, schema_regex
from medusa.decoding.regex_dfa import compile_regex
from medusa.decoding.sampling_params import SamplingParams

PERSON = {"title": "Person", "type": "object", "description": "pydantic writes these annotations",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "email": {"type": ["string", "null"]}, "tags": {"type": "array", "items": {"type": "string"},
                                                                         "minItems": 1, "maxItems": 2},
                         "pet": {"$ref": "#/$defs/Pet"}},
          "required": ["name", "age"], "$defs": {"Pet": {"type": "object", "properties": {
              "kind": {"enum": ["cat", "dog", 3]}, "good": {"type": "boolean"}}, "required": ["kind", "good"]}}}
CASES = [
    (PERSON, ['{"name": "Ada", "age": 36}', '{"name":"Ada","age":-1,"email":null}',
              '{"name": "A\\"da\\u00e9", "age": 0, "tags": ["x"], "pet": {"kind": "cat", "good": true}}',
              '{"name": "Ada", "age": 3, "email": "a@b.c", "pet": {"kind": 3, "good": false}}'],
     ['{"age": 36}', '{"age": 36, "name": "Ada"}', '{"name": "Ada", "age": 3.5}', '{"name": "Ada", "age": 01}',
      '{"name": "Ada Lovelace Byron", "age": 1}',
      '{"name": "Ada", "age": 1, "tags": []}',
      '{"name": "Ada", "age": 1, "tags": ["a", "b", "c"]}', '{"name": "Ada", "age": 1, "pet": {"kind": "cow", '
      '"good": true}}', '{"name": "Ada", "age": 1, "x": 2}', '{"name": "Ada",  "age": 1}', ' {"name": "a", "age": 1}']),
    ({"type": "object", "properties": {"a": {"type": "number"}, "b": {"const": {"k": [1, "x"]}}}},
     ['{}', '{"a": 1.5e-3}', '{"b": {"k": [1, "x"]}}', '{"a": -0, "b": {"k":[1,"x"]}}'],
     ['{"b": 1, "a": 2}', '{"a": 1.}', '{"a": .5}', '{"b": {"k": [1]}}', '{,}']),
    ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string", "format": "date"}]}, "maxItems": 3},
     ['[]', '[1, "2024-01-31", 3]'], ['[1, 2, 3, 4]', '["2024-1-31"]', '[1,]']),
    ({"type": "string", "pattern": "^[A-Z]{2}-\\d+$"}, ['"AB-12"'], ['"ab-12"', '"AB-"', 'AB-1']),
    ({"oneOf": [{"type": "boolean"}, {"type": "null"}]}, ["true", "null"], ["1", '"true"']),
    (True, ['{"a": [1, {"b": null}]}', '"x"', '[[["deep"]]]', '-2.5E+7'], ['[[[["too deep"]]]]', '{a: 1}', 'nil']),
]


@pytest.mark.parametrize("schema, valid, invalid", CASES)
def test_the_regex_matches_exactly_the_texts_the_schema_allows(schema, valid, invalid):
    """The regex, its DFA and the guide's automaton (schema_dfa: schema-free values unbounded, so the regex's
    "too deep" is valid there) agree."""
    pattern = schema_regex(schema)
    dfa, guide = compile_regex(pattern), schema_dfa(schema)
    for text in valid:
        json.loads(text)  # the cases themselves are JSON
        assert re.fullmatch(pattern, text), text
        assert dfa.accepts(dfa.walk(dfa.start, text)) and guide.accepts(guide.walk(guide.start, text)), text
    for text in invalid:
        assert not re.fullmatch(pattern, text), text
        assert not dfa.accepts(dfa.walk(dfa.start, text)), text
        assert guide.accepts(guide.walk(guide.start, text)) == ("too deep" in text), text
    assert schema_regex(json.dumps(schema)) == pattern  # the same from the schema's JSON text


def test_a_schema_free_object_nests_at_most_three_deep():
    assert re.fullmatch(any_object_regex(), '{"a": {"b": {"c": 1}}, "d": []}')
    assert not re.fullmatch(any_object_regex(), '{"a": {"b": {"c": {"d": 1}}}}')
    assert not re.fullmatch(any_object_regex(), "[1]") and re.fullmatch(any_json_regex(), "[1]")


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": 3}, "keyword 'minimum' is not supported"),
    ({"type": "string", "format": "email"}, "format 'email' is not supported"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required names 'b'"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "additionalProperties"),
    ({"$ref": "#/$defs/Nope"}, "does not name a schema"),
    ({"type": "tuple"}, "unknown type 'tuple'"),
    ({"enum": []}, "enum must be a non-empty list"),
    ({"allOf": [{}, {}]}, "allOf is supported with one schema only"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 > maxLength 2: no string can have both"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems 3 > maxItems 2: no array can have both"),
    ({"type": "array", "minItems": 1, "maxItems": 0}, "minItems 1 > maxItems 0"),
    ({"type": "string", "minLength": -1}, "minLength must be a non-negative integer, got -1"),
    ({"type": "array", "maxItems": 2.5}, "maxItems must be a non-negative integer, got 2.5"),
    ("{not json", "not valid JSON"), ('"a string"', "must be a JSON Schema object"),
    (3, "must be a JSON Schema object"),
])
def test_what_it_cannot_enforce_is_refused_naming_guided_json(schema, message):
    with pytest.raises(ValueError, match=message):
        schema_regex(schema)
    with pytest.raises(ValueError, match="guided_json"):
        SamplingParams(guided_json=schema)


def test_the_guide_follows_schema_free_values_and_recursive_refs_as_deep_as_the_text_goes():
    """schema_regex unrolls them (3 and 8 deep); the guide's automaton (schema_dfa) keeps them as rules."""
    def accepts(schema, text):
        dfa = SamplingParams(guided_json=schema).guide_dfa()
        return dfa.accepts(dfa.walk(dfa.start, text))

    deep = '{"a": ' * 12 + "[1, " * 12 + "null" + "]" * 12 + "}" * 12
    assert accepts({"type": "object"}, deep) and not accepts({"type": "object"}, deep + "}")
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"]}}}
    text = '{"v": 1, "kids": [' * 15 + '{"v": 2, "kids": []}' + "]}" * 15
    assert accepts(tree, text) and not accepts(tree, text.replace('"v": 2', '"v": "2"'))
    with pytest.raises(ValueError, match="guided_json: it can never end"):  # every node needs a child
        SamplingParams(guided_json={"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
            "kid": {"$ref": "#/$defs/n"}}, "required": ["kid"]}}})
    with pytest.raises(ValueError, match="guided_json: a rule refers to itself before any character"):
        SamplingParams(guided_json={"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"},
                                                                                   {"type": "null"}]}}})


def test_a_schema_pattern_the_regex_compiler_cannot_follow_is_refused_naming_guided_json():
    with pytest.raises(ValueError, match="guided_json: a pattern in the schema cannot be followed"):
        SamplingParams(guided_json={"type": "string", "pattern": "a(?=b)"})


def test_sampling_params_keep_the_schema_as_json_text_and_take_one_guide():
    params = SamplingParams(guided_json=PERSON)
    assert json.loads(params.guided_json) == PERSON and params.guide_pattern.startswith("guided_json:")
    assert params.guide_dfa() is SamplingParams(guided_json=params.guided_json).guide_dfa()  # cached by its text
    hash(params)
    with pytest.raises(ValueError, match="guided_json and guided_choice cannot both be set"):
        SamplingParams(guided_json=PERSON, guided_choice=("a",))


@pytest.mark.slow
def test_the_default_model_answers_valid_json_with_medusa_as_without(default_model_dir):
    from engine_driver import without_policy
    from medusa.medusa_model import MedusaModel

    model = MedusaModel.from_pretrained(device="cpu")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                               "likes": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "age", "likes"]}
    prompt = model.encode([{"role": "user", "content": "Describe a cat called Tom as JSON."}])
    params = SamplingParams(max_tokens=64, guided_json=schema)
    medusa = without_policy(model.engine()).generate([prompt], params)[0]
    plain = model.engine(speculative=False).generate([prompt], params)[0]
    answer = json.loads(medusa.text)
    assert set(answer) == {"name", "age", "likes"} and isinstance(answer["age"], int) and len(answer["likes"]) <= 3
    assert medusa.finish_reason == "stop" and medusa.token_ids == plain.token_ids
    assert medusa.stats.accepted_tokens > 0
