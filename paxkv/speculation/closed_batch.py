"""What drafts are worth in a closed batch: one that no request waits to join, so that it ends when its longest row
ends, and a step's progress is how much nearer it brings that end, not how many tokens it emits.

A draft accepted in a row that would finish before the longest anyway makes the step dearer and the whole no
sooner. Nor does one accepted draft in the longest row help while another row is as long: the end comes nearer only
if every row as long as the new longest one is also ahead. With n rows tied for the most tokens left, each
accepting its first draft at a rate p, the end comes a step nearer at the rate p^n, not p: open text at batch 8 (a
third of drafts accepted) gains about 1/6500 of a step from drafting every row once, and crediting each draft at
the rows' mean rate (p) made adaptive speculation draft there and run at 0.95x plain decoding.

Rows' acceptances are taken as independent (they are separate requests), each with the chances the draft budget
gives its drafts (DraftBudget.draft_gains: [j], that its drafts 0..j all stand).
"""

from collections.abc import Callable, Sequence

import numpy as np


def closed_batch_progress(
    rooms: Sequence[int],
    draft_rows: Sequence[int],
    candidates: Sequence[Sequence[float]],
    num_emitting: int,
) -> Callable[[list[int]], float]:
    """The progress of a step of a closed batch, per choice of drafts, in tokens: `num_emitting` for each step by
    which the step brings the batch's end nearer (1 without drafts, 1 plus the expected fall of the most tokens any
    row has left beyond that with them), so that it compares with the tokens of a plain step.

    Args:
      rooms: per row of the step, the tokens it may still emit, this step's included (a row whose prompt the step
        does not finish: one more, for the step it waits).
      draft_rows: per candidate, its row in `rooms`.
      candidates: per candidate, the chance that each of its drafts and all before it stand (non-increasing).
      num_emitting: tokens the step emits without drafts.

    Returns:
      drafts per candidate -> the step's progress in tokens.
    """
    rooms = np.asarray(rooms, np.int64)
    most_left = int(rooms.max(initial=0))  # M: without drafts the batch has M - 1 steps left after this one
    draft_rows = np.asarray(draft_rows, np.int64)
    num_drafts = max((len(gains) for gains in candidates), default=0)  # K
    # standing[k, j]: the chance that candidate k accepts at least j drafts (j = 0: certain).
    standing = np.zeros((len(candidates), num_drafts + 1))
    standing[:, 0] = 1.0
    for k, gains in enumerate(candidates):
        standing[k, 1 : len(gains) + 1] = gains
    # A row with r tokens left has r - 1 - (accepted drafts) after the step; the batch, the most of any row. Levels
    # m that drafts can take it below: under max(M - K, 1) the longest row stays at m or above whatever it accepts.
    levels = np.arange(max(most_left - num_drafts, 1), most_left)  # [L]
    plain_rooms = np.delete(rooms, draft_rows)
    plain_above = (plain_rooms[:, None] > levels[None, :]).any(axis=0)  # [L]: a row without drafts stays at m or above
    # A candidate with r tokens left ends below level m if it accepts at least r - m drafts.
    needed = np.clip(rooms[draft_rows][:, None] - levels[None, :], 0, num_drafts)  # [K candidates, L]
    orders = np.arange(num_drafts + 1)

    def progress(counts: list[int]) -> float:
        allowed = standing * (orders[None, :] <= np.asarray(counts)[:, None])  # drafts beyond a count never stand
        below = np.take_along_axis(allowed, needed, axis=1).prod(axis=0)  # [L]: every candidate ends below m
        below = np.where(plain_above, 0.0, below)
        expected_left = (levels[0] - 1 if len(levels) else 0) + float(np.sum(1.0 - below))
        plain_left = max(most_left - 1, 0)
        return num_emitting * (1.0 + max(plain_left - expected_left, 0.0))

    return progress
