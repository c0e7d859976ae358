"""Medusa speculative decoding: heads propose a tree, the base model verifies it in one pass.

    from medusa import MedusaModel
    model = MedusaModel.from_pretrained()          # default model + its shipped heads
    out = model.chat("Name three prime numbers.")
    print(out.text, out.mean_accepted_length)
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["MedusaModel", "MedusaHeads", "HeadsConfig", "ModelConfig", "TreeSpec", "GenerationResult"]


def __getattr__(name: str):
    # Lazy: the face imports medusa.decoding, which imports core modules of this
    # package; importing it eagerly here would make every core import pull it in.
    if name in ("MedusaModel", "GenerationResult"):
        from medusa import medusa_model

        return getattr(medusa_model, name)
    if name in ("MedusaHeads", "HeadsConfig"):
        from medusa import heads

        return getattr(heads, name)
    if name == "ModelConfig":
        from medusa.config import ModelConfig

        return ModelConfig
    if name == "TreeSpec":
        from medusa.tree import TreeSpec

        return TreeSpec
    raise AttributeError(f"module 'medusa' has no attribute {name!r}")
