"""A GBNF grammar for guided decoding (`guided_grammar`): its DFA, made as the text goes, or its regex.

vLLM takes grammars in GBNF, the EBNF of llama.cpp and xgrammar:

    root   ::= answer ("," ws answer)*
    answer ::= "yes" | "no" | [0-9]+   # a comment
    ws     ::= [ \\t]*

Rules are `name ::= expression` (a rule runs until the next `name ::=`), the
output must match `root` whole. Expressions: "strings" (or 'strings') with
\\n \\t \\r \\\\ \\" \\xHH \\uHHHH escapes, [character classes] (ranges, ^
negation), `.` (any character), rule names, ( groups ), alternatives |, and
* + ? {m} {m,} {m,n}. Lark grammars (`rule: ...`) are refused.

The guide follows a grammar exactly (`grammar_dfa`): each rule's body is a
term made once, rule names stay references that a derivative expands only when
the text reaches them (`term_dfa`), so recursion nests as deep as the text goes
and a state is made only when an output gets there. Two cases are bounded:
a rule that reaches itself before reading a character (indirect left recursion:
expanding it would never stop) unrolls recursion MAX_NESTING deep, and a rule
that can never end is left out. Direct left or right recursion (`list ::= list
"," item | item`) is first rewritten as a repetition. `grammar_regex` writes the
grammar as one regex, recursion unrolled REGEX_NESTING deep (a regex cannot
count), for reading and as the tests' oracle.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from medusa.decoding.regex_dfa import _Parser as _RegexParser
from medusa.decoding.term_dfa import EPS, TermDFA, Terms, term_of

MAX_NESTING = 10  # indirect left recursion in the guide: a rule inside itself at most this deep
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


def grammar_dfa(grammar: str, nesting: int | None = None) -> TermDFA:
    """The grammar's DFA, made on demand from its rules as shared terms (`term_dfa`): no pattern to compile,
    whatever the rules inline. nesting None (the guide's): exact, recursion as deep as the text goes, unless a
    rule reaches itself before reading a character (indirect left recursion), which is unrolled MAX_NESTING
    deep; an int: every recursion unrolled that deep (as grammar_regex does). Its `pattern`, the guide's cache
    key, names the grammar and the nesting."""
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
def _grammar_dfa(grammar: str, nesting: int | None) -> TermDFA:
    rules = _rules(grammar)
    if nesting is None and not _left_recursive(rules):
        return _exact_dfa(rules, f"guided_grammar:{grammar}")
    nesting = nesting or MAX_NESTING
    terms = Terms()
    root = _Emitter(rules, _TermBuilder(terms), nesting).root()
    return TermDFA(terms, root, f"guided_grammar:{nesting}:{grammar}")


def _exact_dfa(rules: dict[str, tuple], key: str) -> TermDFA:
    """Each rule's body as a term once, rule names as ("ref", name) terms the derivatives expand: recursion as
    deep as the text goes. Rules that can never end (no finite text) are left out, so every term can still
    become a match and DEAD means what it says."""
    productive = _fixpoint(rules, _can_end)
    if "root" not in productive:
        raise ValueError("guided_grammar: root can never end (every way through it recurses forever)")
    terms = Terms(_fixpoint(rules, _can_be_empty))
    builder = _TermBuilder(terms)
    for name in productive:
        terms.rules[name] = _exact_term(rules[name], builder, productive)
    return TermDFA(terms, terms.ref("root"), key)


def _exact_term(node: tuple, out: _TermBuilder, productive: set[str]) -> int | None:
    """The node as a term with rules by reference; None where it can never end."""
    kind = node[0]
    if kind == "text":
        return out.text(node[1])
    if kind == "class":
        return out.klass(node[1])
    if kind == "ref":
        return out.terms.ref(node[1]) if node[1] in productive else None
    if kind == "cat":
        parts = [_exact_term(item, out, productive) for item in node[1]]
        return None if any(p is None for p in parts) else out.cat(parts)
    if kind == "alt":
        parts = [p for p in (_exact_term(item, out, productive) for item in node[1]) if p is not None]
        return out.alt(parts) if parts else None
    _, inner, lo, hi = node
    body = _exact_term(inner, out, productive)
    if body is None:
        return None if lo > 0 else EPS
    return out.repeat(body, lo, hi)


def _fixpoint(rules: dict[str, tuple], holds: Any) -> set[str]:
    """The rules for which `holds(body, known)` comes true, `known` growing from none until it stops."""
    known: set[str] = set()
    while True:
        more = {name for name, body in rules.items() if name not in known and holds(body, known)}
        if not more:
            return known
        known |= more


def _can_end(node: tuple, ends: set[str]) -> bool:
    """Whether the node derives some finite text, given the rules known to."""
    kind = node[0]
    if kind in ("text", "class"):
        return True
    if kind == "ref":
        return node[1] in ends
    if kind == "cat":
        return all(_can_end(item, ends) for item in node[1])
    if kind == "alt":
        return any(_can_end(item, ends) for item in node[1])
    return node[2] == 0 or _can_end(node[1], ends)


def _can_be_empty(node: tuple, empty: set[str]) -> bool:
    """Whether the node derives the empty text, given the rules known to."""
    kind = node[0]
    if kind == "text":
        return node[1] == ""
    if kind == "class":
        return False
    if kind == "ref":
        return node[1] in empty
    if kind == "cat":
        return all(_can_be_empty(item, empty) for item in node[1])
    if kind == "alt":
        return any(_can_be_empty(item, empty) for item in node[1])
    return node[2] == 0 or _can_be_empty(node[1], empty)


def _left_recursive(rules: dict[str, tuple]) -> bool:
    """Whether a rule can reach itself before any character is read (a derivative would expand it forever)."""
    empty = _fixpoint(rules, _can_be_empty)
    first = {name: _first_refs(body, empty) for name, body in rules.items()}
    for start in rules:
        seen, todo = set(), list(first[start])
        while todo:
            name = todo.pop()
            if name == start:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(first[name])
    return False


def _first_refs(node: tuple, empty: set[str]) -> set[str]:
    """The rules the node may expand before reading a character."""
    kind = node[0]
    if kind == "ref":
        return {node[1]}
    if kind == "cat":
        refs: set[str] = set()
        for item in node[1]:
            refs |= _first_refs(item, empty)
            if not _can_be_empty(item, empty):
                break
        return refs
    if kind == "alt":
        return set().union(*(_first_refs(item, empty) for item in node[1]))
    if kind == "repeat":
        return _first_refs(node[1], empty) if node[3] != 0 else set()
    return set()


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
