"""Medusa candidate trees: a set of top-k rank paths and the tensors derived from it.

A path is a tuple of top-k ranks. ``(0,)`` is head 0's top-1 token; ``(0, 1)`` is
head 1's top-2 token placed after it. Node 0 is the root: the token the base model
already chose. The node for path ``p`` sits at depth ``len(p)`` and carries token
``topk(head[len(p) - 1])[p[-1]]``. Nodes are numbered root first, then paths in
canonical order (by depth, then lexicographic), so a parent always precedes its
children and every tensor below can be built in one forward sweep.

A tree may also carry a prompt-lookup chain (``lookup=L``): L more nodes after the
head nodes, lookup node i at depth i + 1 whose parent is lookup node i - 1 (the
first's is the root). No head proposes them: the engine fills them with the tokens
that followed the latest earlier occurrence of the sequence's last few tokens
(`decoding/prompt_lookup.py`), so the chain may be deeper than the heads reach.

The spec is immutable; its tensors are computed once on first use and shared, so
callers must not modify them in place.
"""

from __future__ import annotations

import heapq
import json
import numbers
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from medusa.paths import tree_dirs

TreePath = tuple[int, ...]
MAX_NODES = 64  # the engine's kernels pack a node's ancestors into one int64
MAX_RANK = 2**31 - 1  # a rank past any vocabulary (heads check theirs: `check_heads`); int32 on the device
LOOKUP_SUFFIX = "+lookup"  # with_lookup names a variant "<name>+lookup<L>"


def _canonical_key(path: TreePath) -> tuple[int, TreePath]:
    return (len(path), path)


def _check_path(path: Any) -> TreePath:
    """One path as a tuple of ints, or a ValueError that names it."""
    if not isinstance(path, (tuple, list)):
        raise ValueError(f"path {path!r} is not a sequence of top-k ranks")
    if len(path) == 0:
        raise ValueError("path () is empty; the root is implicit, leave it out")
    for rank in path:
        # bool is an Integral, but True as a rank is certainly a bug
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool):
            raise ValueError(f"path {tuple(path)!r} has a non-integer rank {rank!r}")
        if rank < 0:
            raise ValueError(f"path {tuple(path)!r} has a negative rank {rank}")
        if rank > MAX_RANK:
            raise ValueError(f"path {tuple(path)!r} has a rank {rank} past any vocabulary (at most {MAX_RANK})")
    return tuple(int(r) for r in path)


def _canonical_paths(paths: Iterable[Any]) -> tuple[TreePath, ...]:
    """Validate and sort: unique, prefix-closed, ordered by depth then lexicographic."""
    if isinstance(paths, (str, bytes)):
        raise ValueError(f"paths must be a sequence of paths, got {paths!r}")
    checked = [_check_path(p) for p in paths]
    seen: set[TreePath] = set()
    for p in checked:
        if p in seen:
            raise ValueError(f"path {p!r} appears more than once")
        seen.add(p)
    ordered = sorted(checked, key=_canonical_key)
    # Checking the immediate prefix suffices: by induction all shorter ones exist.
    for p in ordered:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(
                f"path {p!r} is missing its prefix {p[:-1]!r}; paths must be prefix-closed"
            )
    return tuple(ordered)


def _accuracy_table(accuracies: Any) -> torch.Tensor:
    """accuracies[h][r] = P(head h's rank-r token is correct), as float64 [num_heads, K]."""
    table = torch.as_tensor(accuracies, dtype=torch.float64)
    if table.ndim != 2:
        raise ValueError(f"accuracies must be 2-D [num_heads, K], got shape {tuple(table.shape)}")
    if not bool(torch.isfinite(table).all()) or bool((table < 0).any() or (table > 1).any()):
        raise ValueError("accuracies must be probabilities in [0, 1]")
    return table


