"""AsyncLLMEngine: concurrent streams equal the sync engine; a consumer that leaves aborts its request."""

import asyncio

import pytest
import torch

from medusa.decoding.async_engine import AsyncLLMEngine
from medusa.decoding.engine import EngineConfig, LLMEngine, stream
from medusa.decoding.sampling_params import SamplingParams
from tiny_models import tiny_decoder


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_decoder(24, logit_scale=3, num_heads=4)
    torch.set_num_threads(threads)


def prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(24, (n,), generator=g).tolist() for n in (3, 17, 8, 30, 1, 12, 5, 22)]


@pytest.mark.parametrize("overlapped, interval", [(False, 1), (True, 1), (True, 3)],
                         ids=["medusa", "plain-overlapped", "medusa-overlapped-apply-every-3"])
def test_concurrent_streams_equal_sync_and_disconnect_frees_blocks(tiny, overlapped, interval):
    """Served: Medusa trees, plain steps each launched before the last is read back (a GPU's default),
    or Medusa steps applied three at a time, whose disconnecting consumers abort requests with steps in
    flight or read back but not applied."""
    model, heads = tiny
    params = SamplingParams(max_tokens=16)
    expected = LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4)).generate(prompts(), params)
    engine = LLMEngine(model, heads if interval > 1 or not overlapped else None,
                       EngineConfig(num_blocks=128, block_size=4, overlap=overlapped, apply_interval=interval))
    served = AsyncLLMEngine(engine)

    async def consume(prompt, leave_after=None):
        tokens, n = [], 0
        async for out in served.generate(prompt, params):
            n += 1
            tokens = out.token_ids
            if leave_after is not None and n >= leave_after:
                break  # the client disconnects
        return tokens

    async def main():
        results = await asyncio.gather(*(consume(p) for p in prompts()),
                                       consume([1, 2, 3], leave_after=2), consume([4, 5], leave_after=1))
        for _ in range(50):  # let the loop apply the aborts
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await served.shutdown()
        return results

    results = asyncio.run(main())
    assert results[:8] == [e.token_ids for e in expected]
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == 128 and not engine.blocks.ref_counts.any()


def test_bad_request_raises_to_its_consumer_only(tiny):
    model, heads = tiny
    served = AsyncLLMEngine(LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4)))

    async def main():
        async def bad():
            async for _ in served.generate(list(range(20)) * 40, SamplingParams(max_tokens=400)):
                pass

        async def good():
            outs = [o async for o in served.generate([1, 2], SamplingParams(max_tokens=4))]
            return outs[-1].token_ids

        results = await asyncio.gather(bad(), good(), return_exceptions=True)
        await served.shutdown()
        return results

    error, tokens = asyncio.run(main())
    assert isinstance(error, ValueError) and "context" in str(error)
    assert len(tokens) == 4


def test_sync_stream_yields_until_finished(tiny):
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4))
    outs = list(stream(engine, [1, 2, 3], SamplingParams(max_tokens=10)))
    assert outs[-1].finished and len(outs[-1].token_ids) == 10
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids


def test_sync_stream_of_n_completions_yields_every_one_to_its_end(tiny):
    """n > 1: every completion's outputs, each stream's tokens the completion's own, until all n finish; the
    engine is then free for generate (a stream that returned at completion 0's end left the others running)."""
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4))
    params = SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=2)
    outs = list(stream(engine, [1, 2, 3], params))
    last = {o.index: o for o in outs}
    assert sorted(last) == [0, 1, 2] and all(o.finished for o in last.values())
    for index, out in last.items():
        assert [t for o in outs if o.index == index for t in o.new_token_ids] == out.token_ids
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert [o.token_ids for o in engine.generate([1, 2, 3], params)] == [last[i].token_ids for i in range(3)]


@pytest.mark.parametrize("overlapped", [False, True], ids=["medusa", "plain-overlapped"])
def test_sync_stream_abandoned_early_aborts_its_request(tiny, overlapped):
    model, heads = tiny
    engine = LLMEngine(model, None if overlapped else heads, EngineConfig(num_blocks=64, block_size=4,
                                                                          overlap=overlapped))
    outputs = stream(engine, [1, 2, 3], SamplingParams(max_tokens=50))
    first = [next(outputs) for _ in range(3)]
    assert not first[-1].finished
    assert (engine._inflight is not None) == overlapped  # the next plain step is already running
    outputs.close()  # the caller stops iterating
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_n_completions_stream_to_the_end_and_step_errors_reach_consumers(tiny):
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4))
    served = AsyncLLMEngine(engine)

    async def main():
        outs = [o async for o in served.generate([1, 2], SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=1))]
        finished = sorted(o.index for o in outs if o.finished)

        def broken_step():
            raise RuntimeError("device fell over")

        engine.step = broken_step
        try:
            async for _ in served.generate([3, 4], SamplingParams(max_tokens=5)):
                pass
        except RuntimeError as err:
            error = str(err)
        await served.shutdown()
        return finished, error

    finished, error = asyncio.run(main())
    assert finished == [0, 1, 2]
    assert error == "device fell over"


def test_abort_ends_the_stream_of_a_waiting_consumer(tiny):
    """abort(request_id) mid-stream: the consumer's `async for` ends (it used to wait forever) and the engine
    frees the request's blocks; the other request runs on to its end."""
    model, heads = tiny
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4))
    served = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def main():
        aborted = served.generate([1, 2, 3], params, request_id="gone")
        kept = served.generate([4, 5, 6], params, request_id="kept")
        first = await aborted.__anext__()
        served.abort("gone")
        rest = [out async for out in aborted]  # ends: no output finishes it
        kept_outputs = [out async for out in kept]
        for _ in range(50):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await served.shutdown()
        return first, rest, kept_outputs

    first, rest, kept = asyncio.run(asyncio.wait_for(main(), 60))
    assert not first.finished and not any(out.finished for out in rest)
    assert kept[-1].finished and len(kept[-1].token_ids) == 24
    assert not engine.has_unfinished() and engine.stats().kv_usage == 0
