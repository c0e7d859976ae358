"""Count penalties and the min_tokens ban made by the device inside the decode step (`device_changes.py`): the
same logits as the host's `penalize` + `suppress_eos` row by row, counts kept by each step's emitted tokens, and
an engine whose penalized and banned rows keep device verdicts and overlapped steps, writing what the host's
path writes."""

import pytest
import torch

from medusa.decoding.device_changes import MAX_BANNED, DeviceChanges, RowChanges
from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.engine import EngineConfig, LLMEngine
from medusa.decoding.logits_processing import penalize, suppress_eos
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.scheduler import SchedulerConfig
from medusa.tree import TreeSpec
from engine_driver import count_launches, random_prompts, single_thread, without_policy
from tiny_models import tiny_decoder

VOCAB = 12
KINDS = [dict(presence_penalty=0.4, frequency_penalty=0.3), dict(repetition_penalty=1.8), dict(),
         dict(repetition_penalty=0.6, presence_penalty=-0.5, min_tokens=9), dict(min_tokens=7),
         dict(frequency_penalty=1.1, min_tokens=30), dict(logit_bias={3: 2.5, 7: -4.0}, frequency_penalty=0.2),
         dict(allowed_token_ids=[1, 4, 6, 8, 11], logit_bias={4: 1.5, 5: 3.0}, repetition_penalty=1.4, min_tokens=40)]


def host_logits(params, output, prompt, logits, tree, candidates, banned):
    """The host's path for one row: bias and penalties at every node from its own text, then the min_tokens ban
    (tree None: an admission's first token, no output yet)."""
    changed = penalize(params, output, logits, tree, candidates, prompt).float()
    return suppress_eos(params, len(output), banned, changed, tree.depths if tree else torch.zeros(1).long())


def row_changes_of(params, output_count, window, ends):
    """The engine's `_row_changes` for a row whose host has counted `output_count - window` outputs."""
    ban_left = params.min_tokens - (output_count - window)
    row = RowChanges(params.frequency_penalty, params.presence_penalty, params.repetition_penalty, ban_left,
                     ends if ban_left > 0 else (), bool(params.logit_bias) or params.allowed_token_ids is not None)
    return row if row.penalized or row.banned or row.biased else None


def set_rows(changes, rows, params, outputs, prompts):
    """The engine's `_set_changes` (outputs before the root; None where not penalized)."""
    changes.set_rows(rows, [o if p.has_count_penalties else None for p, o in zip(params, outputs)],
                     [pr if p.repetition_penalty != 1 else [] for p, pr in zip(params, prompts)],
                     [p.logit_bias or None for p in params], [p.allowed_token_ids for p in params])


@pytest.fixture(params=["reference", "kernel"])
def row_pass(request, monkeypatch):
    """The rows' pass (`kernels.row_changes`) by its PyTorch reference, or by the Triton kernel (the interpreter on
    a CPU), which a GPU runs."""
    if request.param == "kernel":
        pytest.importorskip("triton")
        import medusa.kernels.row_changes as row_changes

        monkeypatch.setattr(row_changes, "use_triton", lambda x, *rest: True)
    return request.param


