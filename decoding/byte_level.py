"""Streaming text for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, the default model's SmolLM2).

Their Rust decoder maps each character of each token back to one byte, joins the bytes of all tokens and
converts them to text, invalid UTF-8 replaced by U+FFFD. So a token's text is a fixed byte string, and the
text of a stream of ids is their byte strings joined, through an incremental UTF-8 decoder ("replace", the
same substitution as the Rust conversion: one U+FFFD per maximal invalid subpart), which holds back a
character still unfinished. A streamed token costs a table lookup and one decode: 0.73 us with the
detokenizer's own work on a 2-core CPU, against 2.2 us through the Rust tokenizer's own DecodeStream
(`benchmarks/host_time.py`, session 34).

The table is built once per tokenizer from its vocabulary and checked against the Rust decode of every id
alone; a tokenizer whose decoder is not plain ByteLevel, or whose check fails, gets None (the caller then
streams another way).
"""

from __future__ import annotations

import codecs
import weakref
from typing import Any, Sequence

_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {skip_special: list[bytes] | None}


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte is shown as one printable character. Printable Latin-1 bytes
    stand for themselves; the others (controls, space, 127-160, the soft hyphen) take the characters from
    U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in set(printable)]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return mapping


_BYTE_OF_CHAR = _byte_of_char()


def in_byte_alphabet(pieces: Sequence[str | None]) -> bool:
    """Whether vocabulary pieces are written in GPT-2's byte alphabet: a space shown as "Ġ", which begins a
    good part of any such vocabulary's words (and no SentencePiece "▁")."""
    words = [piece for piece in pieces if piece]
    spaced = sum(piece[0] == "Ġ" for piece in words)
    return spaced * 100 >= len(words) and not any(piece[0] == "▁" for piece in words)


def piece_bytes(piece: str) -> bytes:
    """One vocabulary piece's bytes (`_token_bytes` with the alphabet built once)."""
    return _token_bytes(piece, _BYTE_OF_CHAR)


def _token_bytes(token: str | None, byte_of: dict[str, int]) -> bytes:
    """A vocabulary entry's bytes: through the alphabet, or the token's own UTF-8 where a character is not in
    it (an added token such as "<think>" written plainly), as the ByteLevel decoder does."""
    if token is None:
        return b""
    try:
        return bytes([byte_of[c] for c in token])
    except KeyError:
        return token.encode()


def _build_table(rust: Any, skip_special: bool = True) -> list[bytes] | None:
    """Bytes of every id as `rust.decode(ids, skip_special_tokens=skip_special)` sees it (special tokens: none
    when skipped), or None where that decode is not the byte-level join."""
    if type(rust.decoder).__name__ != "ByteLevel":
        return None
    size = max(rust.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    special = {i for i, added in rust.get_added_tokens_decoder().items() if added.special} if skip_special else ()
    table = [b"" if i in special else piece_bytes(rust.id_to_token(i)) for i in range(size)]
    alone = rust.decode_batch([[i] for i in range(size)], skip_special_tokens=skip_special)
    if any(text != data.decode("utf-8", "replace") for text, data in zip(alone, table)):
        return None
    return table


def byte_table(tokenizer: Any, skip_special: bool = True) -> list[bytes] | None:
    """The byte strings of `tokenizer`'s ids (a transformers fast tokenizer whose decode is its Rust
    tokenizer's), special tokens' empty unless `skip_special` is False; built on first use and kept while the
    tokenizer lives. None: not byte-level."""
    tables = _tables.setdefault(tokenizer, {})
    if skip_special not in tables:
        tables[skip_special] = _build_table(tokenizer.backend_tokenizer, skip_special)
    return tables[skip_special]


class ByteText:
    """The detokenizer's text source (see `detokenizer.WindowText`'s contract) for a byte-level tokenizer:
    each call decodes only the ids past those already seen."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._fed = 0  # ids already decoded
        self._pending = b""  # the bytes of a character not finished yet

    def new_text(self, token_ids: list[int], final: bool) -> str:
        """Text of the ids past those already decoded; an unfinished character at the end stays pending
        (unless `final`: then it is decoded as U+FFFD)."""
        start, self._fed = self._fed, len(token_ids)
        try:
            # one id a call is the common case (a plain step): no slice, no join
            data = self._table[token_ids[start]] if self._fed == start + 1 else \
                b"".join(map(self._table.__getitem__, token_ids[start:]))
        except IndexError:  # an id past the vocabulary (a model whose vocabulary is padded): no text, as in Rust
            data = self._known_bytes(token_ids[start:])
        if self._pending:
            data = self._pending + data
        # codecs' incremental decoder, inline: the text of the whole characters, the rest kept for the next call
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[used:]
        return text

    def _known_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self._table[i] for i in ids if 0 <= i < len(self._table))
