"""The accepted tokens' KV moves: the reference gathers before it writes; the Triton kernel equals it."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.kernels.kv_move import check_moves, move_kv, move_kv_reference  # noqa: E402
from medusa.kernels.kv_move_triton import move_kv_triton  # noqa: E402

from kernel_inputs import DEVICE, engine_through_kernel  # noqa: E402


def moves(g, rows, m, slots, padding_rows=2, spare=3):
    """src, dst [(rows + padding_rows) * m] as a decode step makes them: each real row owns m + spare
    distinct slots (the step's tree), dst its first m, src its accepted path (node at depth d from the
    tree's index >= d, some rows a chain where entry d reads the slot that entry d + 1 writes), src == dst
    past the path; then padding rows, all moves of the shared scratch slot (the last) onto itself."""
    owned = torch.randperm(slots - 1, generator=g)[: rows * (m + spare)].view(rows, m + spare)
    src, dst = [], []
    for b in range(rows):
        accepted = int(torch.randint(0, m, (1,), generator=g)) if b % 3 else m - 1  # depth of the path
        if b % 2 == 0:  # a chain: depth d from index d + 1
            path = list(range(2, accepted + 2))
        else:  # any increasing indices
            path = sorted(torch.randperm(m + spare - 1, generator=g)[:accepted].add(1).tolist())
        index = [0] + path + list(range(accepted + 1, m))
        src.append(owned[b, index])
        dst.append(owned[b, :m])
    scratch = torch.full((padding_rows, m), slots - 1)
    src = torch.cat([torch.stack(src), scratch]).flatten() if rows else scratch.flatten()
    dst = torch.cat([torch.stack(dst), scratch]).flatten() if rows else scratch.flatten()
    return src.to(DEVICE), dst.to(DEVICE)


def pool(g, layers, slots, heads, dim, dtype):
    """k, v [L, S, Hkv, D]: random, no zeros (a row left unwritten shows)."""
    return [(torch.randn(layers, slots, heads, dim, generator=g) + 3).to(dtype).to(DEVICE) for _ in range(2)]


def check(fn, k, v, src, dst, m):
    """fn on clones of k, v equals the reference on clones, and the contract: dst rows hold the old src
    rows, every other slot is untouched."""
    got, want = [t.clone() for t in (k, v)], [t.clone() for t in (k, v)]
    fn(*got, src, dst, m)
    move_kv_reference(*want, src, dst, m)
    for a, e, old in zip(got, want, (k, v)):
        assert torch.equal(a, e)
        assert torch.equal(a[:, dst], old[:, src])
        untouched = torch.ones(old.shape[1], dtype=torch.bool, device=old.device)
        untouched[dst] = False
        assert torch.equal(a[:, untouched], old[:, untouched])
    assert not torch.equal(got[0], k) or bool((src == dst).all())  # something moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim", [(3, 64), (2, 16)])  # Hkv * D = 192 (the default model), 32
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("rows", [1, 4])
def test_triton_kernel_equals_the_reference(dtype, heads, dim, m, rows):
    g = torch.Generator().manual_seed(m * 10 + rows + heads)
    k, v = pool(g, 2, 64, heads, dim, dtype)
    src, dst = moves(g, rows, m, 64)
    check(move_kv_triton, k, v, src, dst, m)


def test_feature_chunks_and_one_row_of_all_moves():
    """Rows wide enough that the features split into chunks; and moves_per_row=None (one row of every
    move): an arbitrary permutation of slots, swaps and cycles included, still gathers first."""
    g = torch.Generator().manual_seed(7)
    k, v = pool(g, 2, 96, 4, 128, torch.float32)  # Hkv * D = 512 at BLOCK_M = 32: chunks of 256
    src, dst = moves(g, 3, 17, 96)
    check(move_kv_triton, k, v, src, dst, 17)
    at = torch.randperm(96, generator=g)[:40].to(DEVICE)
    check(move_kv_triton, k, v, at, at[torch.randperm(40, generator=g).to(DEVICE)], None)


def test_the_reference_reads_before_it_writes():
    """A 2-entry chain: entry 0 writes the slot entry 1 reads, and a swap."""
    g = torch.Generator().manual_seed(8)
    k, v = pool(g, 2, 4, 2, 16, torch.float32)
    for src, dst in (([2, 1], [1, 0]), ([0, 1], [1, 0])):
        src, dst = torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE)
        for fn in (move_kv_reference, move_kv_triton):
            for m in (2, None):
                got = [t.clone() for t in (k, v)]
                fn(*got, src, dst, m)
                for a, old in zip(got, (k, v)):
                    assert torch.equal(a[:, dst], old[:, src]), (fn.__name__, m)


def test_wrappers_name_bad_inputs():
    g = torch.Generator().manual_seed(9)
    k, v = pool(g, 2, 16, 2, 16, torch.float32)
    src, dst = moves(g, 2, 3, 16, padding_rows=0)
    for fn in (move_kv, move_kv_triton):
        with pytest.raises(ValueError, match="src and dst must have one length, got 6 and 5"):
            fn(k, v, src, dst[:5], 3)
        with pytest.raises(ValueError, match="6 moves are not rows of moves_per_row=4"):
            fn(k, v, src, dst, 4)
        with pytest.raises(ValueError, match="src must be 1-D torch.int64"):
            fn(k, v, src.int(), dst, 3)
        with pytest.raises(ValueError, match="dst must be 1-D torch.int64"):
            fn(k, v, src, dst.view(2, 3), 3)
        with pytest.raises(ValueError, match="k and v must be .* one shape, dtype"):
            fn(k, v.half(), src, dst, 3)
        with pytest.raises(ValueError, match="k and v must be .* one shape, dtype"):
            fn(k[0], v[0], src, dst, 3)
        with pytest.raises(ValueError, match="k and v must be contiguous"):
            fn(k.transpose(2, 3), v.transpose(2, 3), src, dst, 3)
    move_kv(k, v, src[:0], dst[:0], 3)  # no moves: nothing to do


def test_the_cache_moves_through_the_kernel(monkeypatch):
    """PagedKVCache.move_all with the dispatcher forced onto the kernel (the interpreter on the CPU)."""
    import medusa.kernels.kv_move as kv_move
    from medusa.config import ModelConfig
    from medusa.decoding.paged_cache import PagedKVCache

    config = ModelConfig(model_type="llama", vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    cache = PagedKVCache(config, num_blocks=8, block_size=4, dtype=torch.float32, device=torch.device(DEVICE))
    g = torch.Generator().manual_seed(10)
    cache.k, cache.v = pool(g, 2, 32, 2, 8, torch.float32)
    src, dst = moves(g, 3, 4, 32)
    want = [t.clone() for t in (cache.k, cache.v)]
    move_kv_reference(*want, src, dst)
    calls = []
    monkeypatch.setattr(kv_move, "use_triton", lambda x, *rest: calls.append(1) or True)
    cache.move_all(src, dst, 4)
    assert calls and torch.equal(cache.k, want[0]) and torch.equal(cache.v, want[1])


def test_an_engine_stepping_through_the_kernel_gives_the_reference_outputs(monkeypatch):
    """The decode step's wiring (one row of moves per batch row) under the interpreter on the CPU: the
    same tokens and acceptance as the reference gives."""
    if DEVICE != "cpu":  # tests/decoding's GPU tests run the kernel inside CUDA graphs, on the default model
        pytest.skip("the tiny model's head_dim of 8 has no GPU attention kernel")
    import medusa.kernels.kv_move as kv_move

    want, got, calls = engine_through_kernel(monkeypatch, kv_move)
    assert got == want and calls > 5
    assert max(max(lengths) for lengths in want[1]) > 1  # some step accepted drafts: some KV moved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run through the device tool)")
@pytest.mark.parametrize("layers,slots,heads,dim,rows", [(30, 8192, 3, 64, 64), (32, 8192, 8, 128, 64),
                                                         (32, 70_000, 8, 128, 8)])  # the last: offsets past 2^31
@torch.inference_mode()  # the dispatcher takes the kernel with autograd off
def test_full_size_on_the_gpu_inside_a_graph(layers, slots, heads, dim, rows, monkeypatch):
    import medusa.kernels.kv_move_triton as kv_move_triton

    launches = []
    monkeypatch.setattr(kv_move_triton, "check_moves", lambda *a: launches.append(1) or check_moves(*a))
    g = torch.Generator().manual_seed(11)
    k = (torch.randn(layers, slots, heads, dim, device="cuda", dtype=torch.bfloat16) + 3)
    v = (torch.randn(layers, slots, heads, dim, device="cuda", dtype=torch.bfloat16) + 3)
    assert (k.numel() > 2 ** 31) == (slots > 65_536)
    src, dst = moves(g, rows, 6, slots)  # slots across the pool, the scratch slot its last
    check(move_kv, k, v, src, dst, 6)
    at = torch.randperm(slots, generator=g)[:384].cuda()
    check(move_kv, k, v, at, at[torch.randperm(384, generator=g).cuda()], None)  # one row, any overlap
    assert len(launches) == 2  # the dispatcher took the kernel
    if slots > 65_536:
        return
    want = [t.clone() for t in (k, v)]
    move_kv_reference(*want, src, dst)
    move_kv(k.clone(), v.clone(), src, dst, 6)  # warm up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        move_kv(k, v, src, dst, 6)
    graph.replay()
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    assert len(launches) == 4
