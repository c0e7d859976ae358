"""Shared by the benchmark scripts' tests: the scripts run as a user runs them, in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, out: Path, *extra: str) -> dict:
    """benchmarks/<script> --quick --out <out> -> its results.json."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
                   check=True, cwd=ROOT, timeout=600)
    return json.loads((out / "results.json").read_text())
