"""RequestOutput keeps a frozen dataclass's contract under its hand-written (faster) __init__."""

import dataclasses

import pytest

from medusa.decoding.outputs import RequestOutput, RequestStats


def make(**changes):
    fields = dict(request_id="r", new_token_ids=[7], new_text="x", finished=False, finish_reason=None,
                  _output_ids=[5, 6, 7, 8], _num_tokens=3, text="abx", stats=RequestStats(steps=2))
    return RequestOutput(**{**fields, **changes})


def test_fields_defaults_and_token_ids_match_the_dataclass():
    out = make()
    assert [f.name for f in dataclasses.fields(RequestOutput)] == list(vars(out))  # every field set, in order
    assert (out.index, out.new_logprobs) == (0, None)  # the declared defaults
    assert out.token_ids == [5, 6, 7] and out.stats.steps == 2
    positional = RequestOutput("r", [7], "x", False, None, [5, 6, 7, 8], 3, "abx", RequestStats(steps=2), 0, None)
    assert positional == out


def test_it_stays_frozen_and_compares_without_the_shared_token_list():
    out = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.text = "changed"
    assert out == make(_output_ids=[5, 6, 7])  # the sequence's growing list is not part of equality
    assert out != make(_num_tokens=2)
    assert dataclasses.replace(out, finished=True, finish_reason="stop").finished
    assert "_output_ids" not in repr(out)


def test_plain_steps_count_as_steps_but_not_as_drafts():
    """vLLM's num_drafts counts steps that drafted: the plain steps a policy runs where trees do not pay draft
    nothing (counted, they pulled the server's mean accepted length to ~1.0)."""
    stats = RequestStats()
    stats.record_step(drafted=7, max_depth=3, count=3)
    stats.record_step(drafted=0, max_depth=0, count=1)
    stats.record_steps(drafted=4, max_depth=2, counts=[2, 1])
    stats.record_steps(drafted=0, max_depth=0, counts=[1, 1, 1])
    assert (stats.steps, stats.drafting_steps, stats.accepted_tokens) == (7, 3, 3)
