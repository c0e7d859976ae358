"""A step's candidate tokens: the reference reads the state rows as the decode step did; the kernel equals it."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.decoding.device_tree import DeviceTree  # noqa: E402
from medusa.kernels.tree_candidates import gather_candidates, gather_candidates_reference  # noqa: E402
from medusa.kernels.tree_candidates_triton import gather_candidates_triton  # noqa: E402
from medusa.tree import TreeSpec  # noqa: E402

from kernel_inputs import DEVICE, engine_through_kernel  # noqa: E402

TREES = [("single", 0), ("tree-4", 0), ("tree-16", 3), ("tree-64", 0), ("tree-32", 6), ("chain-4", 2)]


def state(g, name, lookup, b, rows_total=11, vocab=50_000):
    """A device tree and random state: roots [R], the heads' top-k [R, 4, 10], this step's rows (the last one
    the padding row) and lookup proposals [B, lookup + 2] (wider than the chain, as the kernel's buffer is)."""
    tree = DeviceTree.from_spec(TreeSpec.load(name).with_lookup(lookup) if lookup else TreeSpec.load(name), DEVICE)
    roots = torch.randint(0, vocab, (rows_total,), generator=g)
    topk = torch.randint(0, vocab, (rows_total, 4, 10), generator=g)
    rows = torch.cat([torch.randperm(rows_total - 1, generator=g)[: b - 1], torch.tensor([rows_total - 1])])
    chain = torch.randint(0, vocab, (b, lookup + 2), generator=g) if lookup else None
    return tree, *(t.to(DEVICE) if t is not None else None for t in (rows, roots, topk, chain))


def test_reference_takes_root_heads_then_chain():
    g = torch.Generator().manual_seed(0)
    tree, rows, roots, topk, chain = state(g, "tree-16", 3, 4)
    got = gather_candidates_reference(tree, rows, roots, topk, chain)
    spec = tree.spec
    for b, r in enumerate(rows.tolist()):
        assert got[b, 0] == roots[r]
        for j, path in enumerate(spec.paths, start=1):
            assert got[b, j] == topk[r, len(path) - 1, path[-1]]  # the head of its depth, at its own rank
        assert got[b, spec.first_lookup_node:].tolist() == chain[b, :3].tolist()


@pytest.mark.parametrize("seed,name,lookup,b", [(s, n, lk, b) for s, ((n, lk), b) in
                                                enumerate(zip(TREES, [1, 3, 5, 2, 8, 4]))])
def test_triton_kernel_equals_the_reference(seed, name, lookup, b):
    g = torch.Generator().manual_seed(seed)
    tree, rows, roots, topk, chain = state(g, name, lookup, b)
    heads = topk if tree.first_lookup_node > 1 else None
    want = gather_candidates_reference(tree, rows, roots, heads, chain)
    got = gather_candidates_triton(tree, rows, roots, heads, chain)
    assert got.shape == (b, tree.num_nodes) and torch.equal(got, want)


def test_wrapper_rejects_bad_input():
    g = torch.Generator().manual_seed(7)
    tree, rows, roots, topk, chain = state(g, "tree-16", 3, 3)
    with pytest.raises(ValueError, match="rows must be a 1-D torch.int64"):
        gather_candidates_triton(tree, rows.int(), roots, topk, chain)
    with pytest.raises(ValueError, match="topk"):
        gather_candidates_triton(tree, rows, roots, topk[:, :1], chain)
    with pytest.raises(ValueError, match="topk"):
        gather_candidates_triton(tree, rows, roots, None, chain)
    with pytest.raises(ValueError, match="3 prompt-lookup nodes"):
        gather_candidates_triton(tree, rows, roots, topk, chain[:, :2])
    with pytest.raises(ValueError, match="3 prompt-lookup nodes"):
        gather_candidates_triton(tree, rows, roots, topk, None)


def test_cpu_dispatch_is_the_reference():
    g = torch.Generator().manual_seed(8)
    tree, rows, roots, topk, chain = state(g, "tree-4", 2, 3)
    assert torch.equal(gather_candidates(tree, rows, roots, topk, chain),
                       gather_candidates_reference(tree, rows, roots, topk, chain))


def test_an_engine_stepping_through_the_kernel_gives_the_reference_outputs(monkeypatch):
    """The decode step's wiring (state rows, the heads' top-k buffer, the lookup chain) under the interpreter
    on the CPU: the same tokens and acceptance as the reference gives."""
    if DEVICE != "cpu":  # tests/decoding's GPU tests run the kernel inside CUDA graphs, on the default model
        pytest.skip("the tiny model's head_dim of 8 has no GPU attention kernel")
    import medusa.kernels.tree_candidates as tree_candidates

    want, got, calls = engine_through_kernel(monkeypatch, tree_candidates)
    assert got == want and calls > 5
    assert max(max(lengths) for lengths in want[1]) > 1  # some step accepted drafts


@pytest.mark.gpu
@torch.inference_mode()  # the dispatcher takes the kernel only with autograd off
def test_full_size_on_the_gpu_inside_a_graph():
    g = torch.Generator().manual_seed(9)
    tree, rows, roots, topk, chain = state(g, "tree-64", 0, 64, rows_total=65)
    want = gather_candidates_reference(tree, rows, roots, topk)
    gather_candidates(tree, rows, roots, topk)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = gather_candidates(tree, rows, roots, topk)
    got.fill_(-1)
    graph.replay()
    assert torch.equal(got, want)
