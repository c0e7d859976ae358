"""Triton kernel for attention over paged KV with causal or tree masks.

Same contract as `paged_attention_reference` in `paged_attention.py` (read its
docstring for the layout). One program owns one (sequence, KV head, tile of
query rows), where a row is a (step token, query head of that KV head's group)
pair: the group's heads share every K/V tile loaded, and so do all the tree
tokens of a sequence, so KV is read once per sequence and KV head rather than
once per query token. K/V are walked BLOCK_N keys (several pages) at a time with
an online softmax in float32, in two phases: the cached prefix, which every row
sees (no mask), then the step's own tokens under the causal or tree mask.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from medusa.kernels.fused_ops_triton import _rotate_q, _rotate_rows, load_product
from medusa.kernels.paged_attention import chunks_per_split, kernel_pages, row_tile
from medusa.kernels.pdl import pdl_options, wait_for_previous
from medusa.kernels.skinny_matmul import SplitSums

_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))
# MEDUSA_TMA=0 keeps the prefix walk on per-slot loads whatever the page size (to time one against the other)
TMA_ENABLED = os.environ.get("MEDUSA_TMA", "1") != "0"


@triton.jit
def _softmax_update(s, v, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """Fold one key chunk into the running online softmax (FlashAttention-2 style).

    s [M, N] float32 raw scores q.k, -inf where a key is hidden; qk_scale > 0 the softmax
    scale times log2(e); v [N, D]; m_i, l_i [M] running max (log2 units) and sum; acc [M, D]
    float32 unnormalised output. The scale is applied to each row's max and, per element,
    in one fused multiply-add with the max's subtraction. MASKED: the chunk may hide every
    key of a row, whose max then stays -inf (an unmasked chunk's scores are all finite).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing in this split yet
    else:
        m_new_safe = m_new
    alpha = tl.exp2(m_i - m_new_safe)  # exp2 maps to one MUFU.EX2; exp would add a multiply per element
    p = tl.exp2(s * qk_scale - m_new_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # accumulate in the MMA's fp32 accumulator
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, out_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, kv_lens_ptr, qstart_ptr,
    causal_ptr, bits_ptr, stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb, qk_scale,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    # Grid (row tiles, KV heads * splits, sequences): the row tiles of one (sequence, KV head,
    # split) are adjacent program ids, so they run at the same time and read the same K/V
    # chunks; all but the first read of each chunk then come from L2 instead of HBM.
    wait_for_previous(PDL)  # q and the step's tables come from kernels before this one
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    seq = tl.program_id(2)
    q_begin = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_begin
    if tile * BLOCK_M >= q_len * GROUP:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    prefix = kv_len - q_len  # cached keys, seen by every step token
    causal = tl.load(causal_ptr + seq)
    # this split's share of the keys, in whole BLOCK_N chunks (flash-decoding: short batches
    # still fill the GPU, because each (sequence, head) is spread over NUM_SPLITS programs)
    per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), NUM_SPLITS) * BLOCK_N
    key_begin = split * per_split
    key_end = tl.minimum(key_begin + per_split, kv_len)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] (token, head-in-group) pairs
    row_ok = rows < q_len * GROUP
    token = rows // GROUP  # step-local token index
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [M, D]
    bits = tl.load(bits_ptr + q_begin + token, mask=row_ok, other=0)  # [M] int64
    table = tables_ptr + seq * stride_tb  # this sequence's block table
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_kh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    keys = tl.arange(0, BLOCK_N)

    # Phase 1, the cached prefix: whole BLOCK_N chunks of [key_begin, min(key_end, prefix)).
    # Every row sees every such key and every key is in range, so the loop has no mask at all
    # (no predicated loads, no select on the [M, N] scores). key_begin is a multiple of
    # BLOCK_N, so these are the sequence's aligned chunks; a chunk straddling `prefix` or
    # key_end is left to phase 2. Clamped at 0 first: a split past the prefix has none.
    # A chunk's block ids are loaded one iteration ahead and carried in registers, so its K/V loads
    # hang off no load of their own iteration: each stage past the first then buffers one K/V chunk
    # (with the table load inside the iteration the pipeliner spent two stages per buffer).
    prefix_end = key_begin + tl.maximum(tl.minimum(key_end, prefix) - key_begin, 0) // BLOCK_N * BLOCK_N
    if TMA:
        # Pages of BLOCK_N keys or more: a chunk lies in one page, so K and V each arrive as one bulk
        # copy (TMA) of [BLOCK_N, D] rows of the pool viewed as [slots, Hkv * D]; only the page's id is
        # carried, one scalar.
        next_page = tl.load(table + key_begin // PAGE, mask=key_begin < prefix_end, other=0)
        for start in range(key_begin, prefix_end, BLOCK_N):
            row = (next_page * PAGE + start % PAGE).to(tl.int32)  # the chunk's first slot; TMA takes int32
            ahead = start + BLOCK_N
            next_page = tl.load(table + ahead // PAGE, mask=ahead < prefix_end, other=0)
            k = k_desc.load([row, kv_head * HEAD_DIM])  # [N, D]
            v = v_desc.load([row, kv_head * HEAD_DIM])  # [N, D]
            s = tl.dot(q, tl.trans(k)).to(tl.float32)  # [M, N]
            m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, qk_scale, False)
    else:
        next_block = tl.load(table + (key_begin + keys) // PAGE, mask=key_begin + keys < prefix_end, other=0)  # [N]
        for start in range(key_begin, prefix_end, BLOCK_N):
            logical = start + keys  # [N] several pages per chunk: more loads in flight
            block = next_block.to(tl.int64)
            ahead = logical + BLOCK_N
            next_block = tl.load(table + ahead // PAGE, mask=ahead < prefix_end, other=0)
            slots = block * PAGE + logical % PAGE  # [N]
            k = tl.load(k_head + slots[:, None] * stride_ks + dims[None, :])  # [N, D]
            v = tl.load(v_head + slots[:, None] * stride_ks + dims[None, :])  # [N, D]
            s = tl.dot(q, tl.trans(k)).to(tl.float32)  # [M, N]
            m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, qk_scale, False)

    # Phase 2, [prefix_end, own_end): the prefix chunk's unaligned tail (if any) and the step's
    # own tokens, which need the causal or tree mask (int64 bit shifts, emulated on GPUs: only
    # here, at most 64 + BLOCK_N - 1 keys for a tree, so one or two chunks). A causal row tile
    # sees no step token past its last row's, so its phase ends there; tree ancestors carry no
    # such order guarantee, so a tree tile walks to key_end.
    last_token = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
    own_end = tl.where(causal != 0, tl.minimum(key_end, prefix + last_token + 1), key_end)
    for start in range(prefix_end, own_end, BLOCK_N):
        logical = start + keys  # [N]; start need not be a multiple of BLOCK_N (or PAGE) here
        key_ok = logical < own_end
        block = tl.load(table + logical // PAGE, mask=key_ok, other=0).to(tl.int64)
        slots = block * PAGE + logical % PAGE
        k = tl.load(k_head + slots[:, None] * stride_ks + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_head + slots[:, None] * stride_ks + dims[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32)  # [M, N]
        step = logical - prefix  # [N] index among the step's tokens (negative: prefix)
        in_step = step >= 0
        step_c = tl.where(in_step, step, 0)
        shift = tl.minimum(step_c, 63).to(tl.int64)  # causal chunks may exceed 64 tokens; bits unused there
        tree_ok = ((bits[:, None] >> shift[None, :]) & 1) != 0  # [M, N]
        causal_ok = step_c[None, :] <= token[:, None]
        own_ok = tl.where(causal != 0, causal_ok, tree_ok)
        visible = key_ok[None, :] & ((~in_step[None, :]) | own_ok)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, qk_scale, True)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_begin + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # partials [T, Hq, S, D] and [T, Hq, S, 2] (max in log2 units, sum), merged by _merge_splits_kernel
        num_heads = tl.num_programs(1) // NUM_SPLITS * GROUP
        part = ((q_begin + token) * num_heads + head) * NUM_SPLITS + split  # [M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh, num_heads,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    base = (token * num_heads + head) * NUM_SPLITS + splits  # [S]
    m = tl.load(part_ml_ptr + base * 2)  # log2 units, like the attention kernel's running max
    l_s = tl.load(part_ml_ptr + base * 2 + 1)
    m_max = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [S]; empty splits weigh nothing
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + dims[None, :])  # [S, D]
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, query_start: torch.Tensor,
                           causal: torch.Tensor, step_bits: torch.Tensor, block_size: int,
                           max_query_len: int, scale: float | None = None,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           launch: dict | None = None, max_kv_len: int | None = None,
                           descriptors: tuple | None = None) -> torch.Tensor:
    """Checked wrapper: shapes, dtypes and strides, then one launch (two with split KV) for the batch.

    max_query_len: an upper bound on any sequence's step tokens (sizes the grid
    without reading query_start back to the host). num_splits: programs per
    (sequence, KV head, row tile) along the keys; None picks enough to fill the
    GPU from the host-known shapes alone, so the choice is fixed under a CUDA graph.
    max_kv_len: a host-side bound on the sequences' keys, used only to pick that count (None: the
    block table's width); a longer sequence is still attended in full, by fewer programs.
    launch: num_warps and/or num_stages instead of `_launch_config`'s, and optionally block_m / block_n
    (benchmarks/kernel_bench.py --launch-sweep) and tma (True / False instead of `bulk_copies_fit`'s answer).
    descriptors: `page_descriptors(k_cache, v_cache)`, kept by a caller that attends over the same caches
    again and again (building them costs host time in every eager call) where `bulk_copies_fit` holds.
    """
    _check(q, k_cache, v_cache, block_tables, kv_lens, query_start, causal, step_bits, block_size)
    num_seqs = block_tables.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    launch = dict(launch or {})
    block_m = launch.pop("block_m", row_tile(max_query_len, group))
    block_n = launch.pop("block_n", 64)
    tiles = triton.cdiv(max_query_len * group, block_m)
    if max_kv_len is not None and max_kv_len < 1:
        raise ValueError(f"max_kv_len must be >= 1 (or None for the block table's width), got {max_kv_len}")
    if num_splits is None:
        num_splits = _pick_splits(num_seqs * num_kv_heads * tiles, block_tables.shape[1] * block_size, block_n,
                                  block_m, q, max_kv_len)
    out = torch.empty_like(q) if out is None else out
    if num_splits > 1:
        part_acc = torch.empty(q.shape[0], num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(q.shape[0], num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    # row tiles first: the tiles sharing one (sequence, KV head, split) run together and share K/V in L2
    grid = (tiles, num_kv_heads * num_splits, num_seqs)
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    if not scale > 0:
        raise ValueError(f"scale must be > 0 (the kernel scales each row's maximum), got {scale}")
    tma = launch.pop("tma", None)
    if tma is None:  # a caller's descriptors say it has already asked
        tma = descriptors is not None or bulk_copies_fit(q, k_cache, v_cache, block_size, block_n)
    if not tma:
        k_desc, v_desc = k_cache, v_cache  # unused
    elif descriptors is not None and list(descriptors[0].block_shape) == [block_n, head_dim]:
        k_desc, v_desc = descriptors
    else:
        k_desc, v_desc = page_descriptors(k_cache, v_cache, block_n)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, out, part_acc, part_ml, block_tables, kv_lens, query_start,
        causal.to(torch.int32),  # no-op (no launch) for int32
        step_bits, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale * _LOG2E,  # softmax in exp2: scores (and stored maxima) in log2 units
        NUM_SPLITS=num_splits, GROUP=group, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        TMA=tma, **_launch_options(_launch_config(block_m, block_n, head_dim, q.element_size(), num_splits), launch),
        **pdl_options(q, q.shape[0]),
    )
    if num_splits > 1 and q.shape[0]:
        _merge_splits_kernel[(q.shape[0], num_heads)](out, part_acc, part_ml, out.stride(0), out.stride(1),
                                                      num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
                                                      **pdl_options(q, q.shape[0]))
    return out


def bulk_copies_fit(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
                    block_n: int = 64) -> bool:
    """Whether the prefix walk loads K/V chunks by TMA: a GPU that has it (compute capability 9+),
    pages of whole chunks (block_size a multiple of block_n, so a chunk never spans two pages), and
    contiguous, 16-byte aligned fp16/bf16 caches with heads of 64 or 128.

    Measured on an H200 (RESULTS.md, session 28, per call in a CUDA graph): 32 sequences of 64 tree
    tokens, 32/8 heads of 128, 4096 keys took 0.281-0.286 ms this way (45-46% of the copy bandwidth)
    against 0.374-0.394 on 16-key pages; over three model shapes, 1-32 sequences of 1-64 tokens and
    512-4096 keys, 0.94x on average (0.77-1.08x). On 16-key pages, four boxes a chunk ran slower than
    per-slot loads (0.446 against 0.369 ms there), so those keep them.
    """
    return (TMA_ENABLED and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
            and block_size % block_n == 0 and k_cache.dtype in (torch.float16, torch.bfloat16)
            and k_cache.shape[2] in (64, 128) and k_cache.shape[0] < 2**31
            and all(c.is_contiguous() and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache)))


def page_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int = 64) -> tuple:
    """TMA descriptors of the caches viewed as [slots, Hkv * D], one box = one head's [block_n, D] chunk."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous [slots, Hkv, D] for TMA loads")
    head_dim = k_cache.shape[2]
    return tuple(TensorDescriptor.from_tensor(c.view(c.shape[0], -1), [block_n, head_dim]) for c in (k_cache, v_cache))


def _launch_config(block_m: int, block_n: int, head_dim: int, elem_bytes: int, num_splits: int) -> dict:
    """num_warps / num_stages for the attention kernel on Hopper-class GPUs (ignored by the interpreter).

    Measured on an H200 (RESULTS.md, session 4: batch 32, 64 tree tokens, 8 KV heads of 128, bf16):
    4 warps ran 1.5-2x faster than 8 at every stage count (0.56 against 1.16 ms at 4096 keys).
    With the block ids loaded an iteration ahead, n stages keep n - 1 K and V chunks ([BLOCK_N, D]
    each) in flight. Session 27 (per call in a CUDA graph; three model shapes, 1-32 sequences of
    1-64 tokens, 512-4096 keys): where one or two splits are picked (the batch alone fills the GPU,
    each program walks half the keys or more), 3 stages beat 4, which leave one program per SM for
    heads of 128 (the issue's tree shape: 0.375 against 0.57 ms). Where more splits are picked
    (small batches), 2 stages win while each split walks a few chunks (8B shape, one token, 512
    keys: 5.9 against 6.6 us) and lose from about eight (8 sequences of one token, 4096 keys: 44.4
    against 40.0 us); a graph captured for any context cannot know the walk, and short contexts
    are the common case. 64-row tiles of heads of 128 keep 3 stages up to 4 splits (session 30, 8B
    shape, 4 splits: a 64-node tree at 4096 keys 30.3 -> 27.9 us, 4 sequences of 16 tokens 43.2 -> 33.8;
    at 512 keys 15.1 -> 15.7, where one sequence runs under a key bound and 2 splits; with 16 splits, a
    16-node tree at one sequence, 2 stages stay faster: 9.9 against 10.5 us at 512 keys). fp32 or D=256
    chunks get fewer stages, to stay well under the ~227 KiB of shared memory an SM offers.
    """
    stage_bytes = 2 * block_n * head_dim * elem_bytes  # one K and one V chunk
    deepest = 3 if num_splits <= (4 if block_m >= 64 and head_dim >= 128 else 2) else 2
    return dict(num_warps=4, num_stages=max(1, min(deepest, (160 * 1024) // stage_bytes)))


def _launch_options(config: dict, launch: dict) -> dict:
    """`config` with a caller's num_warps / num_stages in place of its own."""
    unknown = set(launch) - set(config)
    if unknown:
        raise ValueError(f"unknown attention launch options {sorted(unknown)} (num_warps, num_stages, "
                         f"block_m, block_n, tma)")
    return config | launch


def _pick_splits(programs: int, max_keys: int, block_n: int, block_m: int, q: torch.Tensor,
                 max_kv_len: int | None = None) -> int:
    """Splits (a power of two, <= 64): the most that keep the programs within one wave of the GPU
    for tiles of 64 rows (trees, prompt chunks), two waves for 16-row tiles (a token per sequence),
    and, for a step whose keys the host bounds (`max_kv_len`), at most one per `chunks_per_split` key
    chunks of the bound (one chunk; eight for 64-row tiles of heads of 128 whose programs fill a fifth of
    the GPU before splitting).

    Splits past a sequence's keys cost a program and the merge's reads, and max_keys is the
    block table's width (the longest context served), not this step's. Measured on an H200
    (RESULTS.md, session 13: attention per call inside a CUDA graph, tables 4096 keys wider than
    the context): a 64-node tree at one sequence of the 8B shape took 22.2 us under the earlier
    rule (at least two waves: 16 splits) and 15.8 us under this one (4); a 16-node tree at 8
    sequences 29.7 against 15.1 us; one token at 8 sequences gained from the second wave
    (10.7 against 11.5 us at 512 keys, 27.1 against 36.3 at 2048).
    Splits past every sequence's keys still cost: their programs start, store empty partials and
    exit, and the merge reads them (sessions 18-19: the 135M plain step at 512 keys took 0.518 ms
    with 64 splits, 0.487 with at most 16).
    """
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
    target = sms * (2 if block_m <= 16 else 1)
    most = max(1, min(64, max_keys // (2 * block_n)))  # at least two key chunks per split
    if max_kv_len is not None:
        chunks = triton.cdiv(max_kv_len, block_n)
        least = chunks_per_split(block_m, q.shape[-1], fills_a_fifth=programs * 5 >= target)
        most = max(1, min(most, triton.cdiv(chunks, least)))
    splits = 1
    while splits * 2 <= most and programs * splits * 2 <= target:
        splits *= 2
    return splits


def _check(q, k_cache, v_cache, block_tables, kv_lens, query_start, causal, step_bits, block_size) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [T, Hq, D] and k/v caches [slots, Hkv, D] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError("q and the caches need the same head_dim, and Hq a multiple of Hkv")
    if q.shape[2] not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {q.shape[2]} is not supported (16, 32, 64, 128, 256)")
    if q.dtype != k_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q and caches must share one of fp16/bf16/fp32, got {q.dtype} and {k_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("the last dimension of q and the caches must be contiguous, caches alike")
    if not kernel_pages(block_size):
        raise ValueError(f"block_size must be a power of two >= 16 for the kernel, got {block_size}")
    b = block_tables.shape[0]
    if kv_lens.shape != (b,) or query_start.shape != (b + 1,) or causal.shape != (b,):
        raise ValueError("kv_lens [B], query_start [B + 1] and causal [B] must match block_tables [B, max_blocks]")
    if causal.dtype not in (torch.bool, torch.int32):
        raise ValueError(f"causal must be bool or int32 [B], got {causal.dtype}")
    if step_bits.shape != (q.shape[0],) or step_bits.dtype != torch.int64:
        raise ValueError("step_bits must be int64 [T]")
    if block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32")


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_vt, stride_s,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return  # a padding token
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    k = tl.load(k_ptr + token * stride_kt + offs, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + offs, mask=ok)
    tl.store(k_cache_ptr + slot * stride_s + offs, k, mask=ok)
    tl.store(v_cache_ptr + slot * stride_s + offs, v, mask=ok)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into cache slots [T]; negative slots are skipped.

    Each token's [Hkv, D] row must be contiguous, but tokens may be strided (k
    and v can be column slices of the fused QKV output).
    """
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"k/v must be [T, Hkv, D] matching the cache rows, got {tuple(k.shape)}, {tuple(v.shape)}")
    row = k.shape[1] * k.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name}: each token's [Hkv, D] row must be contiguous, got strides {t.stride()}")
    if not k_cache.is_contiguous() or k_cache.stride() != v_cache.stride():
        raise ValueError("k/v caches must be contiguous [slots, Hkv, D]")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be int64 [T]")
    if k.shape[0]:
        _write_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                        k_cache.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slots_ptr, cos_ptr,
                          sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                          stride_ch, stride_split, num_q_heads, num_kv_heads, SPLITS: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, PDL: tl.constexpr):
    # One program per token: q rotated into q_out; k rotated straight into its cache slot and v
    # copied there, so k is never written out and read back by a second kernel. SPLITS > 0: q, k and v
    # are a QKV product's float32 K-slice partials (`SplitSums`), summed as they are loaded.
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _rotate_q(q_ptr, q_out_ptr, pos_ptr, cos_ptr, sin_ptr, token, stride_qt, stride_qh, num_q_heads,
                         stride_split, SPLITS, HALF, BLOCK_QH)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:  # a negative slot is a padding token: nothing to store
        _rotate_rows(k_ptr + token * stride_kt, k_cache_ptr + slot * stride_cs, stride_kh, stride_ch,
                     num_kv_heads, cos, sin, stride_split, SPLITS, HALF, BLOCK_KH)
        heads = tl.arange(0, BLOCK_KH)
        dims = tl.arange(0, 2 * HALF)
        ok = (heads < num_kv_heads)[:, None]
        v = load_product(v_ptr + token * stride_vt, heads[:, None] * stride_vh + dims[None, :], ok, stride_split,
                         SPLITS, v_cache_ptr.dtype.element_ty)  # [Hkv, D]
        tl.store(v_cache_ptr + slot * stride_cs + heads[:, None] * stride_ch + dims[None, :], v, mask=ok)


def _qkv_sources(q, k, v) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """-> ((q, k, v) as the kernel reads them, K slices, the slices' stride): the tensors themselves (0 slices),
    or, where all three are column views of one QKV product left as `SplitSums`, their float32 parts."""
    kinds = {isinstance(t, SplitSums) for t in (q, k, v)}
    if kinds == {False}:
        return (q, k, v), 0, 0
    parts = [t.parts for t in (q, k, v)] if kinds == {True} else []
    if (not parts or any(p.dtype != torch.float32 or p.stride(0) != parts[0].stride(0) for p in parts)
            or len({p.shape[0] for p in parts}) != 1):
        raise ValueError("rope_write_kv: q, k and v must be all tensors or all views of one product's SplitSums "
                         "(float32 parts of one slice count and stride)")
    return tuple(parts), parts[0].shape[0], parts[0].stride(0)


def rope_write_kv_triton(positions: torch.Tensor, q: torch.Tensor | SplitSums, k: torch.Tensor | SplitSums,
                         v: torch.Tensor | SplitSums, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Checked wrapper of `rope_write_kv_reference`'s contract: returns the rotated q [T, Hq, D].

    q, k, v may be strided column slices of the fused QKV output (last dim contiguous), or views of that
    product left as `SplitSums` (`SplitSums.split` and `.view`), summed as the kernel loads them;
    positions [T] int64; cos/sin [P, D/2] float32; caches [slots, Hkv, D] contiguous.
    """
    t, _, d = q.shape
    half = d // 2
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or k.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"rope_write_kv: q [T, Hq, D], k/v [T, Hkv, D] matching the cache rows; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    (qs, ks, vs), splits, stride_split = _qkv_sources(q, k, v)
    if d % 2 or half & (half - 1) or any(x.stride(-1) != 1 for x in (qs, ks, vs)):
        raise ValueError(f"rope_write_kv: head_dim {d} must be twice a power of two, last dims contiguous")
    if cos.shape != sin.shape or cos.shape[-1] != half or cos.dtype != torch.float32 or not cos.is_contiguous():
        raise ValueError(f"rope_write_kv: cos/sin must be contiguous float32 [positions, {half}]")
    if not k_cache.is_contiguous() or k_cache.stride() != v_cache.stride() or k_cache.dtype != k.dtype:
        raise ValueError("rope_write_kv: k/v caches must be contiguous [slots, Hkv, D] of k's dtype")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64 or positions.shape != (t,):
        raise ValueError("rope_write_kv: slot_mapping int64 [T] and positions [T] expected")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=qs.device)
    if t:
        _rope_write_kv_kernel[(t,)](
            qs, ks, vs, q_out, k_cache, v_cache, positions.contiguous(), slot_mapping, cos, sin,
            qs.stride(-3), qs.stride(-2), ks.stride(-3), ks.stride(-2), vs.stride(-3), vs.stride(-2),
            k_cache.stride(0), k_cache.stride(1), stride_split, q.shape[1], k.shape[1], SPLITS=splits,
            HALF=half, BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            **pdl_options(qs, t))
    return q_out


@triton.jit
def _move_kv_kernel(k_cache_ptr, v_cache_ptr, src_ptr, dst_ptr, n, stride_s, ROW: tl.constexpr,
                    BLOCK: tl.constexpr):
    # One program walks the moves in order: destinations never pass a later source
    # (accepted nodes only move down), so in-order copies need no staging buffer.
    chunk = tl.program_id(0)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ROW
    for i in range(0, n):
        src = tl.load(src_ptr + i)
        dst = tl.load(dst_ptr + i)
        tl.store(k_cache_ptr + dst * stride_s + offs, tl.load(k_cache_ptr + src * stride_s + offs, mask=ok), mask=ok)
        tl.store(v_cache_ptr + dst * stride_s + offs, tl.load(v_cache_ptr + src * stride_s + offs, mask=ok), mask=ok)


def move_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
    """Copy KV rows src -> dst [n] in order; dst[i] <= src[i] and both increasing (compaction)."""
    if src_slots.shape != dst_slots.shape or src_slots.dtype != torch.int64 or dst_slots.dtype != torch.int64:
        raise ValueError("src_slots and dst_slots must be int64 tensors of one shape")
    if not k_cache.is_contiguous() or k_cache.stride() != v_cache.stride():
        raise ValueError("k/v caches must be contiguous [slots, Hkv, D]")
    if src_slots.numel() == 0:
        return
    row = k_cache.shape[1] * k_cache.shape[2]
    block = min(triton.next_power_of_2(row), 1024)
    _move_kv_kernel[(triton.cdiv(row, block),)](k_cache, v_cache, src_slots, dst_slots, src_slots.numel(),
                                                k_cache.stride(0), ROW=row, BLOCK=block)
