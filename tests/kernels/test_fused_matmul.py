"""Norm -> linear and SiLU-and-mul -> linear in one kernel, against the PyTorch references.

On the GPU the references sum 16-bit GEMMs in fp32: with cuBLAS's default reduced-precision
reduction, a bf16 case (m=1, k=150, n=70) had too few bit-equal outputs (H200, session 7).
On the CPU the kernels run in Triton's interpreter, which stores bfloat16 as raw
uint16 bits: its tl.dot multiplies those bits as integers and its fp32 -> bf16
casts truncate. `bf16_interpreter` makes both behave as on the GPU (exact fp32
products of the bf16 operands; round to nearest even), so bf16 is tested here too.
"""

import contextlib
import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from medusa.kernels import fused_matmul_triton as fm  # noqa: E402
from medusa.kernels.fused_ops import rms_norm_matmul_reference, silu_mul_matmul_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP32 = torch.bfloat16, torch.float32
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)  # many tiles on tiny shapes
SPLIT3 = {**SMALL, "SPLIT_K": 3}  # K sliced: uneven slices (K = 150: 10 chunks as 4 + 4 + 2)
SPLIT8 = {**SMALL, "SPLIT_K": 8}  # more slices than chunks: the last slices are empty


@pytest.fixture(autouse=True)
def bf16_interpreter(monkeypatch):
    if DEVICE == "cuda":  # cuBLAS may reduce 16-bit GEMMs in 16 bits: the reference must sum in fp32 as the kernels do
        for dtype in ("bf16", "fp16"):
            monkeypatch.setattr(torch.backends.cuda.matmul, f"allow_{dtype}_reduced_precision_reduction", False)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    def as_fp32(h):
        return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    dot, cast = ti.InterpreterBuilder.create_dot, ti.InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, *args):
        return dot(self, *(as_fp32(h) if h.dtype.scalar == tl.bfloat16 else h for h in (a, b)), d, *args)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # nearest, ties to even (no NaNs here)
            return ti.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(ti.InterpreterBuilder, "cast_impl", cast_impl)


@contextlib.contextmanager
def poisoned_outputs(monkeypatch):
    """The wrappers' fresh outputs start as NaN, so an element no program writes fails the comparison."""
    empty = torch.empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
        yield


def rand(g, *shape, dtype=FP32, scale=1.0):
    """Uniform in +-[0.1, 1.1) * scale: no zeros, both signs."""
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return ((torch.rand(*shape, generator=g) + 0.1) * sign * scale).to(dtype).to(DEVICE)


def close(got, want, dtype, equal_share=0.9):
    """fp32: to summation order. 16-bit: within 2%, and mostly bit-equal: the kernels round where the
    references do, so only a different summation order moves an output's last bit now and then
    (skipping one of the rounding steps changes about half of them)."""
    tol = 1e-4 if dtype == FP32 else 2e-2
    if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
        return False
    return dtype == FP32 or (got == want).float().mean().item() >= equal_share


# M in {1, 3, 17, 64}; K and N not multiples of any block; fp32 and bf16 (fp16 once)
NORM_CASES = [  # seed, m, k, n, residual, bias, dtype, launch
    (0, 1, 96, 40, True, False, FP32, None), (1, 3, 200, 130, True, True, FP32, SMALL),
    (2, 17, 72, 50, False, True, FP32, None), (3, 64, 40, 24, False, False, FP32, SMALL),
    (4, 1, 150, 70, False, True, BF16, SMALL), (5, 3, 136, 33, True, False, BF16, None),
    (6, 17, 100, 48, True, True, BF16, SMALL), (7, 64, 200, 20, True, True, BF16, None),
    (8, 5, 72, 40, True, True, torch.float16, SMALL),
    (9, 1, 150, 70, True, True, FP32, SPLIT3), (10, 17, 40, 33, True, False, FP32, SPLIT8),
    (11, 3, 150, 40, False, True, BF16, SPLIT3), (12, 64, 200, 20, True, False, BF16, SPLIT8),
]


