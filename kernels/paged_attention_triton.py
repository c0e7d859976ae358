"""Triton kernel for attention over paged KV with causal or tree masks.

Same contract as `paged_attention_reference` in `paged_attention.py` (read its
docstring for the layout). One program owns one (sequence, KV head, tile of
query rows), where a row is a (step token, query head of that KV head's group)
pair: the group's heads share every K/V tile loaded, and so do all the tree
tokens of a sequence, so KV is read once per sequence and KV head rather than
once per query token. K/V are walked one page (block) at a time with an online
softmax in float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, kv_lens_ptr, qstart_ptr, causal_ptr, bits_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_begin = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_begin
    if tile * BLOCK_M >= q_len * GROUP:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    prefix = kv_len - q_len
    causal = tl.load(causal_ptr + seq)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] (token, head-in-group) pairs
    row_ok = rows < q_len * GROUP
    token = rows // GROUP  # step-local token index
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [M, D]
    bits = tl.load(bits_ptr + q_begin + token, mask=row_ok, other=0)  # [M] int64

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    keys = tl.arange(0, PAGE)
    for page in range(0, tl.cdiv(kv_len, PAGE)):
        block = tl.load(tables_ptr + seq * stride_tb + page).to(tl.int64)
        logical = page * PAGE + keys  # [N]
        slots = block * PAGE + keys
        key_ok = logical < kv_len
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=key_ok[:, None], other=0.0)  # [N, D]
        v = tl.load(v_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [M, N]
        step = logical - prefix  # [N] index among the step's tokens (negative: prefix)
        in_step = step >= 0
        step_c = tl.where(in_step, step, 0)
        shift = tl.minimum(step_c, 63).to(tl.int64)  # causal chunks may exceed 64 tokens; bits unused there
        tree_ok = ((bits[:, None] >> shift[None, :]) & 1) != 0
        causal_ok = step_c[None, :] <= token[:, None]
        own_ok = tl.where(causal != 0, causal_ok, tree_ok)
        visible = key_ok[None, :] & ((~in_step[None, :]) | own_ok)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_begin + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, query_start: torch.Tensor,
                           causal: torch.Tensor, step_bits: torch.Tensor, block_size: int,
                           max_query_len: int, scale: float | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Checked wrapper: shapes, dtypes and strides, then one launch for the whole batch.

    max_query_len: an upper bound on any sequence's step tokens (sizes the grid
    without reading query_start back to the host).
    """
    _check(q, k_cache, v_cache, block_tables, kv_lens, query_start, causal, step_bits, block_size)
    num_seqs = block_tables.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_m = 64 if max_query_len * group >= 64 else 16
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len * group, block_m))
    out = torch.empty_like(q) if out is None else out
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, kv_lens, query_start, causal.to(torch.int32), step_bits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale if scale is not None else 1.0 / math.sqrt(head_dim),
        GROUP=group, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_M=block_m,
    )
    return out


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
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 for the kernel, got {block_size}")
    b = block_tables.shape[0]
    if kv_lens.shape != (b,) or query_start.shape != (b + 1,) or causal.shape != (b,):
        raise ValueError("kv_lens [B], query_start [B + 1] and causal [B] must match block_tables [B, max_blocks]")
    if step_bits.shape != (q.shape[0],) or step_bits.dtype != torch.int64:
        raise ValueError("step_bits must be int64 [T]")
    if block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32")


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_t, stride_s,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return  # a padding token
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    k = tl.load(k_ptr + token * stride_t + offs, mask=ok)
    v = tl.load(v_ptr + token * stride_t + offs, mask=ok)
    tl.store(k_cache_ptr + slot * stride_s + offs, k, mask=ok)
    tl.store(v_cache_ptr + slot * stride_s + offs, v, mask=ok)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (contiguous) into cache slots [T]; negative slots are skipped."""
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[1:] or not k.is_contiguous() or not v.is_contiguous():
        raise ValueError(f"k/v must be contiguous [T, Hkv, D] matching the cache rows, got {tuple(k.shape)}")
    if not k_cache.is_contiguous() or k_cache.stride() != v_cache.stride():
        raise ValueError("k/v caches must be contiguous [slots, Hkv, D]")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be int64 [T]")
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k_cache.stride(0),
                                    ROW=row, BLOCK=triton.next_power_of_2(row))


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
