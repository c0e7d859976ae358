"""The byte-level text source: a table of each id's bytes gives the Rust decoder's text, or is refused."""

import random

import pytest

import medusa.decoding.byte_level as byte_level
from medusa.decoding.byte_level import ByteText, byte_table


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def stream(table, ids, seed):
    """ByteText's text of ids fed in random chunks of 1-5, then flushed."""
    rng, text, source, i = random.Random(seed), "", ByteText(table), 0
    while i < len(ids):
        i += rng.randint(1, 5)
        text += source.new_text(ids[:i], final=False)
    return text + source.new_text(ids, final=True)


def test_the_table_is_built_once_per_tokenizer(tokenizer):
    table = byte_table(tokenizer)
    assert table is byte_table(tokenizer) and len(table) == len(tokenizer)
    assert table[tokenizer.eos_token_id] == b""  # special tokens are skipped, as decode skips them
    assert table[tokenizer.convert_tokens_to_ids("Ġthe")] == b" the"
    kept = byte_table(tokenizer, skip_special=False)  # a second table, special tokens' text in it
    assert kept is byte_table(tokenizer, skip_special=False) and kept[tokenizer.eos_token_id] == b"<|im_end|>"


@pytest.mark.parametrize("seed", range(4))
def test_random_byte_tokens_give_the_rust_text(tokenizer, seed):
    """Sequences of single-byte tokens: truncated, overlong and surrogate UTF-8, stray continuation bytes; the
    incremental decoder's U+FFFD must fall where the Rust decoder's whole-text conversion puts them."""
    table = byte_table(tokenizer)
    singles = [i for i, data in enumerate(table) if len(data) == 1]
    assert len(singles) > 230  # all but bytes no UTF-8 text holds (0xC0, 0xC1, 0xF5-0xFF, some controls)
    rng = random.Random(seed)
    ids = [rng.choice(singles) for _ in range(400)]
    assert stream(table, ids, seed) == tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)


def test_unfinished_characters_wait_and_complete(tokenizer):
    table = byte_table(tokenizer)
    fox = [tokenizer.convert_tokens_to_ids(c) for c in "ðŁ¦Ĭ"]  # U+1F98A's four bytes, one token each
    source = ByteText(table)
    assert [source.new_text(fox[:n], final=False) for n in range(1, 5)] == ["", "", "", "🦊"]
    assert source.new_text(fox + fox[:2], final=False) == "" and source.new_text(fox + fox[:2], final=True) == "\ufffd"


def test_ids_past_the_vocabulary_give_no_text_as_in_rust(tokenizer):
    table = byte_table(tokenizer)
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    padded = ids[:1] + [len(table) + 7] + ids[1:]
    assert stream(table, padded, 0) == tokenizer.backend_tokenizer.decode(padded) == "Hello there"


def test_a_table_that_disagrees_with_the_rust_decode_is_refused(tokenizer, monkeypatch):
    """The whole-vocabulary check is live: one wrong entry and the caller streams another way."""
    wrong = tokenizer.convert_tokens_to_ids("Ġthe")
    real = byte_level._token_bytes
    monkeypatch.setattr(byte_level, "_token_bytes", lambda token, byte_of: b"?" if token == "Ġthe" else
                        real(token, byte_of))
    assert wrong > 0 and byte_level._build_table(tokenizer.backend_tokenizer) is None


def test_a_tokenizer_that_is_not_byte_level_gets_no_table():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    rust = Tokenizer(models.WordLevel({"<unk>": 0, "▁hello": 1, "▁world": 2}, unk_token="<unk>"))
    rust.decoder = decoders.Metaspace()  # SentencePiece style: the first word's space is dropped
    fast = PreTrainedTokenizerFast(tokenizer_object=rust)
    assert byte_table(fast) is None and fast.decode([1, 2]) == "hello world"
