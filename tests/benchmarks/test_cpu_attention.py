"""cpu_attention.py: `attend`'s explicit CPU path against SDPA, per call."""

from bench_scripts import run


def test_cpu_attention_quick(tmp_path):
    """Two shapes timed three ways, and the explicit path agrees with SDPA on them."""
    results = run("cpu_attention.py", tmp_path)
    assert [(r["queries"], r["keys"]) for r in results["rows"]] == [(1, 16), (1, 256)]
    for row in results["rows"]:
        assert min(row["explicit_us"], row["sdpa_grouped_us"], row["sdpa_folded_us"]) > 0
        assert row["max_abs_difference"] < 1e-5