def test_device_changes_equal_the_hosts_row_by_row_and_follow_the_emitted_tokens(row_pass):
    """Rows in permuted state rows, some in flight (their window: tokens the host has not counted yet), on a
    tree with a lookup chain; then a step's emitted tokens recorded, and the next logits again equal."""
    tree = DeviceTree.from_spec(TreeSpec.load("tree-16").with_lookup(3), torch.device("cpu"))
    n, gen = tree.num_nodes, torch.Generator().manual_seed(0)
    changes = DeviceChanges(max_seqs=8, vocab=VOCAB, device=torch.device("cpu"))
    rows = [5, 0, 3, 7, 1, 2, 4, 6]
    params = [SamplingParams(max_tokens=64, **kind) for kind in KINDS]
    outputs = [torch.randint(0, VOCAB, (2 + g,), generator=gen).tolist() for g in range(len(KINDS))]
    prompts = [torch.randint(0, VOCAB, (5,), generator=gen).tolist() for _ in KINDS]
    windows = [0, 2, 1, 3, 0, 2, 1, 0]  # of each output, the tokens of steps in flight
    banned = [(VOCAB - 1, 4)] * len(KINDS)
    set_rows(changes, rows, params, [o[:-1] for o in outputs], prompts)  # the root apart
    penalized = [g for g, p in enumerate(params) if p.has_count_penalties]
    changes.add_roots([rows[g] for g in penalized], torch.tensor([outputs[g][-1] for g in penalized]))
    for step in range(2):
        row_changes = [row_changes_of(p, len(o), w, e) for p, o, w, e in zip(params, outputs, windows, banned)]
        assert changes.prepare(row_changes, len(KINDS)) and row_changes[2] is None
        candidates = torch.randint(0, VOCAB, (len(KINDS), n), generator=gen)
        logits = torch.randn(len(KINDS) * n, VOCAB, generator=gen)
        raw = logits.clone()
        got = changes.apply(logits, torch.tensor(rows), tree, candidates, torch.tensor(windows))
        assert torch.equal(logits, raw)  # the raw logits are kept for logprobs
        for g in range(len(KINDS)):
            want = host_logits(params[g], outputs[g], prompts[g], raw.view(len(KINDS), n, -1)[g], tree,
                               candidates[g], banned[g])
            assert torch.equal(got[g], want), (step, KINDS[g])
        early = len(outputs[4]) + tree.depths < 7  # row 4's min_tokens: its shallow nodes may not end
        assert early.any() or step and torch.equal(torch.isneginf(got[4, :, VOCAB - 1]), early)
        assert torch.isneginf(got[5][:, [4, VOCAB - 1]]).all() and not torch.isneginf(got[2]).any()
        # a step emits the accepted path and the next root: count tokens of the packed row's D + 1
        depth = tree.spec.max_depth
        counts = torch.randint(1, depth + 2, (len(KINDS),), generator=gen)
        tokens = torch.randint(0, VOCAB, (len(KINDS), depth + 1), generator=gen)
        changes.record(torch.tensor(rows), torch.cat([counts[:, None], tokens, torch.zeros(len(KINDS), 1).long()], 1))
        outputs = [o + tokens[g, : counts[g]].tolist() for g, o in enumerate(outputs)]


def test_first_token_changes_equal_the_hosts(row_pass):
    """An admission's first token (no output yet): bias, allowed tokens, the repetition penalty's prompt tokens
    and the min_tokens ban, as the host's `_first_token` makes them; rows in a table with other rows' bias."""
    gen = torch.Generator().manual_seed(1)
    changes = DeviceChanges(max_seqs=8, vocab=VOCAB, device=torch.device("cpu"))
    params = [SamplingParams(max_tokens=64, **kind) for kind in KINDS]
    prompts = [torch.randint(0, VOCAB, (6,), generator=gen).tolist() for _ in KINDS]
    rows = [3, 5, 0, 7, 1, 2, 6, 4]
    set_rows(changes, rows, params, [[] for _ in KINDS], prompts)
    raw = torch.randn(len(KINDS), VOCAB, generator=gen)
    got = changes.first(raw, rows, [row_changes_of(p, 0, 0, (VOCAB - 1, 4)) for p in params])
    for g, p in enumerate(params):
        want = host_logits(p, [], prompts[g], raw[g:g + 1], None, None, (VOCAB - 1, 4))[0]
        assert torch.equal(got[g], want), KINDS[g]
    assert torch.isneginf(got[7]).sum() == VOCAB - 3  # allowed 1, 6, 8 (4 and 11 are ends, banned by min_tokens)


def test_prepare_reports_no_changes_and_refuses_counts_never_set():
    changes = DeviceChanges(max_seqs=4, vocab=VOCAB, device=torch.device("cpu"))
    assert not changes.prepare([None, None], 4) and changes.counts is None  # no memory until a row needs it
    assert changes.prepare([RowChanges(ban_left=3, banned=(1,))], 4)
    fresh = DeviceChanges(max_seqs=4, vocab=VOCAB, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="counts were never set"):
        fresh.prepare([RowChanges(presence=0.5)], 4)


