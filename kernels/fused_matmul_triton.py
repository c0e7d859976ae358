"""Linear layers with the elementwise op before them fused into the GEMM's prologue: one launch each.

A decode step is launch-bound: RMSNorm -> QKV, RMSNorm -> gate_up and
SiLU-and-mul -> down are six kernels per layer where three do. Same contracts as
`rms_norm_matmul_reference` / `silu_mul_matmul_reference` in `fused_ops.py`.

Tiling: x [M, K] (rows may be strided, last dim contiguous), W [N, K] as
nn.Linear stores it (rows may be strided). Program (i, j) computes the output
tile y[i*BLOCK_M : +BLOCK_M, j*BLOCK_N : +BLOCK_N], looping over K in BLOCK_K
chunks with an fp32 accumulator; each chunk's A operand [BLOCK_M, BLOCK_K] is
built from x in registers (normed, or SiLU(gate) * up) and never written out.
M is small on the decode path (batch x tree tokens, mostly <= 64), so the work
is reading W once, spread over the SMs by column tiles and, where those are too
few, by SPLIT_K slices of K. Without the split, the 135M model's down_proj
(N = 576, K = 1536) ran as 18 programs looping over all of K: 22.6 us against
6.5 us for SiLU + cuBLAS (H200, session 7). With it, each (row tile, column
tile, slice) program writes its fp32 partial tile to a workspace and bumps the
tile's arrival counter; the program that arrives last sums the SPLIT_K partials
in slice order (the same sum whichever program is last), stores the output and
zeroes the counter for the next call. One launch still, and no memset: the
counters are left as they were found, so the kernels also replay in a CUDA graph.

RMSNorm needs each row's statistics over all of K before its first chunk: every
program first sums the squares of its BLOCK_M rows over K, then runs the GEMM
loop, reading those rows again. x is at most 512 x 8192 x 2 bytes here and
stays in L2, so the repeated reads across column tiles cost far less than the
separate norm kernel (launch plus a write and a read of the normed rows) they
replace.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_total(x_ptr, res_ptr, rows, cols, ok, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr):
    """x [+ residual] at [rows, cols] -> [BLOCK_M, BLOCK_K] in x's dtype, the sum rounded as torch rounds it."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_ok, stride_x, stride_r, K, eps, write_sum,
             HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """First pass over K: 1 / rms of each row [BLOCK_M] in fp32. With write_sum, also stores x + residual [M, K]."""
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (cols < K)[None, :]
        total = _load_total(x_ptr, res_ptr, rows, cols, ok, stride_x, stride_r, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if write_sum:  # one program writes it; the others only need the statistics
                tl.store(res_out_ptr + rows[:, None] * K + cols[None, :], total, mask=ok)
        t = total.to(tl.float32)
        squares += tl.sum(t * t, 1)
    return tl.rsqrt(squares / K + eps)


@triton.jit
def _store_tile(y_ptr, bias_ptr, acc, rows, row_ok, cols, col_ok, N, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 (+ bias, added in fp32) -> y [M, N], rounded once."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _finish_tile(y_ptr, bias_ptr, ws_ptr, count_ptr, acc, rows, row_ok, cols, col_ok, N, tile, split,
                 HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store this program's tile; with SPLIT_K > 1, its K slice's partial, the last slice to arrive
    storing the sum of all of them (see the module docstring)."""
    if SPLIT_K == 1:
        _store_tile(y_ptr, bias_ptr, acc, rows, row_ok, cols, col_ok, N, HAS_BIAS)
    else:
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [M, N] in a tile
        tile_ws = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(tile_ws + split * (BLOCK_M * BLOCK_N) + offs, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # in slice order: the same rounding whichever program is last
                total += tl.load(tile_ws + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
            _store_tile(y_ptr, bias_ptr, total, rows, row_ok, cols, col_ok, N, HAS_BIAS)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _program_tile(M, N, K, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """This program's output tile and K slice: rows [BLOCK_M], cols [BLOCK_N], their masks, the tile's
    index, the slice's index and its [begin, end) of K in whole BLOCK_K chunks (the last may be empty).

    Row tiles on axis 0: the programs sharing one W column tile run together and share it in L2;
    axis 1 is (column tile, K slice), the slices of a tile adjacent.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_tile, split = tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = tl.program_id(0) * tl.cdiv(N, BLOCK_N) + col_tile
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = split * per_split
    return rows, rows < M, cols, cols < N, tile, split, k_begin, tl.minimum(k_begin + per_split, K)


@triton.jit
def _load_w_t(w_ptr, cols, col_ok, ks, k_ok, stride_w):
    """The W^T tile [BLOCK_K, BLOCK_N] of W [N, K] (rows strided by stride_w)."""
    return tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None],
                   mask=k_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _rms_norm_matmul_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, y_ptr, res_out_ptr, ws_ptr, count_ptr,
                            M, N, K, stride_x, stride_r, stride_w, eps, HAS_RESIDUAL: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, SPLIT_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, row_ok, cols, col_ok, tile, split, k_begin, k_end = _program_tile(M, N, K, SPLIT_K, BLOCK_M, BLOCK_N,
                                                                            BLOCK_K)
    # every slice needs the rows' statistics over all of K; one program writes x + residual
    inv_rms = _inv_rms(x_ptr, res_ptr, res_out_ptr, rows, row_ok, stride_x, stride_r, K, eps,
                       tl.program_id(1) == 0, HAS_RESIDUAL, BLOCK_M, BLOCK_K)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        total = _load_total(x_ptr, res_ptr, rows, ks, row_ok[:, None] & k_ok[None, :], stride_x, stride_r,
                            HAS_RESIDUAL)
        # rounded to x's dtype before the weight multiply and again after it, as rms_norm_reference does
        normed = (total.to(tl.float32) * inv_rms[:, None]).to(total.dtype).to(tl.float32)
        g = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        a = (g[None, :] * normed).to(total.dtype)  # [BLOCK_M, BLOCK_K]
        acc = tl.dot(a, _load_w_t(w_ptr, cols, col_ok, ks, k_ok, stride_w), acc, input_precision=PRECISION)
    _finish_tile(y_ptr, bias_ptr, ws_ptr, count_ptr, acc, rows, row_ok, cols, col_ok, N, tile, split,
                 HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N)


@triton.jit
def _silu_mul_matmul_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, count_ptr, M, N, I, stride_x, stride_w,
                            HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, SPLIT_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, row_ok, cols, col_ok, tile, split, k_begin, k_end = _program_tile(M, N, I, SPLIT_K, BLOCK_M, BLOCK_N,
                                                                            BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        ok = row_ok[:, None] & k_ok[None, :]
        gate = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=ok, other=0.0)
        up = tl.load(x_ptr + rows[:, None] * stride_x + I + ks[None, :], mask=ok, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu rounds to the input dtype
        a = (silu * up).to(gate.dtype)  # [BLOCK_M, BLOCK_K], rounded as silu_and_mul_reference's product
        acc = tl.dot(a, _load_w_t(w_ptr, cols, col_ok, ks, k_ok, stride_w), acc, input_precision=PRECISION)
    _finish_tile(y_ptr, bias_ptr, ws_ptr, count_ptr, acc, rows, row_ok, cols, col_ok, N, tile, split,
                 HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N)


def rms_norm_matmul_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                           bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                           launch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., K] -> (linear(rms_norm(x [+ residual])) [..., N], x + residual [..., K] or None).

    norm_weight [K]; weight [N, K]; bias [N]; all of x's dtype. launch: BLOCK_M / BLOCK_N /
    BLOCK_K / SPLIT_K (default 1) / num_warps / num_stages in place of `_launch_config`'s
    (benchmarks/kernels.py).
    """
    k = x.shape[-1]
    _check_linear("rms_norm_matmul", x, k, weight, bias)
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        raise ValueError(f"rms_norm_matmul: norm_weight must be a contiguous [{k}] of {x.dtype}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} stride {norm_weight.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1 or residual.device != x.device):
        raise ValueError(f"rms_norm_matmul: residual must match x {tuple(x.shape)} {x.dtype} with a contiguous "
                         f"last dim, got {tuple(residual.shape)} {residual.dtype} stride {residual.stride()}")
    rows = x.reshape(-1, k)  # a view for the model's activations; strided rows are fine
    rows_r = residual.reshape(-1, k) if residual is not None else rows
    m, n = rows.shape[0], weight.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if m:
        config = _with_split(launch or _launch_config(m, n, k, x))
        grid, ws, counts = _grid_and_scratch(m, n, config, x.device)
        _rms_norm_matmul_kernel[grid](
            rows, rows_r, norm_weight, weight, bias if bias is not None else weight, y,
            total if total is not None else y, ws, counts, m, n, k, rows.stride(0), rows_r.stride(0),
            weight.stride(0), eps, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            PRECISION=_precision(x), **config)
    return y, total


def silu_mul_matmul_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           launch: dict | None = None) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> linear(silu(gate) * up) [..., N]; weight [N, I], bias [N], of x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul_matmul: x's last dim must be even ([gate | up]), got {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    _check_linear("silu_mul_matmul", x, inter, weight, bias)
    rows = x.reshape(-1, 2 * inter)
    m, n = rows.shape[0], weight.shape[0]
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if m:
        config = _with_split(launch or _launch_config(m, n, inter, x))
        grid, ws, counts = _grid_and_scratch(m, n, config, x.device)
        _silu_mul_matmul_kernel[grid](rows, weight, bias if bias is not None else weight, y, ws, counts, m, n,
                                      inter, rows.stride(0), weight.stride(0), HAS_BIAS=bias is not None,
                                      PRECISION=_precision(x), **config)
    return y


def _with_split(config: dict) -> dict:
    """A launch dict without SPLIT_K (a benchmark's) reads all of K in one program."""
    return config if "SPLIT_K" in config else {**config, "SPLIT_K": 1}


def _grid_and_scratch(m: int, n: int, config: dict, device: torch.device):
    """The grid, the fp32 partials workspace [tiles, SPLIT_K, BLOCK_M, BLOCK_N] and the tiles' arrival
    counters (int32, zero between calls) for a launch; with SPLIT_K == 1 both are unused stand-ins."""
    tiles_m, tiles_n, split = triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]), config["SPLIT_K"]
    if split < 1:
        raise ValueError(f"SPLIT_K must be >= 1, got {split}")
    grid = (tiles_m, tiles_n * split)
    if split == 1:
        stand_in = _counters(device, 1)
        return grid, stand_in, stand_in
    ws = torch.empty(tiles_m * tiles_n * split * config["BLOCK_M"] * config["BLOCK_N"], dtype=torch.float32,
                     device=device)
    return grid, ws, _counters(device, tiles_m * tiles_n)