@dataclass(frozen=True, repr=False)
class TreeSpec:
    """A validated Medusa tree. ``paths`` excludes the root and is stored canonically;
    ``lookup`` is the length of the prompt-lookup chain after the head nodes (0: none)."""

    paths: tuple[TreePath, ...] = ()
    # Labels only: two specs with the same paths and lookup chain are the same tree.
    name: str | None = field(default=None, compare=False)
    description: str = field(default="", compare=False)
    lookup: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", _canonical_paths(self.paths))
        if self.name is not None and not isinstance(self.name, str):
            raise ValueError(f"tree name must be a string, got {self.name!r}")
        if not isinstance(self.lookup, numbers.Integral) or isinstance(self.lookup, bool) or self.lookup < 0:
            raise ValueError(f"lookup (the prompt-lookup chain's length) must be an integer >= 0, "
                             f"got {self.lookup!r}")
        object.__setattr__(self, "lookup", int(self.lookup))
        if not isinstance(self.description, str):
            raise ValueError(f"tree description must be a string, got {self.description!r}")

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], num_heads: int | None = None,
                   name: str | None = None, description: str = "") -> "TreeSpec":
        spec = cls(tuple(paths), name=name, description=description)
        if num_heads is not None:
            spec.check_heads(num_heads)
        return spec

    @classmethod
    def chain(cls, n: int, name: str | None = None) -> "TreeSpec":
        """Top-1 of each of the first n heads: plain (non-tree) speculation, n + 1 nodes."""
        if n < 0:
            raise ValueError(f"chain length must be >= 0, got {n}")
        return cls(tuple((0,) * d for d in range(1, n + 1)), name=name)

    def with_lookup(self, length: int) -> "TreeSpec":
        """These head nodes plus a prompt-lookup chain of `length` nodes (0: the plain tree).

        To stay within MAX_NODES, only the first MAX_NODES - length head nodes (root
        included) are kept: canonical order puts every parent before its children, so
        a prefix of the paths is still prefix-closed.
        """
        if not isinstance(length, numbers.Integral) or isinstance(length, bool) \
                or not 0 <= length <= MAX_NODES - 1:
            raise ValueError(f"lookup length must be an integer in [0, {MAX_NODES - 1}], got {length!r}")
        keep = MAX_NODES - 1 - length  # head paths that fit beside the root and the chain
        base = self.name.rsplit(LOOKUP_SUFFIX, 1)[0] if self.name and self.lookup else self.name
        name = f"{base}{LOOKUP_SUFFIX}{length}" if base and length else base
        return TreeSpec(self.paths[:keep], name=name, description=self.description, lookup=int(length))

    def check_heads(self, num_heads: int, vocab_size: int | None = None) -> None:
        """Raise if some path is deeper than the positions the heads predict (the lookup
        chain needs no head and may be deeper), or, given the heads' vocabulary, ranks past it."""
        for p in self.paths:
            if len(p) > num_heads:
                raise ValueError(
                    f"path {p!r} has depth {len(p)} but the heads predict only "
                    f"{num_heads} positions"
                )
            if vocab_size is not None and max(p) >= vocab_size:
                raise ValueError(f"path {p!r} uses rank {max(p)}, but the heads rank a vocabulary of "
                                 f"{vocab_size} tokens (ranks 0 to {vocab_size - 1})")

    def __hash__(self) -> int:
        # The dataclass hash would hash every path on every call; the engine's tree policy
        # looks trees up in dicts dozens of times a step
        return self._hash

    def __copy__(self) -> TreeSpec:
        return self

    def __deepcopy__(self, memo: dict) -> TreeSpec:
        # immutable: a copy of a tree policy (LLMEngine.sampled_policy) must hold the same trees, which its
        # decisions and revisits compare by identity with the trees the engine's steps ran
        return self

    @cached_property
    def _hash(self) -> int:
        return hash((self.paths, self.lookup))  # the fields equality compares

    # ---- derived shape and tensors ------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return 1 + len(self.paths) + self.lookup

    @property
    def label(self) -> str:
        """How statistics and reports name this tree: its name, else its size."""
        return self.name or f"{self.num_nodes}-node tree"

    @property
    def first_lookup_node(self) -> int:
        """Index of the first prompt-lookup node (== num_nodes when there is no chain)."""
        return 1 + len(self.paths)

    @property
    def head_depth(self) -> int:
        """Depth of the deepest head node: how many heads the tree needs."""
        return len(self.paths[-1]) if self.paths else 0

    @property
    def max_depth(self) -> int:
        return max(self.head_depth, self.lookup)

    @cached_property
    def _index(self) -> dict[TreePath, int]:
        return {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}

    @cached_property
    def parents(self) -> torch.Tensor:  # [N] long, root -1
        idx, first = self._index, self.first_lookup_node
        chain = [0] + list(range(first, first + self.lookup - 1))  # the root, then the previous lookup node
        return torch.tensor([-1] + [idx[p[:-1]] for p in self.paths] + chain[: self.lookup], dtype=torch.long)

    @cached_property
    def parent_ids(self) -> tuple[int, ...]:  # `parents` as host ints, for loops over the nodes
        return tuple(self.parents.tolist())

    @cached_property
    def depths(self) -> torch.Tensor:  # [N] long, root 0
        chain = list(range(1, self.lookup + 1))
        return torch.tensor([0] + [len(p) for p in self.paths] + chain, dtype=torch.long)

    @cached_property
    def node_paths(self) -> tuple[tuple[int, ...], ...]:
        """Node i's path below the root, as node ids in depth order (i itself last; the root's is empty)."""
        parents, paths = self.parent_ids, [()]
        for i in range(1, self.num_nodes):  # parents precede children
            paths.append(paths[parents[i]] + (i,))
        return tuple(paths)

    @property
    def position_offsets(self) -> torch.Tensor:  # [N]: a node's position = root position + depth
        return self.depths

    @cached_property
    def ranks(self) -> torch.Tensor:  # [N] long, root and lookup nodes 0
        return torch.tensor([0] + [p[-1] for p in self.paths] + [0] * self.lookup, dtype=torch.long)

    @cached_property
    def head_index(self) -> torch.Tensor:  # [N] long
        """Which Medusa head proposes each node's token: depth - 1; the root and the lookup
        nodes have -1 because no Medusa head proposes them (the base model's LM head and
        an n-gram match do)."""
        index = self.depths - 1
        index[self.first_lookup_node:] = -1
        return index

    @cached_property
    def attention_mask(self) -> torch.Tensor:  # [N, N] bool, mask[i, j]: j is ancestor-or-self of i
        n = self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool)
        parents = self.parent_ids
        for i in range(n):
            if parents[i] >= 0:  # parents precede children, so their row is complete
                mask[i] = mask[parents[i]]
            mask[i, i] = True
        return mask

    @cached_property
    def is_leaf(self) -> torch.Tensor:  # [N] bool
        leaf = torch.ones(self.num_nodes, dtype=torch.bool)
        leaf[self.parents[1:]] = False
        return leaf

    @property
    def num_leaves(self) -> int:
        return int(self.is_leaf.sum())

    @cached_property
    def retrieve_indices(self) -> torch.Tensor:  # [num_leaves, max_depth + 1] long, -1 padded
        """Node indices along each root-to-leaf path (root first), one row per leaf in
        node order; the verifier reads candidate sequences and their logits through it."""
        parents = self.parent_ids
        rows = []
        for leaf in torch.nonzero(self.is_leaf).flatten().tolist():
            chain = [leaf]
            while parents[chain[-1]] >= 0:
                chain.append(parents[chain[-1]])
            chain.reverse()
            rows.append(chain + [-1] * (self.max_depth + 1 - len(chain)))
        return torch.tensor(rows, dtype=torch.long)

    @cached_property
    def topk_per_depth(self) -> tuple[int, ...]:
        """For depth d = 1..head_depth, how many top-k candidates head d-1 must supply."""
        k = [0] * self.head_depth
        for p in self.paths:
            k[len(p) - 1] = max(k[len(p) - 1], p[-1] + 1)
        return tuple(k)

    @cached_property
    def ancestor_bits(self) -> torch.Tensor:  # [N] int64: bit j set iff mask[i, j]
        """The attention mask packed one row per int64, for kernels. Bit 63 is the
        sign bit, so node 63's bit makes the value negative; test bits with shifts."""
        if self.num_nodes > 64:
            raise ValueError(
                f"ancestor_bits packs the mask into int64 and needs <= 64 nodes; "
                f"tree {self.name!r} has {self.num_nodes}"
            )
        parents = self.parent_ids
        bits = [0] * self.num_nodes
        for i in range(self.num_nodes):
            bits[i] = (bits[parents[i]] if parents[i] >= 0 else 0) | (1 << i)
        signed = [b - (1 << 64) if b >= (1 << 63) else b for b in bits]
        return torch.tensor(signed, dtype=torch.int64)

    # ---- acceptance model and search -----------------------------------------------

    def expected_accept_length(self, accuracies: Any) -> float:
        """Expected tokens per step: 1 (the root) + sum over nodes of the product of
        per-head marginal accuracies along the node's path (Medusa's independence
        approximation). accuracies: [num_heads, K] array-like. The lookup chain is left
        out: a conservative prior that the engine's observed acceptance corrects."""
        table = _accuracy_table(accuracies)
        num_heads, k = table.shape
        prob = {(): 1.0}
        for p in self.paths:  # canonical order: the parent is already done
            if len(p) > num_heads:
                raise ValueError(f"path {p!r} needs head {len(p) - 1} but accuracies "
                                 f"cover only {num_heads} heads")
            if p[-1] >= k:
                raise ValueError(f"path {p!r} uses rank {p[-1]} of head {len(p) - 1} but "
                                 f"accuracies give only {k} ranks")
            prob[p] = prob[p[:-1]] * float(table[len(p) - 1, p[-1]])
        return sum(prob.values())

    @classmethod
    def search(cls, accuracies: Any, num_nodes: int, name: str | None = None) -> "TreeSpec":
        """Greedy tree of num_nodes nodes (root included) maximising the expected accept
        length: repeatedly add the frontier path of highest probability. Since every
        accuracy is <= 1 a child is never likelier than its parent, so this picks the
        top paths overall and is optimal for the expectation. Ties go to the path
        first in canonical order, so the result is deterministic."""
        table = _accuracy_table(accuracies)
        num_heads, k = table.shape
        acc = table.tolist()
        capacity = sum(k**d for d in range(num_heads + 1))
        if not 1 <= num_nodes <= capacity:
            raise ValueError(f"num_nodes must be in [1, {capacity}] for {num_heads} heads "
                             f"and top-{k}, got {num_nodes}")
        # heap entries: (-probability, depth, path); depth then path = canonical order
        frontier: list[tuple[float, int, TreePath]] = []

        def push_children(parent: TreePath, prob: float) -> None:
            if len(parent) < num_heads:
                for r in range(k):
                    heapq.heappush(frontier, (-prob * acc[len(parent)][r], len(parent) + 1,
                                              parent + (r,)))

        push_children((), 1.0)
        chosen: list[TreePath] = []
        while len(chosen) + 1 < num_nodes:
            neg_prob, _, path = heapq.heappop(frontier)
            chosen.append(path)
            push_children(path, -neg_prob)
        return cls(tuple(chosen), name=name)

    # ---- serialisation ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """"lookup" appears only for a tree that has a chain, so plain trees keep their files."""
        d = {"name": self.name, "description": self.description, "paths": [list(p) for p in self.paths]}
        if self.lookup:
            d["lookup"] = self.lookup
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TreeSpec":
        if not isinstance(d, dict):
            raise ValueError(f"a tree spec is a JSON object with 'paths' (and optionally name, description, "
                             f"lookup), got a {type(d).__name__}")
        unknown = set(d) - {"name", "description", "paths", "lookup"}
        if unknown:
            raise ValueError(f"unknown tree spec keys {sorted(unknown)}; "
                             f"expected name, description, paths, lookup")
        if "paths" not in d:
            raise ValueError("tree spec has no 'paths'")
        if not isinstance(d["paths"], (list, tuple)):
            raise ValueError(f"tree spec 'paths' must be a list of paths (lists of top-k ranks), got {d['paths']!r}")
        spec = cls(tuple(d["paths"]), name=d.get("name"), description=d.get("description", ""),
                   lookup=d.get("lookup", 0))
        if spec.num_nodes > MAX_NODES:  # a spec in code may be larger (the tree math has no limit); a file may not
            raise ValueError(f"a tree holds at most {MAX_NODES} nodes (the engine's kernels pack a node's ancestors "
                             f"into one int64), this one {spec.num_nodes}: the root, {len(spec.paths)} head paths"
                             + (f" and a lookup chain of {spec.lookup}" if spec.lookup else ""))
        return spec

    def save(self, path: str | Path) -> None:
        Path(path).write_text(_format_json(self.to_dict()))

    @classmethod
    def load(cls, path_or_name: str | Path) -> "TreeSpec":
        """Load a JSON file, or a named tree when given a bare name: a shipped one (configs/trees) or one
        `medusa-train train --tree-name` wrote (medusa.paths.user_trees_dir). A bare name that is no tree's
        but an existing file is read as the file."""
        if not isinstance(path_or_name, (str, Path)):
            raise ValueError(f"a tree is a name (say 'tree-16'), a JSON file's path or a TreeSpec, "
                             f"got {path_or_name!r}")
        text = str(path_or_name)
        is_name = (isinstance(path_or_name, str) and "/" not in text and "\\" not in text
                   and not text.endswith(".json"))
        if is_name:
            file = next((d / f"{text}.json" for d in tree_dirs() if (d / f"{text}.json").is_file()), None)
            if file is None and Path(text).is_file():
                file, is_name = Path(text), False
            if file is None:
                raise ValueError(f"unknown tree {text!r}; available: "
                                 f"{', '.join(available_trees()) or '(none)'} (or a JSON file's path)")
        else:
            file = Path(path_or_name)
        data = _read_json(file)
        try:
            spec = cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"tree file {file}: {err}") from None
        if spec.name is None and is_name:
            spec = cls(spec.paths, name=text, description=spec.description, lookup=spec.lookup)
        return spec

    def __repr__(self) -> str:
        lookup = f", lookup={self.lookup}" if self.lookup else ""
        return f"TreeSpec(name={self.name!r}, nodes={self.num_nodes}, depth={self.max_depth}{lookup})"


