"""An automaton made on demand from a graph of shared terms, by partial derivatives (Antimirov), for grammars.

`regex_dfa`'s Thompson NFA is built whole from the pattern's text: every repeat
copied, every inlined rule spelled out. A GBNF grammar whose small rules are used
everywhere (JSON's whitespace, `[ \\t]{0,20}`, after every value) becomes a
pattern of 100,000+ characters and an NFA of 500,000 states before the first
token. Here each rule's body is a hash-consed term made once, and a rule's name
a reference expanded only when a derivative reaches it; a state is the set of
terms the text may go on with, and each (state, character) move is made on
first use. Recursion needs no unrolling: a deeper nesting is a longer term,
made when an output gets there. Same interface as `CharDFA` (`start`, `step`,
`walk`, `accepts`, `char_sets`), so the token guide takes either.
"""

from __future__ import annotations

from medusa.decoding.regex_dfa import CharSet, LazyDFA

EPS = 0  # the term of the empty text


class Terms:
    """Hash-consed terms, by id: ("eps",), ("chars", CharSet), ("cat", head, tail), ("alt", id, id, ...),
    ("rep", body, lo, hi or None), and ("ref", name): a grammar rule's body (`rules`), expanded only when a
    derivative reaches it, so recursion needs no unrolling (a rule must not reach itself before reading a
    character: left recursion would derive forever). Constructors normalise (cat right-nested, alt flat and
    sorted, a nullable body's repeat needs no minimum), so equal languages built alike share an id and DFA
    states stay small."""

    def __init__(self, empty_rules: set[str] | None = None) -> None:
        self.nodes: list[tuple] = [("eps",)]
        self._ids: dict[tuple, int] = {("eps",): EPS}
        self._nullable: dict[int, bool] = {EPS: True}
        self._derivatives: dict[tuple[int, str], tuple[int, ...]] = {}
        self.rules: dict[str, int] = {}  # rule name -> its body's term
        self.empty_rules = set(empty_rules or ())  # rules that match the empty text, known before bodies (rep asks)

    def ref(self, name: str) -> int:
        return self._make(("ref", name))

    def _make(self, node: tuple) -> int:
        if node not in self._ids:
            self._ids[node] = len(self.nodes)
            self.nodes.append(node)
        return self._ids[node]

    def chars(self, chars: CharSet) -> int:
        return self._make(("chars", chars))

    def text(self, text: str) -> int:
        return self.seq([self.chars(CharSet(ranges=((ord(c), ord(c)),))) for c in text])

    def seq(self, items: list[int]) -> int:
        term = EPS
        for item in reversed(items):
            term = self.cat(item, term)
        return term

    def cat(self, head: int, tail: int) -> int:
        if head == EPS:
            return tail
        if tail == EPS:
            return head
        node = self.nodes[head]
        if node[0] == "cat":  # right-nested: a derivative peels one head at a time
            return self.cat(node[1], self.cat(node[2], tail))
        return self._make(("cat", head, tail))

    def alt(self, items: list[int]) -> int:
        flat: set[int] = set()
        for item in items:
            node = self.nodes[item]
            flat.update(node[1:] if node[0] == "alt" else (item,))
        if len(flat) == 1:
            return flat.pop()
        return self._make(("alt", *sorted(flat)))

    def rep(self, body: int, lo: int, hi: int | None) -> int:
        if hi == 0 or body == EPS:
            return EPS
        if self.nullable(body):  # empty rounds meet any minimum
            lo = 0
        if lo == hi == 1:
            return body
        return self._make(("rep", body, lo, hi))

    def nullable(self, term: int) -> bool:
        """Whether the term matches the empty text."""
        known = self._nullable.get(term)
        if known is None:
            node = self.nodes[term]
            kind = node[0]
            if kind == "chars":
                known = False
            elif kind == "cat":
                known = self.nullable(node[1]) and self.nullable(node[2])
            elif kind == "alt":
                known = any(self.nullable(t) for t in node[1:])
            elif kind == "ref":
                known = node[1] in self.empty_rules
            else:
                known = node[2] == 0 or self.nullable(node[1])
            self._nullable[term] = known
        return known

    def derive(self, term: int, char: str) -> tuple[int, ...]:
        """The terms the rest of the text must match once `char` is read (none: the text left the term)."""
        key = (term, char)
        known = self._derivatives.get(key)
        if known is None:
            known = tuple(dict.fromkeys(self._derive(term, char)))
            self._derivatives[key] = known
        return known

    def _derive(self, term: int, char: str) -> list[int]:
        node = self.nodes[term]
        kind = node[0]
        if kind == "eps":
            return []
        if kind == "chars":
            return [EPS] if char in node[1] else []
        if kind == "cat":
            _, head, tail = node
            out = [self.cat(d, tail) for d in self.derive(head, char)]
            return out + list(self.derive(tail, char)) if self.nullable(head) else out
        if kind == "alt":
            return [d for t in node[1:] for d in self.derive(t, char)]
        if kind == "ref":
            return list(self.derive(self.rules[node[1]], char))
        _, body, lo, hi = node
        rest = self.rep(body, max(lo - 1, 0), None if hi is None else hi - 1)
        return [self.cat(d, rest) for d in self.derive(body, char)]

    def char_sets(self, root: int) -> list[CharSet]:
        """The distinct character sets below `root`."""
        seen, todo, sets = set(), [root], {}
        while todo:
            term = todo.pop()
            if term in seen:
                continue
            seen.add(term)
            node = self.nodes[term]
            if node[0] == "chars":
                sets[node[1]] = None
            elif node[0] in ("cat", "alt"):
                todo.extend(node[1:])
            elif node[0] == "rep":
                todo.append(node[1])
            elif node[0] == "ref":
                todo.append(self.rules[node[1]])
        return list(sets)


def term_of(terms: Terms, node: tuple) -> int:
    """The term of a parsed regex (`regex_dfa._Parser`'s tuples)."""
    kind = node[0]
    if kind == "chars":
        return terms.chars(node[1])
    if kind == "empty":
        return EPS
    if kind == "cat":
        return terms.seq([term_of(terms, item) for item in node[1]])
    if kind == "alt":
        return terms.alt([term_of(terms, item) for item in node[1]])
    _, body, lo, hi = node
    return terms.rep(term_of(terms, body), lo, hi)


class TermDFA(LazyDFA):
    """The automaton of term `root`: a state is the set of terms the text may go on with (finitely many for a
    regular language; for a recursive grammar, one more set per nesting the output reaches)."""

    def __init__(self, terms: Terms, root: int, pattern: str) -> None:
        super().__init__(pattern)
        self.terms, self.root = terms, root
        self.start = self._intern(frozenset([root]))

    def char_sets(self) -> list[CharSet]:
        return self.terms.char_sets(self.root)

    def _move(self, members: frozenset[int], char: str) -> frozenset[int]:
        return frozenset(d for term in members for d in self.terms.derive(term, char))

    def _accepting(self, members: frozenset[int]) -> bool:
        return any(self.terms.nullable(term) for term in members)
