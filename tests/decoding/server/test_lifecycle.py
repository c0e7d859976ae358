"""Clients that leave abort their requests and free every KV block; SIGTERM shuts `medusa serve` down cleanly."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000, "ignore_eos": True,
        "temperature": 0}


def wait_until(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def all_blocks_free(app) -> bool:
    engines = [e.engine for e in app.state.server.engines.values()]
    return all(not e.has_unfinished() and e.blocks.num_free_blocks == e.blocks.num_blocks for e in engines)


def aborted(app) -> float:
    value = app.state.server.metrics.registry.get_sample_value("medusa:request_success_total",
                                                               {"finished_reason": "abort"})
    return value or 0.0


def first_content(lines) -> dict:
    """Read SSE lines until a chunk with generated text: the request is then decoding."""
    for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                return chunk
    raise AssertionError("the stream ended before any text")


@pytest.mark.slow
def test_disconnect_mid_stream_aborts_and_frees_kv(real_server):
    url, app = real_server
    before = aborted(app)
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", CHAT, json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            first_content(resp.iter_lines())
            assert app.state.server.engines[True].engine.has_unfinished()
        # leaving the block closes the connection with the stream unread: the client is gone
    assert wait_until(lambda: all_blocks_free(app)), "the aborted request still holds KV blocks"
    assert aborted(app) == before + 1


@pytest.mark.slow
def test_disconnect_while_waiting_for_a_full_response(real_server):
    url, app = real_server
    before = aborted(app)
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60, read=1.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(CHAT, json=LONG)
    assert wait_until(lambda: all_blocks_free(app))
    assert aborted(app) == before + 1


def _tiny_checkpoint(folder, tokenizer_dir) -> None:
    """A random 2-layer Llama with the real tokenizer, saved as a Hugging Face folder."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_ends_streams_and_exits_zero(tmp_path, default_model_dir):
    _tiny_checkpoint(tmp_path, default_model_dir)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "medusa.cli", "serve", "--model", str(tmp_path), "--heads", "none",
                             "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _healthy(url), 120), proc.stdout.read() if proc.poll() is not None else "no start"
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", CHAT, json={**LONG, "max_tokens": 4000, "stream": True}) as resp:
                lines = resp.iter_lines()
                first_content(lines)
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]  # it ends at once, not after 4000 tokens
        assert rest[-1] == "data: [DONE]" and any("shutting down" in line for line in rest)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_logs_which_tree_each_batch_size_uses(tmp_path, default_model_dir):
    """`medusa serve` shows the medusa loggers at --log-level (info by default): the engine's start line is there."""
    _tiny_checkpoint(tmp_path, default_model_dir)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "medusa.cli", "serve", "--model", str(tmp_path), "--heads", "none",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), 120), "the server did not start"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "INFO:     medusa.server: engine (speculative=False): tree per batch size" in output, output


def test_serve_leaves_logging_the_user_set_up_alone():
    from medusa.decoding.server.cli import configure_logging

    root, ours = logging.getLogger(), logging.getLogger("medusa")
    saved = root.handlers, ours.handlers, ours.level
    try:
        root.handlers, ours.handlers = [logging.NullHandler()], []  # the user's own configuration
        configure_logging("info")
        assert ours.handlers == [] and ours.level == saved[2]
        root.handlers = []  # none: serve shows medusa's lines
        configure_logging("debug")
        assert len(ours.handlers) == 1 and ours.getEffectiveLevel() == logging.DEBUG
    finally:
        root.handlers, ours.handlers = saved[:2]
        ours.setLevel(saved[2])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_start_log_names_each_run_of_batch_sizes_with_one_tree():
    """A CPU engine has a bucket per batch size: 64 of them would flood the log line."""
    from medusa.decoding.server.app import bucket_runs

    chosen = {1: "searched-12+lookup4", 2: "searched-4+lookup4", **{b: "single" for b in range(3, 65)}}
    assert bucket_runs(chosen) == "1: searched-12+lookup4, 2: searched-4+lookup4, 3-64: single"
    assert bucket_runs({8: "a", 1: "a", 2: "b"}) == "1: a, 2: b, 8: a" and bucket_runs({}) == ""
