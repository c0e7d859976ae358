"""Incremental detokenisation with stop strings, for streaming.

Text is released only when it can no longer change: a trailing incomplete UTF-8
sequence (decoded as U+FFFD) is held back, and so is any suffix that could be
the start of a stop string.

The text comes from one of three sources, the same text each way (a test checks
each, on the default model's tokenizer, against decoding all tokens at once):

- `ByteText` (`byte_level.py`), where the tokenizer is a fast byte-level BPE one
  whose Rust decode is what `decode` returns (the default model's): a table of
  each id's bytes and an incremental UTF-8 decoder, 0.73 us a streamed token.
- `StreamText`, for other fast tokenizers whose Rust decode is what `decode`
  returns: the Rust tokenizer's own incremental decoder
  (`tokenizers.decoders.DecodeStream`, tokenizers >= 0.21), one call per step:
  2.2 us a streamed token on a 2-core CPU with this module's own work
  (`benchmarks/host_time.py`).
- `WindowText`, otherwise: each step decodes a short window of tokens, not the
  whole output (decoding everything again would cost O(output length) per step,
  ~40 us per sequence at 200 tokens and growing). The window starts at the
  tokens of the previous increment, which give the new tokens their context (a
  SentencePiece word's leading space, a byte-level BPE character split across
  tokens); the new text is the window's text past that context's. It only moves
  on once the window's text does not end inside a UTF-8 character. Two decodes a
  step, each ~2.8 us through transformers' Python wrapper (three quarters of it
  type-checking every id), so `_decoder` calls the Rust tokenizer itself where
  the wrapper would only call it.

On the H200's host at 64 requests, the wrapper's decodes were 38% of the
engine's profiled host time (transformers 5.17 sets `clean_up_tokenization_spaces`
on the default model's tokenizer, which kept the wrapper: see `_cleans_up_spaces`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

from medusa.decoding import byte_level
from medusa.decoding.byte_level import ByteText


def _decoder(tokenizer: Any, skip_special: bool = True) -> Callable[[Sequence[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=skip_special)`, the same text by a shorter path where
    there is one: a fast tokenizer whose decode is transformers' own and cleans up no spaces."""
    decode = tokenizer.backend_tokenizer.decode if _decodes_in_rust(tokenizer) else tokenizer.decode
    return partial(decode, skip_special_tokens=skip_special)


