"""A GBNF grammar as a regular language, for guided decoding (`guided_grammar`).

vLLM takes grammars in GBNF, the EBNF of llama.cpp and xgrammar:

    root   ::= answer ("," ws answer)*
    answer ::= "yes" | "no" | [0-9]+   # a comment
    ws     ::= [ \\t]*

Rules are `name ::= expression` (a rule runs until the next `name ::=`), the
output must match `root` whole. Expressions: "strings" (or 'strings') with
\\n \\t \\r \\\\ \\" \\xHH \\uHHHH escapes, [character classes] (ranges, ^
negation), `.` (any character), rule names, ( groups ), alternatives |, and
* + ? {m} {m,} {m,n}.

The guide follows a grammar by a DFA made on demand from its rules as shared
terms (`grammar_dfa`, `term_dfa`: each rule built once however often it is
used); `grammar_regex` writes the language as one regex, for reading and
tests (its size grows fast with nesting: it unrolls REGEX_NESTING deep).
Either is regular, so it cannot count nesting: recursion is rewritten where it
only repeats: a rule whose recursive alternatives all start
with it (`list ::= list "," item | item`) or all end with it (`digits ::=
[0-9] digits | [0-9]`) becomes a repetition and loses nothing. Any other
recursion (`value ::= "[" value "]" | "x"`, mutual recursion) nests at most
MAX_NESTING deep in the guide (as guided_json's schema-free values nest 3);
past that, only a rule's other alternatives remain. Lark grammars (`rule: ...`) are refused.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from medusa.decoding.regex_dfa import _Parser as _RegexParser
from medusa.decoding.term_dfa import EPS, TermDFA, Terms, term_of

MAX_NESTING = 10  # the guide's: a recursive rule inside itself at most this deep (past what becomes repetition)
REGEX_NESTING = 4  # grammar_regex's: a 4-deep JSON grammar is a 129,000-character pattern already
MAX_PATTERN = 200_000  # characters: a grammar whose regex unrolls to more is refused (grammar_regex)
MAX_UNROLLED = 50_000  # rule copies (a rule at each count of the recursive rules on its path): more is refused
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


def grammar_regex(grammar: str, nesting: int = REGEX_NESTING) -> str:
    """The regex of the texts `grammar`'s root rule matches, recursion unrolled `nesting` deep (see the module
    doc). ValueError, naming guided_grammar and where, for a grammar that cannot be read or followed."""
    _check_text(grammar)
    return _grammar_regex(grammar, nesting)


def grammar_dfa(grammar: str, nesting: int = MAX_NESTING) -> TermDFA:
    """The grammar's DFA, made on demand from its rules as shared terms (`term_dfa`), recursion unrolled
    `nesting` deep: no pattern to compile, whatever the rules inline. Its `pattern`, the guide's cache key, is
    "guided_grammar:" and the grammar."""
    _check_text(grammar)
    return _grammar_dfa(grammar, nesting)


def _check_text(grammar: str) -> None:
    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("guided_grammar must be a non-empty GBNF grammar (rules as name ::= expression)")
    if "::=" not in grammar and re.search(r"^\s*[?!]?\w+(\.\d+)?\s*:", grammar, re.MULTILINE):
        raise ValueError("guided_grammar: expected GBNF rules (name ::= expression); Lark grammars are not supported")


@functools.lru_cache(maxsize=32)
def _rules(grammar: str) -> dict[str, tuple]:
    """The grammar's rules, each with its direct left or right recursion as a repetition."""
    rules = _Reader(grammar).rules()
    if "root" not in rules:
        raise ValueError("guided_grammar has no root rule (the output matches `root ::= ...`)")
    return {name: _unloop(name, body) for name, body in rules.items()}


@functools.lru_cache(maxsize=32)
def _grammar_regex(grammar: str, nesting: int) -> str:
    return _Emitter(_rules(grammar), _Regex(nesting), nesting).root()


@functools.lru_cache(maxsize=32)
def _grammar_dfa(grammar: str, nesting: int) -> TermDFA:
    terms = Terms()
    root = _Emitter(_rules(grammar), _TermBuilder(terms), nesting).root()
    return TermDFA(terms, root, f"guided_grammar:{nesting}:{grammar}")


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
            for ref in _refs(body):
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


def _refs(node: tuple) -> list[str]:
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("cat", "alt"):
        return [ref for item in node[1] for ref in _refs(item)]
    if kind == "repeat":
        return _refs(node[1])
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
        if any(name in _refs(("cat", seq)) for seq in parts + rest):
            continue
        loop = ("repeat", ("alt", [("cat", p) for p in parts]), 0, None)
        base = ("alt", [("cat", seq) for seq in rest])
        return ("cat", [base, loop] if side == 0 else [loop, base])
    return body


