"""Tree placement: the reference follows the block tables as BlockManager does; the Triton kernel equals it."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.kernels.tree_placement import place_tree, place_tree_reference  # noqa: E402
from medusa.kernels.tree_placement_triton import place_tree_triton  # noqa: E402
from medusa.tree import TreeSpec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCRATCH, POISON = 10_000, -7


def batch(g, b, n, block_size, width, rows_total=9):
    """Random committed lengths, block tables and state rows; the last batch row is padding (state row
    rows_total - 1, committed length 0 as the engine keeps it)."""
    row_base = torch.randint(0, (width - 1) * block_size - n, (rows_total,), generator=g)
    row_base[-1] = 0
    rows = torch.randperm(rows_total - 1, generator=g)[:b]
    rows[-1] = rows_total - 1
    tables = torch.randint(0, 500, (b, width), generator=g, dtype=torch.int32)
    depths = TreeSpec.load("tree-64").depths[:n].clone().long()  # node 0 is the root, at depth 0
    return row_base, rows, tables, depths


def run(fn, row_base, rows, tables, depths, block_size, last_position=10 ** 6):
    b, n = rows.shape[0], depths.shape[0]
    slots = torch.full((b * n,), POISON, dtype=torch.long, device=row_base.device)
    kv_lens = torch.full((b,), POISON, dtype=torch.long, device=row_base.device)
    base, positions = fn(row_base, rows, tables, depths, block_size, row_base.shape[0] - 1, SCRATCH,
                         last_position, slots, kv_lens)
    return base, positions, slots, kv_lens


def test_reference_follows_the_block_tables():
    g = torch.Generator().manual_seed(0)
    row_base, rows, tables, depths = batch(g, 5, 8, 4, 12)
    base, positions, slots, kv_lens = run(place_tree_reference, row_base, rows, tables, depths, 4)
    for i, row in enumerate(rows.tolist()):
        b = int(row_base[row])
        assert base[i] == b and kv_lens[i] == b + 8
        assert positions[i * 8:(i + 1) * 8].tolist() == [b + int(d) for d in depths]
        want = [int(tables[i, p // 4]) * 4 + p % 4 for p in range(b, b + 8)] if i < 4 else [SCRATCH] * 8
        assert slots[i * 8:(i + 1) * 8].tolist() == want
    clamped = run(place_tree_reference, row_base, rows, tables, depths, 4, last_position=3)[1]
    assert clamped.max() == 3


@pytest.mark.parametrize("seed,b,n,block_size,width", [(0, 4, 1, 16, 6), (1, 7, 13, 4, 20), (2, 3, 64, 16, 9),
                                                         (3, 1, 5, 1, 40)])
def test_triton_kernel_equals_the_reference(seed, b, n, block_size, width):
    g = torch.Generator().manual_seed(seed)
    inputs = [t.to(DEVICE) for t in batch(g, b, n, block_size, width)]
    got = run(place_tree_triton, *inputs, block_size, last_position=int(inputs[0].max()) + 2)
    want = run(place_tree_reference, *inputs, block_size, last_position=int(inputs[0].max()) + 2)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    # a position past the table reads its last column, as the reference does
    inputs[0][inputs[1][0]] = width * block_size
    got = run(place_tree_triton, *inputs, block_size)
    assert torch.equal(got[2], run(place_tree_reference, *inputs, block_size)[2])


def test_triton_wrapper_names_bad_inputs():
    g = torch.Generator().manual_seed(4)
    row_base, rows, tables, depths = [t.to(DEVICE) for t in batch(g, 3, 4, 4, 8)]
    slots = torch.zeros(12, dtype=torch.long, device=DEVICE)
    kv_lens = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="place_tree: tables must be torch.int32"):
        place_tree_triton(row_base, rows, tables.long(), depths, 4, 8, SCRATCH, 99, slots, kv_lens)
    with pytest.raises(ValueError, match="place_tree: slots must be"):
        place_tree_triton(row_base, rows, tables, depths, 4, 8, SCRATCH, 99, slots[:11], kv_lens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the device tool)")
@torch.inference_mode()  # the dispatcher takes the kernel only with autograd off
def test_full_size_on_the_gpu_inside_a_graph():
    g = torch.Generator().manual_seed(5)
    inputs = [t.cuda() for t in batch(g, 64, 64, 16, 600, rows_total=65)]
    want = run(place_tree_reference, *inputs, 16)
    assert torch.equal(run(place_tree, *inputs, 16)[2], want[2])  # the dispatcher takes the kernel
    slots = torch.full((64 * 64,), POISON, dtype=torch.long, device="cuda")
    kv_lens = torch.full((64,), POISON, dtype=torch.long, device="cuda")
    place_tree(*inputs, 16, 64, SCRATCH, 10 ** 6, slots, kv_lens)  # warm up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        base, positions = place_tree(*inputs, 16, 64, SCRATCH, 10 ** 6, slots, kv_lens)
    slots.fill_(POISON)
    graph.replay()
    for a, e in zip((base, positions, slots, kv_lens), want):
        assert torch.equal(a, e)
