"""The two-launch top-k kernel against a stable descending sort."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.kernels.top_k import top_k_indices, top_k_reference  # noqa: E402
from medusa.kernels.top_k_triton import top_k_triton  # noqa: E402

from kernel_inputs import DEVICE, rand  # noqa: E402


# widths over one chunk, several chunks, a ragged last chunk; k = 1 (argmax) up to many
@pytest.mark.parametrize("seed,shape,k", [(0, (3, 700), 1), (1, (2, 2500), 4), (2, (5, 4096), 10),
                                          (3, (2, 3, 1500), 7), (4, (1, 3000), 32)])
def test_matches_a_stable_sort(seed, shape, k):
    g = torch.Generator().manual_seed(seed)
    x = rand(g, *shape)
    got = top_k_triton(x, k)
    assert got.shape == (*shape[:-1], k) and got.dtype == torch.long
    assert torch.equal(got, top_k_reference(x, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_and_minus_infinity_go_by_lowest_index(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 4, (4, 2100), generator=g).to(dtype).to(DEVICE)  # every value repeated
    x[1, :2050] = float("-inf")  # fewer finite entries than k in a row: -inf entries fill in, lowest first
    x[2] = float("-inf")
    for k in (1, 6, 20):
        got = top_k_triton(x, k)
        assert torch.equal(got, top_k_reference(x, k))
        assert all(len(set(row.tolist())) == k for row in got)
    assert torch.equal(top_k_triton(x, 1).squeeze(-1), x.argmax(-1))  # k = 1 is argmax, first maximum
    zeros = torch.tensor([[-1.0, -0.0, 0.0, -2.0]], dtype=dtype, device=DEVICE)  # -0.0 == 0.0: the first wins
    assert top_k_triton(zeros, 4).tolist() == [[1, 2, 0, 3]]


def test_wrapper_checks_k_and_dtype():
    x = torch.zeros(2, 8, device=DEVICE)
    for k in (0, 9):
        with pytest.raises(ValueError, match="k must be"):
            top_k_indices(x, k)
    wide = torch.randn(2, 100, device=DEVICE)
    assert torch.equal(top_k_indices(wide, 40), wide.topk(40, dim=-1).indices)  # past MAX_K: torch.topk
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        top_k_triton(torch.zeros(2, 8, dtype=torch.long, device=DEVICE), 2)


def test_cpu_fallback_picks_the_same_set():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5000, generator=g)
    assert torch.equal(top_k_indices(x, 5), top_k_reference(x, 5))  # distinct values: the same order too
    assert torch.equal(top_k_indices(x, 1), x.argmax(-1, keepdim=True))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,k", [(4, 49152, 10), (36, 49152, 1), (8, 128256, 8)])
def test_full_size_vocabularies(rows, width, k):
    g = torch.Generator().manual_seed(7)
    x = rand(g, rows, width, dtype=torch.bfloat16)
    with torch.inference_mode():  # where the kernels run (under autograd: torch's top-k)
        assert torch.equal(top_k_indices(x, k), top_k_reference(x, k))
