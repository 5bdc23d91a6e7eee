"""What drafts are worth in a closed batch (paxkv/speculation/closed_batch.py), and the budget's choices with it."""

import pytest

from paxkv.speculation.closed_batch import closed_batch_progress
from paxkv.speculation.draft_budget import DraftBudget


def test_one_row_alone_gains_the_drafts_expected_to_stand():
    """A lone row's end comes nearer by every draft it accepts: 1 + the sum of the chances that each stands."""
    progress = closed_batch_progress([50], [0], [[0.8, 0.6, 0.4, 0.2]], num_emitting=1)
    assert progress([0]) == pytest.approx(1.0)
    assert progress([2]) == pytest.approx(1.0 + 0.8 + 0.6)
    assert progress([4]) == pytest.approx(1.0 + 2.0)


def test_rows_tied_for_the_most_left_gain_only_if_all_of_them_accept():
    """Eight rows tied, each accepting its one draft at a third: the end comes a step nearer at (1/3)^8, in units
    of the step's 8 tokens; two rows that accept surely gain a whole step."""
    progress = closed_batch_progress([100] * 8, list(range(8)), [[1 / 3]] * 8, num_emitting=8)
    assert progress([0] * 8) == pytest.approx(8.0)
    assert progress([1] * 8) == pytest.approx(8.0 * (1.0 + (1 / 3) ** 8))
    assert progress([1] * 7 + [0]) == pytest.approx(8.0)  # the row that drafts nothing holds the end where it was
    sure = closed_batch_progress([40, 40], [0, 1], [[1.0, 1.0]] * 2, num_emitting=2)
    assert sure([1, 1]) == pytest.approx(4.0) and sure([2, 2]) == pytest.approx(6.0)


def test_a_row_one_token_shorter_caps_what_the_longest_can_gain():
    """With a plain row one token behind it, the longest row's drafts can take the end at most one step nearer."""
    progress = closed_batch_progress([50, 49], [0], [[0.8, 0.6]], num_emitting=2)
    assert progress([1]) == pytest.approx(2.0 * 1.8)
    assert progress([2]) == pytest.approx(2.0 * 1.8)  # the second draft would pass the row behind: worth nothing
    # Rows with nothing left after this step: nothing to gain.
    assert closed_batch_progress([1, 1], [0], [[0.9]], num_emitting=2)([1]) == pytest.approx(2.0)


def _measured_budget() -> DraftBudget:
    """A budget whose drafts are nearly free: 8 tokens in 100 ms, 8 and 8 drafts in 105 ms."""
    budget = DraftBudget()
    budget.observe_step(8, 0.100)
    budget.observe_step(16, 0.105, num_drafts=8)
    return budget


def test_the_budget_drafts_open_text_for_emitted_tokens_but_not_to_end_a_closed_batch_sooner():
    """Open text at a third accepted: with requests waiting, every emitted token counts and nearly free drafts pay
    (8 + 8/3 tokens in 105 ms against 8 in 100); in a closed batch of eight tied rows they bring its end no nearer,
    so none is drafted. Where one row has the most left by far, its drafts are what ends the batch sooner."""
    budget = _measured_budget()
    candidates = [[1 / 3]] * 8
    assert budget.allot(8, 8, candidates, room=8) == [1] * 8
    tied = closed_batch_progress([100] * 8, list(range(8)), candidates, num_emitting=8)
    assert budget.allot(8, 8, candidates, room=8, progress=tied) == [0] * 8
    one_longest = closed_batch_progress([100] + [60] * 7, list(range(8)), [[0.9]] + candidates[1:], num_emitting=8)
    assert budget.allot(8, 8, [[0.9]] + candidates[1:], room=8, progress=one_longest)[0] == 1
