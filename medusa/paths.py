"""Where the shipped configs live, and where trees a user names are written.

The design card keeps `configs/` at the top of the repository. A wheel ships it inside the package
(`medusa/configs`, mapped in pyproject.toml), so the package's own copy is looked for first and the
checkout's second: an installed package and a source checkout find the same files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _configs_dir() -> Path:
    installed = _PACKAGE / "configs"  # a wheel's copy
    return installed if installed.is_dir() else _PACKAGE.parent / "configs"  # a source checkout


CONFIGS_DIR = _configs_dir()
IN_CHECKOUT = CONFIGS_DIR.parent != _PACKAGE  # configs/ beside the package, not inside it
TREES_DIR = CONFIGS_DIR / "trees"
RECIPES_DIR = CONFIGS_DIR / "train"
TEMPLATES_DIR = CONFIGS_DIR / "chat_templates"
_TREE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def user_trees_dir() -> Path:
    """Where `medusa-train train --tree-name` writes: $MEDUSA_TREES_DIR if set; else configs/trees of a
    source checkout (the project's named trees); else, for an installed package, $XDG_CONFIG_HOME/medusa/trees
    (~/.config/medusa/trees), never the installed package, whose files a reinstall replaces."""
    if os.environ.get("MEDUSA_TREES_DIR"):
        return Path(os.environ["MEDUSA_TREES_DIR"]).expanduser()
    if IN_CHECKOUT:
        return TREES_DIR
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "medusa" / "trees"


def tree_dirs() -> list[Path]:
    """The folders a bare tree name is looked up in: the shipped trees first, then the user's."""
    user = user_trees_dir()
    return [TREES_DIR] if user.resolve() == TREES_DIR.resolve() else [TREES_DIR, user]


def new_tree_file(name: str) -> Path:
    """The file a tree named `name` is written to; raises where the name is not a plain file stem or is
    taken (a shipped tree or an earlier run's), so a run checks it before training, not after."""
    if not isinstance(name, str) or not _TREE_NAME.fullmatch(name) or name.endswith(".json"):
        raise ValueError(f"tree name {name!r}: use letters, digits, '.', '_', '+' or '-' (no path, no .json)")
    for folder in tree_dirs():
        taken = folder / f"{name}.json"
        if taken.exists():
            raise ValueError(f"a tree named {name!r} already exists ({taken}); choose another name or remove it")
    return user_trees_dir() / f"{name}.json"
