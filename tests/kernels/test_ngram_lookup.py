"""Device prompt lookup: the reference equals the host's NgramIndex; the Triton kernel equals the reference."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.decoding.prompt_lookup import NgramIndex  # noqa: E402
from medusa.kernels.ngram_lookup import ngram_lookup, ngram_lookup_reference  # noqa: E402
from medusa.kernels.ngram_lookup_triton import SCAN_BLOCK, ngram_lookup_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def histories(g, rows, width, vocab):
    """Random rows over a small vocabulary (so n-grams recur), lengths from 3/4 full to full; the first
    four rows are empty or nearly so."""
    assert rows > 4
    history = torch.randint(vocab, (rows, width), generator=g) + 5
    lengths = torch.randint(3 * width // 4, width + 1, (rows,), generator=g)
    lengths[:4] = torch.tensor([0, 1, 2, 3])
    return history, lengths


@pytest.mark.parametrize("seed", range(6))
def test_reference_proposes_what_the_host_index_proposes(seed):
    g = torch.Generator().manual_seed(seed)
    history, lengths = histories(g, 12, 48, vocab=2 + seed)
    for length in (1, 4, 9):
        got = ngram_lookup_reference(history, lengths, length)
        for r in range(12):
            tokens = history[r, : lengths[r]].tolist()
            assert got[r].tolist() == NgramIndex(tokens).propose(length), (r, tokens, length)


@pytest.mark.parametrize("seed,rows,width,length", [(0, 12, 40, 4), (1, 7, SCAN_BLOCK * 2 + 37, 7), (2, 6, 9, 1)])
def test_triton_kernel_equals_the_reference(seed, rows, width, length):
    g = torch.Generator().manual_seed(seed)
    history, lengths = histories(g, rows, width, vocab=3)
    history, lengths = history.to(DEVICE), lengths.to(DEVICE)
    assert torch.equal(ngram_lookup_triton(history, lengths, length), ngram_lookup_reference(history, lengths, length))


def test_rows_pick_history_rows_in_place():
    """The engine passes its batch's state rows (padding rows repeat one row): proposals follow them."""
    g = torch.Generator().manual_seed(4)
    history, lengths = histories(g, 9, 60, vocab=3)
    history, lengths = history.to(DEVICE), lengths.to(DEVICE)
    rows = torch.tensor([8, 5, 5, 0, 7], device=DEVICE)
    want = ngram_lookup_reference(history, lengths, 5)[rows]
    assert torch.equal(ngram_lookup_triton(history, lengths, 5, rows=rows), want)
    assert torch.equal(ngram_lookup(history, lengths, rows, 5), want)


def test_a_match_in_a_later_scan_block_wins():
    """The latest occurrence wins even when an earlier block also matched (the kernel's running max)."""
    tokens = [7, 8, 9, 1] + [5] * (SCAN_BLOCK + 20) + [7, 8, 9, 2] + [6] * 10 + [7, 8, 9]
    history = torch.tensor([tokens], device=DEVICE)
    lengths = torch.tensor([len(tokens)], device=DEVICE)
    assert NgramIndex(tokens).propose(2) == [2, 6]
    assert ngram_lookup_triton(history, lengths, 2).tolist() == [[2, 6]]


def test_bad_arguments_are_named():
    history, lengths = torch.zeros(2, 8, dtype=torch.long), torch.tensor([3, 4])
    with pytest.raises(ValueError, match="n-gram sizes"):
        ngram_lookup_triton(history, lengths, 2, sizes=(2, 1))
    with pytest.raises(ValueError, match="history must be"):
        ngram_lookup_triton(history.int(), lengths, 2)
    with pytest.raises(ValueError, match="lengths must be"):
        ngram_lookup_triton(history, lengths[:1], 2)
    with pytest.raises(ValueError, match="length must be >= 1"):
        ngram_lookup_triton(history, lengths, 0)


@pytest.mark.gpu
def test_full_size_on_the_gpu():
    """64 rows of an 8k context, as the engine would keep them."""
    g = torch.Generator().manual_seed(3)
    history, lengths = histories(g, 64, 8192, vocab=50)
    history, lengths = history.cuda(), lengths.cuda()
    assert torch.equal(ngram_lookup_triton(history, lengths, 8), ngram_lookup_reference(history, lengths, 8))
