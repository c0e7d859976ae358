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
    # a tree of the root alone (as the automatic choice gives on a busy CPU): the ratio is said to be noise
    code = main(["generate", "What is 7 times 8?", "--compare", "--tree", "single", "--max-new-tokens", "4",
                 "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "both runs decoded plainly and the ratio is timing noise" in out


def test_generate_rejects_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--dtype", "float8"])
    assert "invalid choice: 'float8'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, error", [
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1"),
    (["--device", "tpu"], "device 'tpu' is not a torch device"),
    (["--model", "/no/such/model.gguf"], "no such .gguf file: /no/such/model.gguf"),
    (["--heads", "none", "--compare"], "with --heads none both are plain"),
])
def test_generate_names_a_bad_option_in_one_line(argv, error, capsys):
    """Checked before the model loads where they can be (none of these reads a weight), and no traceback."""
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert error in err and "Traceback" not in err


@pytest.mark.parametrize("tree, error", [("nope", "unknown tree 'nope'; available: chain-3"),
                                         ("/no/such/tree.json", "/no/such/tree.json")])
def test_a_bad_tree_is_named_before_the_model_loads(tree, error, monkeypatch, capsys):
    from medusa.medusa_model import MedusaModel

    monkeypatch.setattr(MedusaModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["generate", "hi", "--tree", tree]) == 2
    assert error in capsys.readouterr().err


def test_a_cuda_device_without_a_gpu_is_named(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "hi", "--device", "cuda", "--model", "/no/such/model.gguf"]) == 2
    assert "device 'cuda': this torch sees no CUDA GPU" in capsys.readouterr().err


def test_help_texts_give_the_library_default_prompt_lookup(capsys):
    """The CLI spells the default out (importing the model to read it would slow `--help`): it must follow
    DEFAULT_PROMPT_LOOKUP (it said 4 after the default became 8)."""
    from medusa.medusa_model import CPU_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP

    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"{DEFAULT_PROMPT_LOOKUP} on a GPU, {CPU_PROMPT_LOOKUP} on a CPU" in text, command


def test_medusa_generate_runs_without_the_serve_extra():
    """README command 1 installs no extras: `medusa` must build its commands (serve's arguments included) without
    fastapi, uvicorn or pydantic, and `medusa serve` must then say which extra it needs (a subprocess where
    importing them fails, as in a fresh venv)."""
    import subprocess
    import sys

    blocked = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette", "sse_starlette")
    code = ("import sys\n"
            f"for name in {blocked!r}: sys.modules[name] = None\n"
            "from medusa.cli import main\n"
            "sys.argv = ['medusa'] + sys.argv[1:]\n"
            "sys.exit(main())\n")

    def medusa(*args):
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)

    assert medusa("--version").returncode == 0
    helped = medusa("generate", "--help")
    assert helped.returncode == 0 and "--compare" in helped.stdout, helped.stderr
    served = medusa("serve", "--port", "8123")
    assert served.returncode == 2 and "needs the 'serve' extra" in served.stderr and "[serve]" in served.stderr
