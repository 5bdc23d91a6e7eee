"""What drafts are worth in a closed batch (paxkv/speculation/closed_batch.py), and the Drafter's choices with it."""

import math

import pytest

from paxkv.config import SpeculativeConfig
from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import ScheduledSequence
from paxkv.speculation.closed_batch import closed_batch_share, expected_largest_normal
from paxkv.speculation.drafter import Drafter


def test_the_expected_largest_of_n_normal_draws():
    """Blom's approximation against the exact values (0.564 for two, 1.029 for four, 1.424 for eight, 2.070 for 32),
    which it is known to meet within 0.03 (its worst, 0.025, at two)."""
    assert expected_largest_normal(1) == 0.0
    for n, known in ((2, 0.5642), (4, 1.0294), (8, 1.4236), (32, 2.0697)):
        assert expected_largest_normal(n) == pytest.approx(known, abs=0.03)


def test_the_share_is_the_least_rows_accepted_drafts_over_their_mean():
    """One row gets all its drafts' worth; n rows accepting about lam drafts each end sooner by about
    lam - e_n sqrt(lam), so rows that accept many keep most of it and rows that accept few keep none."""
    assert closed_batch_share(1, 0.01, 5) == 1.0
    copying = closed_batch_share(8, 1.5, 128 / 2.5)  # 77 drafts a row over the 51 steps of a 128-token run
    assert copying == pytest.approx(1 - expected_largest_normal(8) / math.sqrt(76.8)) and copying > 0.83
    open_text = closed_batch_share(8, 0.05, 128)  # 6.4 a row
    assert open_text == pytest.approx(1 - expected_largest_normal(8) / math.sqrt(6.4)) and open_text < 0.45
    assert closed_batch_share(8, 0.05, 10) == 0.0  # near the run's end: none
    assert closed_batch_share(8, 0.0, 100) == 0.0


def _decoding_rows(num_output: int, num_accepted: int, drafter: Drafter) -> list[ScheduledSequence]:
    """Eight decoding rows of 100 tokens at most, each `num_output` in with `num_accepted` of them accepted drafts
    (recorded with the drafter), each with a prompt-lookup proposal ("5" recurs)."""
    params = SamplingParams(temperature=0.0, max_tokens=100)
    sequences = []
    for index in range(8):
        request = Request(str(index), [5, 6, 7] * 10, params)
        request.output_token_ids = [5] * num_output
        request.num_computed_tokens = request.num_tokens - 1
        for _ in range(num_output - num_accepted):  # the steps it ran, drafting one token each
            drafter.observe_verified(request, 1, 0)
        for _ in range(num_accepted):
            drafter.observe_verified(request, 1, 1)
        sequences.append(ScheduledSequence(request, [5], [request.num_tokens - 1], [0], [0], request.num_tokens, True))
    return sequences


@pytest.mark.parametrize("num_accepted,drafts_closed", [(2, False), (30, True)])
def test_a_closed_batch_drafts_only_rows_that_accept_enough_to_end_it_sooner(num_accepted, drafts_closed):
    """Drafts that make a step 5% dearer: with requests waiting, rows that accepted 2 drafts in 40 tokens draft
    (every emitted token counts); in a closed batch those 2 a row bring its end no nearer, so they do not, while
    rows that accepted 30 in 40 (copying) still do."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=1))
    sequences = _decoding_rows(40, num_accepted, drafter)
    drafter.budget.observe_step(8, 0.100)
    drafter.budget.observe_step(16, 0.105, num_drafts=8)

    def num_drafted(nothing_waiting: bool) -> int:
        return sum(len(drafts) for _, drafts in drafter.choose(sequences, 8, 64, 1000, nothing_waiting))

    assert num_drafted(nothing_waiting=False) == 8
    assert (num_drafted(nothing_waiting=True) == 8) == drafts_closed
