"""The benchmark scripts' --quick modes run on the CPU, so they cannot break silently."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(script: str, out: Path, *extra: str) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
                   check=True, cwd=ROOT, timeout=600)
    return json.loads((out / "results.json").read_text())


def test_spec_bench_quick(default_model_dir, tmp_path):
    results = run("spec_bench.py", tmp_path, "--hf-per-category", "1")
    overall = results["overall"]
    assert overall["questions"] == 4 and overall["plain_tok_s"] > 0 and overall["medusa_tok_s"] > 0
    assert overall["mean_accepted_length"] >= 1.0 and overall["hf_tok_s"] > 0
    assert overall["identical_greedy_turns"] == overall["turns"]  # float32 on the CPU: exact
    assert len(results["categories"]) == 4
    assert sum(overall["decode_steps_per_tree"].values()) == overall["medusa_steps"] > 0
    assert results["candidate_trees"][0] == "single" and results["candidate_trees"][-1] == "heads"  # unpinned
    assert len(results["candidate_trees"]) == 6


def test_spec_bench_reports_adapter_drift_and_pins_the_heads_tree(default_model_dir, tmp_path):
    """A Medusa-2 heads folder with a LoRA whose B is zero changes nothing: full agreement, identical turns.
    --pin-tree runs only the heads' own tree (one spec_bench run checks both: each costs CI ~30 s)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from medusa import default_model

    heads = tmp_path / "heads"
    shutil.copytree(default_model.default_heads_path(), heads)
    name = "layers.0.mlp.down_proj"
    save_file({f"{name}.lora_A.weight": torch.randn(4, 1536), f"{name}.lora_B.weight": torch.zeros(576, 4)},
              str(heads / "adapter.safetensors"))
    (heads / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["down_proj"]}))
    results = run("spec_bench.py", tmp_path / "out", "--heads", str(heads), "--pin-tree", "--prompt-lookup", "0")
    drift, overall = results["overall"]["adapter_drift"], results["overall"]
    assert drift["tokens"] > 0 and drift["token_agreement"] == 1.0
    assert drift["identical_turns"] == drift["turns"] >= 4
    assert results["pinned_tree"] and results["tree_nodes"] == 64 and results["candidate_trees"] == ["heads"]
    assert overall["decode_steps_per_tree"] == {"heads": overall["medusa_steps"]} and overall["medusa_steps"] > 0
    assert overall["identical_greedy_turns"] == overall["turns"]


def test_head_accuracy_quick(default_model_dir, tmp_path):
    """Scores the shipped heads per category on the base's cached greedy turns; a second run reuses them."""
    results = run("head_accuracy.py", tmp_path)
    (scored,) = results["heads"].values()
    overall = scored["overall"]
    assert results["settings"]["questions"] == 4 and len(scored["categories"]) == 4
    assert overall["turns"] == sum(c["turns"] for c in scored["categories"].values()) >= 4
    assert overall["targets"] == sum(c["targets"] for c in scored["categories"].values()) > 0
    assert all(0 <= a <= b <= 1 for a, b in zip(overall["top1"], overall["top5"])) and len(overall["top1"]) == 4
    assert 1.0 <= overall["accepted_length"] <= 5.0 and scored["tree_nodes"] == 64
    turns = tmp_path / "turns.json"
    turns.write_text(turns.read_text().replace('"ids": [', '"ids": [0, '))  # a marked cache: reused, not remade
    again = run("head_accuracy.py", tmp_path)["heads"]
    assert next(iter(again.values()))["overall"]["targets"] > overall["targets"]


def test_head_accuracy_rejects_unusable_heads_before_generating(tmp_path):
    heads = tmp_path / "m2"
    heads.mkdir()
    (heads / "adapter.safetensors").write_bytes(b"")
    for path, message in ((tmp_path / "none", "no heads at"), (heads, "holds a Medusa-2 LoRA adapter")):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "head_accuracy.py"), "--quick", "--out",
                               str(tmp_path / "out"), "--heads", str(path)], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr and not (tmp_path / "out").exists()


