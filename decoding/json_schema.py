"""A JSON Schema as regex rules, for guided decoding (`guided_json`, `response_format`, tool calls).

The output is one JSON text in a fixed layout: an object's properties in the
schema's order, one optional space after ":" and ",", none elsewhere. The
guide (`schema_dfa`) writes the schema as a regex whose schema-free values
(`{}`, `json_object`) and `$ref`s (to `$defs` / `definitions`) are rules, each
written once and referred to as (?&name), and follows them exactly through
`grammar.rules_dfa`: nested or recursive values go as deep as the text goes.
`schema_regex` writes one plain regex instead, where a regex cannot count:
schema-free values nest ANY_DEPTH deep and `$ref`s are cut MAX_REF_DEPTH deep
(for reading, and the tests' oracle).

Supported: type (one or a list), properties / required (optional properties
may be left out, order kept), additionalProperties false or absent, items,
minItems / maxItems, enum, const, anyOf / oneOf, allOf of one schema,
minLength / maxLength, pattern, format (date-time, date, time, uuid), $ref.
Annotations (title, description, examples, default, ...) are ignored. Any other
keyword (minimum, multipleOf, patternProperties, ...) would change which texts
are valid, so it is refused with a ValueError naming it, not ignored.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from medusa.decoding.grammar import regex_rule, rules_dfa
from medusa.decoding.term_dfa import TermDFA

ANY_DEPTH = 3  # objects / arrays inside a schema-free value, at most this deep
MAX_REF_DEPTH = 8
SEP = " ?"  # after ":" and ","
STRING_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(\.[0-9]+)?([eE][+-]?[0-9]+)?"
FORMATS = {"date-time": r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})",
           "date": r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "time": r"[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?",
           "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"}
ANNOTATIONS = {"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "strict"}
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum", "const",
            "anyOf", "oneOf", "allOf", "minLength", "maxLength", "pattern", "format", "$ref"}


def schema_regex(schema: Any) -> str:
    """The regex of JSON texts valid under `schema` (a dict, True, or a JSON string of one), unrolled where a regex
    cannot count (see the module doc). ValueError, naming guided_json and the keyword, for what is not supported."""
    if isinstance(schema, str):
        return _text_regex(schema)
    schema = _schema_object(schema)
    return _Converter(schema).value(schema, 0)


@functools.lru_cache(maxsize=64)
def _text_regex(text: str) -> str:
    return schema_regex(_schema_object(text))


def schema_dfa(schema: Any) -> TermDFA:
    """The guide's automaton of `schema` (a dict, True, or its JSON text; cached by that text): the schema's
    regex with a schema-free value and each `$ref` as rules (`_Converter`), followed exactly (`grammar.rules_dfa`),
    so neither is cut at a depth. ValueError naming guided_json, as schema_regex."""
    text = schema if isinstance(schema, str) else json.dumps(schema)  # key order kept: properties are ordered
    return _schema_dfa(text)


@functools.lru_cache(maxsize=64)
def _schema_dfa(text: str) -> TermDFA:
    schema = _schema_object(text)
    rules: dict[str, str] = {}
    rules["root"] = _Converter(schema, rules).value(schema, 0)
    return rules_dfa({name: regex_rule(pattern) for name, pattern in rules.items()}, f"guided_json:{text}",
                     "guided_json")


def _schema_object(schema: Any) -> dict:
    """The schema as a dict (read from its JSON text; True is {}); ValueError naming guided_json otherwise."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"guided_json is not valid JSON: {err}") from None
        if isinstance(schema, str):  # JSON text of a string, not of a schema
            raise ValueError("guided_json must be a JSON Schema object, got a string")
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"guided_json must be a JSON Schema object, got {type(schema).__name__}")
    return schema


def any_json_regex(depth: int = ANY_DEPTH) -> str:
    """Any JSON value nesting objects and arrays at most `depth` deep."""
    value = f"({STRING}|{NUMBER}|true|false|null)"
    for _ in range(depth):
        value = _value_of(value)
    return value


