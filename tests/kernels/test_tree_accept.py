"""The verdict and acceptance kernels against their PyTorch references, on random trees and tokens."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.decoding.device_tree import DeviceTree  # noqa: E402
from medusa.kernels.tree_accept import accept_reference, verdict_reference  # noqa: E402
from medusa.kernels.tree_accept_triton import accept_triton, verdict_triton  # noqa: E402
from medusa.tree import TreeSpec  # noqa: E402

from kernel_inputs import DEVICE, engine_through_kernel  # noqa: E402

TREES = [("single", 0), ("tree-4", 0), ("tree-16", 3), ("tree-64", 0), ("tree-4", 6), ("tree-32", 4)]


def random_step(name, lookup, seed, batch=6, vocab=4):
    """A tree and a batch of candidates and targets from a tiny vocabulary (many matches: deep paths)."""
    tree = DeviceTree.from_spec(TreeSpec.load(name).with_lookup(lookup), torch.device(DEVICE))
    g = torch.Generator().manual_seed(seed)
    n = tree.num_nodes
    candidates = torch.randint(0, vocab, (batch, n), generator=g).to(DEVICE)
    targets = torch.randint(0, vocab, (batch, n), generator=g).to(DEVICE)
    return tree, candidates, targets


@pytest.mark.parametrize("name,lookup", TREES)
def test_verdict_matches_the_reference(name, lookup):
    tree, candidates, targets = random_step(name, lookup, seed=len(name) + lookup)
    if tree.bits is None:
        pytest.skip("more than 64 nodes: the reference serves")
    got_best, got_next = torch.full((6,), -7, device=DEVICE), torch.full((6,), -7, device=DEVICE)  # poisoned
    want_best, want_next = torch.empty_like(got_best), torch.empty_like(got_next)
    verdict_triton(tree, candidates, targets, got_best, got_next)
    verdict_reference(tree, candidates, targets, want_best, want_next)
    assert torch.equal(got_best, want_best) and torch.equal(got_next, want_next)
    assert name == "single" or int(tree.depths[want_best].max()) > 0  # some row accepted a draft


@pytest.mark.parametrize("name,lookup", TREES)
@pytest.mark.parametrize("with_history", [False, True])
def test_accept_matches_the_reference(name, lookup, with_history):
    tree, candidates, targets = random_step(name, lookup, seed=3 * len(name) + lookup)
    batch, n = candidates.shape
    best, next_tokens = torch.empty(batch, dtype=torch.long, device=DEVICE), torch.empty(batch, dtype=torch.long,
                                                                                         device=DEVICE)
    verdict_reference(tree, candidates, targets, best, next_tokens)
    g = torch.Generator().manual_seed(9)
    padding_row = 10
    rows = torch.tensor([3, 7, 0, 5, padding_row, padding_row], device=DEVICE)  # two padding rows, as in a bucket
    slots = (torch.randperm(batch * n * 2, generator=g)[: batch * n].view(batch, n) + 50).to(DEVICE)
    state = {"roots": torch.randint(0, 100, (padding_row + 1,), generator=g),
             "row_base": torch.randint(0, 500, (padding_row + 1,), generator=g),
             "history": torch.randint(0, 100, (padding_row + 1, 41), generator=g),
             "history_len": torch.tensor([0, 5, 9, 40, 2, 38, 1, 39, 12, 3, 6])}  # some near the spare column
    state = {k: v.to(DEVICE) for k, v in state.items()}
    mine = {k: v.clone() for k, v in state.items()}
    history = (lambda s: (s["history"], s["history_len"])) if with_history else (lambda s: (None, None))
    got = accept_triton(tree, candidates, best, next_tokens, slots, rows, mine["roots"], mine["row_base"],
                        padding_row, *history(mine))
    want = accept_reference(tree, candidates, best, next_tokens, slots, rows, state["roots"], state["row_base"],
                            padding_row, *history(state))
    count = want[0][:, 0]
    for b in range(batch):  # packed: count, the tokens up to count, best (past count: junk)
        k = int(count[b])
        assert torch.equal(got[0][b, : k + 1], want[0][b, : k + 1]) and got[0][b, -1] == want[0][b, -1]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # KV moves
    real = rows[:4]
    for key in ("roots", "row_base", "history_len"):  # the padding row's root is junk, its counters are 0
        assert torch.equal(mine[key][real], state[key][real]), key
    assert mine["row_base"][padding_row] == 0 and mine["history_len"][padding_row] == (0 if with_history else 6)
    if with_history:  # each real row's history up to its new length (the spare column takes junk)
        for r in real.tolist():
            length = int(state["history_len"][r])
            assert torch.equal(mine["history"][r, :length], state["history"][r, :length])
    assert name == "single" or int(count.max()) > 1  # some row accepted drafts


def test_wrappers_name_bad_inputs():
    tree, candidates, targets = random_step("tree-4", 0, seed=1)
    out = torch.empty(6, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="candidates, targets"):
        verdict_triton(tree, candidates[:, :2], targets, out, out.clone())
    with pytest.raises(ValueError, match="int64"):
        verdict_triton(tree, candidates.int(), targets, out, out.clone())
    with pytest.raises(ValueError, match="slots"):
        accept_triton(tree, candidates, out, out.clone(), candidates[:, :1], out.clone(), out.clone(), out.clone(), 5)


def test_an_engine_stepping_through_the_kernels_gives_the_reference_outputs(monkeypatch):
    """The decode step's wiring of the kernels (buffers, strides, the lookup history), under the
    interpreter on the CPU: the same tokens and acceptance as the references give."""
    if DEVICE != "cpu":  # tests/decoding's GPU tests run the kernels inside CUDA graphs, on the default model
        pytest.skip("the tiny model's head_dim of 8 has no GPU attention kernel")
    import medusa.kernels.tree_accept as tree_accept

    want, got, calls = engine_through_kernel(monkeypatch, tree_accept)
    assert got == want and calls > 10
    assert max(max(lengths) for lengths in want[1]) > 1  # some step accepted drafts
