"""A step's verdict and acceptance in one Triton launch each, one program per row (`tree_accept.py`
has the contract).

verdict: node i passes if it is the root or its token is its parent's target; with the tree's
ancestor-or-self bits (one int64 per node, <= 64 nodes) a node's path passes if none of its bits
is a failing node's, and the best node is the first of the deepest such. accept: the row's path
(`DeviceTree.paths[best]`, D + 1 nodes) gives the tokens, the KV moves and the bookkeeping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.decoding.device_tree import DeviceTree


@triton.jit
def _verdict_kernel(cand_ptr, target_ptr, parents_ptr, bits_ptr, depths_ptr, best_ptr, next_ptr, N,
                    BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, BLOCK_N)
    real = node < N
    child = real & (node > 0)
    parent = tl.load(parents_ptr + node, mask=child, other=0)
    ok = (node == 0) | (tl.load(cand_ptr + b * N + node, mask=child, other=0)
                        == tl.load(target_ptr + b * N + parent, mask=child, other=0))
    one = tl.full([BLOCK_N], 1, tl.int64)
    failing = tl.sum(tl.where(real & ~ok, one << node.to(tl.int64), 0), 0)  # distinct bits: the sum is an OR
    path_ok = real & ((tl.load(bits_ptr + node, mask=real, other=0) & failing) == 0)
    score = tl.where(path_ok, tl.load(depths_ptr + node, mask=real, other=0), -1)
    best = tl.min(tl.where(score == tl.max(score, 0), node, BLOCK_N), 0)  # the first of the deepest
    tl.store(best_ptr + b, best.to(tl.int64))
    tl.store(next_ptr + b, tl.load(target_ptr + b * N + best))


@triton.jit
def _accept_kernel(cand_ptr, best_ptr, next_ptr, paths_ptr, depths_ptr, slots_ptr, rows_ptr, roots_ptr, base_ptr,
                   hist_ptr, hist_len_ptr, packed_ptr, src_ptr, dst_ptr, N, padding_row, hist_stride, spare,
                   P: tl.constexpr, BLOCK_P: tl.constexpr, HISTORY: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    best = tl.load(best_ptr + b)
    nxt = tl.load(next_ptr + b)
    row = tl.load(rows_ptr + b)
    count = tl.load(depths_ptr + best) + 1
    j = tl.arange(0, BLOCK_P)  # depth along the path
    on_path = j < P
    path = tl.load(paths_ptr + best * P + j, mask=on_path, other=0)  # [BLOCK_P] node at depth j
    child = tl.load(paths_ptr + best * P + j + 1, mask=j + 1 < P, other=0)  # the node a depth below
    drafts = tl.load(cand_ptr + b * N + child, mask=j + 1 < P, other=0)
    tokens = tl.where(j == count - 1, nxt, drafts)  # [BLOCK_P]: the accepted drafts, then next
    out = packed_ptr + b * (P + 2)
    tl.store(out, count)
    tl.store(out + 1 + j, tokens, mask=on_path)
    tl.store(out + P + 1, best)
    dst = tl.load(slots_ptr + b * N + j, mask=on_path, other=0)
    src = tl.where(j < count, tl.load(slots_ptr + b * N + path, mask=on_path, other=0), dst)
    tl.store(src_ptr + b * P + j, src, mask=on_path)
    tl.store(dst_ptr + b * P + j, dst, mask=on_path)
    tl.store(roots_ptr + row, nxt)
    padding = row == padding_row
    tl.store(base_ptr + row, tl.where(padding, 0, tl.load(base_ptr + row) + count))
    if HISTORY:
        length = tl.load(hist_len_ptr + row)
        column = tl.minimum(tl.where(j < count, length + j, spare), spare)
        tl.store(hist_ptr + row * hist_stride + column, tokens, mask=on_path)
        tl.store(hist_len_ptr + row, tl.where(padding, 0, tl.minimum(length + count, spare)))


def _check_int64(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.long or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous int64 tensors, got {t.dtype} with strides {t.stride()}")


def verdict_triton(tree: DeviceTree, candidates: torch.Tensor, targets: torch.Tensor, best: torch.Tensor,
                   next_tokens: torch.Tensor) -> None:
    n = tree.num_nodes
    if tree.bits is None or candidates.shape[1] != n or targets.shape != candidates.shape:
        raise ValueError(f"verdict: a tree of <= 64 nodes and candidates, targets [B, {n}], got "
                         f"{tuple(candidates.shape)} and {tuple(targets.shape)} for {n} nodes")
    _check_int64("verdict", candidates, targets, best, next_tokens)
    _verdict_kernel[(candidates.shape[0],)](candidates, targets, tree.parents, tree.bits, tree.depths, best,
                                            next_tokens, n, BLOCK_N=max(16, triton.next_power_of_2(n)), num_warps=1)


def accept_triton(tree: DeviceTree, candidates: torch.Tensor, best: torch.Tensor, next_tokens: torch.Tensor,
                  slots: torch.Tensor, rows: torch.Tensor, roots: torch.Tensor, row_base: torch.Tensor,
                  padding_row: int, history: torch.Tensor | None = None,
                  history_len: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, n = candidates.shape
    if slots.shape != candidates.shape or best.shape != (batch,) or rows.shape != (batch,):
        raise ValueError(f"accept: candidates and slots [B, N], best and rows [B], got {tuple(candidates.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(best.shape)}, {tuple(rows.shape)}")
    _check_int64("accept", candidates, best, next_tokens, slots, rows, roots, row_base)
    width = tree.paths.shape[1]  # D + 1
    packed = torch.empty(batch, width + 2, dtype=torch.long, device=candidates.device)
    src = torch.empty(batch * width, dtype=torch.long, device=candidates.device)
    dst = torch.empty_like(src)
    with_history = history is not None
    _accept_kernel[(batch,)](
        candidates, best, next_tokens, tree.paths, tree.depths, slots, rows, roots, row_base,
        history if with_history else roots, history_len if with_history else roots, packed, src, dst, n,
        padding_row, history.stride(0) if with_history else 0, history.shape[1] - 1 if with_history else 0,
        P=width, BLOCK_P=max(16, triton.next_power_of_2(width)), HISTORY=with_history, num_warps=1)
    return packed, src, dst
