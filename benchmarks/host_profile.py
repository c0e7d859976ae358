"""Where the host's time goes in an engine run: cProfile around a level (a diagnosis tool, like step_trace.py).

`with HostProfile() as profile:` profiles every Python call inside; `profile.summary(n)`
lists the n functions with the most time of their own (tottime) and `profile.write(path)`
saves the report sorted both ways (own time, cumulative). With overlapped steps the
host waits for the device inside one call (the step's read-back, `Tensor.tolist`), so
that call's own time is device time the host did not cover with work: everything else
is the host's per-step cost. cProfile slows Python-heavy code by about 1.5-2x, so
compare shares, not the run's tok/s with an unprofiled one.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path


class HostProfile:
    def __enter__(self) -> "HostProfile":
        self._profile = cProfile.Profile()
        self._profile.enable()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.disable()
        self.stats = pstats.Stats(self._profile)

    def summary(self, n: int = 12) -> dict:
        """Total profiled seconds and the n functions with the most own time: [(name, calls, own s, cumulative s)]."""
        rows = sorted(self.stats.stats.items(), key=lambda item: -item[1][2])[:n]
        top = [(_name(func), calls, round(own, 4), round(cumulative, 4))
               for func, (_, calls, own, cumulative, _) in rows]
        return {"seconds": round(self.stats.total_tt, 4), "top_own_time": top}

    def write(self, path: Path, n: int = 40) -> None:
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(self._profile, stream=text).sort_stats(order).print_stats(n)
        path.write_text(text.getvalue())


def _name(func: tuple[str, int, str]) -> str:
    """'file.py:line(function)' with the path cut to its last two parts, or a builtin's name."""
    file, line, name = func
    if file == "~":  # a builtin
        return name
    return f"{'/'.join(Path(file).parts[-2:])}:{line}({name})"
