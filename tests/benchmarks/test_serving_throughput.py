"""serving.py, throughput.py and host_time.py on the CPU."""

import gzip
import json
import subprocess
import sys

import pytest
from bench_scripts import ROOT, run

from medusa.medusa_model import CPU_PROMPT_LOOKUP

pytestmark = pytest.mark.slow


def test_serving_quick(default_model_dir, tmp_path):
    results = run("serving.py", tmp_path)
    rows = {(r["mode"], r["concurrency"]): r for r in results["rows"]}
    assert set(rows) == {(mode, c) for mode in ("plain", "medusa") for c in (1, 2)}
    for (mode, c), row in rows.items():
        assert row["failed"] == 0 and row["requests"] == 2 * c
        assert row["request_throughput"] > 0 and row["output_tok_s"] > 0
        assert row["output_tokens"] == 8 * row["requests"]  # ignore_eos: every request makes max_tokens
        assert 0 < row["ttft_p50"] <= row["ttft_p99"] and 0 < row["tpot_p50"] <= row["tpot_p99"]
    # the server's counters were read; a CPU's policy may run plain steps only, which draft nothing (vLLM's
    # num_drafts), and then there is no mean to report
    medusa = rows[("medusa", 1)]
    assert "drafts" in medusa and medusa["drafts"] >= 0
    assert (medusa["drafts"] == 0 and medusa["mean_accepted_length"] is None) or medusa["mean_accepted_length"] >= 1.0
    assert results["environment"]["server_exit_code"] == 0  # SIGTERM: a clean shutdown
    assert results["environment"]["kv_blocks"] == 512  # the CPU's pool; a GPU sizes it from free memory
    assert results["environment"]["prompt_lookup"] == CPU_PROMPT_LOOKUP  # the CPU's default chain
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
        assert row["ms_per_step_less_captures"] == pytest.approx(row["ms_per_step"])
        # nothing compiled (Triton's interpreter runs the kernels as Python)
        assert row["triton_compiles_runs"] == [0] * 3 and row["compile_s_runs"] == [0.0] * 3
        assert sum(row["decode_steps_per_tree"].values()) > 0 and 1 <= row["mean_decode_batch"] <= c
        # the CPU's warmup times trees eagerly (`eager_costs.py`): the batch sizes that ran decide, plain none
        assert all(1 <= int(b) <= c for b in row["tree_decisions"]) and (mode == "medusa" or not row["tree_decisions"])
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


def test_throughput_rejects_a_bad_length_spread(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--out",
                           str(tmp_path), "--length-spread", "1.5"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "--length-spread must be in [0, 1), got 1.5" in done.stderr


def test_throughput_quick_with_seeded_sampled_requests(tmp_path):
    results = run("throughput.py", tmp_path, "--temperature", "0.7", "--repeats", "1", "--block-size", "32",
                  "--min-requests", "5")
    assert results["temperature"] == 0.7 and results["block_size"] == 32
    rows = {(r["mode"], r["concurrency"]): r for r in results["rows"]}
    assert set(rows) == {(mode, c) for mode in ("plain", "medusa") for c in (1, 4)}
    # 3 requests a slot, but at least 5: one request at a time serves 5, four 12
    assert all(r["requests"] == max(3 * r["concurrency"], 5) for r in rows.values())
    assert all(r["tok_s"] > 0 and r["tokens"] == r["requests"] * 8 for r in rows.values())


def test_throughput_rejects_a_negative_temperature_or_request_count(tmp_path):
    for flag, value, message in (("--temperature", "-1", "--temperature must be >= 0, got -1.0"),
                                 ("--min-requests", "-2", "--min-requests must be >= 0, got -2"),
                                 ("--apply-interval", "0", "--apply-interval must be >= 1, got 0")):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--out",
                               str(tmp_path), flag, value], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr


def test_host_time_quick(default_model_dir, tmp_path):
    results = run("host_time.py", tmp_path, "--apply-interval", "1", "2")
    levels = [(level["mode"], level["apply_interval"]) for level in results["levels"]]
    assert levels == [("plain", 1), ("plain", 2), ("medusa", 1), ("medusa", 2)]
    for level in results["levels"]:
        parts = level["ms_per_step"]
        assert len(level["host_ms_runs"]) == 2 and parts["host_ms"] == min(level["host_ms_runs"])
        assert 0 < parts["schedule"] < parts["step"] and 0 < parts["append"] < parts["apply_steps"] < parts["step"]
        assert parts["start_decoding"] > 0  # requests were admitted
    detok = results["detokenizer_us_per_token"]
    assert set(detok) == {"bytes", "stream", "window_rust", "window_transformers"} and min(detok.values()) > 0


def test_host_verdicts_quick(default_model_dir, tmp_path):
    """Only guided rows are decided on the host, in a few reads a step; logprobs, penalties, min_tokens and bias
    rows never are (`device_changes.py`), nor read anything a row."""
    kinds = run("host_verdicts.py", tmp_path)["kinds"]
    assert set(kinds) == {"free", "guided_json", "logprobs", "presence_penalty", "repetition_penalty", "min_tokens",
                          "logit_bias"}
    assert all(kind["decode_steps"] > 0 for kind in kinds.values())
    device = [name for name in kinds if name != "guided_json"]
    assert all(kinds[name]["host_rows_per_step"] == 0 for name in device)
    assert all(kinds[name]["reads_per_step"] <= 3 for name in device if name != "logprobs")  # none a row
    assert kinds["guided_json"]["host_rows_per_step"] > 0 and kinds["guided_json"]["reads_per_step"] <= 4


def test_spread_order_samples_the_whole_file_from_its_first_requests():
    """Spec-Bench lists its categories one after another; a level's first requests must not all be the first's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import spread_order

    for n in (1, 2, 13, 480, 512):
        assert sorted(spread_order(n)) == list(range(n))
    order = spread_order(480)
    assert order[:8] == [0, 256, 128, 384, 64, 320, 192, 448]  # one request a slot: 8 served, 60 apart
    categories = [min(i // 10, 8) if i < 80 else 8 + (i - 80) // 80 for i in order]  # spec_bench.jsonl's layout
    assert len(set(categories[:8])) >= 6 and len(set(categories[:64])) == 13


def test_guided_quick_times_the_kinds_asked_and_each_steps_phases(default_model_dir, tmp_path):
    """guided.py: guided JSON against plain decoding, only the kinds asked, and with --profile-steps the Medusa
    engine's phases a step (host_verify: the guided rows' targets made on the host)."""
    result = run("guided.py", tmp_path, "--kinds", "guided", "free", "--profile-steps")
    assert [(row["concurrency"], row["params"]) for row in result["rows"]] == [(1, "guided"), (1, "free"),
                                                                             (2, "guided"), (2, "free")]
    assert all(row["medusa_tok_s"] > 0 and row["plain_tok_s"] > 0 for row in result["rows"])
    guided = [row for row in result["rows"] if row["params"] == "guided"]
    phases = [row["medusa_phases"] for row in guided]
    assert all(phase["decode_steps"] > 0 and phase["host_verify_ms"] > 0 for phase in phases)
    for row in guided:  # every request of the level checked; whatever ended (not cut) fits the schema
        assert sum(row["finish_reasons"].values()) == row["requests"]
        assert row["fits_schema"] in (None, 1.0) and (row["fits_schema"] is None) == (
            set(row["finish_reasons"]) == {"length"})


def test_guided_schema_check_leaves_out_answers_cut_by_max_tokens():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from guided import schema_check

    class Out:
        def __init__(self, text, finish_reason):
            self.text, self.finish_reason = text, finish_reason

    valid = '{"answer": "4", "confidence": "high"}'
    check = schema_check([Out(valid, "stop"), Out('{"answer": "4", "conf', "length"), Out('{"answer": 4}', "stop")])
    assert check == {"fits_schema": 0.5, "finish_reasons": {"stop": 2, "length": 1}}
    assert schema_check([Out('{"ans', "length")])["fits_schema"] is None
    assert schema_check([]) == {"fits_schema": None, "finish_reasons": {}}