@pytest.fixture(scope="module")
def tiny():
    with single_thread():
        yield tiny_decoder(VOCAB, logit_scale=3, num_heads=4)


def mixed_params(stop_ids=(VOCAB - 1,)):
    """Penalized, banned, biased, sampled and free rows together (seeded draws: the same text either way)."""
    return [SamplingParams(max_tokens=20, presence_penalty=0.9, frequency_penalty=0.4),
            SamplingParams(max_tokens=20, repetition_penalty=1.6, temperature=0.8, seed=3),
            SamplingParams(max_tokens=20, min_tokens=12, stop_token_ids=stop_ids),
            SamplingParams(max_tokens=20),
            SamplingParams(max_tokens=20, temperature=1.0, seed=5, frequency_penalty=0.8, min_tokens=6,
                           stop_token_ids=stop_ids),
            SamplingParams(max_tokens=16, temperature=0.7, seed=9),
            SamplingParams(max_tokens=18, logit_bias={3: 2.0, 6: -3.0}, temperature=0.9, seed=2),
            SamplingParams(max_tokens=18, allowed_token_ids=[1, 2, 5, 7, 9, VOCAB - 1], presence_penalty=0.7,
                           min_tokens=5, stop_token_ids=stop_ids)]


def run(model, heads, params, overlap, host_path=False, num_blocks=256):
    engine = without_policy(LLMEngine(model, heads, EngineConfig(num_blocks=num_blocks, block_size=4)))
    engine.overlap = overlap
    if host_path:  # every changed row decided on the host, as before the device made these changes
        engine._needs_host = lambda r: r.params.has_penalties or r.seq.num_output_tokens < r.eos_banned_until
    else:
        engine.runner.decode.override = lambda *a: pytest.fail("a row took the host's verdict")
    launched = count_launches(engine)
    outs = engine.generate(random_prompts(len(params), VOCAB, 14, seed=21), params)
    assert engine.blocks.num_free_blocks == num_blocks and not engine.blocks.ref_counts.any()
    return [(o.token_ids, o.finish_reason) for o in outs], launched


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_penalized_and_banned_rows_keep_device_verdicts_and_write_the_hosts_text(tiny, overlap):
    model, heads = tiny
    params = mixed_params()
    device, launched = run(model, heads, params, overlap)
    host, host_launched = run(model, heads, params, overlap, host_path=True)
    assert device == host
    assert len(device[2][0]) >= 12 and VOCAB - 1 not in device[2][0][:12]  # banned until min_tokens
    if overlap:  # overlapped steps with the changed rows in them (the host's rows overlap too)
        assert max(launched) > 1 and len(launched) > 5 and len(host_launched) > 5
    plain, _ = run(model, None, params, overlap)
    assert plain == device  # Medusa's trees change nothing: each node saw its own path's counts


def test_more_end_tokens_than_the_device_bans_go_to_the_host(tiny):
    model, heads = tiny
    many = tuple(range(VOCAB - MAX_BANNED - 1, VOCAB))
    params = [SamplingParams(max_tokens=12, min_tokens=10, stop_token_ids=many), SamplingParams(max_tokens=12)]
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4))
    rid = engine.add_request([1, 2, 3], params[0])
    assert engine._needs_host(engine.requests[rid]) and engine._row_changes(engine.requests[rid]) is None
    outs = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4)).generate([[1, 2, 3], [4, 5]], params)
    assert len(outs[0].token_ids) >= 10 and not set(many) & set(outs[0].token_ids[:10])