def run_kernels_script(out: Path, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/kernel_bench.py at full size (no --quick), for its argument checks."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_bench.py"), *args, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_kernels_quick(tmp_path):
    results = run("kernel_bench.py", tmp_path, "--step-context", "40")
    assert [r["context"] for r in results["attention"]] == [64, 128] and results["step_context"] == 40
    assert {(r["batch"], r["tree_tokens"]) for r in results["steps"]} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(r["seconds"] > 0 for r in results["steps"]) and results["launch_sweep"] == []


@pytest.mark.parametrize("sweep", ["--launch-sweep", "--split-sweep"])
def test_kernels_sweeps_need_a_gpu(tmp_path, sweep):
    if __import__("torch").cuda.is_available():
        pytest.skip("on a GPU the sweeps run")
    done = run_kernels_script(tmp_path, sweep)
    assert done.returncode == 2 and "need a CUDA device" in done.stderr


def test_kernels_rejects_an_empty_step_context(tmp_path):
    done = run_kernels_script(tmp_path, "--step-context", "0")
    assert done.returncode == 2 and "--step-context must be >= 1, got 0" in done.stderr


def test_serving_quick(default_model_dir, tmp_path):
    results = run("serving.py", tmp_path)
    rows = {(r["mode"], r["concurrency"]): r for r in results["rows"]}
    assert set(rows) == {(mode, c) for mode in ("plain", "medusa") for c in (1, 2)}
    for (mode, c), row in rows.items():
        assert row["failed"] == 0 and row["requests"] == 2 * c
        assert row["request_throughput"] > 0 and row["output_tok_s"] > 0
        assert row["output_tokens"] == 8 * row["requests"]  # ignore_eos: every request makes max_tokens
        assert 0 < row["ttft_p50"] <= row["ttft_p99"] and 0 < row["tpot_p50"] <= row["tpot_p99"]
    assert rows[("medusa", 1)]["mean_accepted_length"] >= 1.0  # the server's counters moved
    assert results["environment"]["server_exit_code"] == 0  # SIGTERM: a clean shutdown
    assert results["environment"]["kv_blocks"] == 512  # the CPU's pool; a GPU sizes it from free memory
    assert results["environment"]["prompt_lookup"] == 0  # none by default on a CPU
    assert (tmp_path / "serving.png").stat().st_size > 0


