"""The OpenAI-compatible server: `build_app(model, served_name)` or `medusa serve`."""

from medusa.decoding.server.app import build_app

__all__ = ["build_app"]
