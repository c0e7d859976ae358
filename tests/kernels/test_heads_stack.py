"""The heads' residual-stack kernel against its reference, and the heads' inference path through it."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.heads import HeadsConfig, MedusaHeads  # noqa: E402
from medusa.kernels.heads_stack import KERNEL_MAX_ROWS, heads_stack, heads_stack_reference  # noqa: E402
from medusa.kernels.heads_stack_triton import heads_stack_triton  # noqa: E402

from kernel_inputs import DEVICE, rand  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def weights(g, k, h, num_layers, vocab, dtype, root_rows=0):
    """layers [(weight [K, H, H], bias [K, H])] and, for root_rows > 0, the root stage's (roots [root_rows],
    embed [V, H], root_proj_t [K, H, H]), else None."""
    layers = [(rand(g, k, h, h, dtype=dtype) / h ** 0.5, rand(g, k, h, dtype=dtype)) for _ in range(num_layers)]
    root = None
    if root_rows:
        root = (torch.randint(0, vocab, (root_rows,), generator=g).to(DEVICE), rand(g, vocab, h, dtype=dtype) * 3,
                rand(g, k, h, h, dtype=dtype) / h ** 0.5)
    return layers, root


def close(got, want, dtype):
    tol = TOLERANCE[dtype]
    return torch.allclose(got.float(), want.float(), atol=tol * want.float().abs().max().item(), rtol=tol)


# H not a power of two (200, 100, 96; the default model's 576 in the GPU test); 1 to KERNEL_MAX_ROWS rows; with
# and without the root stage; one and two layers
@pytest.mark.parametrize("seed,rows,h,num_layers,with_root,dtype", [
    (0, 1, 200, 2, True, torch.float32), (1, 3, 100, 1, False, torch.float32), (2, 16, 64, 2, True, torch.float32),
    (3, 2, 200, 1, True, torch.bfloat16), (4, 5, 96, 2, False, torch.float16), (10, 7, 96, 2, True, torch.float32)])
def test_triton_kernel_matches_the_reference(seed, rows, h, num_layers, with_root, dtype):
    g = torch.Generator().manual_seed(seed)
    k, vocab = 4, 50
    layers, root = weights(g, k, h, num_layers, vocab, dtype, rows if with_root else 0)
    x = rand(g, rows, h, dtype=dtype)
    got = heads_stack_triton(x, layers, k, root)
    want = heads_stack_reference(x, layers, k, root)
    assert got.shape == want.shape == (k, rows, h) and got.dtype == dtype
    assert close(got, want, dtype)
    # every head differs: each used its own weights
    assert all(not torch.allclose(got[0], got[i]) for i in range(1, k))


def test_root_stage_alone_and_no_stage():
    g = torch.Generator().manual_seed(5)
    k, h, rows = 3, 40, 4
    _, root = weights(g, k, h, 0, 30, torch.float32, rows)
    x = rand(g, rows, h)
    assert close(heads_stack_triton(x, [], k, root), heads_stack_reference(x, [], k, root), torch.float32)
    plain = heads_stack_triton(x, [], k, None)
    assert plain.shape == (k, rows, h) and all(torch.equal(plain[i], x) for i in range(k))


def test_row_counts_launch_power_of_two_variants(monkeypatch):
    """ROWS is a compile-time constant: 3, 5 or 7 rows (an admission of that many requests) launch the 4- or
    8-row variant that a decode graph's batch bucket compiled, on zero-padded rows, and return only theirs."""
    import medusa.kernels.heads_stack_triton as module

    launched, kernel = [], module._heads_stage_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["ROWS"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_heads_stage_kernel", Recorder())
    g = torch.Generator().manual_seed(11)
    for rows in (3, 5, 7, 8):
        layers, root = weights(g, 2, 48, 1, 20, torch.float32, rows)
        x = rand(g, rows, 48)
        got = heads_stack_triton(x, layers, 2, root)
        assert got.shape == (2, rows, 48) and close(got, heads_stack_reference(x, layers, 2, root), torch.float32)
    assert launched == [4, 4, 8, 8, 8, 8, 8, 8]  # two stages (root, one layer) per call


def test_wrapper_rejects_bad_input():
    g = torch.Generator().manual_seed(6)
    layers, root = weights(g, 2, 32, 1, 10, torch.float32, 3)
    x = rand(g, 3, 32)
    with pytest.raises(ValueError, match="rows"):
        heads_stack_triton(rand(g, KERNEL_MAX_ROWS + 1, 32), layers, 2)
    with pytest.raises(ValueError, match="weight"):
        heads_stack_triton(x, [(layers[0][0][:, :, :16].contiguous(), layers[0][1])], 2)
    with pytest.raises(ValueError, match="bias"):
        heads_stack_triton(x, [(layers[0][0], layers[0][1][:1])], 2)
    with pytest.raises(ValueError, match="roots"):
        heads_stack_triton(x, layers, 2, (torch.zeros(2, dtype=torch.long, device=DEVICE), *root[1:]))
    with pytest.raises(ValueError, match="embed"):
        heads_stack_triton(x, layers, 2, (torch.zeros(3, dtype=torch.long, device=DEVICE), root[1][:, :16], root[2]))


def test_dispatch_falls_back_past_the_kernel_rows():
    g = torch.Generator().manual_seed(7)
    layers, _ = weights(g, 2, 24, 1, 10, torch.float32)
    x = rand(g, KERNEL_MAX_ROWS + 3, 24)
    assert torch.equal(heads_stack(x, layers, 2), heads_stack_reference(x, layers, 2))


@pytest.mark.parametrize("condition_on_root", [False, True])
def test_heads_inference_equals_their_training_modules(condition_on_root):
    """The stacked inference path (here the reference on the CPU) computes what the heads' own modules do."""
    torch.manual_seed(8)
    cfg = HeadsConfig(hidden_size=48, vocab_size=64, num_heads=3, num_layers=2, condition_on_root=condition_on_root)
    heads = MedusaHeads(cfg)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn_like(p) / 7)
    hidden, lm = torch.randn(2, 5, 48), torch.randn(64, 48)
    roots = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        fast = heads(hidden, lm, roots=roots)
    with torch.enable_grad():
        slow = heads(hidden, lm, roots=roots).detach()
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        heads.heads[1][0].linear.weight.add_(1.0)  # the stacked weights follow an update (an optimizer's step)
        moved = heads(hidden, lm, roots=roots)
    assert not torch.allclose(moved[1], fast[1]) and torch.allclose(moved[0], fast[0])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 5, 16])
def test_full_size_heads_on_the_gpu(rows):
    """The default model's heads' shape (4 heads, 2 layers, H 576, vocabulary 49,152) in bf16."""
    g = torch.Generator().manual_seed(9)
    layers, root = weights(g, 4, 576, 2, 49152, torch.bfloat16, rows)
    x = rand(g, rows, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = heads_stack(x, layers, 4, root)
    assert close(got, heads_stack_reference(x, layers, 4, root), torch.bfloat16)
