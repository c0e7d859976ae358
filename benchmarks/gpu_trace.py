"""What the GPU does during engine steps: a torch.profiler trace, condensed (a diagnosis tool).

`with GpuTrace() as trace:` records every kernel and copy launched inside (CUDA
graph replays included: CUPTI sees their kernels); `trace.summary(steps)` says,
per engine step, how long the GPU was busy and idle, and which kernels took the
time. Where a step's wall time exceeds its busy time, the host (or a sync) is
what bounds it, not the kernels. `trace.write(path)` keeps the Chrome trace.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch


class GpuTrace:
    def __enter__(self) -> "GpuTrace":
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profiler.__exit__(*exc)
        with tempfile.TemporaryDirectory() as folder:  # the profiler exports to a file only
            path = Path(folder) / "trace.json"
            self._profiler.export_chrome_trace(str(path))
            self.events = json.loads(path.read_text())["traceEvents"]

    def write(self, path: Path) -> None:
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": self.events}, f)

    def summary(self, steps: int, top: int = 15) -> dict:
        """Per engine step (ms): the traced window, GPU busy time (kernels and copies, overlaps merged),
        idle time, kernel launches; and the `top` kernels by time, each with its share of the busy time."""
        device = [e for e in self.events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        if not device:
            return {"error": "no device events (is this a GPU?)"}
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in device)
        busy, (start, end) = 0.0, spans[0]
        for s, e in spans[1:]:
            if s > end:
                busy, start, end = busy + end - start, s, e
            else:
                end = max(end, e)
        busy += end - start
        window = spans[-1][1] - spans[0][0]
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in device:
            by_name[e["name"]][0] += 1
            by_name[e["name"]][1] += e["dur"]
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        per_step = 1e-3 / max(steps, 1)  # us in total -> ms per step
        return {"steps": steps, "window_ms_per_step": window * per_step, "busy_ms_per_step": busy * per_step,
                "idle_ms_per_step": (window - busy) * per_step, "kernels_per_step": len(device) / max(steps, 1),
                "top": [{"name": name[:90], "per_step": n / max(steps, 1), "ms_per_step": us * per_step,
                         "share": us / busy} for name, (n, us) in ranked]}
