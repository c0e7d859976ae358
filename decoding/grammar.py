"""A GBNF grammar for guided decoding (`guided_grammar`): its DFA, made as the text goes, or its regex.

The grammar's text is read by `gbnf` (its syntax is documented there).

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
from typing import Any

from medusa.decoding.gbnf import read_rules, refs
from medusa.decoding.regex_dfa import _Parser as _RegexParser
from medusa.decoding.term_dfa import EPS, TermDFA, Terms, term_of

MAX_NESTING = 10  # indirect left recursion in the guide: a rule inside itself at most this deep
REGEX_NESTING = 4  # grammar_regex's: a 4-deep JSON grammar is a 129,000-character pattern already
MAX_PATTERN = 200_000  # characters: a grammar whose regex unrolls to more is refused (grammar_regex)
MAX_UNROLLED = 50_000  # rule copies (a rule at each count of the recursive rules on its path): more is refused


def grammar_regex(grammar: str, nesting: int = REGEX_NESTING) -> str:
    """The regex of the texts `grammar`'s root rule matches, recursion unrolled `nesting` deep (see the module
    doc). ValueError, naming guided_grammar and where, for a grammar that cannot be read or followed."""
    read_rules(grammar)  # refuses what cannot be read, before the cache sees it (a list is unhashable)
    return _grammar_regex(grammar, nesting)


def grammar_dfa(grammar: str, nesting: int | None = None) -> TermDFA:
    """The grammar's DFA, made on demand from its rules as shared terms (`term_dfa`): no pattern to compile,
    whatever the rules inline. nesting None (the guide's): exact, recursion as deep as the text goes, unless a
    rule reaches itself before reading a character (indirect left recursion), which is unrolled MAX_NESTING
    deep; an int: every recursion unrolled that deep (as grammar_regex does). Its `pattern`, the guide's cache
    key, names the grammar and the nesting."""
    read_rules(grammar)  # refuses what cannot be read, before the cache sees it (a list is unhashable)
    return _grammar_dfa(grammar, nesting)


@functools.lru_cache(maxsize=32)
def _grammar_regex(grammar: str, nesting: int) -> str:
    return _Emitter(read_rules(grammar), _Regex(nesting), nesting).root()


def regex_rule(pattern: str) -> tuple:
    """A rule from a regex in `regex_dfa`'s syntax, whose (?&name) are references to other rules (json_schema
    writes its schemas' recursion so): the parsed pattern's nodes ("chars", "empty", "cat", "alt", "repeat",
    "ref") are rule nodes too."""
    return _RegexParser(pattern).parse()


def rules_dfa(rules: dict[str, tuple], key: str, field: str) -> TermDFA:
    """The exact automaton of rules["root"] (`key`: its cache key; `field`: the request field errors name). A rule
    that reaches itself before reading a character is refused: a derivative would expand it forever."""
    if _left_recursive(rules):
        raise ValueError(f"{field}: a rule refers to itself before any character is read (left recursion)")
    return _exact_dfa(rules, key, field)


@functools.lru_cache(maxsize=32)
def _grammar_dfa(grammar: str, nesting: int | None) -> TermDFA:
    rules = read_rules(grammar)
    if nesting is None and not _left_recursive(rules):
        return _exact_dfa(rules, f"guided_grammar:{grammar}", "guided_grammar")
    nesting = nesting or MAX_NESTING
    terms = Terms()
    root = _Emitter(rules, _TermBuilder(terms), nesting).root()
    return TermDFA(terms, root, f"guided_grammar:{nesting}:{grammar}")


def _exact_dfa(rules: dict[str, tuple], key: str, field: str) -> TermDFA:
    """Each rule's body as a term once, rule names as ("ref", name) terms the derivatives expand: recursion as
    deep as the text goes. Rules that can never end (no finite text) are left out, so every term can still
    become a match and DEAD means what it says."""
    productive = _fixpoint(rules, _can_end)
    if "root" not in productive:
        raise ValueError(f"{field}: it can never end (every way through it recurses forever)")
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
    if kind == "chars":
        return out.terms.chars(node[1])
    if kind == "empty":
        return EPS
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
    return _derives(node, ends, only_empty=False)


def _can_be_empty(node: tuple, empty: set[str]) -> bool:
    """Whether the node derives the empty text, given the rules known to."""
    return _derives(node, empty, only_empty=True)


def _derives(node: tuple, known: set[str], only_empty: bool) -> bool:
    """Whether the node derives a text (only_empty: the empty text), given the rules `known` to."""
    kind = node[0]
    if kind in ("text", "class", "chars", "empty"):  # leaves: any derives a text, the empty ones the empty text
        return not only_empty or kind == "empty" or kind == "text" and node[1] == ""
    if kind == "ref":
        return node[1] in known
    if kind == "cat":
        return all(_derives(item, known, only_empty) for item in node[1])
    if kind == "alt":
        return any(_derives(item, known, only_empty) for item in node[1])
    return node[2] == 0 or _derives(node[1], known, only_empty)


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
        first: set[str] = set()
        for item in node[1]:
            first |= _first_refs(item, empty)
            if not _can_be_empty(item, empty):
                break
        return first
    if kind == "alt":
        return set().union(*(_first_refs(item, empty) for item in node[1]))
    if kind == "repeat":
        return _first_refs(node[1], empty) if node[3] != 0 else set()
    return set()


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
    seen, todo = set(), list(refs(rules[start]))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(refs(rules[name]))
    return seen


def _text_char(char: str) -> str:
    if char.isalnum() or char == " " or char == "_":
        return char
    return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else char
