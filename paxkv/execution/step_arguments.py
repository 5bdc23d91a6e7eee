"""The host-side arguments of one engine step: padded inputs, sampling arrays and optional vocabulary arrays."""

from collections.abc import Callable

import jax
import numpy as np

from paxkv.execution.sampler import SamplingArrays
from paxkv.execution.step import StepBatch
from paxkv.execution.step_inputs import (
    NO_PADDING,
    StepInputs,
    StepPadding,
    padded_draft_rows,
    shared_padded_sizes,
)
from paxkv.execution.verification import DraftRows, num_draft_rows
from paxkv.scheduling.scheduled_batch import ReplicaBatch, ScheduledBatch
from paxkv.scheduling.stopping import holds_back_stops, stop_token_ids


def build_step_batch(
    batch: ScheduledBatch,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    pages_per_seq: int,
    seed_of: Callable[[str], int],
    vocab_size: int,
    eos_token_ids: list[int],
    padding: StepPadding = NO_PADDING,
) -> tuple[StepBatch, bool]:
    """The step's batch argument (numpy arrays, every leaf [D, ...]) and its logprobs flag, for a batch.

    All replicas pad to the same T and S buckets, and an optional vocabulary array any replica needs, all get.

    Args:
      batch: a batch the scheduler returned.
      max_num_batched_tokens, max_num_seqs: the budgets (the largest T and S buckets).
      pages_per_seq: block-table width.
      seed_of: request id -> the seed of that sample.
      vocab_size: the model's vocabulary size.
      eos_token_ids: tokens min_tokens holds back (unless a request ignores EOS).
      padding: the smallest T and S buckets (S's also the smallest R bucket of draft rows).
    """
    padded_sizes = shared_padded_sizes(batch.replica_batches, max_num_batched_tokens, max_num_seqs, padding)
    needed = [vocab_arrays_needed(b) for b in batch.replica_batches]
    force = (any(n[0] for n in needed), any(n[1] for n in needed))
    most_drafts = max(num_draft_rows(b) for b in batch.replica_batches)
    padded_drafts = padded_draft_rows(most_drafts, max_num_batched_tokens, padding)

    def replica_batch(replica: ReplicaBatch) -> StepBatch:
        inputs = StepInputs.from_batch(
            replica,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            pages_per_seq=pages_per_seq,
            padded_sizes=padded_sizes,
        )
        rows = replica.sequences
        num_rows = inputs.logits_indices.shape[0]
        sampling = SamplingArrays.from_params(
            [s.request.sampling_params for s in rows],
            positions=[s.kv_len for s in rows],
            seeds=[seed_of(s.request.request_id) for s in rows],
            batch_size=num_rows,
        )
        vocab = vocab_arrays(replica, num_rows, vocab_size, eos_token_ids, force)
        drafts = DraftRows.from_batch(replica, num_rows, padded_drafts, seed_of) if padded_drafts else None
        return StepBatch(inputs, sampling, *vocab, drafts=drafts)

    stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *map(replica_batch, batch.replica_batches))
    with_logprobs = any(s.request.sampling_params.logprobs is not None for s in batch.sequences)
    return stacked, with_logprobs


def vocab_arrays_needed(batch: ReplicaBatch) -> tuple[bool, bool]:
    """Whether some row of `batch` has a penalty (token_counts, prompt_mask) and holds back stop tokens (suppress)."""
    rows = batch.sequences
    params = [s.request.sampling_params for s in rows]
    penalties = any(p.has_penalties for p in params)
    suppress = any(holds_back_stops(s.request) for s in rows)
    return penalties, suppress


def vocab_arrays(
    batch: ReplicaBatch, num_rows: int, vocab_size: int, eos_token_ids: list[int], force: tuple[bool, bool]
):
    """(token_counts, prompt_mask, suppress): per-row vocabulary arrays for penalties and min_tokens, each None
    unless some row needs it or `force` asks for it (rows that need nothing get neutral ones).

    Args:
      batch: one replica's batch.
      num_rows: S, the padded row count.
      vocab_size: the model's vocabulary size.
      eos_token_ids: tokens min_tokens holds back.
      force: build the penalty arrays, and suppress, even if no row needs them.
    """
    rows = batch.sequences
    needs_penalties, needs_any_suppress = (n or f for n, f in zip(vocab_arrays_needed(batch), force, strict=True))
    token_counts = prompt_mask = suppress = None
    if needs_penalties:
        token_counts = np.zeros((num_rows, vocab_size), np.int32)  # i32[S, vocab]
        prompt_mask = np.zeros((num_rows, vocab_size), bool)  # bool[S, vocab]
        for row, sequence in enumerate(rows):
            np.add.at(token_counts[row], sequence.request.output_token_ids, 1)
            prompt_mask[row, sequence.request.prompt_token_ids] = True
    if needs_any_suppress:
        suppress = np.zeros((num_rows, vocab_size), bool)  # bool[S, vocab]
        for row, sequence in enumerate(rows):
            if holds_back_stops(sequence.request):
                suppress[row, stop_token_ids(sequence.request, eos_token_ids)] = True
    return token_counts, prompt_mask, suppress


def empty_step_batch(
    num_replicas: int,
    num_tokens: int,
    num_seqs: int,
    *,
    pages_per_seq: int,
    vocab_size: int,
    vocab_arrays: bool = False,
    draft_row_bucket: int = 0,
) -> StepBatch:
    """A step batch of the (T, S) bucket that holds no sequence (numpy, every leaf [D, ...]): every token and row is
    padding, which writes only the null page. What warm-up runs, and what ahead-of-time compiles take the shapes of.

    Args:
      num_replicas: D.
      num_tokens, num_seqs: the T and S buckets.
      pages_per_seq: block-table width.
      vocab_size: the model's vocabulary size.
      vocab_arrays: include the per-row vocabulary arrays (penalties and min_tokens), the largest variant.
      draft_row_bucket: R, the draft rows (all padding) of a speculating step's shape; 0 for none.
    """
    empty = ReplicaBatch(sequences=[], num_batched_tokens=0, preempted_request_ids=[])
    inputs = StepInputs.from_batch(
        empty,
        max_num_batched_tokens=num_tokens,
        max_num_seqs=num_seqs,
        pages_per_seq=pages_per_seq,
        padded_sizes=(num_tokens, num_seqs),
    )
    sampling = SamplingArrays.from_params([], positions=[], batch_size=num_seqs)
    vocab = [None, None, None]
    if vocab_arrays:
        vocab = [
            np.zeros((num_seqs, vocab_size), np.int32),
            np.zeros((num_seqs, vocab_size), bool),
            np.zeros((num_seqs, vocab_size), bool),
        ]
    drafts = DraftRows.from_batch(empty, num_seqs, draft_row_bucket, lambda _: 0) if draft_row_bucket else None
    one = StepBatch(inputs, sampling, *vocab, drafts=drafts)
    return jax.tree.map(lambda leaf: np.stack([leaf] * num_replicas), one)
