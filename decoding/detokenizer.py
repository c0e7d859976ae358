"""Incremental detokenisation with stop strings, for streaming.

Text is released only when it can no longer change: a trailing incomplete UTF-8
sequence (decoded as U+FFFD) is held back, and so is any suffix that could be
the start of a stop string.

Each step decodes only a short window of tokens, not the whole output: decoding
everything again would cost O(output length) per step, ~40 us per sequence at
200 tokens and growing. The window starts at the tokens of the previous
increment, which give the new tokens their context (a SentencePiece word's
leading space, a byte-level BPE character split across tokens); the new text is
the window's text past that context's. It only moves on once the window's text
does not end inside a UTF-8 character. A test checks, on the default model's
tokenizer, that the text built this way equals decoding all tokens at once.

A step decodes twice per sequence (the window and its context). Through a fast
Hugging Face tokenizer's `decode` each call costs ~2.8 us, three quarters of it
in transformers' Python wrapper (it type-checks every id), so where the wrapper
would only call the Rust tokenizer, `_decoder` calls the Rust tokenizer itself.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence


def _decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=True)`, the same text by a shorter path where
    there is one: a fast tokenizer whose decode is transformers' own and cleans up no spaces."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # not a transformers tokenizer then
        return partial(tokenizer.decode, skip_special_tokens=True)
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
             and cls._decode is PreTrainedTokenizerFast._decode and not _cleans_up_spaces(tokenizer))
    decode = tokenizer.backend_tokenizer.decode if plain else tokenizer.decode
    return partial(decode, skip_special_tokens=True)


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


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self._decode_ids = _decoder(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""  # text so far, cut at a stop string once one is seen
        self.released = 0  # characters of self.text already handed out
        self.stopped = False
        self._decoded = ""  # text of token_ids[:_read], never cut
        self._context, self._read = 0, 0  # token_ids[_context:_read]: the window's context tokens

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly releasable text. Sets `stopped` on a stop string."""
        self.token_ids.extend(token_ids)
        if self.stopped:
            return ""
        self._decode_window(final=False)
        return self._after_decode()

    def flush(self) -> str:
        """Release everything left (generation ended), a trailing incomplete character included."""
        if not self.stopped:
            self._decode_window(final=True)
            self._after_decode()
        return self._release(len(self.text))

    def _decode_window(self, final: bool) -> None:
        """Extend _decoded with the text of the tokens past _read, unless it ends mid-character."""
        if self._read == len(self.token_ids):
            return
        window = self.token_ids[self._context:]
        context = self._decode(window[: self._read - self._context])
        text = self._decode_ids(window)  # never empty
        if len(text) <= len(context) or (text.endswith("\ufffd") and not final):
            return  # nothing visible yet, or a character still incomplete: wait for more tokens
        self._decoded += text[len(context):]
        self._context, self._read = self._read, len(self.token_ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _after_decode(self) -> str:
        text = self._decoded
        cut = self._first_stop(text)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self._release(len(self.text))
        self.text = text
        return self._release(len(text) - self._holdback(text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        delta, self.released = self.text[self.released:upto], upto
        return delta

    def _first_stop(self, text: str) -> int | None:
        if not self.stop:
            return None
        # only the unreleased tail plus a stop's length can hold a new match
        start = max(0, self.released - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

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

    def __init__(self, tokenizer: Any) -> None:
        self._decode_ids = _decoder(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""  # empty until flush

    def add(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        return ""

    def flush(self) -> str:
        self.text = self._decode_ids(self.token_ids) if self.token_ids else ""
        return self.text