def _decodes_in_rust(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=...)` is exactly its Rust tokenizer's decode."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # not a transformers tokenizer then
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not _cleans_up_spaces(tokenizer))


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether transformers' decode would clean up the Rust tokenizer's text (" ." -> "." and the like).

    `clean_up_tokenization_spaces` asks for it, but transformers 5 skips it for a BPE model (the default
    model's tokenizer: its GGUF conversion sets the flag under transformers 5.17, not under 5.24) unless
    `clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output` is set; a version without
    that attribute may clean BPE text too, so the wrapper is kept there.
    """
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None)
    is_bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    return not (is_bpe and forced is False)


class WindowText:
    """Text of a growing list of ids, by decoding a window of them per call (the module's docstring)."""

    def __init__(self, tokenizer: Any, skip_special: bool = True) -> None:
        self._decode_ids = _decoder(tokenizer, skip_special)
        self._context, self._read = 0, 0  # token_ids[_context:_read]: the window's context tokens

    def new_text(self, token_ids: list[int], final: bool) -> str:
        """Text of the ids past those already turned into text; "" while it ends mid-character
        (unless `final`: then the incomplete character is decoded as U+FFFD)."""
        if self._read == len(token_ids):
            return ""
        window = token_ids[self._context:]
        context = self._decode(window[: self._read - self._context])
        text = self._decode_ids(window)  # never empty
        if len(text) <= len(context) or (text.endswith("\ufffd") and not final):
            return ""  # nothing visible yet, or a character still incomplete: wait for more tokens
        self._context, self._read = self._read, len(token_ids)
        return text[len(context):]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_ids(ids) if ids else ""


class StreamText:
    """WindowText's contract through the Rust tokenizer's `DecodeStream` (the module's docstring)."""

    def __init__(self, tokenizer: Any, stream_type: type, skip_special: bool = True) -> None:
        self._rust, self._skip_special = tokenizer.backend_tokenizer, skip_special
        self._stream = stream_type(skip_special_tokens=skip_special)
        self._fed = 0  # ids given to the stream
        self._chars = 0  # characters the stream has returned
        self._whole_fed = 0  # ids whose text the stream has returned whole (none of it held back)

    def new_text(self, token_ids: list[int], final: bool) -> str:
        text = ""
        if self._fed < len(token_ids):
            text = self._stream.step(self._rust, token_ids[self._fed:]) or ""  # None: a character incomplete
            self._fed = len(token_ids)
            self._chars += len(text)
            if text:
                self._whole_fed = self._fed
        if final and self._whole_fed < self._fed:  # the stream holds an incomplete character back: decode it
            rest = self._rust.decode(token_ids, skip_special_tokens=self._skip_special)[self._chars:]
            self._chars, self._whole_fed = self._chars + len(rest), self._fed
            text += rest
        return text


def prepare(tokenizer: Any) -> None:
    """Build up front what streaming `tokenizer`'s text needs (its byte table: 0.23-0.25 s for the default model's
    49k vocabulary on a 2-core CPU, RESULTS.md session 34), so that the first request does not wait for it."""
    if tokenizer is not None and _decodes_in_rust(tokenizer):
        byte_level.byte_table(tokenizer)


def _text_source(tokenizer: Any, skip_special: bool = True) -> ByteText | StreamText | WindowText:
    if not _decodes_in_rust(tokenizer):
        return WindowText(tokenizer, skip_special)
    table = byte_level.byte_table(tokenizer, skip_special)
    if table is not None:
        return ByteText(table)
    stream = _stream_type(tokenizer.backend_tokenizer)
    return StreamText(tokenizer, stream, skip_special) if stream is not None else WindowText(tokenizer, skip_special)


_UNCHECKED = object()
_stream = _UNCHECKED  # tokenizers' DecodeStream if its step takes a list of ids, else None; checked once


def _stream_type(rust: Any) -> type | None:
    """tokenizers' `DecodeStream`, where it exists (>= 0.21) and its `step` takes a list of ids (a step
    may add several tokens); checked on the first tokenizer that asks."""
    global _stream
    if _stream is _UNCHECKED:
        try:
            from tokenizers.decoders import DecodeStream

            DecodeStream(skip_special_tokens=True).step(rust, [0])
            _stream = DecodeStream
        except (ImportError, TypeError):
            _stream = None
    return _stream


class IncrementalDetokenizer:
    """Text of a growing list of token ids, released as it becomes final, cut at the first stop string (before it,
    or after it with `include_stop`, vLLM's include_stop_str_in_output); special tokens' text is left out unless
    skip_special is False."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special: bool = True, min_tokens: int = 0) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer, self.stop, self.include_stop = tokenizer, tuple(stop), include_stop
        # vLLM's min_tokens holds stop strings back too: only one that ends in the text of the min_tokens-th
        # token or later ends the output. `_stops_from`: where that token's text starts (None: not decoded yet)
        self.min_tokens, self._stops_from = min_tokens, 0 if min_tokens <= 0 else None
        self._source = _text_source(tokenizer, skip_special)
        self.token_ids: list[int] = []
        self.text = ""  # text so far, cut at a stop string once one is seen
        self.released = 0  # characters of self.text already handed out
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (vLLM's stop_reason)
        self._decoded = ""  # text of the ids decoded so far, never cut

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly releasable text. Sets `stopped` on a stop string."""
        if self._stops_from is None and len(self.token_ids) + len(token_ids) >= self.min_tokens:
            self._stops_from = len(self._decoded)  # (a stop ending in this call's earlier tokens' text counts too)
        self.token_ids.extend(token_ids)
        if self.stopped:
            return ""
        new = self._source.new_text(self.token_ids, final=False)
        if not new:  # nothing decoded: nothing more to release either
            return ""
        self._decoded += new
        if not self.stop:  # no stop string to hold text back for, and `new` never ends mid-character
            self.text, self.released = self._decoded, len(self._decoded)
            return new
        return self._after_decode()

    def flush(self) -> str:
        """Release everything left (generation ended), a trailing incomplete character included."""
        if not self.stopped:
            self._decoded += self._source.new_text(self.token_ids, final=True)
            self._after_decode()
        return self._release(len(self.text))

    def _after_decode(self) -> str:
        text = self._decoded
        hit = self._first_stop(text)
        if hit is not None:
            cut, self.stop_string = hit
            self.text, self.stopped = text[:cut], True
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._holdback(text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        delta, self.released = self.text[self.released:upto], upto
        return delta

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(where the text ends at the earliest stop string: its start, or its end with include_stop; that
        string); None: no stop string yet. Stops that start at the same place: the first listed."""
        if not self.stop or self._stops_from is None:
            return None
        # only the unreleased tail plus a stop's length can hold a new match; none ending before _stops_from
        start = max(0, self.released - max((len(s) for s in self.stop), default=0))
        hits = [(i, s) for i, s in ((text.find(s, max(start, self._stops_from - len(s) + 1)), s) for s in self.stop)
                if i >= 0]
        if not hits:
            return None
        at, stop = min(hits, key=lambda hit: hit[0])
        return (at + len(stop) if self.include_stop else at), stop

    def _holdback(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold


class FinalDetokenizer:
    """IncrementalDetokenizer's interface for output_kind="final" without stop strings: `add` only
    keeps the ids, `flush` decodes them all at once (the same text, as the incremental one's test
    checks), so a request that is read only when it ends pays for one decode, not one per step."""

    stop: tuple[str, ...] = ()
    stopped = False
    stop_string = None

    def __init__(self, tokenizer: Any, skip_special: bool = True) -> None:
        self._decode_ids = _decoder(tokenizer, skip_special)
        self.token_ids: list[int] = []
        self.text = ""  # empty until flush

    def add(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        return ""

    def flush(self) -> str:
        self.text = self._decode_ids(self.token_ids) if self.token_ids else ""
        return self.text
