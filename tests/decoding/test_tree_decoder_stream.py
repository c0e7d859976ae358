"""The batch-1 decoder's generator: its steps run under inference mode, and a stream left half-read closes
quietly, also at interpreter exit (a generator decorated with a torch context re-entered it on close, after
torch was torn down: "Exception ignored in ... TreeDecoder.decode", a helper found it)."""

import subprocess
import sys
from pathlib import Path

import torch

from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.tree import TreeSpec
from tiny_models import tiny_decoder

HALF_READ = """
import sys
sys.path.insert(0, {tests!r})
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.tree import TreeSpec
from tiny_models import tiny_decoder
model, heads = tiny_decoder(24, num_heads=4)
streams = [TreeDecoder(model, heads, TreeSpec.load("tree-8")).decode([1, 2, 3], 20, SamplingConfig()) for _ in range(2)]
print(next(streams[0]), next(streams[1]), next(streams[0]))
"""


def test_steps_run_under_inference_mode_and_the_generator_holds_no_torch_context():
    model, heads = tiny_decoder(24, num_heads=4)
    seen, forward = [], model.forward
    model.forward = lambda *a, **kw: seen.append(torch.is_inference_mode_enabled()) or forward(*a, **kw)
    stream = TreeDecoder(model, heads, TreeSpec.load("tree-8")).decode([1, 2, 3], 12, SamplingConfig())
    next(stream)
    assert not torch.is_inference_mode_enabled()  # between steps the caller's own mode holds
    rest = [t for chunk in stream for t in chunk]
    assert seen and all(seen) and rest


def test_half_read_streams_close_quietly_at_interpreter_exit():
    tests = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", HALF_READ.format(tests=tests)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Error" not in done.stderr, done.stderr
