"""The skinny matmul kernel (a few rows times a weight) against F.linear, and when layers take it."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.kernels import pdl  # noqa: E402
from medusa.kernels.dispatch import overlapped_launches  # noqa: E402
from medusa.kernels.skinny_matmul import (  # noqa: E402
    DOT_MAX_K, DOT_MAX_ROWS, KERNEL_MAX_ROWS, covers, skinny_matmul_reference, takes_skinny)
from medusa.kernels.skinny_matmul_triton import skinny_matmul_triton  # noqa: E402

from kernel_inputs import DEVICE, rand  # noqa: E402


def close(a, b, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), atol=tol * b.float().abs().max().item(), rtol=tol)


# (rows, K, N): K not a power of two (576, 100), N not a multiple of a program's rows; one row (CUDA cores),
# 2 to 16 rows (tensor cores: a full 16-row tile, partial ones)
@pytest.mark.parametrize("seed,rows,k,n,bias", [(0, 1, 576, 96, False), (1, 3, 100, 37, True), (2, 16, 64, 300, False),
                                                 (3, 2, 1536, 40, True), (4, 16, 576, 50, False), (5, 9, 1536, 16, True),
                                                 (6, 1, 3000, 20, True)])
def test_matches_linear(seed, rows, k, n, bias):
    g = torch.Generator().manual_seed(seed)
    x, w = rand(g, rows, k), rand(g, n, k)
    b = rand(g, n) if bias else None
    got = skinny_matmul_triton(x, w, b)
    assert got.shape == (rows, n) and close(got, skinny_matmul_reference(x, w, b), torch.float32)


# bf16 tensor-core products only on a GPU: the CPU interpreter computes bf16 tl.dot wrongly
@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (2, torch.float16)]
                         + ([(2, torch.bfloat16)] if DEVICE == "cuda" else []))
def test_half_precision_leading_dims_and_strided_rows(rows, dtype):
    g = torch.Generator().manual_seed(4)
    wide = rand(g, 1, rows, 200, dtype=dtype)
    x = wide[..., :160]  # [1, rows, 160], rows strided by 200 (a column slice, as q is of the QKV output)
    w = rand(g, 70, 160, dtype=dtype)
    got = skinny_matmul_triton(x, w)
    assert got.shape == (1, rows, 70) and got.dtype == dtype
    assert close(got, skinny_matmul_reference(x, w, None), dtype)


def test_wrapper_names_bad_inputs():
    g = torch.Generator().manual_seed(5)
    x, w = rand(g, 2, 32), rand(g, 16, 32)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_matmul_triton(x, rand(g, 32, 16).t())
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul_triton(rand(g, DOT_MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match="rows"):
        skinny_matmul_triton(rand(g, KERNEL_MAX_ROWS + 1, DOT_MAX_K + 1), rand(g, 4, DOT_MAX_K + 1))
    with pytest.raises(ValueError, match="dtype"):
        skinny_matmul_triton(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        skinny_matmul_triton(x, w, rand(g, 15))


# (rows, K, N): K a multiple of the slice (512, 1536) or not (576: the last slice masked), rows 2 to 16
@pytest.mark.parametrize("seed,rows,k,n,bias", [(0, 2, 512, 40, False), (1, 5, 576, 96, True), (2, 16, 1536, 33, False),
                                                 (3, 16, 576, 64, True)])
def test_split_k_products_match_linear(seed, rows, k, n, bias):
    """K cut into SPLIT_K_BLOCK slices, each slice's float32 product kept apart (`SplitSums`); fp16, which the
    interpreter computes right (bf16 runs on the GPU)."""
    from medusa.kernels.skinny_matmul import SPLIT_K_BLOCK
    from medusa.kernels.skinny_matmul_triton import split_k_matmul_triton

    g = torch.Generator().manual_seed(seed)
    x, w = rand(g, 1, rows, k, dtype=torch.float16) / 8, rand(g, n, k, dtype=torch.float16) / 8
    b = rand(g, n, dtype=torch.float16) if bias else None
    got = split_k_matmul_triton(x, w, b)
    assert got.parts.shape == (-(-k // SPLIT_K_BLOCK), rows, n) and got.parts.dtype == torch.float32
    assert got.shape == (1, rows, n) and got.dtype == torch.float16
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert torch.allclose(got.parts.sum(0).view(1, rows, n), want, atol=1e-3, rtol=1e-3)  # float32 sums
    assert close(got.total(), want, torch.float16) and got.total().dtype == torch.float16


def test_which_products_split_k_and_what_the_wrapper_refuses():
    from medusa.kernels.skinny_matmul import SPLIT_K_BLOCK, splits_k
    from medusa.kernels.skinny_matmul_triton import split_k_matmul_triton

    assert splits_k(2, 2 * SPLIT_K_BLOCK, torch.bfloat16) and splits_k(DOT_MAX_ROWS, 1536, torch.float16)
    assert not splits_k(1, 1536, torch.bfloat16)  # a plain step's row: the CUDA-core kernel
    assert not splits_k(DOT_MAX_ROWS + 1, 1536, torch.bfloat16)  # a batch: cuBLAS
    assert not splits_k(8, 2 * SPLIT_K_BLOCK - 1, torch.bfloat16)  # one slice would be all of K
    assert not splits_k(8, 1536, torch.float32)  # float32 (the equality tests) keeps whole-K products
    g = torch.Generator().manual_seed(9)
    x, w = rand(g, 4, 512, dtype=torch.float16), rand(g, 8, 512, dtype=torch.float16)
    with pytest.raises(ValueError, match="rows of fp16/bf16"):
        split_k_matmul_triton(x.float(), w.float())
    with pytest.raises(ValueError, match="contiguous"):
        split_k_matmul_triton(x, rand(g, 512, 8, dtype=torch.float16).t())
    with pytest.raises(ValueError, match="bias"):
        split_k_matmul_triton(x, w, rand(g, 7, dtype=torch.float16))


@torch.no_grad()  # inference: the kernels are not for training (checked below under enable_grad)
def test_which_products_take_the_kernels():
    assert covers(1, 14336, 2) and covers(16, 576, 2) and covers(9, DOT_MAX_K, 2)  # plain steps; small trees
    assert not covers(DOT_MAX_ROWS + 1, 576, 2) and not covers(2, DOT_MAX_K + 1, 2)  # batches; wide models
    assert covers(2, 1024, 4) and not covers(2, 1536, 4)  # float32 tiles are twice as large
    assert not covers(0, 576, 2) and not covers(1, 0, 2)
    g = torch.Generator().manual_seed(6)
    w = rand(g, 16, 32)
    if DEVICE == "cpu":
        assert not takes_skinny(rand(g, 1, 32), w, None)  # the CPU keeps F.linear
        return
    assert takes_skinny(rand(g, 1, 32), w, None) and not takes_skinny(rand(g, 8, 32), w, None)
    with overlapped_launches(True):  # several rows: only inside a forward whose launches overlap
        assert takes_skinny(rand(g, 8, 32), w, None)
    with overlapped_launches(False):
        assert not takes_skinny(rand(g, 8, 32), w, None)
    assert not takes_skinny(rand(g, 1, 32), w.to(torch.bfloat16), None)  # mixed dtypes
    with torch.enable_grad():
        assert not takes_skinny(rand(g, 1, 32), w, None)  # training


@pytest.mark.parametrize("shape", [(2, 256), (64, 256), (3, 5, 256)])
def test_cpu_products_of_few_rows_by_large_weights_swap_operands_and_match_linear(shape):
    """At inference on a CPU, 2-64 rows times a weight of CPU_SWAP_MIN_BYTES or more and K of CPU_SWAP_MIN_K
    or more run as weight @ x.T (faster under MKL, RESULTS.md sessions 27 and 47), leading dimensions kept,
    bias added, contiguous as F.linear's output; one row, more rows, smaller weights, a smaller K and
    training keep F.linear."""
    from medusa.kernels.skinny_matmul import CPU_SWAP_MAX_ROWS, CPU_SWAP_MIN_BYTES, CPU_SWAP_MIN_K, linear, swaps_on_cpu

    k = CPU_SWAP_MIN_K
    assert shape[-1] == k
    g = torch.Generator().manual_seed(8)
    out_rows = CPU_SWAP_MIN_BYTES // (4 * k)  # float32 rows of K: exactly the threshold
    w = torch.randn(out_rows, k, generator=g)
    b = torch.randn(out_rows, generator=g)
    x = torch.randn(*shape, generator=g)
    with torch.inference_mode():
        assert swaps_on_cpu(x, w)
        for bias in (None, b):
            got = linear(x, w, bias)
            assert got.shape == (*shape[:-1], out_rows) and got.is_contiguous()
            assert torch.allclose(got, torch.nn.functional.linear(x, w, bias), atol=1e-4, rtol=1e-5)
        assert not swaps_on_cpu(x.reshape(-1, k)[:1], w)  # one row
        assert not swaps_on_cpu(torch.randn(CPU_SWAP_MAX_ROWS + 1, k, generator=g), w)
        assert not swaps_on_cpu(x, w[:-1])  # a smaller weight
        narrow = torch.randn(2 * out_rows, k // 2, generator=g)  # as many bytes, K below CPU_SWAP_MIN_K
        assert not swaps_on_cpu(torch.randn(4, k // 2, generator=g), narrow)
    assert not swaps_on_cpu(x, w)  # training (grad enabled)


def test_no_pdl_under_the_interpreter_or_on_the_cpu():
    assert pdl.pdl_options(torch.zeros(1), 1) == {"PDL": False}


def test_a_model_step_sets_overlapped_launches_for_its_kernels_and_restores_them():
    from medusa.kernels.dispatch import overlapped_launches, step_overlap

    assert step_overlap() is None  # outside a model's forward: kernels decide by their own row count
    with overlapped_launches(True):
        with overlapped_launches(False):  # a nested forward (say, a prompt forward inside a step)
            assert step_overlap() is False
        assert step_overlap() is True
        with pytest.raises(RuntimeError), overlapped_launches(False):
            raise RuntimeError("a failing forward")
        assert step_overlap() is True  # restored after an error too
    assert step_overlap() is None


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (2048, 16384), (8192, 2048), (14336, 4096), (576, 49152)])
def test_full_size_shapes_match_linear(k, n):
    g = torch.Generator().manual_seed(7)
    w = rand(g, n, k, dtype=torch.bfloat16)
    for rows in (1, 2, 4, 8) + ((9, 16) if k <= DOT_MAX_K else ()):
        x = rand(g, rows, k, dtype=torch.bfloat16)
        assert close(skinny_matmul_triton(x, w), skinny_matmul_reference(x, w, None), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_a_pdl_chain_replayed_in_a_cuda_graph_matches_eager_references(rows):
    """norm -> matmul -> SiLU-and-mul -> matmul, 8 times over, every kernel launched with PDL inside
    one captured graph (a plain step's one row, a tree's 16): each kernel must still see its
    predecessor's finished output."""
    from medusa.kernels.dispatch import overlapped_launches
    from medusa.kernels.fused_ops import rms_norm_reference, silu_and_mul_reference
    from medusa.kernels.fused_ops_triton import rms_norm_triton, silu_and_mul_triton

    assert pdl.pdl_enabled(torch.zeros(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    g = torch.Generator().manual_seed(8)
    layers = [(rand(g, 576), rand(g, 3072, 576) / 24, rand(g, 576, 1536) / 40) for _ in range(8)]
    x = rand(g, rows, 576)
    if rows > 1:  # float32 tiles of K = 1536 would not fit the tensor-core kernel
        layers = [tuple(t.to(torch.bfloat16) for t in layer) for layer in layers]
        x = x.to(torch.bfloat16)

    def chain(norm, matmul, silu):
        h = x
        for scale, up, down in layers:
            h = h + matmul(silu(matmul(norm(h, scale), up)), down)
        return h

    want = chain(lambda h, s: rms_norm_reference(h, s, 1e-5), lambda a, w: skinny_matmul_reference(a, w, None),
                 silu_and_mul_reference)

    def fast():
        return chain(lambda h, s: rms_norm_triton(h, s, 1e-5)[0], skinny_matmul_triton, silu_and_mul_triton)

    with overlapped_launches(False):
        eager = fast()  # the same kernels launched one after another, without PDL
    assert close(eager, want, x.dtype)
    with overlapped_launches(True):
        fast()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast()
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("tokens,overlapped", [(1, True), (12, True), (DOT_MAX_ROWS + 1, False)])
def test_a_forward_launches_with_pdl_only_where_every_matmul_is_skinny(monkeypatch, tokens, overlapped):
    """The model decides for its whole forward: a plain step, a small tree on a narrow model (every matmul a
    skinny one) overlap their launches; a larger step, whose matmuls are cuBLAS's, does not."""
    import medusa.model
    from medusa.attention import CausalAttention
    from tiny_models import tiny_decoder

    model, _ = tiny_decoder()
    seen = []
    real = medusa.model.overlapped_launches

    def record(enabled):
        seen.append(enabled)
        return real(enabled)

    monkeypatch.setattr(medusa.model, "overlapped_launches", record)
    with torch.no_grad():
        model(torch.zeros(tokens, dtype=torch.long), torch.arange(tokens), CausalAttention())
    assert seen == [overlapped]


def test_a_tree_steps_forward_cuts_its_projections_into_k_slices(monkeypatch):
    """A forward of a few rows through the Triton kernels (on a CPU the interpreter; `use_triton` forced on): o_proj and
    down_proj leave their products as `SplitSums`, which the next norms add up; qkv_proj keeps whole K for a
    backend without the fused RoPE kernel (`CausalAttention`). The hidden states match the forward whose
    products keep whole K, and the PyTorch one."""
    import medusa.kernels.skinny_matmul as skinny
    import medusa.kernels.skinny_matmul_triton as skinny_triton
    import medusa.layers
    import medusa.rope
    from medusa.attention import CausalAttention
    from medusa.config import ModelConfig
    from medusa.model import DecoderModel

    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=512, intermediate_size=512, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=64)  # every K 512: 2 slices
    model = DecoderModel(config).eval().half().to(DEVICE)
    ids, positions = torch.randint(0, 64, (6,), device=DEVICE), torch.arange(6, device=DEVICE)

    def forward(kernels: bool):
        for module in (skinny, medusa.layers, medusa.rope):
            monkeypatch.setattr(module, "use_triton", lambda x, *rest: kernels)
        with torch.no_grad():
            return model(ids, positions, CausalAttention()).float()

    reference = forward(False)
    calls = []
    real = skinny_triton.split_k_matmul_triton
    monkeypatch.setattr(skinny_triton, "split_k_matmul_triton", lambda *a: calls.append(a) or real(*a))
    split = forward(True)
    assert [w.shape for _, w, _ in calls] == [(512, 512), (512, 512)] * config.num_layers  # o and down
    monkeypatch.setattr(skinny, "SPLIT_K_ENABLED", False)
    whole = forward(True)
    assert len(calls) == 2 * config.num_layers
    assert torch.allclose(split, whole, atol=2e-2, rtol=2e-2) and torch.allclose(split, reference, atol=2e-2, rtol=2e-2)


def test_over_the_paged_cache_every_projection_of_a_tree_step_is_cut_into_k_slices(monkeypatch):
    """A narrow model (every K 512: two slices) over the paged KV cache, kernels forced on (the interpreter on a
    CPU): qkv_proj's
    `SplitSums` go to the RoPE-and-KV-write kernel, o_proj's and down_proj's to the norms (gate_up_proj keeps
    whole K). The hidden states and the cached k/v match whole-K products' and PyTorch's."""
    import medusa.decoding.paged_cache as paged_cache
    import medusa.kernels.paged_attention_triton as attention_triton
    import medusa.kernels.skinny_matmul as skinny
    import medusa.kernels.skinny_matmul_triton as skinny_triton
    import medusa.layers
    import medusa.rope
    from medusa.config import ModelConfig
    from medusa.model import DecoderModel

    torch.manual_seed(1)
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=512, intermediate_size=512, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=64)
    model = DecoderModel(config).eval().half().to(DEVICE)
    tokens = 5
    ids, positions = torch.randint(0, 64, (tokens,), device=DEVICE), torch.arange(3, 3 + tokens, device=DEVICE)
    on = dict(device=DEVICE)
    step = paged_cache.StepMetadata(  # one sequence: 3 cached keys, then the step's 5 tokens, causal
        slot_mapping=torch.arange(3, 3 + tokens, **on), block_tables=torch.zeros(1, 1, dtype=torch.int32, **on),
        kv_lens=torch.tensor([3 + tokens], **on), query_start=torch.tensor([0, tokens], **on),
        causal=torch.ones(1, dtype=torch.int32, **on), step_bits=torch.zeros(tokens, dtype=torch.int64, **on),
        max_query_len=tokens)
    prefix = torch.randn(config.num_layers, 3, config.num_kv_heads, config.head_dim).half().to(DEVICE)

    def forward(kernels: bool):
        for module in (skinny, medusa.layers, medusa.rope, paged_cache):
            monkeypatch.setattr(module, "use_triton", lambda x, *rest: kernels)
        cache = paged_cache.PagedKVCache(config, num_blocks=1, block_size=16, dtype=torch.float16,
                                         device=torch.device(DEVICE))
        cache.use_triton = kernels
        cache.k[:, :3], cache.v[:, :3] = prefix, -prefix  # three cached keys before the step's
        with torch.no_grad():
            hidden = cache.forward(model, ids, positions, step).float()
        return hidden, cache.k[:, :3 + tokens].float(), cache.v[:, :3 + tokens].float()

    reference = forward(False)
    sliced, rotated = [], []
    real_split, real_rope = skinny_triton.split_k_matmul_triton, attention_triton.rope_write_kv_triton
    monkeypatch.setattr(skinny_triton, "split_k_matmul_triton", lambda *a: sliced.append(a[1].shape) or real_split(*a))
    monkeypatch.setattr(attention_triton, "rope_write_kv_triton",
                        lambda *a: rotated.append(type(a[1]).__name__) or real_rope(*a))
    split = forward(True)
    qkv = (3 * 512 // 2, 512)  # [N, K] of the fused weight
    assert sliced == [qkv, (512, 512), (512, 512)] * config.num_layers
    assert rotated == ["SplitSums"] * config.num_layers
    monkeypatch.setattr(skinny, "SPLIT_K_ENABLED", False)
    whole = forward(True)
    assert rotated == ["SplitSums"] * config.num_layers + ["Tensor"] * config.num_layers
    for a, b, c in zip(split, whole, reference):
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2) and torch.allclose(a, c, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_split_sums_feed_the_next_norm_in_a_pdl_chain_replayed_in_a_cuda_graph():
    """The 135M's MLP shapes, bf16, 16 rows: norm -> gate/up -> SiLU -> down cut into K slices -> the next
    norm adds them up, 4 times over, with PDL in one captured graph; against whole-K products eagerly."""
    from medusa.kernels.dispatch import overlapped_launches
    from medusa.kernels.fused_ops_triton import rms_norm_triton, silu_and_mul_triton
    from medusa.kernels.skinny_matmul_triton import split_k_matmul_triton

    g = torch.Generator().manual_seed(10)
    bf16 = dict(dtype=torch.bfloat16)
    layers = [(rand(g, 576, **bf16), rand(g, 3072, 576, **bf16) / 24, rand(g, 576, 1536, **bf16) / 40)
              for _ in range(4)]
    x, residual = rand(g, 16, 576, **bf16), rand(g, 16, 576, **bf16)
    for k, n in ((576, 576), (1536, 576), (576, 960)):  # o_proj, down_proj, and a wider N
        a, w = rand(g, 16, k, **bf16), rand(g, n, k, **bf16) / 20
        for rows in (2, 9, 16):
            assert close(split_k_matmul_triton(a[:rows], w).total(), skinny_matmul_reference(a[:rows], w, None),
                         torch.bfloat16)

    def chain(down_matmul):
        h, res = x, residual
        for scale, up, down in layers:
            normed, res = rms_norm_triton(h, scale, 1e-5, res)
            h = down_matmul(silu_and_mul_triton(skinny_matmul_triton(normed, up)), down)
        return rms_norm_triton(h, layers[0][0], 1e-5, res)[0]

    with overlapped_launches(False):
        whole = chain(skinny_matmul_triton)
        eager = chain(split_k_matmul_triton)
    assert close(eager, whole, torch.bfloat16)
    with overlapped_launches(True):
        chain(split_k_matmul_triton)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(split_k_matmul_triton)
    for _ in range(20):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_norms_without_the_kernels_add_up_split_sums_first():
    """A norm on the PyTorch path (a CPU; mixed dtypes) given `SplitSums` sums them, as `total()` does."""
    from medusa.kernels.skinny_matmul import SplitSums
    from medusa.layers import RMSNorm

    g = torch.Generator().manual_seed(11)
    parts, residual = torch.randn(3, 4, 32, generator=g), torch.randn(4, 32, generator=g)
    x = SplitSums(parts, torch.Size((4, 32)), torch.float32)
    norm = RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        got, total = norm.add_and_norm(x, residual)
        want, want_total = norm.add_and_norm(x.total(), residual)
        assert torch.equal(got, want) and torch.equal(total, want_total)
        assert torch.equal(norm(x), norm(x.total()))
