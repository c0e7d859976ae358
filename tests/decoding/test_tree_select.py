"""choose_tree: expected tokens per second from timed forwards, the heads' own time included."""

from __future__ import annotations

from medusa.decoding import tree_select
from tiny_models import tiny_decoder

ACCURACIES = [[0.6 * 0.8 ** h * 0.3 ** r for r in range(8)] for h in range(4)]  # [heads][ranks]


def choose(monkeypatch, heads_ms: float):
    model, heads = tiny_decoder(24, num_heads=4)
    heads = type(heads)(type(heads.config)(**{**heads.config.__dict__, "accuracies": ACCURACIES}))
    # a forward of n tree tokens costs 10 ms + 1 ms per token: a 2-node tree accepts 1.6 tokens for 12 ms
    monkeypatch.setattr(tree_select, "step_seconds", lambda base, n, context: (10 + n) / 1e3)
    monkeypatch.setattr(tree_select, "heads_seconds", lambda base, h: heads_ms / 1e3)
    return tree_select.choose_tree(model, heads)


def test_cheap_heads_speculate_and_dear_heads_decode_plain(monkeypatch):
    assert choose(monkeypatch, heads_ms=0.5).num_nodes > 1
    # every tree loses to plain's 1 token / 11 ms once the heads add 12 ms (2 nodes: 1.6 tokens / 24 ms;
    # 4 nodes: about 2.1 / 26 ms), though without them a 4-node tree would win (2.1 / 14 ms)
    assert choose(monkeypatch, heads_ms=12.0).num_nodes == 1


def test_heads_seconds_times_a_real_proposal():
    model, heads = tiny_decoder(24, num_heads=2)
    assert 0 < tree_select.heads_seconds(model, heads) < 1.0