class _Regex:
    """Builds the grammar as regex text."""

    empty = ""

    def __init__(self, nesting: int) -> None:
        self.nesting = nesting

    @staticmethod
    def text(text: str) -> str:
        return "".join(_text_char(c) for c in text)

    @staticmethod
    def klass(pattern: str) -> str:
        return pattern

    @staticmethod
    def group(inner: str) -> str:
        return f"({inner})"

    @staticmethod
    def cat(parts: list[str]) -> str:
        return "".join(parts)

    @staticmethod
    def alt(parts: list[str]) -> str:
        return "(" + "|".join(parts) + ")"

    @staticmethod
    def repeat(inner: str, lo: int, hi: int | None) -> str:
        return f"({inner}){_bounds(lo, hi)}"

    def check(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN:
            raise ValueError(f"guided_grammar unrolls to a pattern over {MAX_PATTERN} characters: its recursion "
                             f"nests too widely (each recursive rule unrolls {self.nesting} deep)")


class _TermBuilder:
    """Builds the grammar as shared terms: a rule's term is made once and every use refers to it."""

    empty = EPS

    def __init__(self, terms: Terms) -> None:
        self.terms = terms
        self.text = terms.text
        self.cat = terms.seq
        self.alt = terms.alt
        self.repeat = terms.rep

    def klass(self, pattern: str) -> int:
        return term_of(self.terms, _RegexParser(pattern).parse())

    @staticmethod
    def group(inner: int) -> int:
        return inner

    @staticmethod
    def check(term: int) -> None:
        pass


class _Emitter:
    """Rules inlined into one regex (or term); a rule already `nesting` times on the expansion's path is a dead
    end (None). A rule's result depends only on how often each recursive rule is on the path, so it is cached by
    that: made once however often the rule is used."""

    def __init__(self, rules: dict[str, tuple], builder: Any, nesting: int) -> None:
        self.rules, self.out, self.nesting = rules, builder, nesting
        self.recursive = sorted(name for name in rules if name in _reachable(rules, name))
        self.cache: dict[tuple, Any] = {}

    def root(self) -> Any:
        result = self.rule("root", ())
        if result is None:
            raise ValueError(f"guided_grammar: root cannot end within {self.nesting} levels of nesting")
        return result if result != "" else "()"  # the empty text: a pattern the regex compiler takes

    def rule(self, name: str, path: tuple[str, ...]) -> Any:
        if path.count(name) >= self.nesting:
            return None
        key = (name, tuple(path.count(r) for r in self.recursive))
        if key not in self.cache:
            if len(self.cache) >= MAX_UNROLLED:
                raise ValueError(f"guided_grammar unrolls to over {MAX_UNROLLED} rule copies: its rules recurse "
                                 f"into each other too widely to follow {self.nesting} deep")
            result = self.node(self.rules[name], path + (name,))
            if result is not None:
                self.out.check(result)
            self.cache[key] = result
        return self.cache[key]

    def node(self, node: tuple, path: tuple[str, ...]) -> Any:
        kind, out = node[0], self.out
        if kind == "text":
            return out.text(node[1])
        if kind == "class":
            return out.klass(node[1])
        if kind == "ref":
            inner = self.rule(node[1], path)
            return None if inner is None else out.group(inner)
        if kind == "cat":
            parts = [self.node(item, path) for item in node[1]]
            return None if any(p is None for p in parts) else out.cat(parts)
        if kind == "alt":
            parts = [p for p in (self.node(item, path) for item in node[1]) if p is not None]
            return None if not parts else out.alt(parts)
        _, inner, lo, hi = node
        result = self.node(inner, path)
        if result is None:
            return None if lo > 0 else out.empty
        return out.repeat(result, lo, hi)


def _bounds(lo: int, hi: int | None) -> str:
    shorthand = {(0, None): "*", (1, None): "+", (0, 1): "?"}
    if (lo, hi) in shorthand:
        return shorthand[(lo, hi)]
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"


def _reachable(rules: dict[str, tuple], start: str) -> set[str]:
    """Rules reachable from `start`'s body (start itself only if it is recursive)."""
    seen, todo = set(), list(_refs(rules[start]))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_refs(rules[name]))
    return seen


def _text_char(char: str) -> str:
    if char.isalnum() or char == " " or char == "_":
        return char
    return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else char
