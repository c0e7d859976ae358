"""Fused RMSNorm / SiLU-and-mul / RoPE / strided KV-write kernels against their PyTorch references."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.config import RopeConfig  # noqa: E402
from medusa.kernels.fused_ops import (  # noqa: E402
    add_rms_norm_reference, rms_norm_reference, rotary_reference, silu_and_mul_reference)
from medusa.kernels.fused_ops_triton import rms_norm_triton, rotary_triton, silu_and_mul_triton  # noqa: E402
from medusa.kernels.paged_attention import rope_write_kv_reference, write_kv_reference  # noqa: E402
from medusa.kernels.paged_attention_triton import rope_write_kv_triton, write_kv_triton  # noqa: E402
from medusa.rope import RotaryEmbedding  # noqa: E402

from kernel_inputs import DEVICE, rand  # noqa: E402


def close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("seed,rows,size", [(0, 5, 64), (1, 3, 100), (2, 1, 576)])
def test_rms_norm_with_and_without_residual(seed, rows, size):
    g = torch.Generator().manual_seed(seed)
    x, r, w = rand(g, rows, size), rand(g, rows, size), rand(g, size)
    got, none = rms_norm_triton(x, w, 1e-5)
    assert none is None and close(got, rms_norm_reference(x, w, 1e-5), torch.float32)
    got, total = rms_norm_triton(x, w, 1e-5, residual=r)
    want, want_total = add_rms_norm_reference(x, r, w, 1e-5)
    assert close(got, want, torch.float32) and torch.equal(total, want_total)


@pytest.mark.parametrize("splits,dtype", [(3, torch.float16), (6, torch.float16), (2, torch.float32)])
def test_rms_norm_adds_up_a_products_split_sums_as_it_loads_them(splits, dtype):
    """x given as float32 partial sums over K slices (`SplitSums`, o_proj's and down_proj's output in a tree
    step): summed, rounded once to x's dtype, then the residual add and the norm as for a plain x."""
    from medusa.kernels.skinny_matmul import SplitSums

    g = torch.Generator().manual_seed(20 + splits)
    parts, r, w = rand(g, splits, 5, 96) / splits, rand(g, 1, 5, 96, dtype=dtype), rand(g, 96, dtype=dtype)
    x = SplitSums(parts, torch.Size((1, 5, 96)), dtype)
    assert torch.equal(x.total(), parts.sum(0).to(dtype).view(1, 5, 96))
    got, total = rms_norm_triton(x, w, 1e-5, residual=r)
    want, want_total = add_rms_norm_reference(x.total(), r, w, 1e-5)
    assert got.shape == (1, 5, 96) and got.dtype == dtype
    assert close(total, want_total, dtype) and close(got, want, dtype)
    got, none = rms_norm_triton(x, w, 1e-5)
    assert none is None and close(got, rms_norm_reference(x.total(), w, 1e-5), dtype)
    with pytest.raises(ValueError, match="SplitSums parts must be contiguous float32"):
        rms_norm_triton(SplitSums(parts.half(), x.shape, dtype), w, 1e-5, residual=r)


def test_rms_norm_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(3)
    wide = rand(g, 2, 3, 96)
    x = wide[..., :64]  # rows strided by 96
    w = rand(g, 64)
    got, _ = rms_norm_triton(x, w, 1e-6)
    assert got.shape == (2, 3, 64) and close(got, rms_norm_reference(x, w, 1e-6), torch.float32)


@pytest.mark.parametrize("seed,rows,inter", [(0, 4, 96), (1, 1, 1536), (2, 7, 40)])
def test_silu_and_mul(seed, rows, inter):
    g = torch.Generator().manual_seed(seed)
    x = rand(g, rows, 2 * inter)
    assert close(silu_and_mul_triton(x), silu_and_mul_reference(x), torch.float32)


