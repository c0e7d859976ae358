"""Incremental detokenisation: a byte table, the Rust DecodeStream or a window per step, yet the text equals one
decode."""

import random

import pytest

import medusa.decoding.byte_level as byte_level
import medusa.decoding.detokenizer as detokenizer
from medusa.decoding.byte_level import ByteText
from medusa.decoding.detokenizer import FinalDetokenizer, IncrementalDetokenizer, StreamText, WindowText, _decoder

TEXT = ("Héllo wörld! 你好，世界。 Emoji: 🦊🚀 — «quotes» and math: ∑ x² ≤ 10.\n"
        "def f(x):\n    return x ** 2  # ünïcode\n") * 3


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


SOURCES = {"bytes": ByteText, "stream": StreamText, "window": WindowText}


@pytest.fixture(params=list(SOURCES), autouse=True)
def source(request, monkeypatch):
    """Every test runs with each text source: the default tokenizer takes the byte table, a fast tokenizer that is
    not byte-level the stream, other tokenizers the window."""
    if request.param == "stream":
        monkeypatch.setattr(byte_level, "byte_table", lambda tokenizer, skip_special=True: None)
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "_text_source", WindowText)
    return request.param


def test_the_default_tokenizer_takes_each_source_in_turn(tokenizer, source):
    assert isinstance(IncrementalDetokenizer(tokenizer)._source, SOURCES[source])


def feed(tokenizer, ids, seed, stop=(), include_stop=False):
    """Feed ids in random chunks of 1-4 tokens; returns the detokenizer and the released deltas joined."""
    rng, detok, released, i = random.Random(seed), IncrementalDetokenizer(tokenizer, stop, include_stop), "", 0
    while i < len(ids) and not detok.stopped:
        n = rng.randint(1, 4)
        released += detok.add(ids[i:i + n])
        i += n
    return detok, released + detok.flush()


@pytest.mark.parametrize("seed", range(6))
def test_random_tokens_give_the_text_of_one_decode(tokenizer, seed):
    """Random ids include lone UTF-8 byte tokens: the hard case for a windowed decode."""
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    detok, released = feed(tokenizer, ids, seed)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text == whole and released == whole


@pytest.mark.parametrize("seed", range(3))
def test_the_final_only_detokenizer_gives_the_incremental_text_in_one_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT) + [rng.randrange(tokenizer.vocab_size) for _ in range(50)]
    incremental, _ = feed(tokenizer, ids, seed)
    final = FinalDetokenizer(tokenizer)
    assert all(final.add(ids[i:i + 3]) == "" for i in range(0, len(ids), 3)) and final.text == ""
    assert final.flush() == final.text == incremental.text and not final.stopped


