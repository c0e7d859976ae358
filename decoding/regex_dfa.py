"""A regular expression as a lazily built DFA over characters, for guided decoding (`guided_regex`).

The output must match the whole pattern (vLLM's semantics), so a text is worth
continuing only while the DFA has a live state after it. The pattern is parsed
into a small tree, built into a Thompson NFA, and its DFA states (sets of NFA
states) are made on first use, one (state, character) move at a time: no
alphabet is enumerated, so any Unicode text works.

Supported: literals and escapes (\\n, \\t, \\xhh, \\uhhhh, escaped punctuation),
., [classes] with ranges and negation, \\d \\w \\s and their negations (with
Python's Unicode meaning), groups ( ), (?: ), (?P<name> ), alternation |, and
* + ? {m} {m,} {m,n} (lazy forms match the same texts). ^ at the start and $
at the end are accepted (the match is whole anyway). Anything else (back
references, lookaround, flags, anchors inside) is refused with a ValueError.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

DEAD = -1  # the DFA state of a text no continuation can make match
MAX_REPEAT = 1000  # {m,n} bounds above this would build NFAs too large to be worth it
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_CLASSES = {"d": str.isdecimal, "w": lambda c: c.isalnum() or c == "_",
            "s": lambda c: c in " \t\n\r\f\v\x1c\x1d\x1e\x1f\x85" or c.isspace()}


@dataclass(frozen=True)
class CharSet:
    """Characters an NFA edge takes: in one of `ranges` (inclusive code points) or of the named `classes`
    (d, w, s; upper case for the complement), or with `negated` everything else."""

    ranges: tuple[tuple[int, int], ...] = ()
    classes: tuple[str, ...] = ()
    negated: bool = False

    def __contains__(self, char: str) -> bool:
        code = ord(char)
        hit = any(lo <= code <= hi for lo, hi in self.ranges) or any(
            _CLASSES[name.lower()](char) != name.isupper() for name in self.classes)
        return hit != self.negated


ANY_BUT_NEWLINE = CharSet(ranges=((10, 10),), negated=True)


class _Parser:
    """Recursive descent over the pattern into nested tuples: ("chars", CharSet), ("cat", [...]),
    ("alt", [...]), ("repeat", node, lo, hi or None), ("empty",)."""

    def __init__(self, pattern: str) -> None:
        self.text, self.at = pattern, 0

    def parse(self) -> tuple:
        if self.text.startswith("^"):
            self.at = 1
        node = self._alternation()
        if self.at < len(self.text):  # an unmatched ")"
            self._fail("unbalanced parenthesis")
        return node

    def _fail(self, why: str) -> None:
        raise ValueError(f"guided_regex {self.text!r}: {why} at position {self.at}")

    def _peek(self) -> str | None:
        return self.text[self.at] if self.at < len(self.text) else None

    def _take(self) -> str:
        if self.at >= len(self.text):
            self._fail("unexpected end of pattern")
        self.at += 1
        return self.text[self.at - 1]

    def _alternation(self) -> tuple:
        branches = [self._concatenation()]
        while self._peek() == "|":
            self.at += 1
            branches.append(self._concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _concatenation(self) -> tuple:
        items = []
        while self._peek() not in (None, "|", ")"):
            if self._peek() == "$":
                if self.at != len(self.text) - 1:
                    self._fail("$ is supported only at the end")
                self.at += 1
                continue
            items.append(self._quantified(self._atom()))
        return ("cat", items) if items else ("empty",)

    def _quantified(self, node: tuple) -> tuple:
        while self._peek() in ("*", "+", "?", "{"):
            start, char = self.at, self._take()
            if char == "{":
                bounds = re.match(r"(\d*)(,?)(\d*)\}", self.text[self.at:])
                if not bounds or not (bounds.group(1) or bounds.group(3)):
                    self.at = start  # a literal "{", as Python reads it
                    return node
                self.at += bounds.end()
                lo = int(bounds.group(1) or 0)
                hi = lo if not bounds.group(2) else (int(bounds.group(3)) if bounds.group(3) else None)
                if hi is not None and hi < lo or max(lo, hi or 0) > MAX_REPEAT:
                    self._fail(f"repeat bounds must satisfy m <= n <= {MAX_REPEAT}")
            else:
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            if self._peek() == "?":  # lazy: the same set of whole matches
                self.at += 1
            elif self._peek() == "+":
                self._fail("possessive quantifiers are not supported")
            node = ("repeat", node, lo, hi)
        return node

    def _atom(self) -> tuple:
        char = self._take()
        if char == "(":
            if self.text.startswith("?:", self.at):
                self.at += 2
            elif self.text.startswith("?P<", self.at):
                end = self.text.find(">", self.at)
                if end < 0:
                    self._fail("unterminated group name")
                self.at = end + 1
            elif self.text.startswith("?&", self.at):  # a rule of a grammar (term_dfa); Python's re refuses it
                end = self.text.find(")", self.at)
                if end < 0:
                    self._fail("unterminated rule reference")
                name, self.at = self.text[self.at + 2:end], end + 1
                return ("ref", name)
            elif self._peek() == "?":
                self._fail("lookaround, flags and other (?...) groups are not supported")
            node = self._alternation()
            if self._take() != ")":
                self._fail("missing )")
            return node
        if char == "[":
            return ("chars", self._class())
        if char == ".":
            return ("chars", ANY_BUT_NEWLINE)
        if char == "\\":
            return ("chars", self._escape(in_class=False))
        if char in "*+?":
            self._fail("nothing to repeat")
        if char == "^":
            self._fail("^ is supported only at the start")
        return ("chars", CharSet(ranges=((ord(char), ord(char)),)))

    def _escape(self, in_class: bool) -> CharSet:
        char = self._take()
        if char.lower() in _CLASSES:
            return CharSet(classes=(char,))
        code = self._escaped_code(char, in_class)
        return CharSet(ranges=((code, code),))

    def _escaped_code(self, char: str, in_class: bool) -> int:
        if char in _ESCAPES:
            return ord(_ESCAPES[char])
        if char == "b" and in_class:
            return 8
        if char in "xu":
            digits = 2 if char == "x" else 4
            hexa = self.text[self.at:self.at + digits]
            if len(hexa) != digits or not all(h in "0123456789abcdefABCDEF" for h in hexa):
                self._fail(f"\\{char} needs {digits} hex digits")
            self.at += digits
            return int(hexa, 16)
        if char.isalnum():
            self._fail(f"\\{char} (anchors, back references) is not supported")
        return ord(char)

    def _class(self) -> CharSet:
        negated = self._peek() == "^"
        self.at += negated
        ranges, classes, first = [], [], True
        while first or self._peek() != "]":
            first, char = False, self._take()
            if char == "\\":
                escaped = self._take()
                if escaped.lower() in _CLASSES:
                    classes.append(escaped)
                    continue
                low = self._escaped_code(escaped, in_class=True)
            else:
                low = ord(char)
            high = low
            if self._peek() == "-" and self.text[self.at + 1:self.at + 2] not in ("]", ""):
                self.at += 1
                end = self._take()
                high = self._escaped_code(self._take(), in_class=True) if end == "\\" else ord(end)
                if high < low:
                    self._fail("bad character range")
            ranges.append((low, high))
        self.at += 1
        return CharSet(ranges=tuple(ranges), classes=tuple(classes), negated=negated)


@dataclass
class _NFA:
    """Thompson NFA: state i has epsilon moves eps[i] and at most one character move edge[i] = (CharSet, target)."""

    eps: list[list[int]] = field(default_factory=list)
    edge: list[tuple[CharSet, int] | None] = field(default_factory=list)

    def new(self) -> int:
        self.eps.append([])
        self.edge.append(None)
        return len(self.eps) - 1

    def build(self, node: tuple) -> tuple[int, int]:
        """Add `node`'s fragment; returns its (start, accept) states."""
        start, accept = self.new(), self.new()
        kind = node[0]
        if kind == "chars":
            self.edge[start] = (node[1], accept)
        elif kind == "empty":
            self.eps[start].append(accept)
        elif kind == "cat":
            at = start
            for item in node[1]:
                first, last = self.build(item)
                self.eps[at].append(first)
                at = last
            self.eps[at].append(accept)
        elif kind == "alt":
            for branch in node[1]:
                first, last = self.build(branch)
                self.eps[start].append(first)
                self.eps[last].append(accept)
        else:  # repeat: lo copies, then hi - lo optional ones (or a loop)
            _, body, lo, hi = node
            copies = self._copies(body, lo + (1 if hi is None else hi - lo))
            at = start
            for first, last in copies[:lo]:
                self.eps[at].append(first)
                at = last
            if hi is None:
                first, last = copies[-1]
                self.eps[at] += [first, accept]
                self.eps[last] += [first, accept]
            else:
                for first, last in copies[lo:]:
                    self.eps[at] += [first, accept]
                    at = last
                self.eps[at].append(accept)
        return start, accept

    def _copies(self, node: tuple, count: int) -> list[tuple[int, int]]:
        """`count` unlinked fragments of `node`: the first built, the others copied from it with their states
        shifted (a fragment's states are contiguous and its moves stay inside it until it is linked), which is
        far cheaper than building each (grammars repeat large bodies, e.g. whitespace {0,20} inlined often)."""
        if count == 0:
            return []
        base = len(self.eps)
        first, last = self.build(node)
        copies = [(first, last)]
        if count == 1:
            return copies
        eps, edge = [list(e) for e in self.eps[base:]], self.edge[base:]
        for _ in range(count - 1):
            shift = len(self.eps) - base
            self.eps += [[t + shift for t in e] for e in eps]
            self.edge += [None if e is None else (e[0], e[1] + shift) for e in edge]
            copies.append((first + shift, last + shift))
        return copies


