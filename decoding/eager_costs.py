"""Step costs for an engine without CUDA graphs (a CPU): a few eager steps timed, the rest read off them.

With graphs, `LLMEngine.warmup()` times every (batch bucket, tree) step. Without them nothing is
padded, so every batch size is a bucket of its own (1 .. max_num_seqs), and on a CPU one step of the
default model takes 80 ms and more: timing each would take minutes. Warmup therefore times

  - every tree at one row (the common case on a CPU: one request at a time), and
  - plain steps with and without the heads at 1, 2, 4, ... rows, up to LADDER_ROWS,

and `EagerCosts.step` estimates the rest: a plain step of B rows read off that ladder (linear between
its points, along its last segment past its end), and a tree at B rows as that plus B times what
the tree adds to a plain step at one row. Rows, not tokens, are what a CPU's step grows with: each
row reads its own context (default model, float32, 2 cores, 512 cached tokens: a plain step of 16 rows
350-430 ms, one row of a 16-node tree 137-223 ms, a plain row 72-98 ms; RESULTS.md, session 29). B times
the one-row increment errs toward plain decoding (B trees' extra tokens share their weight reads); these
are only the measured policy's starting costs: once a tree runs at a batch size, its wall time there replaces them
(`tree_policy.py`).

Without this a CPU engine ran the largest tree its token budget allows at every step: at one
request on the default model 0.63-0.72x of plain decoding (RESULTS.md, session 28).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from medusa.tree import TreeSpec

LADDER_ROWS = 16  # plain steps are timed at 1, 2, 4, ... rows up to this; costs past it extrapolated
EAGER_ROUNDS = 2  # timed rounds of every step (after one warm-up step); each step keeps its fastest


@dataclass
class EagerCosts:
    rows: list[int]  # the ladder's row counts, ascending, from 1
    plain: list[float]  # [len(rows)] seconds of a plain step without the heads at each
    heads: list[float]  # [len(rows)] seconds the heads add to it
    one_row: dict[TreeSpec, float]  # each tree's step at one row (a speculative one with its heads)

    def plain_at(self, rows: int) -> float:
        return _on_line(self.rows, self.plain, rows)

    def heads_at(self, rows: int) -> float:
        return max(0.0, _on_line(self.rows, self.heads, rows))

    def step(self, batch: int, tree: TreeSpec) -> float:
        """Estimated seconds of a step of `batch` rows of `tree` (a plain one without the heads)."""
        if tree.num_nodes == 1:
            return self.plain_at(batch)
        return self.plain_at(batch) + batch * max(0.0, self.one_row[tree] - self.plain_at(1))


def ladder_rows(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to min(max_rows, LADDER_ROWS)."""
    top = min(max_rows, LADDER_ROWS)
    return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


def measure(time_step, trees: list[TreeSpec], plain: TreeSpec, max_rows: int) -> EagerCosts:
    """Time the steps `EagerCosts` needs: `time_step(tree, rows, propose)` -> seconds of one eager step;
    every step once per round, EAGER_ROUNDS rounds after one step that warms up, the fastest kept."""
    rows = ladder_rows(max_rows)
    runs = [(tree, 1, True) for tree in trees if tree.num_nodes > 1]
    runs += [(plain, r, propose) for r in rows for propose in (False, True)]
    time_step(plain, 1, False)  # the first eager step allocates what later ones reuse
    fastest: dict = {}
    for _ in range(EAGER_ROUNDS):
        for run in runs:
            seconds = time_step(*run)
            fastest[run] = min(fastest.get(run, seconds), seconds)
    bare = [fastest[plain, r, False] for r in rows]
    return EagerCosts(rows, bare, [fastest[plain, r, True] - b for r, b in zip(rows, bare)],
                      {tree: fastest[tree, 1, True] for tree in trees if tree.num_nodes > 1})


def _on_line(xs: list[int], ys: list[float], x: int) -> float:
    """ys at x: linear between the points, along the last segment past the end, the first value before it."""
    if len(xs) == 1 or x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])