def test_the_short_decode_path_gives_the_tokenizers_text(default_model_dir, tokenizer):
    """The default tokenizer is decoded by the Rust tokenizer directly: the text must be decode()'s."""
    from transformers import AutoTokenizer

    decode = _decoder(tokenizer)
    assert decode.func == tokenizer.backend_tokenizer.decode  # the short path is taken
    rng = random.Random(0)
    for n in (1, 2, 3, 8, 50):  # special tokens included: both must skip them
        ids = [rng.randrange(len(tokenizer)) for _ in range(n)] + [tokenizer.eos_token_id]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    # asked to clean up spaces, transformers skips it for a BPE model (the flag is set under 5.17): short path
    cleaning = AutoTokenizer.from_pretrained(str(default_model_dir), clean_up_tokenization_spaces=True)
    ids = cleaning.encode("Wait , what ? It 's fine . We 're done !", add_special_tokens=False)
    assert _decoder(cleaning).func == cleaning.backend_tokenizer.decode
    assert _decoder(cleaning)(ids) == cleaning.decode(ids, skip_special_tokens=True) == cleaning.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    forced = AutoTokenizer.from_pretrained(str(default_model_dir), clean_up_tokenization_spaces=True,
                                           clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    assert _decoder(forced).func == forced.decode  # the wrapper does more there: keep it
    assert _decoder(forced)(ids) != cleaning.decode(ids, skip_special_tokens=True)  # " ," -> ","


def test_multibyte_text_streams_exactly(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, released = feed(tokenizer, ids, 0)
    assert detok.text == released == tokenizer.decode(ids, skip_special_tokens=True)
    pieces = IncrementalDetokenizer(tokenizer)
    assert all("\ufffd" not in pieces.add([t]) for t in ids)  # no half character is ever released


def test_each_step_decodes_a_short_window(tokenizer):
    """The cost per step must not grow with the output (a whole-output decode would be O(n) per step).
    A tokenizer that is not transformers' fast one (this wrapper) takes the window."""
    ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    seen = []

    class Counting:
        def decode(self, window, **kw):
            seen.append(len(window))
            return tokenizer.decode(window, **kw)

    detok = IncrementalDetokenizer(Counting())
    for t in ids:
        detok.add([t])
    assert len(ids) > 400 and max(seen) <= 8
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop", [["ünïcode"], ["世界"], ["🚀"], ["x **", "wörld"], [" and math"]])
def test_stop_strings_cut_the_text_there(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, released = feed(tokenizer, ids, 1, stop)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min(whole.find(s) for s in stop if s in whole)
    assert detok.stopped and detok.text == released == whole[:cut]
    assert detok.stop_string == next(s for s in stop if whole.find(s) == cut)


@pytest.mark.parametrize("stop", [["ünïcode"], ["世界"], ["🚀"], ["x **", "wörld"], ["wör", "wörld"], [" and math"]])
def test_with_include_stop_the_text_ends_after_the_stop_string(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok, released = feed(tokenizer, ids, 4, stop, include_stop=True)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    at = min(whole.find(s) for s in stop if s in whole)
    first = next(s for s in stop if whole.find(s) == at)  # of stops starting there, the one listed first
    assert detok.stopped and detok.text == released == whole[:at + len(first)] and detok.stop_string == first


def test_text_never_runs_past_an_unfinished_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["END OF TEXT"])
    out = detok.add(tokenizer.encode("Some answer. END OF", add_special_tokens=False))
    assert out == "Some answer. " and not detok.stopped  # "END OF" may begin the stop string: held back
    assert detok.flush() == "END OF"  # the generation ended without it: release the rest


def test_an_unfinished_character_at_the_end_is_released_by_flush(tokenizer):
    ids = tokenizer.encode("ok 🦊", add_special_tokens=False)
    byte_ids = [tokenizer.convert_tokens_to_ids("ð")]  # byte 0xF0: the first of a 4-byte character's
    assert tokenizer.decode(byte_ids) == "\ufffd"
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) == "ok 🦊" and detok.add(byte_ids) == "" and detok.flush() == "\ufffd"
    assert detok.text == tokenizer.decode(ids + byte_ids) and detok.flush() == ""


def test_a_decode_stream_that_takes_one_id_at_a_time_falls_back_to_the_window(tokenizer, source, monkeypatch):
    """tokenizers releases whose DecodeStream.step takes no list of ids: the windowed decode, same text."""
    import tokenizers.decoders

    class OneAtATime:
        def __init__(self, skip_special_tokens=False):
            pass

        def step(self, rust, token_id):
            if not isinstance(token_id, int):
                raise TypeError("argument 'id': 'list' object cannot be interpreted as an integer")

    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", OneAtATime)
    monkeypatch.setattr(byte_level, "byte_table", lambda tokenizer, skip_special=True: None)  # not byte-level
    monkeypatch.setattr(detokenizer, "_stream", detokenizer._UNCHECKED)
    detok, released = feed(tokenizer, tokenizer.encode(TEXT, add_special_tokens=False), 2)
    assert isinstance(detok._source, WindowText) and released == tokenizer.decode(tokenizer.encode(TEXT),
                                                                                   skip_special_tokens=True)


def test_special_tokens_inside_the_output_are_skipped_as_decode_skips_them(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    special = sorted(tokenizer.all_special_ids)
    mixed = [t for i, token in enumerate(ids) for t in ([token, special[i % len(special)]] if i % 7 == 3 else [token])]
    detok, released = feed(tokenizer, mixed, 3)
    assert len(mixed) > len(ids) and released == detok.text == tokenizer.decode(mixed, skip_special_tokens=True)


def test_special_tokens_stay_in_the_text_when_not_skipped(tokenizer):
    """skip_special=False (vLLM's skip_special_tokens=false): decode's text with the special tokens kept, by
    every source; the final-only detokenizer too."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    special = sorted(tokenizer.all_special_ids)
    mixed = [t for i, token in enumerate(ids) for t in ([token, special[i % len(special)]] if i % 5 == 2 else [token])]
    detok, released, i = IncrementalDetokenizer(tokenizer, skip_special=False), "", 0
    while i < len(mixed):
        released += detok.add(mixed[i:i + 3])
        i += 3
    released += detok.flush()
    whole = tokenizer.decode(mixed, skip_special_tokens=False)
    assert released == detok.text == whole and "<|im_end|>" in whole
    final = FinalDetokenizer(tokenizer, skip_special=False)
    final.add(mixed)
    assert final.flush() == whole


def test_min_tokens_holds_stop_strings_back_as_vllm_does(tokenizer):
    """A stop string that ends in the text of the first min_tokens - 1 tokens does not end the output (vLLM looks
    for stop strings only once min_tokens are out); one ending in the min_tokens-th token's text or later does."""
    ids = tokenizer("1, 2, 3, 4, 5, 6, 7, 8", add_special_tokens=False)["input_ids"]
    texts = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
    first_comma = next(n for n, text in enumerate(texts) if "," in text)  # tokens until the first ", " is out

    def run(min_tokens):
        detok = IncrementalDetokenizer(tokenizer, [","], min_tokens=min_tokens)
        for n, token in enumerate(ids, start=1):
            detok.add([token])
            if detok.stopped:
                return n, detok.text
        return None, detok.text

    assert run(0) == (first_comma, "1")
    assert run(first_comma) == (first_comma, "1")  # that token is the min_tokens-th: it may stop
    held, text = run(first_comma + 1)
    assert held > first_comma + 1 and text == "1, 2"  # the first comma passed, the next one stops
    assert run(len(ids)) == (None, "1, 2, 3, 4, 5, 6, 7, 8")  # no comma ends in the last token's text


def test_the_engine_s_detokenizer_takes_the_requests_min_tokens(tokenizer):
    from medusa.decoding.engine_request import make_detokenizer
    from medusa.decoding.sampling_params import SamplingParams

    assert make_detokenizer(tokenizer, SamplingParams(max_tokens=20, min_tokens=10, stop=" 7")).min_tokens == 10
