"""cpu_projection.py: the CPU vocabulary projection in both operand orders, and the steps it feeds."""

import subprocess
import sys

from bench_scripts import ROOT, run


def test_cpu_projection_quick(tmp_path):
    """Times both forms at 1, 2 and 4 rows and one round of forwards and proposals under each swap rule."""
    results = run("cpu_projection.py", tmp_path)
    assert [r["rows"] for r in results["projection"]] == [1, 2, 4]
    assert all(r["linear_ms"] > 0 and r["swapped_ms"] > 0 for r in results["projection"])
    assert set(results["steps"]) == {"on", "lm_head_only", "off"}
    for label in ("on", "lm_head_only", "off"):
        (row,) = results["steps"][label]
        assert set(row) == {"forward_1_ms", "forward_4_ms", "forward_8_ms", "forward_16_ms", "heads_ms"}
        assert all(v > 0 for v in row.values())
    assert results["swap_min_bytes"] > 0 and results["swap_max_rows"] >= 2


def test_cpu_projection_rejects_bad_counts(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_projection.py"), "--rounds", "0", "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "--rounds and --repeats must be >= 1" in done.stderr
    assert not (tmp_path / "out").exists()
