"""A wheel carries what the package reads at run time: the shipped heads and configs/ (named trees,
training recipes, chat templates), and an installed package finds them without the checkout."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "medusa", "training", "decoding", "kernels", "configs"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project built as a wheel from a copy of its sources (setuptools builds in the tree it is given)."""
    if shutil.which("git") is None:
        pytest.skip("needs git to list the tracked sources")
    pytest.importorskip("setuptools", minversion="68")  # the build backend, used without build isolation
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(["git", "ls-files", *SOURCES], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in tracked.stdout.splitlines():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", str(src), "-w", str(out)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    return next(out.glob("*.whl"))


def test_the_wheel_holds_every_shipped_config_and_the_heads(wheel):
    import medusa

    assert wheel.name.startswith(f"medusa_decoding-{medusa.__version__}-")  # one version, medusa.__version__
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = [p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*") if p.is_file()]
    assert configs and {f"medusa/{name}" for name in configs} <= names
    assert "medusa/assets/smollm2-135m-instruct-heads/heads.safetensors" in names


def test_an_installed_package_finds_trees_recipes_and_templates_and_writes_trees_outside_itself(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import medusa, medusa.paths as p\n"
        "from medusa.tree import TreeSpec\n"
        "from medusa.training.config import load_config\n"
        "from medusa.decoding.server.cli import _chat_template\n"
        "assert medusa.__file__.startswith(%r) and p.__file__.startswith(%r), p.__file__\n"
        "assert TreeSpec.load('tree-32').num_nodes == 32\n"
        "assert load_config('medusa1-smollm2').heads.num_heads >= 1\n"
        "assert '{%%' in _chat_template('chatml-tools')\n"
        "print(p.user_trees_dir())\n" % (str(site), str(site))
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MEDUSA_TREES_DIR", "XDG_CONFIG_HOME")}
    env.update(PYTHONPATH=str(site), HOME=str(tmp_path / "home"))
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(tmp_path / "home" / ".config" / "medusa" / "trees")


@pytest.mark.parametrize("module", ["medusa.cli", "medusa.training.cli"])
def test_both_commands_say_their_version(module, capsys):
    import importlib

    import medusa

    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.split()[-1] == medusa.__version__


def test_no_test_folder_is_named_after_the_package():
    """A subprocess with tests/ on PYTHONPATH (the torchrun tests) would import such a folder as a namespace
    package `medusa`, ahead of the editable install's finder: `from medusa import __version__` then failed."""
    assert not (ROOT / "tests" / "medusa").exists()
