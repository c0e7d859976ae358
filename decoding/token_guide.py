"""Which tokens keep a guided output matchable: a regex's character DFA lifted to the tokenizer's vocabulary.

`VocabTrie` holds every token's text in a character trie, once per tokenizer.
`RegexGuide` walks every token's text from a DFA state at once (numpy, over
character classes: `_ClassWalk`), so the tokens a state allows and the state
each leads to cost a few numpy passes, made the first time the state is
reached and kept. Where every match goes on with the same text (a JSON key), it also
spells that text in tokens, for the engine to propose on the lookup chain.
`GuideProgress` is a request's own cursor: the state after its output,
advanced by the tokens appended since the last step.

A token's text is its bytes decoded as UTF-8 (byte-level tokenizers), or its
piece with SentencePiece's "▁" read as a space. Tokens whose bytes are not
whole UTF-8 characters alone, special tokens and empty ones are never allowed
under a guide: characters a tokenizer splits across tokens cannot be written.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from medusa.decoding import byte_level
from medusa.decoding.host_buffers import to_device
from medusa.decoding.regex_dfa import DEAD, LazyDFA

_END = ""  # the trie key under which a node lists the token ids whose text ends there
MAX_FORCED = 16  # forced tokens proposed at most (a lookup chain is shorter)
MAX_STATES = 1024  # DFA states a guide keeps the moves and masks of (a string under maxLength: a state a character)
MAX_GUIDES = 16  # patterns whose guides are kept
_tries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> VocabTrie
_guides: dict[tuple[int, str], RegexGuide] = {}  # (id(trie), pattern) -> guide; a few patterns live at once


class _BuildClock:
    """Host seconds spent building guide states (moves, masks, forced text, mask rows on the device) in this
    process. A state is built once and kept, so the time is a one-off, as a graph captured at first use is:
    the engine's tree policy leaves it out of the step it fell in (`build_seconds`). Builds nest (forced text
    walks moves): only the outermost is counted, per thread."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._local = threading.local()

    def __enter__(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.start = time.perf_counter()
        self._local.depth = depth + 1

    def __exit__(self, *exc) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            self.seconds += time.perf_counter() - self._local.start


_building = _BuildClock()


def build_seconds() -> float:
    """Host seconds spent so far building guide states (see `_BuildClock`); a difference of two readings is
    the build time between them."""
    return _building.seconds


class VocabTrie:
    """Token texts (None: not writable under a guide) in a trie of nested dicts, char -> child; a node's
    `_END` entry lists the ids whose text ends at it."""

    def __init__(self, texts: Sequence[str | None]) -> None:
        self.vocab = len(texts)
        self.root: dict = {}
        self.tokens = [(token, text) for token, text in enumerate(texts) if text]
        self.alphabet = sorted(set().union(*(text for _, text in self.tokens)))
        index = {char: i for i, char in enumerate(self.alphabet)}
        self.first_chars = np.full(self.vocab, -1, dtype=np.int64)  # [V] each text's first char in the alphabet
        for token, text in self.tokens:
            self.first_chars[token] = index[text[0]]
        for token, text in self.tokens:
            node = self.root
            for char in text:
                node = node.setdefault(char, {})
            node.setdefault(_END, []).append(token)

    @classmethod
    def of(cls, tokenizer: Any) -> VocabTrie:
        """The trie of `tokenizer`'s vocabulary, built on first use and kept while the tokenizer lives."""
        if tokenizer not in _tries:
            _tries[tokenizer] = cls(token_texts(tokenizer))
        return _tries[tokenizer]


def token_texts(tokenizer: Any) -> list[str | None]:
    """Each id's text alone, or None where it has none a guide can use (special, empty, a partial character).

    A byte-level BPE's texts come from the detokenizer's table where it has one; where it has none (its
    check against the Rust decode of every id failed, or the decoder is not plain ByteLevel: both seen with
    other tokenizers versions), from the vocabulary's pieces through GPT-2's byte alphabet, never from the
    pieces as written ("Ġ" for a space: a guide that needs a space would then find no token for it)."""
    table = byte_level.byte_table(tokenizer)
    if table is not None:
        return [_utf8(data) for data in table]
    special = set(tokenizer.all_special_ids) | _added_specials(tokenizer)
    size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    if byte_level.in_byte_alphabet(pieces):
        return [None if token in special or piece is None else _utf8(byte_level.piece_bytes(piece))
                for token, piece in enumerate(pieces)]
    return [None if token in special or piece is None or _is_byte_piece(piece) else piece.replace("▁", " ")
            for token, piece in enumerate(pieces)]


def _added_specials(tokenizer: Any) -> set[int]:
    """Ids of the added tokens a fast tokenizer marks special (some are not among `all_special_ids`)."""
    rust = getattr(tokenizer, "backend_tokenizer", None)
    return {i for i, added in rust.get_added_tokens_decoder().items() if added.special} if rust is not None else set()


def _utf8(data: bytes) -> str | None:
    try:
        return data.decode("utf-8") or None
    except UnicodeDecodeError:
        return None


def _is_byte_piece(piece: str) -> bool:
    """SentencePiece's byte fallback pieces, "<0x0A>": one byte each, not a character a guide can follow."""
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


class RegexGuide:
    """A pattern's DFA over one vocabulary: `allowed(state)` -> bool mask [V] (ends included where the state
    accepts), `advance(state, token)` -> the state after the token (DEAD if it was not allowed)."""

    def __init__(self, dfa: LazyDFA, trie: VocabTrie, ends: Sequence[int]) -> None:
        self.dfa, self.trie, self.ends = dfa, trie, tuple(ends)
        self._walk = _ClassWalk(dfa, trie)
        self._next: dict[int, np.ndarray] = {}  # state -> [V] the state after each token (DEAD: not allowed)
        self._forced: dict[int, tuple[int, ...]] = {}  # state -> the tokens proposed for its forced text
        self._masks: dict[int, torch.Tensor] = {}  # state -> `allowed`
        self._tables: dict[torch.device, _MaskTable] = {}  # `masks`: the states' masks a row each, per device

    @classmethod
    def of(cls, dfa: LazyDFA, tokenizer: Any, ends: Sequence[int]) -> RegexGuide:
        trie = VocabTrie.of(tokenizer)
        key = (id(trie), dfa.pattern, tuple(ends))
        if key not in _guides:
            if len(_guides) >= MAX_GUIDES:
                _guides.pop(next(iter(_guides)))
            _guides[key] = cls(dfa, trie, ends)
        return _guides[key]

    @property
    def start(self) -> int:
        return self.dfa.start

    def advance(self, state: int, token: int) -> int:
        return DEAD if state == DEAD or token >= self.trie.vocab else int(self._moves(state)[token])

    def allowed(self, state: int) -> torch.Tensor:
        """bool [V] on the host: the tokens that keep the text matchable, and the ends where the text already
        matches. A dead state (a text that left the pattern, which the guide never writes) allows the ends only.
        Built once a state; a step's many nodes take theirs on the device from `masks` (one gather)."""
        if state not in self._masks:
            with _building:
                self._masks[state] = self._allowed(state)
        return self._masks[state]

    def _allowed(self, state: int) -> torch.Tensor:
        live = self._moves(state) != DEAD if state != DEAD else np.zeros(self.trie.vocab, dtype=bool)
        mask = torch.from_numpy(live)
        if state == DEAD or self.dfa.accepts(state):
            mask[list(self.ends)] = True
        elif not live.any():  # the text must go on, but no token spells a way: say so, once a state
            warnings.warn(f"guide {self.dfa.pattern[:60]!r}: no token of the vocabulary continues the text "
                          f"at its state {state}; a row there ends without a match", stacklevel=3)
        return mask

    def masks(self, states: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """`allowed` of each state at once: bool [M, V] on `device`, one gather from a table of the states' masks
        kept there (a row a state). A step's nodes share few states (a string's, say, one a depth), and a
        stack of one mask a node cost the host a call and a tensor each."""
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = _MaskTable(self.trie.vocab, device)
        return self._tables[device].gather(self, states)

    def forced_tokens(self, state: int, limit: int) -> tuple[int, ...]:
        """Up to `limit` tokens spelling the text every match must continue with from `state` (a JSON key and its
        quotes, say), longest vocabulary entry first, each one the guide allows. Proposals for the lookup chain:
        greedy or sampled, a row writes what its masked logits pick, so a different spelling only costs them."""
        if state not in self._forced:
            with _building:
                self._forced[state] = self._spell(state)
        return self._forced[state][:limit]

    def _spell(self, state: int) -> tuple[int, ...]:
        """`forced_tokens` of `state`, all of them."""
        text, tokens, at = self._forced_text(state), [], state
        while text and len(tokens) < MAX_FORCED:
            token, length = self._longest_entry(text)
            after = self.advance(at, token) if token is not None else DEAD
            if after == DEAD:
                break
            tokens.append(token)
            text, at = text[length:], after
        return tuple(tokens)

    def _forced_text(self, state: int) -> str:
        """The characters every match goes on with from `state`: while exactly one character keeps it alive and
        the text so far does not match yet (a choice, or an end, would follow). Tokens the state allows that
        start with two characters settle it at once (most states of free text), without a DFA step per
        character of the alphabet (~4 ms a state for SmolLM2's)."""
        if state != DEAD:
            firsts = self.trie.first_chars[self._moves(state) != DEAD]
            if len(np.unique(firsts[firsts >= 0])) > 1:
                return ""
        text, step = "", self.dfa.step
        while state != DEAD and not self.dfa.accepts(state) and len(text) < 4 * MAX_FORCED:
            live = [c for c in self.trie.alphabet if step(state, c) != DEAD]
            if len(live) != 1:
                break
            text, state = text + live[0], step(state, live[0])
        return text

    def _longest_entry(self, text: str) -> tuple[int | None, int]:
        """The vocabulary entry that is the longest prefix of `text` -> (token, its length); (None, 0) if none."""
        node, best = self.trie.root, (None, 0)
        for length, char in enumerate(text, 1):
            node = node.get(char)
            if node is None:
                break
            if _END in node:
                best = (node[_END][0], length)
        return best

    def _moves(self, state: int) -> np.ndarray:
        """[V] the state each token leads to from `state` (DEAD: not allowed), all walked at once (`_ClassWalk`).
        At most MAX_STATES kept (200 KB each for a 49k vocabulary), the oldest dropped first."""
        if state not in self._next:
            if len(self._next) >= MAX_STATES:
                oldest = next(iter(self._next))
                del self._next[oldest]
                self._masks.pop(oldest, None)
            with _building:
                self._next[state] = self._walk.run(state, self.trie.vocab)
        return self._next[state]


class _ClassWalk:
    """Every token's text walked through the DFA from one state at once, in numpy: texts as rows of character
    classes (characters the pattern's sets cannot tell apart share one, ~30 for a JSON schema), one pass per
    character position, the DFA's moves by class in a table filled on first use. A state costs about the same
    whether few tokens live in it or most do (inside a JSON string, counted by maxLength or not)."""

    def __init__(self, dfa: LazyDFA, trie: VocabTrie) -> None:
        self.dfa = dfa
        sets = dfa.char_sets()
        ids: dict[tuple[bool, ...], int] = {}
        class_of, self.chars = {}, []  # char -> class; class -> a character of it
        for char in trie.alphabet:
            signature = tuple(char in s for s in sets)
            if signature not in ids:
                ids[signature] = len(self.chars)
                self.chars.append(char)
            class_of[char] = ids[signature]
        order = sorted(trie.tokens, key=lambda entry: -len(entry[1]))  # longest first: a position's walkers lead
        self.tokens = np.array([token for token, _ in order], dtype=np.int64)
        lengths = np.array([len(text) for _, text in order], dtype=np.int64)
        self.walkers = [int((lengths > at).sum()) for at in range(int(lengths.max(initial=0)))]  # per position
        # column `at`: the class of character `at` of each text that long (ragged: 0.3 M entries, not T x 81)
        self.columns = [np.empty(count, dtype=np.int16) for count in self.walkers]
        for row, (_, text) in enumerate(order):
            for at, char in enumerate(text):
                self.columns[at][row] = class_of[char]
        self.table = np.full((64, len(self.chars)), -2, dtype=np.int64)  # [state + 1, class] -> state; -2 unknown
        self.table[0] = DEAD  # row 0 is DEAD's: it stays dead

    def run(self, state: int, vocab: int) -> np.ndarray:
        """[vocab] the state each token reaches from `state` (DEAD for those that leave the pattern).

        The texts are sorted longest first, so the texts still walking at a position are the first
        `walkers[at]` rows and those ending there a slice after them: no row is ever selected by a mask. A text
        that left the pattern walks on in DEAD's row (it stays there), which costs less than taking it out:
        inside a counted string most texts live to their end: 3.0-3.4 ms a state there, against 5.8-7.3 with
        masks (a 2-core CPU); a narrow state, where most leave at once, 1.0 ms against 0.8."""
        self._fit(state + 1)
        reached = np.full(vocab, DEAD, dtype=np.int32)
        rows = np.full(len(self.tokens), state + 1, dtype=np.int64)  # [state + 1] per text, longest first
        ended = len(self.tokens)
        for at, count in enumerate(self.walkers):
            reached[self.tokens[count:ended]] = rows[count:ended] - 1  # texts of `at` characters end here
            rows, ended = self._moves(rows[:count], self.columns[at]) + 1, count
            if at % 4 == 3 and not rows.any():  # every text has left the pattern (a narrow state, most often)
                return reached
        reached[self.tokens[:ended]] = rows - 1
        return reached

    def _moves(self, rows: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """The state after each (row = state + 1, character class) pair, from the table (DFA steps fill it where
        it holds none yet)."""
        width = self.table.shape[1]
        keys = rows * width + classes
        moved = self.table.ravel()[keys]
        unknown = moved == -2
        if unknown.any():
            for key in np.unique(keys[unknown]).tolist():
                row, char_class = divmod(key, width)
                target = self.dfa.step(row - 1, self.chars[char_class])
                self._fit(target + 1)
                self.table[row, char_class] = target
            moved = self.table.ravel()[keys]
        return moved

    def _fit(self, row: int) -> None:
        if row >= len(self.table):
            grown = np.full((2 * row, self.table.shape[1]), -2, dtype=np.int64)
            grown[: len(self.table)] = self.table
            self.table = grown


class _MaskTable:
    """One guide's masks on one device, a row a state ([S, V] bool, doubled as states come, at most MAX_STATES
    rows: past that it starts over; a state's mask never changes, so rows in flight stay right)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.rows: dict[int, int] = {}  # state -> its row
        self.table = torch.zeros(16, vocab, dtype=torch.bool, device=device)

    def gather(self, guide: RegexGuide, states: Sequence[int]) -> torch.Tensor:
        """[M, V] the masks of `states` (added first where new)."""
        new = [state for state in dict.fromkeys(states) if state not in self.rows]
        if new:
            if len(self.rows) + len(new) > MAX_STATES:
                self.rows.clear()
                new = list(dict.fromkeys(states))
            with _building:
                self._add(guide, new)
        at = to_device([self.rows[state] for state in states], torch.long, self.table.device)
        return self.table[at]

    def _add(self, guide: RegexGuide, states: list[int]) -> None:
        first, device = len(self.rows), self.table.device
        if first + len(states) > len(self.table):
            grown = torch.zeros(max(2 * len(self.table), first + len(states)), self.table.shape[1], dtype=torch.bool,
                                device=device)
            grown[:first] = self.table[:first]
            self.table = grown
        self.rows.update((state, first + i) for i, state in enumerate(states))
        masks = torch.stack([guide.allowed(state) for state in states])  # [n, V] on the host, each built once
        if device.type == "cuda":  # from page-locked memory: waits for no step
            masks = masks.pin_memory().to(device, non_blocking=True)
        self.table[first:first + len(states)] = masks


class GuideProgress:
    """One request's place in its guide: the DFA state after its output, kept across steps (an output only grows:
    each call walks just the tokens appended since the last)."""

    def __init__(self, guide: RegexGuide) -> None:
        self.guide = guide
        self._known, self._state = 0, guide.start

    def forced_after(self, output_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """`RegexGuide.forced_tokens` after the output."""
        return self.guide.forced_tokens(self.state_after(output_ids), limit)

    def state_after(self, output_ids: Sequence[int]) -> int:
        if len(output_ids) < self._known:  # not this request's growing output: start over
            self._known, self._state = 0, self.guide.start
        for token in output_ids[self._known:]:
            self._state = self.guide.advance(self._state, token)
        self._known = len(output_ids)
        return self._state
