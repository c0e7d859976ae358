"""GBNF, the grammar format vLLM takes for guided_grammar (llama.cpp's and xgrammar's EBNF), read into rules.

    root   ::= answer ("," ws answer)*
    answer ::= "yes" | "no" | [0-9]+   # a comment
    ws     ::= [ \\t]*

Rules are `name ::= expression` (a rule runs until the next `name ::=`), the
output must match `root` whole. Expressions: "strings" (or 'strings') with
\\n \\t \\r \\\\ \\" \\xHH \\uHHHH escapes, [character classes] (ranges, ^
negation), `.` (any character), rule names, ( groups ), alternatives |, and
* + ? {m} {m,} {m,n}. Lark grammars (`rule: ...`) are refused. A rule is nested
tuples: ("text", str), ("class", str: a class in `regex_dfa`'s syntax), ("ref",
name), ("cat", [...]), ("alt", [...]), ("repeat", node, lo, hi or None).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.-]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<klass>\[(?:[^\]\\]|\\.)*\])
  | (?P<repeat>\{\s*\d*\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[()|*+?.])
""", re.VERBOSE | re.DOTALL)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-",
            "^": "^", "/": "/", "f": "\f", "v": "\v", "0": "\0"}


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    at: int  # offset in the grammar


def read_rules(grammar: str) -> dict[str, tuple]:
    """The grammar's rules by name, each with its direct left or right recursion as a repetition. ValueError,
    naming guided_grammar and where, for a grammar that cannot be read."""
    _check_text(grammar)
    return _read_rules(grammar)


def _check_text(grammar: str) -> None:
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("guided_grammar must be a non-empty GBNF grammar (rules as name ::= expression)")
    if "::=" not in grammar and re.search(r"^\s*[?!]?\w+(\.\d+)?\s*:", grammar, re.MULTILINE):
        raise ValueError("guided_grammar: expected GBNF rules (name ::= expression); Lark grammars are not supported")


@functools.lru_cache(maxsize=32)
def _read_rules(grammar: str) -> dict[str, tuple]:
    """The grammar's rules, each with its direct left or right recursion as a repetition."""
    rules = _Reader(grammar).rules()
    if "root" not in rules:
        raise ValueError("guided_grammar has no root rule (the output matches `root ::= ...`)")
    return {name: _unloop(name, body) for name, body in rules.items()}