def any_object_regex(depth: int = ANY_DEPTH) -> str:
    """Any JSON object (response_format json_object), its values nesting at most `depth - 1` deep."""
    return _object_of(any_json_regex(depth - 1))


def _value_of(inner: str) -> str:
    """Any JSON value whose arrays' items and objects' values are `inner`."""
    return f"({STRING}|{NUMBER}|true|false|null|\\[({inner}(,{SEP}{inner})*)?\\]|{_object_of(inner)})"


def _object_of(inner: str) -> str:
    """Any JSON object whose values are `inner`."""
    return f"\\{{({STRING}:{SEP}{inner}(,{SEP}{STRING}:{SEP}{inner})*)?\\}}"


class _Converter:
    """Schema -> regex. With `rules` (schema_dfa's), a schema-free value is the rule `json_value` and a `$ref` the
    rule of its target, each referred to as (?&name) and written once into `rules`, so nothing is cut at a
    depth; without, both are unrolled (ANY_DEPTH, MAX_REF_DEPTH)."""

    def __init__(self, root: dict, rules: dict[str, str] | None = None) -> None:
        self.root, self.rules = root, rules
        self.ref_rules: dict[str, str] = {}  # a $ref -> its rule's name

    def _any(self) -> str:
        if self.rules is None:
            return any_json_regex()
        if "json_value" not in self.rules:
            self.rules["json_value"] = _value_of("(?&json_value)")
        return "(?&json_value)"

    def _any_object(self) -> str:
        return any_object_regex() if self.rules is None else _object_of(self._any())

    def _ref(self, ref: str, depth: int) -> str:
        if self.rules is None:
            return self.value(self._resolve(ref, depth), depth + 1)
        if ref not in self.ref_rules:
            name = self.ref_rules[ref] = f"ref{len(self.ref_rules)}"  # taken first: a recursive $ref finds it
            self.rules[name] = self.value(self._resolve(ref, 0), 0)
        return f"(?&{self.ref_rules[ref]})"

    def value(self, schema: Any, depth: int) -> str:
        if schema is True or schema == {}:
            return self._any()
        if schema is False or not isinstance(schema, dict):
            raise ValueError(f"guided_json: a schema must be an object or true, got {schema!r}")
        unknown = set(schema) - KEYWORDS - ANNOTATIONS
        if unknown:
            raise ValueError(f"guided_json: keyword {sorted(unknown)[0]!r} is not supported (supported: "
                             f"{', '.join(sorted(KEYWORDS))})")
        if "$ref" in schema:
            return self._ref(schema["$ref"], depth)
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ValueError("guided_json: enum must be a non-empty list")
            return "(" + "|".join(_literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(" + "|".join(self.value(s, depth) for s in _schemas(schema[key], key)) + ")"
        if "allOf" in schema:
            parts = _schemas(schema["allOf"], "allOf")
            if len(parts) != 1:
                raise ValueError("guided_json: allOf is supported with one schema only")
            return self.value(parts[0], depth)
        kinds = schema.get("type", "object" if "properties" in schema else None)
        if kinds is None:
            return self._any()
        kinds = kinds if isinstance(kinds, list) else [kinds]
        return "(" + "|".join(self._typed(schema, kind, depth) for kind in kinds) + ")"

    def _typed(self, schema: dict, kind: str, depth: int) -> str:
        if kind == "string":
            return self._string(schema)
        if kind == "integer":
            return INTEGER
        if kind == "number":
            return NUMBER
        if kind == "boolean":
            return "(true|false)"
        if kind == "null":
            return "null"
        if kind == "array":
            return self._array(schema, depth)
        if kind == "object":
            return self._object(schema, depth)
        raise ValueError(f"guided_json: unknown type {kind!r}")

    def _string(self, schema: dict) -> str:
        if "pattern" in schema:  # the whole string matches it (anchors or not)
            pattern = schema["pattern"]
            try:
                re.compile(pattern)
            except (re.error, TypeError) as error:
                raise ValueError(f"guided_json: pattern {pattern!r} is not a valid regular expression: {error}") \
                    from None
            pattern = pattern[1:] if pattern.startswith("^") else pattern
            pattern = pattern[:-1] if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
            return f'"({pattern})"'
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise ValueError(f"guided_json: string format {schema['format']!r} is not supported (supported: "
                                 f"{', '.join(FORMATS)})")
            return f'"{FORMATS[schema["format"]]}"'
        low, high = _bounds(schema, "minLength", "maxLength", "string")
        if low or high is not None:
            return f'"{STRING_CHAR}{{{low},{"" if high is None else high}}}"'
        return STRING

    def _array(self, schema: dict, depth: int) -> str:
        item = self.value(schema.get("items", True), depth)
        low, high = _bounds(schema, "minItems", "maxItems", "array")
        if high == 0:
            return r"\[\]"
        more = f"(,{SEP}{item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        body = f"{item}{more}"
        return f"\\[{body}\\]" if low else f"\\[({body})?\\]"

    def _object(self, schema: dict, depth: int) -> str:
        properties = schema.get("properties")
        extra = schema.get("additionalProperties", False if properties else True)
        if not properties:
            if extra is False:
                return r"\{\}"
            return self._any_object()
        if extra not in (False, None) and properties:
            raise ValueError("guided_json: additionalProperties beside properties is not supported (leave it out or "
                             "set it false)")
        required = set(schema.get("required", []))
        unknown = required - set(properties)
        if unknown:
            raise ValueError(f"guided_json: required names {sorted(unknown)[0]!r}, which is not in properties")
        fields = [(f'{_literal(name)}:{SEP}{self.value(sub, depth)}', name in required)
                  for name, sub in properties.items()]
        return r"\{" + _ordered(fields) + r"\}"

    def _resolve(self, ref: str, depth: int) -> dict:
        if depth >= MAX_REF_DEPTH:
            raise ValueError(f"guided_json: $ref nests deeper than {MAX_REF_DEPTH} (a recursive schema?)")
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        target = self.root.get(match.group(1), {}).get(match.group(2)) if match else None
        if target is None:
            raise ValueError(f"guided_json: $ref {ref!r} does not name a schema in $defs or definitions")
        return target


def _bounds(schema: dict, low_key: str, high_key: str, kind: str) -> tuple[int, int | None]:
    """A length's (least, most or None) from its two keywords, refused here where no value could meet them: they
    become a regex repeat, whose own error would only show the internal regex."""
    low, high = schema.get(low_key), schema.get(high_key)
    for key, bound in ((low_key, low), (high_key, high)):
        if bound is not None and (type(bound) is not int or bound < 0):
            raise ValueError(f"guided_json: {key} must be a non-negative integer, got {bound!r}")
    low = low or 0
    if high is not None and low > high:
        raise ValueError(f"guided_json: {low_key} {low} > {high_key} {high}: no {kind} can have both")
    return low, high


def _ordered(fields: list[tuple[str, bool]]) -> str:
    """Fields in order, separated by commas, the optional ones (required False) free to be left out."""
    if not fields:
        return ""
    if all(required for _, required in fields):
        return f",{SEP}".join(text for text, _ in fields)
    # the text starts at the first field written: some optional ones, then a required one or the end
    starts = []
    for i, (text, required) in enumerate(fields):
        rest = "".join(f"(,{SEP}{t})" + ("" if r else "?") for t, r in fields[i + 1:])
        starts.append(text + rest)
        if required:
            break
    else:
        return "(" + "|".join(starts) + ")?"
    return "(" + "|".join(starts) + ")"


def _schemas(value: Any, key: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"guided_json: {key} must be a non-empty list of schemas")
    return value


def _literal(value: Any) -> str:
    """A JSON value written compactly (", " and ": " as SEP allows), as a regex."""
    if isinstance(value, dict):
        items = [f"{_literal(k)}:{SEP}{_literal(v)}" for k, v in value.items()]
        return r"\{" + f",{SEP}".join(items) + r"\}"
    if isinstance(value, list):
        return r"\[" + f",{SEP}".join(_literal(v) for v in value) + r"\]"
    return re.escape(json.dumps(value, ensure_ascii=False))
