"""What drafts are worth in a closed batch: one that no request waits to join, so that it ends when its longest row
ends, and a draft is worth how much nearer it brings that end, not the token it adds.

Over the rest of the run, the n rows with the most left (within a draft length of the most) each accept some number
of drafts; the batch ends sooner by about the least of those numbers, not by their mean. With each row accepting
about lam drafts (a sum of many chances, so a spread of about sqrt(lam)), the least of n is about
lam - e_n * sqrt(lam), e_n the expected largest of n standard normal draws. So each draft counts at the share
1 - e_n / sqrt(lam) of the mean progress of the longest rows, and at none where that is negative:
- copying text at batch 8 (rows accepting a token and a half a step, 77 over the 51 steps of a 128-token run): 0.84
  of it;
- open text at batch 8 (a twentieth of a token a step, 6 a run): 0.42 at the start of the run, falling to none as
  the run nears its end (by the rows' record). Counted at their mean instead, these drafts made the run 0.95x plain.

Counting only what one step's drafts take off the longest row (every tied row must accept for the end to move, and
rows take turns at having a proposal) drafted copy at batch 8 43 times in a run, at 1.02x plain, against 1.19x: a
row's accepted drafts make it the longest row less often later, which one step's view does not see.
"""

import math
from statistics import NormalDist


def expected_largest_normal(n: int) -> float:
    """The expected largest of n standard normal draws (Blom's approximation; 0 for one)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def closed_batch_share(num_longest: int, accepted_per_step: float, steps_left: float) -> float:
    """The share of the longest rows' mean progress by which a closed batch's end comes nearer.

    Args:
      num_longest: rows within a draft length of the most tokens left (n).
      accepted_per_step: drafts such a row is expected to accept a step over the rest of the run.
      steps_left: steps the longest rows have left.
    """
    expected = accepted_per_step * steps_left  # lam
    if num_longest <= 1:
        return 1.0
    if expected <= 0.0:
        return 0.0
    return max(0.0, 1.0 - expected_largest_normal(num_longest) / math.sqrt(expected))
