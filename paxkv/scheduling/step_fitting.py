"""Fitting a step to the size the model runner pads it to: a step just past a step size gives its excess prefill
tokens to the next step instead of padding up to the next size."""

from collections.abc import Sequence

from paxkv.scheduling.request_pages import RequestPages
from paxkv.scheduling.scheduled_batch import ScheduledSequence

# The smallest step size fit_to_step_size trims a step down to.
MIN_FITTED_STEP_SIZE = 64
# The fewest padded tokens a fitted step must save: the tokens it moves cost a step of their own when nothing else
# runs (a lone 100-token prompt as 96 + 4 took 171 ms against 150 ms as one step of 128, on SmolLM2 in f32).
MIN_FITTED_SAVING = 64


def fit_to_step_size(
    sequences: list[ScheduledSequence], num_tokens: int, step_sizes: Sequence[int], pages: RequestPages
) -> int:
    """Shorten the newest prefill chunks so that a step just past a step size runs at that size instead of padding
    up to the next one; return how many tokens it took out (they run in a later step).

    The model runner pads a step's T tokens up to a step size (a power of two, or 1.5 times one), so 260 prompt
    tokens cost as much as 384. Taking the step down to 256 costs one more, smaller step later (260 as 256 + 4,
    padded to 256 + 16). That pays where few tokens move and the sizes are far apart: at most a quarter of the gap
    moves, the gap is at least MIN_FITTED_SAVING tokens, and the size below is at least MIN_FITTED_STEP_SIZE (below
    either, a step's fixed cost outweighs the padding).

    Args:
      sequences: the step's sequences, drafts included (sequences with drafts keep all their tokens); re-planned in
        place.
      num_tokens: the tokens they run.
      step_sizes: the sizes steps pad to, ascending (none: nothing is fitted).
      pages: the replica's page planner, which gives back the pages a shortened chunk no longer fills.
    """
    padded = next((size for size in step_sizes if size >= num_tokens), None)
    lower = max((size for size in step_sizes if size < num_tokens), default=None)
    if padded is None or lower is None or lower < MIN_FITTED_STEP_SIZE or padded - lower < MIN_FITTED_SAVING:
        return 0
    excess = num_tokens - lower
    trimmable = [0 if s.num_draft_tokens else s.num_new_tokens - 1 for s in sequences]
    if excess > (padded - lower) // 4 or excess > sum(trimmable):
        return 0
    for index in reversed(range(len(sequences))):  # the newest admissions, then the running chunks
        sequence = sequences[index]
        cut = min(trimmable[index], excess)
        if cut > 0:
            sequences[index] = pages.shrink(sequence, sequence.num_new_tokens - cut)
            excess -= cut
    return num_tokens - lower
