"""The heads shipped for the default model load, fit it, and carry their tree and accuracies."""

from medusa.default_model import default_heads_path
from medusa.heads import MedusaHeads
from medusa.tree import TreeSpec


def test_shipped_heads_load_and_fit_the_default_model():
    path = default_heads_path()
    assert path is not None, "medusa/assets/smollm2-135m-instruct-heads is missing"
    heads = MedusaHeads.from_pretrained(path, hidden_size=576, vocab_size=49152)
    assert heads.config.base_model == "SmolLM2-135M-Instruct"
    assert heads.config.num_heads == 4 and heads.config.lm_head == "shared" and heads.config.condition_on_root
    tree = TreeSpec.from_paths(heads.config.tree, num_heads=heads.config.num_heads)
    assert tree.num_nodes == 64
    accuracies = heads.config.accuracies
    # measured on the diverse held-out mix they were trained for (RESULTS.md, session 13: 0.597 and 2.63)
    assert len(accuracies) == 4 and accuracies[0][0] > 0.55
    assert tree.expected_accept_length(accuracies) > 2.5
