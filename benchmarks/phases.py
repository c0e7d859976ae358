"""Where an engine step's time goes: wraps its phases with synchronised timers (a diagnosis tool).

Each phase is timed from a device synchronisation before it to one after it, so
GPU work lands in the phase that launched it: `part1` (tree forward, logits,
greedy verdict) and `part2` (compaction, heads, next proposals) are device time,
the rest is host time. The syncs remove what little overlap a step has, so a
profiled run is a little slower than an unprofiled one; compare phases, not totals.
"""

from __future__ import annotations

import time
from collections import defaultdict

from common import sync

PHASES = ("schedule", "prefill", "prepare", "part1", "host_verify", "part2", "post")


class PhaseTimer:
    """`with PhaseTimer(engine) as timer:` times every step the engine runs inside; `timer.report()`."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.decode_steps = 0
        step = engine.runner.decode
        self._targets = (("schedule", engine.scheduler, "schedule"), ("prefill", engine.runner, "run"),
                         ("prepare", step, "prepare"), ("part1", step, "forward"),
                         ("host_verify", engine, "_verify_on_host"), ("part2", step, "finish"),
                         ("decode", engine, "_decode"))

    def __enter__(self) -> "PhaseTimer":
        for name, owner, attr in self._targets:  # instance attributes shadow the methods...
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))
        return self

    def __exit__(self, *exc) -> None:
        for _, owner, attr in self._targets:  # ...and deleting them brings the methods back
            delattr(owner, attr)

    def _timed(self, name: str, fn):
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            self.seconds[name] += time.perf_counter() - start
            self.decode_steps += name == "decode"
            return out
        return run

    def report(self) -> dict[str, float]:
        """Milliseconds per decode step of each phase; `post` is the decode step's remainder
        (appending tokens, detokenizing, stop checks, commits, outputs)."""
        s = dict(self.seconds)
        inner = sum(s.get(k, 0.0) for k in ("prepare", "part1", "host_verify", "part2"))
        s["post"] = s.get("decode", 0.0) - inner
        steps = max(self.decode_steps, 1)
        return {f"{k}_ms": 1e3 * s.get(k, 0.0) / steps for k in PHASES} | {"decode_steps": self.decode_steps}
