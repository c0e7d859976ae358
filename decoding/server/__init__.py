"""The OpenAI-compatible server: `build_app(model, served_name)` or `medusa serve`.

`build_app` is imported on first use (PEP 562), so that `medusa generate`, which builds the `serve` command's
arguments, runs without the `serve` extra (fastapi, uvicorn, pydantic) installed."""

__all__ = ["build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from medusa.decoding.server.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
