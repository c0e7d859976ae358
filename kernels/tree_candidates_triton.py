"""A decode step's candidate tokens in one Triton launch: one program per batch row.

Same contract as `gather_candidates_reference` in `tree_candidates.py`: the
row's root, its heads' proposals at each head node and its lookup chain, read
in place from the step's state buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from medusa.decoding.device_tree import DeviceTree


@triton.jit
def _candidates_kernel(rows_ptr, roots_ptr, topk_ptr, head_ptr, rank_ptr, lookup_ptr, out_ptr, n, first_lookup,
                       stride_row, stride_head, stride_lookup, NODES: tl.constexpr, HAS_LOOKUP: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i)
    j = tl.arange(0, NODES)
    node = j < n
    head_node = (j >= 1) & (j < first_lookup)
    head = tl.load(head_ptr + j - 1, mask=head_node, other=0)  # which head proposes node j, at which rank
    rank = tl.load(rank_ptr + j - 1, mask=head_node, other=0)
    token = tl.load(topk_ptr + row * stride_row + head * stride_head + rank, mask=head_node, other=0)
    token = tl.where(j == 0, tl.load(roots_ptr + row), token)
    if HAS_LOOKUP:
        chain = node & (j >= first_lookup)
        token = tl.where(chain, tl.load(lookup_ptr + i * stride_lookup + j - first_lookup, mask=chain, other=0),
                         token)
    tl.store(out_ptr + i * n + j, token, mask=node)


def gather_candidates_triton(tree: DeviceTree, rows: torch.Tensor, roots: torch.Tensor, topk: torch.Tensor | None,
                             lookup: torch.Tensor | None = None) -> torch.Tensor:
    """See `gather_candidates` in tree_candidates.py; checks shapes, dtypes and devices, then one launch."""
    b, n, first = rows.shape[0], tree.num_nodes, tree.first_lookup_node
    device = roots.device
    for name, tensor, dims in (("rows", rows, 1), ("roots", roots, 1), ("topk", topk, 3), ("lookup", lookup, 2)):
        if tensor is not None and (tensor.dtype != torch.long or tensor.device != device or tensor.dim() != dims
                                   or tensor.stride(-1) != 1):
            raise ValueError(f"gather_candidates: {name} must be a {dims}-D torch.int64 tensor on {device} with a "
                             f"contiguous last dimension, got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
    # host-side bounds (reading the device tree's tensors here would synchronise inside a graph capture)
    if first > 1 and (topk is None or topk.shape[1] < tree.spec.head_depth or topk.shape[2] < tree.max_topk):
        raise ValueError(f"gather_candidates: tree {tree.spec.label!r} reads {tree.spec.head_depth} heads' top "
                         f"{tree.max_topk}: topk [R, K, kmax] must hold them, got "
                         f"{None if topk is None else tuple(topk.shape)}")
    if tree.num_lookup and (lookup is None or lookup.shape[0] != b or lookup.shape[1] < tree.num_lookup):
        raise ValueError(f"gather_candidates: tree {tree.spec.label!r} has {tree.num_lookup} prompt-lookup nodes: "
                         f"lookup must be [{b}, >= {tree.num_lookup}], got {None if lookup is None else tuple(lookup.shape)}")
    out = torch.empty(b, n, dtype=torch.long, device=device)
    if b:
        # a tree without head nodes (or chain) reads none of those tensors: any non-empty one will do
        heads, index, ranks = (topk, tree.head_index, tree.ranks) if first > 1 else (roots, roots, roots)
        chain = lookup if tree.num_lookup else roots
        _candidates_kernel[(b,)](rows, roots, heads, index, ranks, chain, out, n, first,
                                 heads.stride(0) if first > 1 else 0, heads.stride(1) if first > 1 else 0,
                                 chain.stride(0) if tree.num_lookup else 0, NODES=triton.next_power_of_2(n),
                                 HAS_LOOKUP=tree.num_lookup > 0)
    return out
