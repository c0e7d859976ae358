"""A step's per-row logit changes (bias, repetition / frequency / presence penalties): the Triton kernel against
the PyTorch reference, bit for bit, and the reference against the host's per-row arithmetic."""

import pytest
import torch

pytest.importorskip("triton")

from medusa.kernels.row_changes import change_rows, change_rows_reference  # noqa: E402
from medusa.kernels.row_changes_triton import change_rows_triton  # noqa: E402

from kernel_inputs import DEVICE, rand  # noqa: E402

SETTINGS = 6  # a settings table's columns: the kernel reads strided views of four of them


def inputs(seed, groups, nodes, vocab, dtype, tables=3):
    """Logits with both signs; a state-row table of groups + 2 rows, read in a shuffled order; bias rows with
    -inf outside an allowed set on some rows; integer counts, mostly zero; prompt tokens seen; settings with
    zero penalties and repetition 1 on some rows (unchanged rows), biased flags on others."""
    g = torch.Generator().manual_seed(seed)
    logits = (rand(g, groups, nodes, vocab) * 8).to(dtype)
    states = groups + 2
    rows = torch.randperm(states, generator=g)[:groups].to(DEVICE)
    bias = rand(g, states, vocab) * 3
    bias[::2, vocab // 3:] = float("-inf")  # allowed_token_ids: only the first third
    counts = (torch.randint(0, 4, (states, vocab), generator=g) * (torch.rand(states, vocab, generator=g) < 0.1))
    counts = counts.float().to(DEVICE)
    seen = (torch.rand(states, vocab, generator=g) < 0.05).to(DEVICE)
    settings = torch.zeros(groups, SETTINGS)
    settings[:, 0] = torch.rand(groups, generator=g) * 2 - 1  # frequency
    settings[:, 1] = torch.rand(groups, generator=g) * 2 - 1  # presence
    settings[:, 2] = torch.rand(groups, generator=g) * 1.5 + 0.5  # repetition
    settings[:, 3] = (torch.rand(groups, generator=g) < 0.6).float()  # biased
    settings[::3, :3] = torch.tensor([0.0, 0.0, 1.0])  # rows without penalties
    settings = settings.to(DEVICE)
    return logits, rows, bias, counts, seen, (settings[:, 0], settings[:, 1], settings[:, 2], settings[:, 3])


# nodes past one program's NODES (8) and a ragged last group; a vocabulary past one BLOCK with a ragged chunk
@pytest.mark.parametrize("seed,groups,nodes,vocab,dtype", [(0, 3, 11, 2500, torch.float32),
                                                           (1, 4, 1, 1100, torch.bfloat16),
                                                           (2, 2, 17, 700, torch.float16)])
@pytest.mark.parametrize("with_bias,with_counts,repeats", [(True, True, True), (True, True, False),
                                                           (False, True, True), (True, False, False)])
def test_kernel_changes_every_cell_as_the_reference(seed, groups, nodes, vocab, dtype, with_bias, with_counts,
                                                    repeats):
    logits, rows, bias, counts, seen, settings = inputs(seed, groups, nodes, vocab, dtype)
    bias = bias if with_bias else None
    counts, seen = (counts, seen) if with_counts else (None, None)
    got = change_rows_triton(logits, rows, bias, counts, seen, *settings, repeats)
    want = change_rows_reference(logits, rows, bias, counts, seen, *settings, repeats)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert torch.equal(got, want)  # the same bits, -inf included
    unchanged = (settings[3] == 0) & (settings[0] == 0) & (settings[1] == 0) & (settings[2] == 1)
    assert torch.equal(got[unchanged], logits[unchanged].float())  # rows without changes keep their logits


def test_kernel_reads_logits_whose_rows_are_strided():
    """A step's logits are a view of [Bp * N, V]; an admission's first tokens a [f, 1, V] view of [f, V]."""
    logits, rows, bias, counts, seen, settings = inputs(3, 3, 5, 1500, torch.float32)
    wide = torch.zeros(3, 5, 1600, device=DEVICE)
    wide[..., :1500] = logits
    view = wide[..., :1500]
    assert not view.is_contiguous()
    assert torch.equal(change_rows_triton(view, rows, bias, counts, seen, *settings, True),
                       change_rows_reference(logits, rows, bias, counts, seen, *settings, True))


def test_reference_is_the_hosts_arithmetic_row_by_row():
    """Each row alone, with its own tables' rows: bias added, then repetition on seen tokens, then the counts'."""
    logits, rows, bias, counts, seen, (frequency, presence, repetition, biased) = inputs(4, 3, 4, 600, torch.float32)
    got = change_rows_reference(logits, rows, bias, counts, seen, frequency, presence, repetition, biased, True)
    for g, row in enumerate(rows.tolist()):
        x = logits[g] + (bias[row] if biased[g] > 0 else 0.0)
        was_seen = (counts[row] > 0) | seen[row]
        x = torch.where(was_seen, torch.where(x > 0, x / repetition[g], x * repetition[g]), x)
        x = x - frequency[g] * counts[row] - presence[g] * (counts[row] > 0).float()
        assert torch.equal(got[g], x)


def test_bad_inputs_name_the_problem():
    logits, rows, bias, counts, seen, settings = inputs(5, 2, 3, 300, torch.float32)
    with pytest.raises(ValueError, match="logits must be float"):
        change_rows(logits[0], rows, bias, counts, seen, *settings, True)
    with pytest.raises(ValueError, match="rows must be long"):
        change_rows(logits, rows.int(), bias, counts, seen, *settings, True)
    with pytest.raises(ValueError, match="counts and prompt_seen come together"):
        change_rows(logits, rows, bias, counts, None, *settings, True)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        change_rows(logits, rows, bias[:, :100], counts, seen, *settings, True)
    with pytest.raises(ValueError, match="frequency, presence, repetition and biased"):
        change_rows(logits, rows, bias, counts, seen, settings[0].double(), *settings[1:], True)


@pytest.mark.gpu
@pytest.mark.parametrize("repeats", [False, True])
def test_kernel_at_a_steps_full_size_on_the_gpu(repeats):
    """32 rows of a 20-node tree over SmolLM2's 49,152 logits in bfloat16, as the engine's step changes them."""
    logits, rows, bias, counts, seen, settings = inputs(6, 32, 20, 49152, torch.bfloat16)
    with torch.inference_mode():  # where the kernel runs
        got = change_rows(logits, rows, bias, counts, seen, *settings, repeats)
    assert torch.equal(got, change_rows_reference(logits, rows, bias, counts, seen, *settings, repeats))