@pytest.mark.parametrize("seed,m,k,n,with_residual,with_bias,dtype,launch", NORM_CASES)
def test_rms_norm_matmul(seed, m, k, n, with_residual, with_bias, dtype, launch, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    x, norm_w = rand(g, m, k, dtype=dtype), rand(g, k, dtype=dtype)
    residual = rand(g, m, k, dtype=dtype) if with_residual else None
    w = rand(g, n, k, dtype=dtype, scale=k ** -0.5)  # outputs of order 1
    bias = rand(g, n, dtype=dtype) if with_bias else None
    with poisoned_outputs(monkeypatch):
        got, total = fm.rms_norm_matmul_triton(x, norm_w, 1e-5, w, bias, residual, launch=launch)
    want, want_total = rms_norm_matmul_reference(x, norm_w, 1e-5, w, bias, residual)
    assert got.shape == (m, n) and got.dtype == dtype and close(got, want, dtype)
    assert (total is None) == (want_total is None)
    assert total is None or torch.equal(total, want_total)  # the add rounds exactly as torch's


SILU_CASES = [  # seed, m, inter, n, bias, dtype, launch
    (0, 1, 96, 40, False, FP32, None), (1, 3, 130, 50, True, FP32, SMALL), (2, 17, 40, 70, False, FP32, SMALL),
    (3, 64, 72, 20, False, FP32, None), (4, 1, 150, 24, False, BF16, SMALL), (5, 3, 100, 33, True, BF16, None),
    (6, 17, 136, 40, False, BF16, SMALL), (7, 64, 40, 50, False, BF16, None),
    (8, 5, 72, 40, False, torch.float16, SMALL),
    (9, 1, 150, 24, True, FP32, SPLIT3), (10, 17, 40, 70, False, FP32, SPLIT8),
    (11, 3, 150, 33, False, BF16, SPLIT3), (12, 64, 100, 50, True, BF16, SPLIT8),
]


@pytest.mark.parametrize("seed,m,inter,n,with_bias,dtype,launch", SILU_CASES)
def test_silu_mul_matmul(seed, m, inter, n, with_bias, dtype, launch, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    x = rand(g, m, 2 * inter, dtype=dtype, scale=2.0)  # gates reach silu's curved part
    w = rand(g, n, inter, dtype=dtype, scale=inter ** -0.5)
    bias = rand(g, n, dtype=dtype) if with_bias else None
    with poisoned_outputs(monkeypatch):
        got = fm.silu_mul_matmul_triton(x, w, bias, launch=launch)
    want = silu_mul_matmul_reference(x, w, bias)
    assert got.shape == (m, n) and got.dtype == dtype and close(got, want, dtype)


def test_split_k_leaves_its_counters_at_zero_and_repeats_exactly():
    """The last slice to arrive zeroes its tile's counter: a second call (a graph replay, say) starts
    clean, and sums the slices in the same order, so it gives the same bits."""
    g = torch.Generator().manual_seed(13)
    x, norm_w, w = rand(g, 5, 150), rand(g, 150), rand(g, 70, 150, scale=0.1)
    first, _ = fm.rms_norm_matmul_triton(x, norm_w, 1e-5, w, launch=SPLIT3)
    assert not fm._counters(x.device, 1).any()
    again, _ = fm.rms_norm_matmul_triton(x, norm_w, 1e-5, w, launch=SPLIT3)
    assert torch.equal(first, again) and not fm._counters(x.device, 1).any()
    gate_up, w2 = rand(g, 5, 2 * 150), rand(g, 70, 150, scale=0.1)
    assert torch.equal(fm.silu_mul_matmul_triton(gate_up, w2, launch=SPLIT8),
                       fm.silu_mul_matmul_triton(gate_up, w2, launch=SPLIT8))
    assert not fm._counters(x.device, 1).any()
    with pytest.raises(ValueError, match="SPLIT_K must be >= 1"):
        fm.silu_mul_matmul_triton(gate_up, w2, launch={**SMALL, "SPLIT_K": 0})


def test_strided_rows_leading_dims_and_empty_inputs(monkeypatch):
    """Rows of x, residual and W may be strided views (slices of wider tensors); leading dims come back."""
    g = torch.Generator().manual_seed(9)
    x, residual = rand(g, 2, 3, 80)[..., :56], rand(g, 2, 3, 64)[..., :56]
    norm_w, w = rand(g, 56), rand(g, 30, 70, scale=0.1)[:, :56]
    with poisoned_outputs(monkeypatch):
        got, total = fm.rms_norm_matmul_triton(x, norm_w, 1e-6, w, residual=residual, launch=SMALL)
    want, want_total = rms_norm_matmul_reference(x, norm_w, 1e-6, w, residual=residual)
    assert got.shape == (2, 3, 30) and close(got, want, FP32) and torch.equal(total, want_total)
    gate_up, w2 = rand(g, 2, 3, 90)[..., :80], rand(g, 30, 50, scale=0.1)[:, :40]
    with poisoned_outputs(monkeypatch):
        got = fm.silu_mul_matmul_triton(gate_up, w2, launch=SMALL)
    assert got.shape == (2, 3, 30) and close(got, silu_mul_matmul_reference(gate_up, w2), FP32)
    y, none = fm.rms_norm_matmul_triton(x[:0], norm_w, 1e-6, w)
    assert y.shape == (0, 3, 30) and none is None
    assert fm.silu_mul_matmul_triton(gate_up[:, :0], w2).shape == (2, 0, 30)


def test_rms_norm_matmul_names_bad_inputs():
    x, norm_w, w = torch.ones(3, 8, device=DEVICE), torch.ones(8, device=DEVICE), torch.ones(5, 8, device=DEVICE)
    bad = {
        "weight must be \\[N, 8\\]": dict(weight=torch.ones(5, 6, device=DEVICE)),
        "weight must be .* with contiguous rows": dict(weight=torch.ones(8, 5, device=DEVICE).t()),
        "norm_weight must be a contiguous \\[8\\]": dict(norm_weight=torch.ones(6, device=DEVICE)),
        "norm_weight .* torch.float32": dict(norm_weight=torch.ones(8, dtype=BF16, device=DEVICE)),
        "weight must be torch.float32": dict(weight=torch.ones(5, 8, dtype=BF16, device=DEVICE)),
        "bias must be a contiguous \\[5\\]": dict(bias=torch.ones(4, device=DEVICE)),
        "bias must be torch.float32": dict(bias=torch.ones(5, dtype=BF16, device=DEVICE)),
        "residual must match x": dict(residual=torch.ones(3, 6, device=DEVICE)),
        "x must be .* contiguous last dim": dict(x=torch.ones(8, 3, device=DEVICE).t()),
        "x must be float16/bfloat16/float32": dict(x=torch.ones(3, 8, dtype=torch.float64, device=DEVICE)),
    }
    for message, change in bad.items():
        args = {**dict(x=x, norm_weight=norm_w, eps=1e-5, weight=w, bias=None, residual=None), **change}
        with pytest.raises(ValueError, match=f"rms_norm_matmul: {message}"):
            fm.rms_norm_matmul_triton(**args)


def test_silu_mul_matmul_names_bad_inputs():
    x, w = torch.ones(3, 8, device=DEVICE), torch.ones(5, 4, device=DEVICE)
    with pytest.raises(ValueError, match="silu_mul_matmul: x's last dim must be even"):
        fm.silu_mul_matmul_triton(torch.ones(3, 7, device=DEVICE), w)
    with pytest.raises(ValueError, match="silu_mul_matmul: weight must be \\[N, 4\\]"):
        fm.silu_mul_matmul_triton(x, torch.ones(5, 8, device=DEVICE))  # W of the [gate | up] width
    with pytest.raises(ValueError, match="silu_mul_matmul: weight must be torch.float32"):
        fm.silu_mul_matmul_triton(x, w.to(BF16))
    with pytest.raises(ValueError, match="silu_mul_matmul: x must be .* with a contiguous last dim"):
        fm.silu_mul_matmul_triton(torch.ones(8, 3, device=DEVICE).t(), w)


def test_launch_config_fills_the_gpu_with_column_tiles(monkeypatch):
    monkeypatch.setattr(fm, "_sm_count", lambda device: 132)  # an H200
    x = torch.ones(1, device=DEVICE, dtype=BF16)
    small = fm._launch_config(1, 576, 1536, x)  # 135M down_proj at batch 1: few columns
    assert small["BLOCK_M"] == 16 and small["BLOCK_N"] == 32 and small["BLOCK_K"] == 128
    assert small["SPLIT_K"] == 6  # 18 tiles x 6 slices of 2 chunks: 108 programs, not 18
    assert fm._launch_config(1, 2048, 8192, x)["SPLIT_K"] == 4  # 1B down_proj: 64 tiles x 4
    big = fm._launch_config(40, 28672, 4096, x)  # 8B gate_up: plenty of column tiles
    assert big["BLOCK_M"] == 64 and big["BLOCK_N"] == 128 and big["SPLIT_K"] == 1
    assert fm._launch_config(3, 100, 64, x.float())["BLOCK_K"] == 64


def test_model_layers_take_the_fused_kernels_when_enabled(monkeypatch):
    """The tiny Llama with the fused path forced on (interpreter on the CPU) gives the unfused logits."""
    import medusa.layers
    from medusa.attention import CausalAttention
    from tiny_models import tiny_decoder

    model, _ = tiny_decoder(vocab=40, num_layers=2)
    model.to(DEVICE)
    ids = torch.randint(0, 40, (5,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    pos = torch.arange(5, device=DEVICE)
    with torch.no_grad():
        want = model.compute_logits(model(ids, pos, CausalAttention()))
        calls = []
        monkeypatch.setattr(medusa.layers, "use_fused_matmul", lambda *a: calls.append(a) or True)
        got = model.compute_logits(model(ids, pos, CausalAttention()))
    assert len(calls) == 3 * 2  # two norms and the SiLU per layer
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_switch_is_off_by_default_and_needs_cuda(monkeypatch):
    from medusa.kernels.dispatch import use_fused_matmul

    x = torch.ones(4, 8)
    monkeypatch.delenv("MEDUSA_FUSED_MATMUL", raising=False)
    assert not use_fused_matmul(x)
    monkeypatch.setenv("MEDUSA_FUSED_MATMUL", "1")
    assert not use_fused_matmul(x, None)  # CPU tensors always take the references
    if torch.cuda.is_available():
        with torch.no_grad():
            assert use_fused_matmul(x.cuda(), None, torch.ones(8, device="cuda"))
            assert not use_fused_matmul(torch.ones(513, 8, device="cuda"))  # prefill-sized: cuBLAS


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,inter", [(576, 960, 1536), (2048, 3072, 8192), (4096, 6144, 14336)])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_full_size_bf16(k, n, inter, m):
    """The 135M / 1B / 8B projections: QKV after the norm, down_proj after SiLU-and-mul."""
    g = torch.Generator().manual_seed(m)
    x, residual, norm_w = rand(g, m, k, dtype=BF16), rand(g, m, k, dtype=BF16), rand(g, k, dtype=BF16)
    w = rand(g, n, k, dtype=BF16, scale=k ** -0.5)
    got, total = fm.rms_norm_matmul_triton(x, norm_w, 1e-5, w, residual=residual)
    want, want_total = rms_norm_matmul_reference(x, norm_w, 1e-5, w, residual=residual)
    # cuBLAS may split K and reduce in bf16 (torch allows it by default): no bit-equality asked
    assert torch.equal(total, want_total) and close(got, want, BF16, equal_share=0)
    gate_up, w_down = rand(g, m, 2 * inter, dtype=BF16), rand(g, k, inter, dtype=BF16, scale=inter ** -0.5)
    got = fm.silu_mul_matmul_triton(gate_up, w_down)
    assert close(got, silu_mul_matmul_reference(gate_up, w_down), BF16, equal_share=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_tiny_llama_on_cuda_with_and_without_fused_matmul(dtype, monkeypatch):
    """Same logits (to the dtype's precision) and the same greedy tokens with the switch on and off."""
    from medusa.attention import CausalAttention
    from tiny_models import tiny_decoder

    model, _ = tiny_decoder(vocab=64, num_layers=3, logit_scale=4.0)
    model.to("cuda", dtype)
    prompt = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1)).cuda()

    def greedy(switch: str, steps: int = 8):
        monkeypatch.setenv("MEDUSA_FUSED_MATMUL", switch)
        ids, first = prompt, None
        with torch.no_grad():
            for _ in range(steps):
                logits = model.compute_logits(model(ids, torch.arange(len(ids), device="cuda"), CausalAttention()))
                first = logits if first is None else first
                ids = torch.cat([ids, logits[-1].argmax().view(1)])
        return first.float(), ids

    (plain, plain_ids), (fused, fused_ids) = greedy("0"), greedy("1")
    tol = 1e-4 if dtype == FP32 else 3e-2
    assert torch.allclose(fused, plain, atol=tol * plain.abs().max().item(), rtol=tol)
    assert torch.equal(fused_ids, plain_ids)