def test_throughput_quick(tmp_path):
    results = run("throughput.py", tmp_path, "--profile-steps", "--trace-steps", "--host-profile", "--gpu-trace",
                  "--length-spread", "0.5")
    rows = {(r["mode"], r["concurrency"]): r for r in results["rows"]}
    assert set(rows) == {(mode, c) for mode in ("plain", "medusa") for c in (1, 4)}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import answer_lengths

    for (mode, c), row in rows.items():
        lengths = answer_lengths(3 * c, 8, 0.5)  # ignore_eos: every answer is as long as its max_tokens
        assert row["requests"] == 3 * c and row["tokens"] == sum(lengths) and len(set(lengths)) > 1
        assert row["tok_s"] > 0 and row["mean_accepted_length"] >= 1.0
        assert len(row["tok_s_runs"]) == 3 and row["tok_s"] == sorted(row["tok_s_runs"])[1]  # the median of 3
        assert row["graphs_captured_runs"] == [0] * 3 and row["capture_s_runs"] == [0.0] * 3  # no graphs on a CPU
        # nothing compiled (Triton's interpreter runs the kernels as Python)
        assert row["triton_compiles_runs"] == [0] * 3 and row["compile_s_runs"] == [0.0] * 3
        assert sum(row["decode_steps_per_tree"].values()) > 0 and 1 <= row["mean_decode_batch"] <= c
        assert row["tree_decisions"] == {}  # no measured tree policy on the CPU
    assert rows[("plain", 1)]["speedup"] == 1.0
    for (mode, c), row in rows.items():  # runs alternate between the modes: each over the plain run before it
        plain = rows[("plain", c)]["tok_s_runs"]
        assert row["speedup_runs"] == [t / p for t, p in zip(row["tok_s_runs"], plain)] and len(plain) == 3
    for row in rows.values():  # --profile-steps: the same level again with every phase timed
        phases = row["phases"]
        assert phases["decode_steps"] > 0 and phases["part1_ms"] > 0 and phases["prepare_ms"] > 0
        assert min(v for k, v in phases.items() if k.endswith("_ms")) >= 0
    for (mode, c), row in rows.items():  # --trace-steps: and once more with every engine step recorded
        steps = json.loads((tmp_path / f"trace_tiny_{mode}_c{c}.json").read_text())
        kinds = row["trace"]["kinds"]
        assert sum(k["steps"] for k in kinds.values()) == len(steps) > 0
        decoded = [s for s in steps if s["rows"]]  # 3 x C requests of 8 tokens, at most C at a time
        assert all(1 <= s["rows"] <= c and s["padded"] >= s["rows"] for s in decoded)
        # each request's 7 tokens after its first take decode rows that emit at most 5 (4 heads + root) each
        assert sum(s["rows"] for s in decoded) >= 3 * c * 7 / 5
        assert all(s["ms"] > 0 for s in steps) and any(s["prefilled"] or s["carried"] for s in steps)
    for (mode, c), row in rows.items():  # --host-profile: and once more under cProfile
        profile = row["host_profile"]
        assert profile["seconds"] > 0 and len(profile["top_own_time"]) == 12
        own = [seconds for _, _, seconds, _ in profile["top_own_time"]]
        assert own == sorted(own, reverse=True) and own[0] <= profile["seconds"]
        report = (tmp_path / f"host_profile_tiny_{mode}_c{c}.txt").read_text()
        assert "engine.py" in report and "(step)" in report
    for (mode, c), row in rows.items():  # --gpu-trace: and once more under torch.profiler (no kernels on a CPU)
        assert "no device events" in row["gpu_trace"]["error"]
        with gzip.open(tmp_path / f"gpu_trace_tiny_{mode}_c{c}.json.gz", "rt") as f:
            assert any(e.get("name", "").startswith("aten::") for e in json.load(f)["traceEvents"])
    assert (tmp_path / "throughput.png").stat().st_size > 0


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


def test_throughput_rejects_a_bad_length_spread(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--out",
                           str(tmp_path), "--length-spread", "1.5"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "--length-spread must be in [0, 1), got 1.5" in done.stderr


def test_throughput_quick_with_seeded_sampled_requests(tmp_path):
    results = run("throughput.py", tmp_path, "--temperature", "0.7", "--repeats", "1")
    assert results["temperature"] == 0.7
    rows = {(r["mode"], r["concurrency"]): r for r in results["rows"]}
    assert set(rows) == {(mode, c) for mode in ("plain", "medusa") for c in (1, 4)}
    assert all(r["tok_s"] > 0 and r["tokens"] == 3 * r["concurrency"] * 8 for r in rows.values())


def test_throughput_rejects_a_negative_temperature(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--out",
                           str(tmp_path), "--temperature", "-1"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "--temperature must be >= 0, got -1.0" in done.stderr


@pytest.mark.parametrize("flag, value, message", [("--per-category", "0", "--per-category must be >= 1, got 0"),
                                                  ("--max-tokens", "0", "--max-tokens must be >= 1, got 0"),
                                                  ("--temperature", "0", "--temperature must be > 0")])
def test_sampled_acceptance_rejects_bad_settings_before_loading(tmp_path, flag, value, message):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampled_acceptance.py"), "--out",
                           str(tmp_path / "out.json"), flag, value], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_host_time_quick(default_model_dir, tmp_path):
    results = run("host_time.py", tmp_path)
    assert [level["mode"] for level in results["levels"]] == ["plain", "medusa"]
    for level in results["levels"]:
        parts = level["ms_per_step"]
        assert len(level["host_ms_runs"]) == 2 and parts["host_ms"] == min(level["host_ms_runs"])
        assert 0 < parts["schedule"] < parts["step"] and 0 < parts["append"] < parts["apply_rows"] < parts["step"]
        assert parts["start_decoding"] > 0  # requests were admitted
    detok = results["detokenizer_us_per_token"]
    assert set(detok) == {"stream", "window_rust", "window_transformers"} and min(detok.values()) > 0
