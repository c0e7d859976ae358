"""Helpers for engine tests: one thread for tiny ops, random prompts, staggered submission."""

import dataclasses
from contextlib import contextmanager

import torch


@contextmanager
def single_thread():
    """Ops as small as a tiny model's run far slower when threads contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def random_prompts(n: int, vocab: int, max_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run_staggered(engine, prompts, params, per_step: int = 3) -> dict:
    """Submit `per_step` new requests every step, as a server would -> {prompt index: final output}."""
    ids, done, pending = {}, {}, list(range(len(prompts)))
    while pending or engine.has_unfinished():
        for _ in range(per_step):
            if pending:
                i = pending.pop(0)
                ids[engine.add_request(prompts[i], params[i])] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
    return done


def run_with_logprobs(engine, prompts, params) -> list[tuple[list[int], list | None, str]]:
    """All requests added at once, then steps until they finish -> each request's (tokens, logprobs gathered
    from its outputs' new_logprobs, or None if it asked for none, finish reason)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    got = {rid: ([], None, None) for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs, _ = got[out.request_id]
            if out.new_logprobs is not None:
                logprobs = (logprobs or []) + out.new_logprobs
            got[out.request_id] = (tokens + out.new_token_ids, logprobs, out.finish_reason)
    return [got[rid] for rid in ids]


def count_launches(engine) -> list[int]:
    """-> a list that gets the tree size of each overlapped step the engine launches"""
    launched = []
    launch = engine._launch
    engine._launch = lambda seqs, tree, **kw: launched.append(tree.num_nodes) or launch(seqs, tree, **kw)
    return launched


def force_overlap(request, monkeypatch):
    """For a fixture parametrized over [False, True, k]: every LLMEngine built in the test runs with
    `overlap` set to the parameter, so the CPU checks the overlapped steps' bookkeeping as well; an
    integer k >= 2 means overlapped, applying the tokens every k steps (`EngineConfig.apply_interval`)."""
    from medusa.decoding.engine import EngineConfig, LLMEngine

    init = LLMEngine.__init__
    mode = request.param

    def forced(self, *args, **kwargs):
        if not isinstance(mode, bool):  # the interval is fixed at construction (the block tables' width)
            args, config = list(args), kwargs.pop("config", None)
            if len(args) > 2:
                config = args.pop(2)
            kwargs["config"] = dataclasses.replace(config or EngineConfig(), apply_interval=mode)
        init(self, *args, **kwargs)
        self.overlap = bool(mode)

    monkeypatch.setattr(LLMEngine, "__init__", forced)
    return request.param


def without_policy(engine):
    """The engine as before any warmup: each step runs the largest tree the token budget allows, whatever a
    CPU's eager timings chose (`eager_costs.py`). For tests that must see trees verified."""
    from medusa.decoding.tree_policy import TreePolicy

    engine.policy, engine.scheduler.policy = TreePolicy(), None
    return engine