class LazyDFA:
    """A DFA whose states (sets of members: NFA states, or terms) and moves are made on first use: `start`,
    `step(state, char) -> state or DEAD`, `walk`, `accepts(state)`. Subclasses say how a set moves on a character
    and whether it accepts."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._ids: dict[frozenset[int], int] = {}
        self._sets: list[frozenset[int]] = []
        self._moves: list[dict[str, int]] = []
        self._accepts: list[bool] = []

    def char_sets(self) -> list[CharSet]:
        """The distinct character sets of the pattern: two characters in the same ones move the DFA alike."""
        raise NotImplementedError

    def _move(self, members: frozenset[int], char: str) -> frozenset[int]:
        raise NotImplementedError

    def _accepting(self, members: frozenset[int]) -> bool:
        raise NotImplementedError

    def step(self, state: int, char: str) -> int:
        moves = self._moves[state]
        target = moves.get(char)
        if target is None:
            reached = self._move(self._sets[state], char)
            target = self._intern(reached) if reached else DEAD
            moves[char] = target
        return target

    def walk(self, state: int, text: str) -> int:
        for char in text:
            if state == DEAD:
                break
            state = self.step(state, char)
        return state

    def accepts(self, state: int) -> bool:
        return state != DEAD and self._accepts[state]

    def _intern(self, members: frozenset[int]) -> int:
        if members not in self._ids:
            self._ids[members] = len(self._sets)
            self._sets.append(members)
            self._moves.append({})
            self._accepts.append(self._accepting(members))
        return self._ids[members]


class CharDFA(LazyDFA):
    """The pattern's DFA over its Thompson NFA (built whole): a state is a set of NFA states."""

    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        self._nfa = _NFA()
        first, self._final = self._nfa.build(_Parser(pattern).parse())
        self.start = self._intern(self._closure([first]))

    def char_sets(self) -> list[CharSet]:
        return list(dict.fromkeys(edge[0] for edge in self._nfa.edge if edge is not None))

    def _move(self, members: frozenset[int], char: str) -> frozenset[int]:
        reached = [edge[1] for s in members if (edge := self._nfa.edge[s]) and char in edge[0]]
        return self._closure(reached) if reached else frozenset()

    def _accepting(self, members: frozenset[int]) -> bool:
        return self._final in members

    def _closure(self, states: list[int]) -> frozenset[int]:
        seen, stack = set(states), list(states)
        while stack:
            for nxt in self._nfa.eps[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen)


@functools.lru_cache(maxsize=64)
def compile_regex(pattern: str) -> CharDFA:
    """The DFA of `pattern` (cached: requests often share one). Raises ValueError naming guided_regex for a
    pattern Python's `re` rejects or that uses what is not supported here."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"guided_regex must be a non-empty string, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"guided_regex {pattern!r} is not a valid regular expression: {error}") from None
    return CharDFA(pattern)