def test_a_reused_state_row_and_a_preempted_row_count_their_own_tokens(tiny):
    """Requests admitted one after another reuse state rows (their counts start again), and a pool too small for
    the load preempts penalized rows (recomputed, their counts set again from their outputs): texts equal those
    of each request alone."""
    model, heads = tiny
    params = [SamplingParams(max_tokens=30, presence_penalty=1.2, frequency_penalty=0.5 * (i % 3),
                             repetition_penalty=1.0 + 0.3 * (i % 2)) for i in range(8)]
    prompts = random_prompts(8, VOCAB, 14, seed=4)
    alone = [LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4)).generate([p], [sp])[0].token_ids
             for p, sp in zip(prompts, params)]
    sched = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4, max_tree_tokens=64)
    tight = LLMEngine(model, heads, EngineConfig(num_blocks=40, block_size=4, scheduler=sched,
                                                 enable_prefix_caching=False))
    tight.runner.decode.override = lambda *a: pytest.fail("a row took the host's verdict")
    preempted, schedule = [], tight.scheduler.schedule
    tight.scheduler.schedule = lambda **kw: (out := schedule(**kw)) and preempted.extend(out.preempted) or out
    outs = tight.generate(prompts, params)
    assert preempted, "the pool was meant to be too small"
    assert [o.token_ids for o in outs] == alone


def test_changed_admissions_draw_their_first_tokens_on_the_device(tiny):
    """Admissions with penalties, bias, allowed tokens or a min_tokens ban leave their first tokens on the
    device (read a step later), changed there, their counts started from them; texts equal the host's path."""
    model, heads = tiny
    params = [SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5, temperature=0.9, seed=0),
              SamplingParams(max_tokens=16, repetition_penalty=1.7),
              SamplingParams(max_tokens=16, logit_bias={2: 3.0}, temperature=0.8, seed=1),
              SamplingParams(max_tokens=16, allowed_token_ids=[3, 4, 8, VOCAB - 1], min_tokens=4,
                             stop_token_ids=(VOCAB - 1,))]
    prompts = random_prompts(4, VOCAB, 10, seed=8)
    engine = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4, overlap=True))
    engine._first_token = lambda *a: pytest.fail("a first token was the host's")
    engine.runner.decode.override = lambda *a: pytest.fail("a row took the host's verdict")
    deferred, start = [], engine._start_decoding

    def started(ready, hidden):  # how many admissions' first tokens wait on the device
        outputs = start(ready, hidden)
        deferred.append(len(engine._first_tokens))
        return outputs

    engine._start_decoding = started
    device = [o.token_ids for o in engine.generate(prompts, params)]
    host_engine = LLMEngine(model, heads, EngineConfig(num_blocks=64, block_size=4, overlap=False))
    host_engine._needs_host = lambda r: True
    assert device == [o.token_ids for o in host_engine.generate(prompts, params)]
    assert any(deferred)


def test_rows_the_host_decides_overlap_the_steps_and_write_what_synchronous_steps_write(tiny):
    """A sampled row under a ban of more end tokens than the device holds, and one made the host's, beside rows
    the device decides: part 1 is launched, the previous step read back and applied meanwhile, then the host's
    targets made (the banned row stays the host's for a step prepared while it was, whatever the host learns
    meanwhile). Outputs equal synchronous steps'. (Bad words and guides: the overlap runs of their tests.)"""
    model, heads = tiny
    many = tuple(range(VOCAB - MAX_BANNED - 1, VOCAB))
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=1, presence_penalty=0.4),
              SamplingParams(max_tokens=20),
              SamplingParams(max_tokens=20, temperature=0.7, seed=3, min_tokens=8, stop_token_ids=many),
              SamplingParams(max_tokens=20, temperature=0.8, seed=4, frequency_penalty=0.5)]
    prompts = random_prompts(len(params), VOCAB, 12, seed=13)
    texts = {}
    for overlap in (False, True):
        engine = LLMEngine(model, heads, EngineConfig(num_blocks=128, block_size=4, overlap=overlap))
        engine._needs_host = lambda r, needs=engine._needs_host: needs(r) or r.params.temperature == 0.9
        launched, hosted = count_launches(engine), []
        verify = engine._verify_on_host
        engine._verify_on_host = lambda *a: hosted.append(len(a[3])) or verify(*a)  # a[3]: the host rows
        texts[overlap] = [o.token_ids for o in engine.generate(prompts, params)]
        assert sum(hosted) > 0
        if overlap:
            assert len(launched) > 5  # steps with the host's rows in them, launched ahead
    assert texts[True] == texts[False]
    assert not set(many) & set(texts[True][2][:8])
