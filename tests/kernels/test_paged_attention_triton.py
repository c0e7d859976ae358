"""The Triton paged tree-attention kernel against the PyTorch reference (interpreter on CPU, full size on GPU)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from medusa.kernels.paged_attention import paged_attention_reference  # noqa: E402
from medusa.kernels.paged_attention_triton import bulk_copies_fit, paged_attention_triton  # noqa: E402
from medusa.tree import TreeSpec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_batch(seed, kinds, prefix_max, hq, hkv, d, page, dtype, num_blocks=256, prefixes=None):
    """Sequences of each kind ('tree-N', 'chain-3', or an int prompt-chunk length) on scattered pages.

    Cached-prefix lengths are random in [0, prefix_max], or exactly `prefixes` (one per kind) when given.
    """
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, bits, causal, kv_lens, q_lens = [], [], [], [], []
    for i, kind in enumerate(kinds):
        prefix = prefixes[i] if prefixes else int(torch.randint(0, prefix_max + 1, (1,), generator=g))
        tree = TreeSpec.load(kind) if isinstance(kind, str) else None
        q_len = tree.num_nodes if tree else kind
        tables.append([free.pop() for _ in range(-(-(prefix + q_len) // page))])
        bits.append(tree.ancestor_bits if tree else torch.zeros(q_len, dtype=torch.long))
        causal.append(tree is None)
        kv_lens.append(prefix + q_len)
        q_lens.append(q_len)
    width = max(len(t) for t in tables)
    make = lambda *shape: (torch.rand(*shape, generator=g) + 0.1).to(dtype)  # noqa: E731  no zeros
    batch = dict(
        q=make(sum(q_lens), hq, d) - 0.5, k_cache=make(num_blocks * page, hkv, d) - 0.5,
        v_cache=make(num_blocks * page, hkv, d),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens), query_start=torch.tensor([0] + q_lens).cumsum(0),
        causal=torch.tensor(causal), step_bits=torch.cat(bits))
    return {k: v.to(DEVICE) for k, v in batch.items()}, max(q_lens)


CASES = [  # (kinds, prefix_max, hq, hkv, d, page, dtype)
    (["tree-8", 5, "chain-3", "tree-16"], 40, 4, 2, 64, 16, torch.float32),
    (["tree-64", 1], 20, 2, 1, 64, 16, torch.float32),
    ([17, "tree-4"], 50, 8, 2, 128, 16, torch.float32),
    (["single", "tree-32"], 33, 4, 4, 64, 32, torch.float32),
]


@pytest.mark.parametrize("seed,case", [(s, c) for s, c in enumerate(CASES)])
def test_kernel_matches_reference(seed, case):
    kinds, prefix_max, hq, hkv, d, page, dtype = case
    batch, max_q = random_batch(seed, kinds, prefix_max, hq, hkv, d, page, dtype)
    expected = paged_attention_reference(**batch, block_size=page)
    poisoned = torch.full_like(batch["q"], float("nan"))  # every row must be written
    got = paged_attention_triton(**batch, block_size=page, max_query_len=max_q, out=poisoned)
    assert not got.isnan().any()
    assert torch.allclose(got.float(), expected.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("case", [0, 2])
def test_split_kv_matches_reference(case, num_splits):
    """Keys spread over several programs and merged; causal rows see nothing in some splits."""
    kinds, prefix_max, hq, hkv, d, page, dtype = CASES[case]
    batch, max_q = random_batch(10 + case, kinds, prefix_max * 3, hq, hkv, d, page, dtype)
    expected = paged_attention_reference(**batch, block_size=page)
    poisoned = torch.full_like(batch["q"], float("nan"))
    got = paged_attention_triton(**batch, block_size=page, max_query_len=max_q, out=poisoned, num_splits=num_splits)
    assert not got.isnan().any()
    assert torch.allclose(got.float(), expected.float(), atol=2e-3, rtol=2e-3)


# Exact cached-prefix lengths around the kernel's BLOCK_N = 64 key chunks. The kernel walks the
# prefix (no mask) and then the step's own keys (causal / tree mask) in two loops per split, so
# these put split boundaries inside the step tokens, prefixes off and on chunk multiples, empty
# prefixes and splits, and prefixes longer than two chunks.
PHASE_LAYOUTS = {  # name: (kinds, prefixes, hq, hkv)
    # tree-64 at 100: kv 164, a split boundary at 128 (2 or 8 splits) among the tree tokens;
    # tree-16 at 0: no cached keys; chain-3 at 191: three whole chunks and a 63-key tail;
    # tree-64 at 300: kv 364, split boundaries at 192/256 in the prefix and at 320 in the tree.
    # Group 2: the 128 rows of a tree-64 are two row tiles.
    "tree": (["tree-64", "tree-16", "chain-3", "tree-64"], [100, 0, 191, 300], 4, 2),
    # chunks of 70 at 0 (more than 64 step tokens, a split boundary at 64 among them) and at
    # 200 (boundary at 256 with 8 splits); a one-token decode at 130; 33 tokens at 256, a
    # multiple of the chunk. Group 3: row tiles of 64 rows end in the middle of a token.
    "causal": ([70, 70, 1, 33], [0, 200, 130, 256], 6, 2),
}


# page 128: a page holds two chunks; fp16 rather than bf16, which the CPU interpreter computes wrongly
@pytest.mark.parametrize("page,dtype", [(16, torch.float32), (128, torch.float16)])
@pytest.mark.parametrize("num_splits", [1, 2, 8])
@pytest.mark.parametrize("layout", sorted(PHASE_LAYOUTS))
def test_prefix_and_step_phases_match_reference(layout, num_splits, page, dtype):
    kinds, prefixes, hq, hkv = PHASE_LAYOUTS[layout]
    batch, max_q = random_batch(20 + num_splits, kinds, 0, hq, hkv, 32, page, dtype,
                                num_blocks=4096 // page, prefixes=prefixes)
    expected = paged_attention_reference(**{**batch, "q": batch["q"].float(), "k_cache": batch["k_cache"].float(),
                                            "v_cache": batch["v_cache"].float()}, block_size=page)
    poisoned = torch.full_like(batch["q"], float("nan"))
    got = paged_attention_triton(**batch, block_size=page, max_query_len=max_q, out=poisoned, num_splits=num_splits)
    assert not got.isnan().any()
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), expected, atol=tol, rtol=tol)


# pages of 64 keys hold one chunk, of 128 two (the chunk's offset in its page is not 0)
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("layout", sorted(PHASE_LAYOUTS))
def test_prefix_walk_by_bulk_copies_matches_reference(layout, num_splits, page):
    """The prefix walk's TMA path (descriptor loads of whole chunks) forced on, heads of 64."""
    kinds, prefixes, hq, hkv = PHASE_LAYOUTS[layout]
    batch, max_q = random_batch(30 + num_splits, kinds, 0, hq, hkv, 64, page, torch.float16,
                                num_blocks=4096 // page, prefixes=prefixes)
    expected = paged_attention_reference(**{**batch, "q": batch["q"].float(), "k_cache": batch["k_cache"].float(),
                                            "v_cache": batch["v_cache"].float()}, block_size=page)
    poisoned = torch.full_like(batch["q"], float("nan"))
    got = paged_attention_triton(**batch, block_size=page, max_query_len=max_q, out=poisoned, num_splits=num_splits,
                                 launch=dict(tma=True))
    assert not got.isnan().any()
    assert torch.allclose(got.float(), expected, atol=1e-2, rtol=1e-2)


def test_bulk_copies_need_whole_chunk_pages_on_a_gpu_with_tma():
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(256, 2, 128, dtype=torch.bfloat16)
    assert not bulk_copies_fit(q, cache, cache, 64)  # a CPU tensor: no TMA
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        q, cache = q.cuda(), cache.cuda()
        assert bulk_copies_fit(q, cache, cache, 64) and bulk_copies_fit(q, cache, cache, 128)
        assert not bulk_copies_fit(q, cache, cache, 16)  # a chunk would span four pages
        assert not bulk_copies_fit(q.float(), cache.float(), cache.float(), 64)
        assert not bulk_copies_fit(q, cache, cache[:, :1], 64)  # v not contiguous
        misaligned = cache.view(-1)[4:4 + cache.numel() // 2].view(128, 2, 128)  # 8 bytes past an aligned start
        assert not bulk_copies_fit(q, misaligned, cache[:128], 64)


@pytest.mark.parametrize("block_m", [16, 64])
def test_split_count_fills_the_gpu_without_overshooting(block_m):
    """The most splits (a power of two) that keep programs within the target and two key chunks
    per split; no more, since splits past a sequence's keys still cost a program and merge reads."""
    from medusa.kernels.paged_attention_triton import _pick_splits

    target = 8 * (2 if block_m <= 16 else 1)  # the CPU stands in for a GPU of 8 SMs
    q = torch.zeros(1)
    for programs in (1, 3, 8, 9, 16, 40):
        for max_keys in (64, 256, 1000, 8192):
            splits = _pick_splits(programs, max_keys, 64, block_m, q)
            most = max(1, min(64, max_keys // 128))
            assert splits & (splits - 1) == 0 and splits <= most
            assert splits == 1 or programs * splits <= target
            assert splits * 2 > most or programs * splits * 2 > target  # doubling would break a bound


def test_a_key_bound_sets_the_split_count_but_never_drops_keys():
    """max_kv_len caps the splits at one per 64-key chunk of the bound; a sequence past the bound
    (the host's bound is a hint for the split count) is still attended over all of its keys."""
    from medusa.kernels.paged_attention_triton import _pick_splits

    q = torch.zeros(1)
    unbounded = _pick_splits(1, 8192, 64, 16, q)  # 16 with the CPU's 8 stand-in SMs (two waves of 16-row tiles)
    assert unbounded >= 4
    assert _pick_splits(1, 8192, 64, 16, q, max_kv_len=100) == 2
    assert _pick_splits(1, 8192, 64, 16, q, max_kv_len=1) == 1
    assert _pick_splits(1, 512, 64, 16, q, max_kv_len=4096) == 4  # the tables' width still bounds it
    # 64-row tiles of heads of 128 whose programs fill a fifth of the GPU: a bound leaves each split eight
    # key chunks (its partials cost more than the parallelism gains)
    wide = torch.zeros(1, 1, 128)
    assert _pick_splits(2, 8192, 64, 64, wide) == 4  # 8 programs: one wave of the CPU's 8 stand-in SMs
    assert [_pick_splits(2, 8192, 64, 64, wide, max_kv_len=n) for n in (64, 576, 1024, 4096)] == [1, 2, 2, 4]
    assert _pick_splits(2, 8192, 64, 64, torch.zeros(1, 1, 64), max_kv_len=576) == 4  # heads of 64: one chunk
    assert _pick_splits(1, 8192, 64, 64, wide, max_kv_len=576) == 8  # 1 program of 8 SMs: splitting pays
    kinds, prefix_max, hq, hkv, d, page, dtype = CASES[0]
    batch, max_q = random_batch(50, kinds, 300, hq, hkv, d, page, dtype)
    assert batch["kv_lens"].max() > 64
    expected = paged_attention_reference(**batch, block_size=page)
    poisoned = torch.full_like(batch["q"], float("nan"))
    got = paged_attention_triton(**batch, block_size=page, max_query_len=max_q, out=poisoned, max_kv_len=64)
    assert torch.allclose(got.float(), expected.float(), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="max_kv_len"):
        paged_attention_triton(**batch, block_size=page, max_query_len=max_q, max_kv_len=0)


@pytest.mark.parametrize("block_m,block_n", [(128, 64), (16, 32)])
def test_tile_sizes_match_reference(block_m, block_n):
    """The row-tile and key-chunk sizes a launch may override (benchmarks/kernel_bench.py --launch-sweep)."""
    kinds, prefixes, hq, hkv = PHASE_LAYOUTS["tree"]
    batch, max_q = random_batch(40 + block_m, kinds, 0, hq, hkv, 32, 16, torch.float32,
                                num_blocks=256, prefixes=prefixes)
    expected = paged_attention_reference(**batch, block_size=16)
    for num_splits in (1, 4):
        poisoned = torch.full_like(batch["q"], float("nan"))
        got = paged_attention_triton(**batch, block_size=16, max_query_len=max_q, out=poisoned, num_splits=num_splits,
                                     launch=dict(block_m=block_m, block_n=block_n))
        assert torch.allclose(got.float(), expected.float(), atol=2e-3, rtol=2e-3), num_splits


def test_pipeline_depth_keeps_two_chunks_in_flight_where_few_splits_walk_long():
    """One or two splits (the batch fills the GPU: each program walks half the keys or more) keep two
    K/V chunks in flight (3 stages), more splits one (2); fp32 or D=256 chunks fewer, as shared memory
    allows (H200, session 27)."""
    from medusa.kernels.paged_attention_triton import _launch_config

    assert [_launch_config(64, 64, 64, 2, splits)["num_stages"] for splits in (1, 2, 4, 16)] == [3, 3, 2, 2]
    assert [_launch_config(16, 64, 128, 2, splits)["num_stages"] for splits in (1, 2, 4, 16)] == [3, 3, 2, 2]
    # 64-row tiles of heads of 128 keep two chunks in flight up to 4 splits (session 30)
    assert [_launch_config(64, 64, 128, 2, splits)["num_stages"] for splits in (1, 2, 4, 8, 16)] == [3, 3, 3, 2, 2]
    assert _launch_config(16, 64, 64, 2, 1)["num_stages"] == 3
    assert _launch_config(64, 64, 128, 4, 1)["num_stages"] == 2  # fp32: 64 KiB a stage
    assert _launch_config(64, 64, 256, 4, 1)["num_stages"] == 1  # fp32 D=256: 128 KiB a stage


def test_wrapper_names_bad_inputs():
    batch, max_q = random_batch(0, ["tree-4"], 8, 2, 1, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_triton(**{**batch, "q": batch["q"][..., :48].contiguous(),
                                  "k_cache": batch["k_cache"][..., :48].contiguous(),
                                  "v_cache": batch["v_cache"][..., :48].contiguous()}, block_size=16, max_query_len=max_q)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_triton(**{**batch, "block_tables": batch["block_tables"].long()}, block_size=16,
                               max_query_len=max_q)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention_triton(**batch, block_size=12, max_query_len=max_q)
    with pytest.raises(ValueError, match="unknown attention launch options"):
        paged_attention_triton(**batch, block_size=16, max_query_len=max_q, launch=dict(num_stage=3))
    with pytest.raises(ValueError, match="scale must be > 0"):
        paged_attention_triton(**batch, block_size=16, max_query_len=max_q, scale=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])  # 64: the prefix walk by TMA on Hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference_full_size(dtype, page):
    kinds = ["tree-64"] * 24 + [512] * 4 + ["tree-16"] * 4
    batch, max_q = random_batch(7, kinds, 2048, 32, 8, 128, page, dtype, num_blocks=8192 * 16 // page)
    expected = paged_attention_reference(**batch, block_size=page)
    for splits in (None, 1, 16):
        got = paged_attention_triton(**batch, block_size=page, max_query_len=max_q, num_splits=splits)
        assert torch.allclose(got.float(), expected.float(), atol=2e-2, rtol=2e-2), splits


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_split_kv_replays_in_a_cuda_graph(page):
    """Split KV inside a CUDA graph: the partials and their merge (and at 64-key pages the TMA
    descriptors, kernel parameters fixed at capture) replay correctly, again and again."""
    batch, max_q = random_batch(9, ["single"] * 3 + ["tree-64"], 3000, 32, 8, 128, page, torch.bfloat16,
                                num_blocks=1024 * 16 // page)
    expected = paged_attention_reference(**batch, block_size=page)
    out = torch.empty_like(batch["q"])
    run = lambda: paged_attention_triton(**batch, block_size=page, max_query_len=max_q, out=out, num_splits=16)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(50):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_write_and_move_kernels_match_reference():
    from medusa.kernels.paged_attention import move_kv_reference, write_kv_reference
    from medusa.kernels.paged_attention_triton import move_kv_triton, write_kv_triton

    g = torch.Generator().manual_seed(3)
    caches = [torch.rand(64, 2, 16, generator=g).to(DEVICE) + 0.1 for _ in range(2)]
    ref = [c.clone() for c in caches]
    k, v = (torch.rand(6, 2, 16, generator=g).to(DEVICE) + 0.1 for _ in range(2))
    slots = torch.tensor([3, -1, 40, 41, 7, 63], device=DEVICE)
    write_kv_triton(*caches, k, v, slots)
    write_kv_reference(*ref, k, v, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    # compaction of accepted nodes 0, 2, 5 of a tree at 40..45, plus another sequence's 10 -> 9
    src = torch.tensor([9 + 1, 40, 42, 45], device=DEVICE)
    dst = torch.tensor([9, 40, 41, 42], device=DEVICE)
    move_kv_triton(*caches, src, dst)
    move_kv_reference(*ref, src, dst)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


def test_int32_causal_flags_match_bool_ones():
    """The engine passes causal as int32 (no cast per layer); the result must not depend on it."""
    batch, max_q = random_batch(11, [9, "tree-8"], 30, 4, 2, 64, 16, torch.float32)
    as_bool = paged_attention_triton(**batch, block_size=16, max_query_len=max_q)
    as_int = paged_attention_triton(**(batch | {"causal": batch["causal"].to(torch.int32)}), block_size=16,
                                    max_query_len=max_q)
    assert torch.equal(as_bool, as_int)
    reference = paged_attention_reference(**(batch | {"causal": batch["causal"].to(torch.int32)}), block_size=16)
    assert torch.allclose(as_int, reference, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="causal must be bool or int32"):
        paged_attention_triton(**(batch | {"causal": batch["causal"].float()}), block_size=16, max_query_len=max_q)
