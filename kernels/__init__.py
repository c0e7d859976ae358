"""Triton kernels of the hot path, installed as `medusa.kernels` (pyproject's package-dir maps it here)."""

if __name__ == "kernels":
    # Imported by the bare name: the checkout's root is on sys.path (`python -m pytest` or `python -m medusa...`
    # run from it), so this directory shadows the PyPI package `kernels` (Hugging Face's), which transformers
    # >= 5.25 imports. Load the installed package instead and leave it in sys.modules, where the pending import
    # statement takes its result from; keep this one when no other `kernels` is installed.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is not None and _spec.origin is not None and _spec.loader is not None:  # not a namespace directory
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _installed
        _spec.loader.exec_module(_installed)
