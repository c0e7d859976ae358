"""The `medusa generate` command: its greedy verdict, and the README demo end to end on the CPU."""

import pytest

from medusa.cli import greedy_verdict, main


def test_greedy_verdict_says_where_outputs_part_and_why_in_16_bit():
    assert greedy_verdict([1, 2, 3], [1, 2, 3], "bfloat16") == "[greedy outputs identical: yes]"
    line = greedy_verdict([1, 2, 3, 4], [1, 2, 9, 4], "bfloat16")
    assert "NO, they part at token 3 of 4" in line and "--dtype float32" in line
    assert greedy_verdict([1, 2], [1, 2, 3], "float32") == "[greedy outputs identical: NO, they part at token 3 of 2]"


@pytest.mark.slow
def test_generate_compare_in_float32_is_identical(default_model_dir, capsys):
    code = main(["generate", "What is 7 times 8?", "--compare", "--dtype", "float32", "--max-new-tokens", "12",
                 "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "[greedy outputs identical: yes]" in out and "[plain decoding:" in out


def test_generate_rejects_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--dtype", "float8"])
    assert "invalid choice: 'float8'" in capsys.readouterr().err


def test_help_texts_give_the_library_default_prompt_lookup(capsys):
    """The CLI spells the default out (importing the model to read it would slow `--help`): it must follow
    DEFAULT_PROMPT_LOOKUP (it said 4 after the default became 8)."""
    from medusa.medusa_model import CPU_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP

    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"{DEFAULT_PROMPT_LOOKUP} on a GPU, {CPU_PROMPT_LOOKUP} on a CPU" in text, command
