"""Tests for medusa.tree: validation, derived tensors, acceptance model, search, JSON I/O."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from medusa.tree import TreeSpec, available_trees

# The assumed profile the named trees in configs/trees were generated from.
PROFILE = [
    [0.45, 0.12, 0.06, 0.04, 0.03, 0.02, 0.02, 0.015, 0.01, 0.01],
    [0.28, 0.09, 0.05, 0.03, 0.025, 0.02, 0.015, 0.01, 0.01, 0.01],
    [0.19, 0.07, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01, 0.01, 0.01],
    [0.15, 0.06, 0.035, 0.025, 0.02, 0.015, 0.01, 0.01, 0.01, 0.01],
]
NAMED_NODE_COUNTS = {"single": 1, "chain-3": 4, "chain-4": 5, "tree-4": 4, "tree-8": 8,
                     "tree-16": 16, "tree-32": 32, "tree-64": 64}
SEEDS = range(40)


def random_paths(seed: int, max_nodes: int = 70, max_depth: int = 6, max_rank: int = 5) -> list:
    """A random prefix-closed path set grown from the root, returned shuffled."""
    rng = random.Random(seed)
    paths: list[tuple[int, ...]] = []
    present = {()}
    target = rng.randint(0, max_nodes)
    for _ in range(20 * max_nodes):
        if len(paths) >= target:
            break
        parent = rng.choice(sorted(present, key=lambda p: (len(p), p)))
        child = parent + (rng.randrange(max_rank),)
        if len(child) <= max_depth and child not in present:
            present.add(child)
            paths.append(child)
    rng.shuffle(paths)
    return paths


def random_tree(seed: int) -> TreeSpec:
    return TreeSpec.from_paths(random_paths(seed), name=f"random-{seed}")


def tensors(spec: TreeSpec) -> dict:
    out = {k: getattr(spec, k) for k in ("parents", "depths", "ranks", "head_index",
                                           "attention_mask", "retrieve_indices")}
    if spec.num_nodes <= 64:
        out["ancestor_bits"] = spec.ancestor_bits
    return out


def assert_same(a: TreeSpec, b: TreeSpec) -> None:
    assert a == b and a.paths == b.paths and a.name == b.name
    assert a.topk_per_depth == b.topk_per_depth
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("seed", SEEDS)
def test_roundtrip_dict_and_file(seed, tmp_path):
    spec = random_tree(seed)
    if spec.num_nodes > 64:  # the tree math has no limit, but a tree from a file is one the engine can run
        with pytest.raises(ValueError, match="at most 64 nodes"):
            TreeSpec.from_dict(spec.to_dict())
        return
    assert_same(spec, TreeSpec.from_dict(spec.to_dict()))
    file = tmp_path / "t.json"
    spec.save(file)
    assert_same(spec, TreeSpec.load(file))
    assert_same(spec, TreeSpec.load(str(file)))


@pytest.mark.parametrize("seed", SEEDS)
def test_paths_are_canonical_and_nodes_consistent(seed):
    spec = random_tree(seed)
    assert list(spec.paths) == sorted(spec.paths, key=lambda p: (len(p), p))
    n = spec.num_nodes
    assert n == 1 + len(spec.paths)
    assert spec.parents.shape == spec.depths.shape == spec.ranks.shape == (n,)
    assert spec.parents[0] == -1 and spec.depths[0] == 0 and spec.ranks[0] == 0
    assert spec.head_index[0] == -1
    assert spec.position_offsets is spec.depths
    paths = [()] + list(spec.paths)
    for i in range(1, n):
        p = paths[i]
        parent = int(spec.parents[i])
        assert 0 <= parent < i and paths[parent] == p[:-1]
        assert spec.depths[i] == len(p) and spec.ranks[i] == p[-1]
        assert spec.head_index[i] == len(p) - 1
    assert spec.max_depth == max((len(p) for p in spec.paths), default=0)
    expect_k = [1 + max(p[-1] for p in spec.paths if len(p) == d)
                for d in range(1, spec.max_depth + 1)]
    assert list(spec.topk_per_depth) == expect_k


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_mask(seed):
    spec = random_tree(seed)
    n, mask, parents = spec.num_nodes, spec.attention_mask, spec.parents
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    assert mask.diagonal().all()  # reflexive
    paths = [()] + list(spec.paths)
    for i in range(n):
        for j in range(n):
            # j is visible to i iff j's path is a prefix of i's path
            assert bool(mask[i, j]) == (paths[i][: len(paths[j])] == paths[j])
        if i > 0:  # consistent with parents: own row = parent's row + self
            expect = mask[parents[i]].clone()
            expect[i] = True
            assert torch.equal(mask[i], expect)
    # ancestor-closed: whatever i sees, it also sees everything that node sees
    m = mask.long()
    assert torch.equal((m @ m) > 0, mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_retrieve_indices(seed):
    spec = random_tree(seed)
    ri, parents, depths = spec.retrieve_indices, spec.parents, spec.depths
    leaves = [i for i in range(spec.num_nodes) if i not in set(parents.tolist())]
    assert ri.shape == (len(leaves), spec.max_depth + 1) == (spec.num_leaves, spec.max_depth + 1)
    seen_leaves, seen_nodes = [], set()
    for row in ri.tolist():
        valid = [x for x in row if x >= 0]
        assert row == valid + [-1] * (len(row) - len(valid))  # padding only at the end
        assert valid[0] == 0
        for t, node in enumerate(valid):
            assert depths[node] == t
            if t:
                assert parents[node] == valid[t - 1]
        seen_leaves.append(valid[-1])
        seen_nodes.update(valid)
    assert sorted(seen_leaves) == leaves  # every leaf exactly once
    assert seen_nodes == set(range(spec.num_nodes))


@pytest.mark.parametrize("seed", SEEDS)
def test_ancestor_bits_match_mask(seed):
    spec = random_tree(seed)
    if spec.num_nodes > 64:
        with pytest.raises(ValueError, match="64"):
            spec.ancestor_bits
        return
    bits = spec.ancestor_bits
    assert bits.dtype == torch.int64 and bits.shape == (spec.num_nodes,)
    j = torch.arange(spec.num_nodes)
    unpacked = ((bits[:, None] >> j[None, :]) & 1).bool()
    assert torch.equal(unpacked, spec.attention_mask)


def test_ancestor_bits_full_64_and_too_many():
    spec = TreeSpec.chain(63)  # node 63 sets the sign bit
    assert spec.ancestor_bits[63] < 0
    j = torch.arange(64)
    assert torch.equal(((spec.ancestor_bits[:, None] >> j) & 1).bool(), spec.attention_mask)
    with pytest.raises(ValueError, match="64"):
        TreeSpec.chain(64).ancestor_bits


def test_single_node_tree():
    spec = TreeSpec.from_paths([])
    assert spec == TreeSpec() == TreeSpec.chain(0)
    assert spec.num_nodes == 1 and spec.max_depth == 0 and spec.num_leaves == 1
    assert torch.equal(spec.attention_mask, torch.tensor([[True]]))
    assert torch.equal(spec.retrieve_indices, torch.tensor([[0]]))
    assert spec.parents.tolist() == [-1] and spec.depths.tolist() == [0]
    assert spec.topk_per_depth == () and spec.ancestor_bits.tolist() == [1]
    assert spec.expected_accept_length(PROFILE) == 1.0


@pytest.mark.parametrize("n", [1, 3, 5])
def test_chain(n):
    spec = TreeSpec.chain(n)
    assert spec.paths == tuple((0,) * d for d in range(1, n + 1))
    assert spec.num_nodes == n + 1 and spec.max_depth == n
    assert torch.equal(spec.attention_mask, torch.ones(n + 1, n + 1, dtype=torch.bool).tril())
    assert spec.retrieve_indices.tolist() == [list(range(n + 1))]
    assert spec.topk_per_depth == (1,) * n


@pytest.mark.parametrize("paths, offending, extra", [
    ([(0, 1)], "(0, 1)", "(0,)"),
    ([(0,), (0, 0), (0, 0, 2, 1)], "(0, 0, 2, 1)", "(0, 0, 2)"),
    ([(0,), (0, -1)], "(0, -1)", "negative"),
    ([(0,), (1.5,)], "(1.5,)", "non-integer"),
    ([(0,), ("a",)], "('a',)", "non-integer"),
    ([(0,), (True,)], "(True,)", "non-integer"),
    ([(0,), ()], "()", "empty"),
    ([(0,), (1,), (0,)], "(0,)", "more than once"),
    ([(0,), [0]], "(0,)", "more than once"),
    ([0, 1], "0", "sequence"),
])
def test_invalid_paths(paths, offending, extra):
    with pytest.raises(ValueError) as err:
        TreeSpec.from_paths(paths)
    assert offending in str(err.value) and extra in str(err.value)


def test_depth_beyond_heads():
    paths = [(0,) * d for d in range(1, 6)]
    with pytest.raises(ValueError, match=r"path \(0, 0, 0, 0, 0\) has depth 5 .* only 4 positions"):
        TreeSpec.from_paths(paths, num_heads=4)
    spec = TreeSpec.from_paths(paths, num_heads=5)
    spec.check_heads(5)
    with pytest.raises(ValueError, match=r"\(0, 0, 0, 0, 0\)"):
        spec.check_heads(4)


def test_expected_accept_length():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1)])
    expect = 1 + 0.5 + 0.2 + 0.5 * 0.4 + 0.5 * 0.1
    assert spec.expected_accept_length(acc) == pytest.approx(expect)
    with pytest.raises(ValueError, match=r"\(0, 0, 0\)"):
        TreeSpec.chain(3).expected_accept_length(acc)  # needs a third head
    with pytest.raises(ValueError, match=r"\(2,\)"):
        TreeSpec.from_paths([(2,)]).expected_accept_length(acc)  # needs rank 2
    with pytest.raises(ValueError):
        spec.expected_accept_length([0.5, 0.2])  # not 2-D


def test_search_properties():
    previous = 1.0
    for n in range(1, 65):
        spec = TreeSpec.search(PROFILE, n)
        assert spec.num_nodes == n
        spec.check_heads(len(PROFILE))
        assert TreeSpec.from_paths(spec.paths) == spec  # valid and canonical
        e = spec.expected_accept_length(PROFILE)
        assert e >= previous - 1e-12  # never worse than a smaller searched tree
        if n - 1 <= len(PROFILE):
            assert e >= TreeSpec.chain(n - 1).expected_accept_length(PROFILE) - 1e-12
        previous = e
        assert TreeSpec.search(PROFILE, n) == spec  # deterministic


def test_search_is_optimal_by_brute_force():
    acc = [[0.6, 0.3, 0.1], [0.5, 0.4, 0.2]]
    all_paths = [p for d in (1, 2) for p in itertools.product(range(3), repeat=d)]
    for n in range(1, len(all_paths) + 2):
        best = 0.0
        for subset in itertools.combinations(all_paths, n - 1):
            if all(len(p) == 1 or p[:-1] in subset for p in subset):
                best = max(best, TreeSpec.from_paths(subset).expected_accept_length(acc))
        assert TreeSpec.search(acc, n).expected_accept_length(acc) == pytest.approx(best)


def test_search_ties_follow_path_order_and_bounds():
    uniform = [[0.5] * 3] * 2
    assert TreeSpec.search(uniform, 5).paths == ((0,), (1,), (2,), (0, 0))
    with pytest.raises(ValueError):
        TreeSpec.search(uniform, 0)
    with pytest.raises(ValueError):
        TreeSpec.search(uniform, 1 + 3 + 9 + 1)  # more nodes than 2 heads x top-3 allow
    assert TreeSpec.search(uniform, 13).num_nodes == 13


def test_named_trees():
    assert set(NAMED_NODE_COUNTS) <= set(available_trees())
    for name, n in NAMED_NODE_COUNTS.items():
        spec = TreeSpec.load(name)
        assert spec.name == name and spec.num_nodes == n and spec.description
        assert repr(spec) == f"TreeSpec(name={name!r}, nodes={n}, depth={spec.max_depth})"
        if name.startswith("tree-"):
            spec.check_heads(4)
            assert spec == TreeSpec.search(PROFILE, n)  # generated from the stated profile
    assert TreeSpec.load("single").expected_accept_length(PROFILE) == 1.0
    assert TreeSpec.load("chain-4") == TreeSpec.chain(4)


def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match="tree-8") as err:
        TreeSpec.load("no-such-tree")
    assert "no-such-tree" in str(err.value)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="pathz"):
        TreeSpec.from_dict({"name": "x", "pathz": [[0]]})


@pytest.mark.parametrize("seed", SEEDS)
def test_node_paths_are_the_masks_ancestors_below_the_root_in_depth_order(seed):
    spec = random_tree(seed).with_lookup(3)
    mask, depths = spec.attention_mask, spec.depths.tolist()
    for i, path in enumerate(spec.node_paths):
        assert set(path) == {j for j in range(1, spec.num_nodes) if mask[i, j]}
        assert [depths[j] for j in path] == list(range(1, depths[i] + 1))


def test_a_tree_file_that_is_no_tree_is_named_with_what_is_wrong(tmp_path):
    """Bad tree files fail when loaded, naming the file and the problem: never a raw TypeError or JSON error."""
    cases = {
        "list.json": ("[[0], [0, 0]]", "list.json: a tree spec is a JSON object with 'paths'.*got a list"),
        "paths_int.json": ('{"paths": 5}', "paths_int.json: tree spec 'paths' must be a list of paths"),
        "paths_null.json": ('{"paths": null}', "paths_null.json: tree spec 'paths' must be a list"),
        "broken.json": ('{"paths": [[0], [0,0]', r"broken.json is not valid JSON: Expecting ',' delimiter at line 1"),
        "huge.json": ('{"paths": [[99999999999999999999]]}', "has a rank 99999999999999999999 past any vocabulary"),
        "desc.json": ('{"paths": [[0]], "description": 5}', "tree description must be a string, got 5"),
        "big.json": (json.dumps({"paths": [[r] for r in range(64)]}), "at most 64 nodes.*this one 65"),
        "chain.json": ('{"paths": [[0]], "lookup": 63}', "at most 64 nodes.*and a lookup chain of 63"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            TreeSpec.load(tmp_path / name)
    (tmp_path / "adir.json").mkdir()
    with pytest.raises(ValueError, match="adir.json is a directory"):
        TreeSpec.load(str(tmp_path / "adir.json"))
    (tmp_path / "utf16.json").write_bytes('{"paths": []}'.encode("utf-16"))
    with pytest.raises(ValueError, match="utf16.json is not UTF-8 text"):
        TreeSpec.load(tmp_path / "utf16.json")
    with pytest.raises(ValueError, match="a tree is a name.*got 5"):
        TreeSpec.load(5)


def test_a_tree_file_with_a_bom_or_without_the_json_suffix_loads(tmp_path, monkeypatch):
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + b'{"paths": [[0], [0, 0]]}')
    assert TreeSpec.load(tmp_path / "bom.json").paths == ((0,), (0, 0))
    (tmp_path / "mine.txt").write_text('{"paths": [[0]]}')
    monkeypatch.chdir(tmp_path)  # a bare name that is no named tree but a file here: the file
    assert TreeSpec.load("mine.txt").paths == ((0,),)
    with pytest.raises(ValueError, match="unknown tree 'nosuch'.*or a JSON file's path"):
        TreeSpec.load("nosuch")


def test_heads_check_a_trees_ranks_against_their_vocabulary():
    spec = TreeSpec.from_paths([(0,), (3,), (3, 1)])
    spec.check_heads(2, vocab_size=4)
    with pytest.raises(ValueError, match=r"path \(3,\) uses rank 3, but the heads rank a vocabulary of 3 tokens"):
        spec.check_heads(2, vocab_size=3)
