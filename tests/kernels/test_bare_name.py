"""The checkout's `kernels/` must not shadow an installed package named `kernels` (transformers >= 5.25 imports
Hugging Face's) when Python runs from the checkout's root."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_kernels_from_root(*python_flags, pythonpath=""):
    code = "import kernels, sys; print(getattr(kernels, 'WHO', 'checkout'), sys.modules['kernels'] is kernels)"
    env = dict(os.environ, PYTHONPATH=pythonpath)
    result = subprocess.run(
        [sys.executable, *python_flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_an_installed_kernels_package_wins_over_the_checkout(tmp_path):
    installed = tmp_path / "kernels"
    installed.mkdir()
    (installed / "__init__.py").write_text("WHO = 'installed'\n")
    assert _import_kernels_from_root(pythonpath=str(tmp_path)) == ["installed", "True"]


def test_the_checkout_keeps_the_name_when_nothing_else_has_it():
    # -S: no site-packages, so no installed `kernels` can be found.
    assert _import_kernels_from_root("-S") == ["checkout", "True"]


def test_our_kernels_stay_reachable_as_medusa_kernels():
    from medusa.kernels import paged_attention  # noqa: F401
