"""Server fixtures: the real default model served by uvicorn in a background thread, and a tiny
random model behind the real tokenizer for the tests that only exercise the HTTP layer."""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

SERVED_NAME = "SmolLM2-135M-Instruct"


@contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` on a free loopback port until the block exits (lifespan shutdown included)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="session")
def real_model(default_model_dir):
    from medusa.medusa_model import MedusaModel

    return MedusaModel.from_pretrained(device="cpu")


@pytest.fixture(scope="session")
def real_server(real_model):
    """(base_url, app) serving the real model; a smaller KV pool than the default keeps memory low."""
    from medusa.decoding.engine import EngineConfig
    from medusa.decoding.server import build_app
    from engine_driver import without_policy

    app = build_app(real_model, SERVED_NAME, engine_config=EngineConfig(num_blocks=256))
    without_policy(app.state.server.engine(True).engine)  # trees every step: the tests count drafts, whatever the timings chose
    with running_server(app) as url:
        yield url, app


@pytest.fixture(scope="session")
def tiny_model(default_model_dir):
    """A 2-layer random model with 3 heads and the real tokenizer (chat template included):
    fast enough that any request the server accepts finishes in well under a second."""
    from medusa.medusa_model import MedusaModel, _load_tokenizer
    from tiny_models import tiny_decoder

    base, heads = tiny_decoder(vocab=49152, max_positions=96, num_heads=3, logit_scale=3)
    return MedusaModel(base, _load_tokenizer(default_model_dir), heads, system_prompt="Be brief.")


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    """(base_url, app) serving the tiny model over real HTTP: a client with a timeout turns a request
    that never answers into a failure, where a TestClient would wait forever."""
    from medusa.decoding.engine import EngineConfig
    from medusa.decoding.server import build_app

    app = build_app(tiny_model, "tiny", engine_config=EngineConfig(num_blocks=128))
    with running_server(app) as url:
        yield url, app


# The serve extra is optional (the GPU host has no fastapi): skip these tests where it is missing,
# except in CI, whose install of ".[test]" must bring it.
_NEEDED = ("fastapi", "uvicorn", "openai", "httpx", "prometheus_client")
if not os.environ.get("CI") and any(importlib.util.find_spec(name) is None for name in _NEEDED):
    collect_ignore_glob = ["test_*.py"]