# Arrival counters per device: one per output tile of a split launch. The decode path's largest fused
# launch is 512 rows (FUSED_MATMUL_MAX_ROWS, 8 row tiles) by an 8B gate_up's 28672 columns (896 tiles
# of 32): 7,168 tiles. Allocated once and never replaced, since captured graphs keep its address.
MAX_SPLIT_TILES = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """The device's zeroed int32 counters, kept across calls: the kernels restore every counter they
    touch to zero, so a launch needs no memset, and a CUDA graph may replay it."""
    if size > MAX_SPLIT_TILES:
        raise ValueError(f"a split-K launch of {size} output tiles exceeds MAX_SPLIT_TILES ({MAX_SPLIT_TILES}): "
                         "use larger BLOCK_M / BLOCK_N or SPLIT_K=1")
    device = torch.device(device)
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused matmul: the first call on a device must run outside CUDA graph capture "
                               "(it allocates the split-K counters); run the step once eagerly first")
        _COUNTERS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _check_linear(op: str, x: torch.Tensor, k: int, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """x's dtype is a float type the kernels take, its last dim contiguous; weight [N, k] rows contiguous; bias [N]."""
    if x.dtype not in _DTYPES or x.dim() < 1 or x.stride(-1) != 1:
        raise ValueError(f"{op}: x must be float16/bfloat16/float32 with a contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)} stride {x.stride()}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"{op}: weight must be [N, {k}] with contiguous rows (nn.Linear's layout), got "
                         f"{tuple(weight.shape)} stride {weight.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"{op}: bias must be a contiguous [{weight.shape[0]}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{op}: {name} must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}")


def _precision(x: torch.Tensor) -> str:
    """fp32 inputs multiply in full fp32, as F.linear does unless torch allows TF32; 16-bit ones ignore this."""
    return "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _launch_config(m: int, n: int, k: int, x: torch.Tensor) -> dict:
    """Tile sizes, K slices, num_warps and num_stages for both kernels. Tune with
    `python benchmarks/kernels.py --fused-matmul --fused-sweep`.

    - BLOCK_M: the smallest of 16 / 32 / 64 covering M (tl.dot needs >= 16 rows); 64 beyond.
    - BLOCK_N: decode GEMMs are weight-read bound, and at M <= 64 there is one row tile, so
      the column tiles must spread W over the SMs: the widest of 128 / 64 that gives at least
      one program per SM, else 32.
    - SPLIT_K: where the tiles are still fewer than the SMs (the 135M model's down_proj has
      N = 576: 18 tiles of 32), K is sliced until there are about two programs per SM, each
      slice at least two BLOCK_K chunks long.
    - BLOCK_K: 256 bytes of each W row per chunk (128 16-bit or 64 fp32 elements).
    - num_stages: software pipelining keeps that many A and W chunks in shared memory
      ([BLOCK_M + BLOCK_N, BLOCK_K] each): up to 4, within ~160 KiB of the ~227 KiB an SM has.
    """
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles_m = triton.cdiv(m, block_m)
    sms = _sm_count(x.device)
    block_n = next((b for b in (128, 64) if tiles_m * triton.cdiv(n, b) >= sms), 32)
    block_k = 256 // x.element_size()
    tiles = tiles_m * triton.cdiv(n, block_n)
    split = 1 if tiles >= sms else max(1, min(2 * sms // tiles, triton.cdiv(k, block_k) // 2))
    stage_bytes = (block_m + block_n) * block_k * x.element_size()
    num_stages = max(2, min(4, (160 * 1024) // stage_bytes))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4,
                num_stages=num_stages)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (cached: the query costs microseconds per launch otherwise); 8 off the GPU."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
