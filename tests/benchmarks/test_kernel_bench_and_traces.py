"""kernel_bench.py's checks and the GPU scripts' host-side parts (traces, stall logs)."""

import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import ROOT, run

pytestmark = pytest.mark.slow


def run_kernels_script(out: Path, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/kernel_bench.py at full size (no --quick), for its argument checks."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_bench.py"), *args, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_kernels_quick(tmp_path):
    results = run("kernel_bench.py", tmp_path, "--step-context", "40")
    assert [r["context"] for r in results["attention"]] == [64, 128] and results["step_context"] == 40
    assert {(r["batch"], r["tree_tokens"]) for r in results["steps"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(r["seconds"] > 0 for r in results["steps"]) and results["launch_sweep"] == []


def test_kernels_quick_on_64_token_pages(tmp_path):
    results = run("kernel_bench.py", tmp_path, "--block-size", "64", "--skip-attention", "--batches", "1",
                  "--tree-sizes", "4")
    assert results["block_size"] == 64 and [r["tree_tokens"] for r in results["steps"]] == [4]


@pytest.mark.parametrize("sweep", ["--launch-sweep", "--split-sweep"])
def test_kernels_sweeps_need_a_gpu(tmp_path, sweep):
    if __import__("torch").cuda.is_available():
        pytest.skip("on a GPU the sweeps run")
    done = run_kernels_script(tmp_path, sweep)
    assert done.returncode == 2 and "need a CUDA device" in done.stderr


def test_kernels_rejects_an_empty_step_context(tmp_path):
    done = run_kernels_script(tmp_path, "--step-context", "0")
    assert done.returncode == 2 and "--step-context must be >= 1, got 0" in done.stderr


def test_gpu_trace_summary_merges_overlapping_kernels():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_trace import GpuTrace

    trace = GpuTrace()
    kernel = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    # two steps: kernels at 0-10 and 5-20 us overlap (PDL), then a gap to 30-40, a copy at 50-60
    trace.events = [kernel("a", 0, 10), kernel("b", 5, 15), kernel("a", 30, 10),
                    {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 50, "dur": 10},
                    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    summary = trace.summary(steps=2)
    assert summary["window_ms_per_step"] == 60e-3 / 2 and summary["busy_ms_per_step"] == 40e-3 / 2
    assert summary["idle_ms_per_step"] == 20e-3 / 2 and summary["kernels_per_step"] == 2
    top = {t["name"]: t for t in summary["top"]}
    assert top["a"]["per_step"] == 1 and top["a"]["ms_per_step"] == 20e-3 / 2 and top["a"]["share"] == 0.5


def test_stalls_logs_what_the_steps_waited_for_and_needs_a_gpu(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gc

    from stall_log import StallLog, stalls_summary
    from stalls import kinds_summary

    class Trace:  # stands in for step_trace.StepTrace: two steps recorded so far
        steps = [{}, {}]

    with StallLog() as log:
        log.trace = Trace()
        gc.collect()
    gc.collect()  # after the log ended: not recorded
    events = log.take()
    assert [e["kind"] for e in events] == ["gc"] and events[0]["step"] == 2 and events[0]["ms"] >= 0
    # a Triton compile (a cache miss of a kernel variant) is logged with the kernel's name, and the patch goes
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(JITFunction, "_do_compile", lambda fn, *args, **kwargs: "compiled")
    stub = JITFunction._do_compile
    with StallLog() as log:
        assert JITFunction._do_compile(type("Kernel", (), {"__name__": "_some_kernel"})(), "key") == "compiled"
    assert JITFunction._do_compile is stub
    assert [(e["kind"], e["name"], e["step"]) for e in log.take()] == [("triton_compile", "_some_kernel", -1)]
    assert stalls_summary(events + events)["gc"]["count"] == 2 and log.take() == []
    # a decode step's capture is named by its key
    from medusa.decoding.decode_step import DecodeStep
    from medusa.tree import TreeSpec

    monkeypatch.setattr(DecodeStep, "_capture", lambda step, tree, padded, sampling, propose, prompts, kv_bound=None:
                        "graphs")
    tree = type("Tree", (), {"spec": TreeSpec.load("tree-4")})()
    prompts = type("Prompts", (), {"num_tokens": 64})()
    with StallLog() as log:
        assert DecodeStep._capture(None, tree, 8, 1, False, prompts) == "graphs"
        DecodeStep._capture(None, tree, 1, 0, True, None, kv_bound=1024)
    assert [e["name"] for e in log.take()] == ["8 rows, tree-4, sampled, no heads, 64 prompt tokens",
                                               "1 rows, tree-4, greedy, heads, keys <= 1024"]
    step = lambda rows, nodes, carried, prefilled, ms: {"rows": rows, "nodes": nodes, "carried": carried,
                                                        "prefilled": prefilled, "ms": ms}
    kinds = kinds_summary([step(0, 0, 0, 64, 9.0), step(4, 16, 32, 0, 2.0), step(4, 16, 0, 0, 1.0),
                           step(4, 16, 0, 0, 3.0), step(4, 1, 0, 16, 500.0)])
    assert list(kinds) == ["plain+prefill", "prefill", "tree-16", "tree-16+prompts"]  # by total time
    assert kinds["tree-16"] == {"steps": 2, "ms": 4.0, "p50": 2.0, "p90": 2.8, "max": 3.0}
    if not __import__("torch").cuda.is_available():
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stalls.py"), "--out", str(tmp_path)],
                              cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def test_step_parts_lists_the_last_replay_and_needs_a_gpu(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_trace import GpuTrace
    from step_parts import kernels_of

    trace = GpuTrace()
    kernel = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    # two replays of two kernels each, listed out of order, and a host event
    trace.events = [kernel("b", 108, 3), kernel("a", 0, 4), kernel("a", 100, 5), kernel("b", 6, 2),
                    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    assert kernels_of(trace, 2) == [(0.0, 5, "a"), (8.0, 3, "b")]
    if not __import__("torch").cuda.is_available():
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_parts.py"), "--out",
                               str(tmp_path / "parts.json")], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 1 and "needs a GPU" in done.stderr