@pytest.mark.parametrize("splits,dtype", [(2, torch.float16), (3, torch.float32)])
def test_rope_and_kv_write_add_up_a_qkv_products_split_sums(splits, dtype):
    """qkv_proj's output left as `SplitSums` and cut into q, k, v views (as the attention layer cuts the
    product): the kernel sums each as it loads it, and rotates and stores what the summed product gives."""
    from medusa.kernels.skinny_matmul import SplitSums

    g = torch.Generator().manual_seed(40 + splits)
    tokens, hq, hkv, d = 6, 4, 2, 64
    rope = RotaryEmbedding(d, 512, RopeConfig(theta=10000.0)).to(DEVICE)
    qkv = SplitSums(rand(g, splits, tokens, (hq + 2 * hkv) * d) / splits, torch.Size((tokens, (hq + 2 * hkv) * d)),
                    dtype)
    views = [t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1)]
    assert all(torch.equal(a.total(), b) for a, b in
               zip(views, (t.view(tokens, -1, d) for t in qkv.total().split([hq * d, hkv * d, hkv * d], dim=-1))))
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEVICE)
    slots = torch.tensor([9, -1, 0, 17, 3, 30], device=DEVICE)
    got = [torch.full((32, hkv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    want = [t.clone() for t in got]
    got_q = rope_write_kv_triton(positions, *views, rope.cos, rope.sin, *got, slots)
    want_q = rope_write_kv_reference(positions, *(t.total() for t in views), rope.cos, rope.sin, *want, slots)
    assert got_q.dtype == dtype and close(got_q, want_q, dtype)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and close(a.nan_to_num(9.0), b.nan_to_num(9.0), dtype)
    with pytest.raises(ValueError, match="all tensors or all views of one product's SplitSums"):
        rope_write_kv_triton(positions, views[0].total(), *views[1:], rope.cos, rope.sin, *got, slots)
    with pytest.raises(ValueError, match="sizes summing to the last dim"):
        qkv.split([hq * d, hkv * d])


@pytest.mark.parametrize("seed,hq,hkv,d", [(0, 4, 2, 64), (1, 9, 3, 64), (2, 8, 8, 128)])
def test_rotary_on_qkv_slices(seed, hq, hkv, d):
    g = torch.Generator().manual_seed(seed)
    tokens = 6
    rope = RotaryEmbedding(d, 512, RopeConfig(theta=10000.0)).to(DEVICE)
    qkv = rand(g, tokens, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(tokens, hq, d)  # strided views, as the attention layer passes them
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEVICE)
    got_q, got_k = rotary_triton(positions, q, k, rope.cos, rope.sin)
    want_q, want_k = rotary_reference(positions, q, k, rope.cos, rope.sin)
    assert close(got_q, want_q, torch.float32) and close(got_k, want_k, torch.float32)


def test_write_kv_from_strided_slices():
    g = torch.Generator().manual_seed(5)
    tokens, hkv, d = 5, 2, 64
    kv = rand(g, tokens, 3 * hkv * d)
    k, v = kv[:, hkv * d:2 * hkv * d].view(tokens, hkv, d), kv[:, 2 * hkv * d:].view(tokens, hkv, d)
    slots = torch.tensor([7, -1, 0, 12, 3], device=DEVICE)
    got = [torch.full((16, hkv, d), float("nan"), device=DEVICE) for _ in range(2)]
    want = [t.clone() for t in got]
    write_kv_triton(*got, k, v, slots)
    write_kv_reference(*want, k, v, slots)
    assert all(torch.equal(a.nan_to_num(9.0), b.nan_to_num(9.0)) for a, b in zip(got, want))


@pytest.mark.parametrize("seed,hq,hkv,d,dtype", [(0, 4, 2, 64, torch.float32), (1, 9, 3, 64, torch.float32),
                                                  (2, 8, 8, 128, torch.float32), (3, 6, 2, 32, torch.float16)])
def test_rope_and_kv_write_in_one_kernel(seed, hq, hkv, d, dtype):
    """q comes back rotated; rotated k and v land in their slots; padding slots and the rest stay poisoned."""
    g = torch.Generator().manual_seed(seed)
    tokens = 7
    rope = RotaryEmbedding(d, 512, RopeConfig(theta=10000.0)).to(DEVICE)
    qkv = rand(g, tokens, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1))  # strided views
    positions = torch.randint(0, 512, (tokens,), generator=g).to(DEVICE)
    slots = torch.tensor([9, -1, 0, 17, 3, -1, 30], device=DEVICE)
    got = [torch.full((32, hkv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    want = [t.clone() for t in got]
    got_q = rope_write_kv_triton(positions, q, k, v, rope.cos, rope.sin, *got, slots)
    want_q = rope_write_kv_reference(positions, q, k, v, rope.cos, rope.sin, *want, slots)
    assert close(got_q, want_q, dtype)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and close(a.nan_to_num(9.0), b.nan_to_num(9.0), dtype)


def test_wrappers_name_bad_inputs():
    x = torch.ones(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(4, device=DEVICE), 1e-5)
    q3, cache = torch.ones(2, 4, 64, device=DEVICE), torch.zeros(8, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rope_write_kv: q .* k/v .* matching the cache rows"):
        rope_write_kv_triton(torch.zeros(2, dtype=torch.long, device=DEVICE), q3, q3[:, :2], q3[:, :3],
                             torch.ones(8, 32, device=DEVICE), torch.ones(8, 32, device=DEVICE), cache, cache,
                             torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.ones(2, 7, device=DEVICE))
    q = torch.ones(2, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_triton(torch.zeros(2, dtype=torch.long, device=DEVICE), q, q, torch.ones(8, 16, device=DEVICE),
                      torch.ones(8, 16, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_full_size_low_precision(dtype):
    g = torch.Generator().manual_seed(11)
    x, r, w = rand(g, 64, 4096, dtype=dtype), rand(g, 64, 4096, dtype=dtype), rand(g, 4096, dtype=dtype)
    got, total = rms_norm_triton(x, w, 1e-5, residual=r)
    want, want_total = add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(total, want_total) and close(got, want, dtype)
    y = rand(g, 64, 2 * 14336, dtype=dtype)
    assert close(silu_and_mul_triton(y), silu_and_mul_reference(y), dtype)