def _read_json(file: Path) -> Any:
    """A tree file's JSON (a UTF-8 BOM, as some editors write, allowed); a ValueError naming the file when it is
    a directory, not UTF-8 text or not JSON (a missing file stays a FileNotFoundError)."""
    if file.is_dir():
        raise ValueError(f"tree file {file} is a directory")
    try:
        return json.loads(file.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError:
        raise ValueError(f"tree file {file} is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"tree file {file} is not valid JSON: {err.msg} at line {err.lineno} column "
                         f"{err.colno}") from None


def _format_json(d: dict[str, Any]) -> str:
    """JSON with one path per line: readable and diffable, unlike indent=2's one int per line."""
    paths = ",\n".join(f"    {json.dumps(p)}" for p in d["paths"])
    paths = f"[\n{paths}\n  ]" if paths else "[]"
    lookup = f',\n  "lookup": {d["lookup"]}' if "lookup" in d else ""
    return ("{\n"
            f'  "name": {json.dumps(d["name"])},\n'
            f'  "description": {json.dumps(d["description"])},\n'
            f'  "paths": {paths}{lookup}\n'
            "}\n")


def available_trees() -> list[str]:
    """Names of the shipped trees (configs/trees) and of the user's named trees, sorted."""
    return sorted({p.stem for d in tree_dirs() for p in d.glob("*.json")})
