"""A per-step record of an engine run (a diagnosis tool, like phases.py, but without syncs).

`with StepTrace(engine) as trace:` notes, for every `engine.step()` inside, when it
returned, how many sequences its decode forward ran (0: none), the tree's node
count and the padded batch, the prompt tokens carried in that forward, and the
prompt tokens of a prefill forward of its own. `trace.summary()` condenses it:
where the steps' rows and time went, by kind of step. Nothing is synchronised.
With overlapped steps an engine step launches its decode step and then waits
for the one before it, so its time is mostly its predecessor's device time:
the summary then charges each step the time of the engine step after it.
"""

from __future__ import annotations

import time
from collections import defaultdict


class StepTrace:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.steps: list[dict] = []
        self._current: dict = {}

    def __enter__(self) -> "StepTrace":
        engine, runner = self.engine, self.engine.runner
        self._wrapped = ((engine, "step", self._step), (engine, "_forward", self._forward), (runner, "run", self._run))
        for owner, attr, wrap in self._wrapped:  # instance attributes shadow the methods...
            setattr(owner, attr, wrap(getattr(owner, attr)))
        self._last = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, _ in self._wrapped:  # ...and deleting them brings the methods back
            delattr(owner, attr)

    def _step(self, fn):
        def step(*args, **kwargs):
            self._current = {"rows": 0, "nodes": 0, "padded": 0, "carried": 0, "prefilled": 0}
            out = fn(*args, **kwargs)
            now = time.perf_counter()
            self.steps.append({**self._current, "ms": 1e3 * (now - self._last)})
            self._last = now
            return out
        return step

    def _forward(self, fn):
        def forward(seqs, tree, prompts):
            forwarded = fn(seqs, tree, prompts)  # (requests, padded batch, ...)
            self._current.update(rows=len(seqs), nodes=tree.num_nodes, padded=forwarded[1],
                                 carried=prompts.num_tokens if prompts is not None else 0)
            return forwarded
        return forward

    def _run(self, fn):
        def run(batch):
            self._current["prefilled"] += batch.num_tokens
            return fn(batch)
        return run

    def summary(self) -> dict:
        """Per kind of step (prefill only, plain decode, tree decode; with or without carried prompts):
        steps, total ms, mean rows; and the mean rows of the decode steps in each tenth of the run."""
        kinds: dict[str, dict] = defaultdict(lambda: {"steps": 0, "ms": 0.0, "rows": 0})
        times = [s["ms"] for s in self.steps]
        if self.engine.overlap:  # the last step's own time was never waited for: it gets its predecessor's
            times = times[1:] + times[-1:]
        for s, ms in zip(self.steps, times):
            k = kinds[step_kind(s)]
            k["steps"] += 1
            k["ms"] += ms
            k["rows"] += s["rows"]
        for k in kinds.values():
            k["mean_rows"] = k.pop("rows") / k["steps"]
            k["mean_ms"] = k["ms"] / k["steps"]
        decodes = [s["rows"] for s in self.steps if s["rows"]]
        tenth = max(1, len(decodes) // 10)
        deciles = [sum(decodes[i:i + tenth]) / len(decodes[i:i + tenth]) for i in range(0, len(decodes), tenth)]
        return {"kinds": dict(kinds), "decode_rows_by_tenth": deciles}


def step_kind(step: dict) -> str:
    """A recorded step's kind: prefill (a prompt forward alone), plain or tree-N decode, +prompts (carried in the
    decode graph), +prefill (a prompt forward of its own beside it)."""
    kind = "prefill" if not step["rows"] else ("plain" if step["nodes"] == 1 else f"tree-{step['nodes']}")
    return kind + ("+prompts" if step["carried"] else "") + ("+prefill" if step["rows"] and step["prefilled"] else "")
