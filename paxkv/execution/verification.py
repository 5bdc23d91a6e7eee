"""Speculative verification: the draft rows of a step, and how many drafts of each sequence its samples accept.

A sequence that decodes with k drafts computes 1 + k tokens in the step: its last token x (position n) and the
drafts d_1..d_k (positions n + 1..n + k). Beside its usual row, which samples position n + k + 1 from the last
token's logits, the step samples k draft rows: row j (0-based) samples position n + 1 + j from the logits of the
token before d_{j+1}, with the key of (seed, position) that decoding without drafts would use there. A draft
stands while it equals that sample; the first sample that differs is emitted in its place, and when all k
stand, the usual row's sample follows them.

This is exact, not approximate: every emitted token is the sample that plain decoding would have drawn at its
position from the same prefix, so greedy and seeded sampled output are the same with speculation as without.
As a rejection rule it is Leviathan et al.'s for a point-mass draft (accept d with probability p(d), else draw
from p with d removed), which is what a prompt-lookup draft is. A draft model's drafts are drawn with these same
keys (paxkv.execution.draft_proposer), which couples them with the samples checked here.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.execution.sampler import SamplingArrays
from paxkv.scheduling.scheduled_batch import ReplicaBatch

# The draft token of a padding row: no sample equals it.
PADDING_DRAFT = -2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftRows:
    """The R draft rows of one replica's step (leaves [R, ...]), after its S usual rows."""

    logits_indices: jax.Array  # i32[R] the batch token whose logits verify each draft
    tokens: jax.Array  # i32[R] the draft each row verifies; PADDING_DRAFT for padding
    rows: jax.Array  # i32[R] the sequence row each belongs to; S for padding
    index: jax.Array  # i32[R] its place among its sequence's drafts, from 0
    sampling: SamplingArrays  # R rows: the sequence's settings at the position each row samples

    @classmethod
    def from_batch(
        cls, batch: ReplicaBatch, num_rows: int, num_draft_rows: int, seed_of: Callable[[str], int]
    ) -> "DraftRows":
        """Lay out a replica batch's drafts, sequence by sequence, padded to `num_draft_rows`.

        Args:
          batch: the replica's batch.
          num_rows: S, the padded count of usual rows (the row of padding draft rows).
          num_draft_rows: R, at least the batch's drafts.
          seed_of: request id -> the seed of that sample.
        """
        logits_indices = np.zeros(num_draft_rows, np.int32)
        tokens = np.full(num_draft_rows, PADDING_DRAFT, np.int32)
        rows = np.full(num_draft_rows, num_rows, np.int32)
        index = np.zeros(num_draft_rows, np.int32)
        params, positions, seeds = [], [], []
        start = draft_row = 0
        for row, sequence in enumerate(batch.sequences):
            num_drafts = sequence.num_draft_tokens
            first = sequence.num_new_tokens - num_drafts - 1  # the last token's index within the chunk
            for j in range(num_drafts):
                logits_indices[draft_row] = start + first + j
                tokens[draft_row] = sequence.token_ids[first + 1 + j]
                rows[draft_row], index[draft_row] = row, j
                params.append(sequence.request.sampling_params)
                positions.append(sequence.positions[first + 1 + j])
                seeds.append(seed_of(sequence.request.request_id))
                draft_row += 1
            start += sequence.num_new_tokens
        sampling = SamplingArrays.from_params(params, positions, seeds, batch_size=num_draft_rows)
        return cls(logits_indices, tokens, rows, index, sampling)


def num_draft_rows(batch: ReplicaBatch) -> int:
    """How many drafts a replica batch verifies."""
    return sum(sequence.num_draft_tokens for sequence in batch.sequences)


def count_accepted(draft_samples: jax.Array, drafts: DraftRows, num_rows: int) -> jax.Array:
    """i32[S]: per sequence row, how many leading drafts equal the samples drawn at their positions.

    Args:
      draft_samples: i32[R] the token sampled on each draft row.
      drafts: the step's DraftRows.
      num_rows: S.
    """
    rejected = draft_samples != drafts.tokens  # bool[R]; padding rows never match
    big = jnp.iinfo(jnp.int32).max
    # The first rejected draft of each row (segment S collects the padding), capped by the row's draft count.
    first_rejected = jax.ops.segment_min(jnp.where(rejected, drafts.index, big), drafts.rows, num_rows + 1)
    num_drafts = jax.ops.segment_sum(jnp.ones_like(drafts.rows), drafts.rows, num_rows + 1)
    return jnp.minimum(first_rejected, num_drafts)[:num_rows].astype(jnp.int32)


def emitted_candidates(num_drafts: int, num_accepted: int) -> list[int]:
    """Which of a sequence's 1 + k samples it emits, in order: 0 is its usual row, 1 + j its draft row j.

    The accepted drafts' own samples (equal to the drafts), then the first rejected draft's sample or, when every
    draft stands, the usual row's.

    Args:
      num_drafts: k.
      num_accepted: a, 0 <= a <= k.
    """
    if not 0 <= num_accepted <= num_drafts:
        raise ValueError(f"{num_accepted} accepted drafts out of {num_drafts}")
    return [1 + j for j in range(num_accepted)] + [0 if num_accepted == num_drafts else 1 + num_accepted]
