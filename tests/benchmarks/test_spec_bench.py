"""spec_bench.py --quick: the systems side by side on 4 questions."""



import pytest
from bench_scripts import run

pytestmark = pytest.mark.slow


def test_spec_bench_quick(default_model_dir, tmp_path):
    results = run("spec_bench.py", tmp_path, "--hf-per-category", "1")
    overall = results["overall"]
    assert overall["questions"] == 4 and overall["plain_tok_s"] > 0 and overall["medusa_tok_s"] > 0
    assert overall["mean_accepted_length"] >= 1.0 and overall["hf_tok_s"] > 0
    assert overall["identical_greedy_turns"] == overall["turns"]  # float32 on the CPU: exact
    assert len(results["categories"]) == 4
    assert sum(overall["decode_steps_per_tree"].values()) == overall["medusa_steps"] > 0
    from medusa.medusa_model import CPU_PROMPT_LOOKUP

    own = f"heads+lookup{CPU_PROMPT_LOOKUP}"  # the heads' own tree with the CPU's default lookup chain
    assert results["candidate_trees"][0] == "single" and results["candidate_trees"][-1] == own  # unpinned
    assert len(results["candidate_trees"]) == 6


def test_spec_bench_quick_through_the_batch1_decoder(default_model_dir, tmp_path):
    """--decoder generate: MedusaModel.generate per turn, on a CPU the batch-1 decoder `medusa generate` runs."""
    results = run("spec_bench.py", tmp_path, "--decoder", "generate")
    overall = results["overall"]
    assert results["decoder"] == "generate" and results["batch1_tree"]  # the tree timed at load
    assert overall["questions"] == 4 and overall["plain_tok_s"] > 0 and overall["medusa_tok_s"] > 0
    assert overall["identical_greedy_turns"] == overall["turns"]  # float32 on the CPU: exact
    assert overall["decode_steps_per_tree"] == {} and overall["medusa_steps"] > 0