class _Reader:
    """Tokens, then recursive descent into nested tuples: ("text", str), ("class", str: a regex class),
    ("ref", name), ("cat", [...]), ("alt", [...]), ("repeat", node, lo, hi or None)."""

    def __init__(self, grammar: str) -> None:
        self.grammar = grammar
        self.tokens = self._tokens()
        self.at = 0

    def _tokens(self) -> list[_Token]:
        tokens, at = [], 0
        while at < len(self.grammar):
            match = _TOKEN.match(self.grammar, at)
            if match is None:
                self._fail(f"unexpected {self.grammar[at]!r}", at)
            if match.lastgroup != "space":
                tokens.append(_Token(match.lastgroup, match.group(), at))
            at = match.end()
        return tokens

    def _fail(self, why: str, at: int | None = None) -> None:
        if at is None:
            at = self.tokens[self.at].at if self.at < len(self.tokens) else len(self.grammar)
        line = self.grammar.count("\n", 0, at) + 1
        column = at - (self.grammar.rfind("\n", 0, at) + 1) + 1
        raise ValueError(f"guided_grammar: {why} at line {line}, column {column}")

    def _peek(self, ahead: int = 0) -> _Token | None:
        at = self.at + ahead
        return self.tokens[at] if at < len(self.tokens) else None

    def _rule_starts(self) -> bool:
        name, define = self._peek(), self._peek(1)
        return name is not None and name.kind == "name" and define is not None and define.kind == "define"

    def rules(self) -> dict[str, tuple]:
        if not self.tokens:
            self._fail("no rules")
        rules: dict[str, tuple] = {}
        while self.at < len(self.tokens):
            if not self._rule_starts():
                self._fail("expected a rule (name ::= expression)")
            name = self.tokens[self.at].text
            if name in rules:
                self._fail(f"rule {name!r} is defined twice")
            self.at += 2
            rules[name] = self._alternatives()
            if self.at < len(self.tokens) and not self._rule_starts():
                self._fail(f"unexpected {self.tokens[self.at].text!r}")
        for name, body in rules.items():
            for ref in refs(body):
                if ref not in rules:
                    raise ValueError(f"guided_grammar: rule {name!r} refers to {ref!r}, which is not defined")
        return rules

    def _alternatives(self) -> tuple:
        branches = [self._sequence()]
        while self._is("op", "|"):
            self.at += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _is(self, kind: str, text: str | None = None) -> bool:
        token = self._peek()
        return token is not None and token.kind == kind and (text is None or token.text == text)

    def _sequence(self) -> tuple:
        items = []
        while self._peek() is not None and not self._rule_starts() and not self._is("op", "|") \
                and not self._is("op", ")"):
            items.append(self._repeated(self._atom()))
        return ("cat", items)

    def _repeated(self, node: tuple) -> tuple:
        while self._is("op") and self._peek().text in "*+?" or self._is("repeat"):
            token = self.tokens[self.at]
            self.at += 1
            if token.kind == "op":
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[token.text]
            else:
                lo_text, comma, hi_text = token.text[1:-1].replace(" ", "").partition(",")
                lo = int(lo_text or 0)
                hi = lo if not comma else (int(hi_text) if hi_text else None)
                if hi is not None and hi < lo:
                    self._fail(f"repeat {token.text} has its maximum below its minimum", token.at)
            node = ("repeat", node, lo, hi)
        return node

    def _atom(self) -> tuple:
        token = self._peek()
        if token is None:
            self._fail("unexpected end of grammar")
        self.at += 1
        if token.kind == "string":
            return ("text", self._unescape(token.text[1:-1], token.at))
        if token.kind == "klass":
            return ("class", self._klass(token))
        if token.kind == "name":
            return ("ref", token.text)
        if token.text == ".":
            return ("class", r"(.|\n)")
        if token.text == "(":
            node = self._alternatives()
            if not self._is("op", ")"):
                self._fail("missing )")
            self.at += 1
            return node
        self._fail(f"unexpected {token.text!r}", token.at)

    def _unescape(self, text: str, at: int) -> str:
        out, i = [], 0
        while i < len(text):
            char = text[i]
            if char != "\\":
                out.append(char)
                i += 1
                continue
            code = text[i + 1:i + 2]
            if code in ("x", "u", "U"):
                digits = {"x": 2, "u": 4, "U": 8}[code]
                hexa = text[i + 2:i + 2 + digits]
                if len(hexa) != digits or not all(h in "0123456789abcdefABCDEF" for h in hexa):
                    self._fail(f"\\{code} needs {digits} hex digits", at)
                out.append(chr(int(hexa, 16)))
                i += 2 + digits
            elif code in _ESCAPES:
                out.append(_ESCAPES[code])
                i += 2
            else:
                self._fail(f"unknown escape \\{code}", at)
        return "".join(out)

    def _klass(self, token: _Token) -> str:
        """A [class] in our regex syntax, each character written as \\uHHHH (as itself past U+FFFF): an
        unescaped "-" between two characters makes a range, an escaped one is a dash."""
        body = token.text[1:-1]
        negated = body.startswith("^")
        items, i = [], int(negated)  # (character, written escaped) pairs
        while i < len(body):
            end = i + 1
            if body[i] == "\\":
                end = i + 2 + {"x": 2, "u": 4, "U": 8}.get(body[i + 1:i + 2], 0)
            items.append((self._unescape(body[i:end], token.at), body[i] == "\\"))
            i = end
        if not items:
            self._fail("empty character class", token.at)
        out, i = [], 0
        while i < len(items):
            if i + 2 < len(items) and items[i + 1] == ("-", False):
                low, high = items[i][0], items[i + 2][0]
                if high < low:
                    self._fail(f"character range {low!r}-{high!r} runs backwards", token.at)
                out.append(f"{_class_char(low)}-{_class_char(high)}")
                i += 3
            else:
                out.append(_class_char(items[i][0]))
                i += 1
        return "[" + "^" * negated + "".join(out) + "]"


def _class_char(char: str) -> str:
    return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else char


def refs(node: tuple) -> list[str]:
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("cat", "alt"):
        return [ref for item in node[1] for ref in refs(item)]
    if kind == "repeat":
        return refs(node[1])
    return []


def _unloop(name: str, body: tuple) -> tuple:
    """`name`'s body with direct left or right recursion as a repetition: A ::= A x | y -> y x*, and
    A ::= x A | y -> x* y, when A appears nowhere else in the body. Other bodies are kept."""
    branches = body[1] if body[0] == "alt" else [body]
    seqs = [b[1] if b[0] == "cat" else [b] for b in branches]
    is_self = lambda item: item == ("ref", name)  # noqa: E731
    for side in (0, -1):
        looped = [seq for seq in seqs if seq and is_self(seq[side])]
        rest = [seq for seq in seqs if not (seq and is_self(seq[side]))]
        if not looped or not rest:
            continue
        parts = [seq[1:] if side == 0 else seq[:-1] for seq in looped]
        if any(name in refs(("cat", seq)) for seq in parts + rest):
            continue
        loop = ("repeat", ("alt", [("cat", p) for p in parts]), 0, None)
        base = ("alt", [("cat", seq) for seq in rest])
        return ("cat", [base, loop] if side == 0 else [loop, base])
    return body
