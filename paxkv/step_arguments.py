"""The host-side arguments of one engine step: padded inputs, sampling arrays and optional vocabulary arrays."""

from collections.abc import Callable

import jax
import numpy as np

from paxkv.data_parallel import DataParallelBatch
from paxkv.sampler import SamplingArrays
from paxkv.scheduled_batch import ScheduledBatch
from paxkv.step_inputs import StepInputs, padded_batch_sizes


def build_step_arguments(
    batch: ScheduledBatch | DataParallelBatch,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    pages_per_seq: int,
    seed_of: Callable[[str], int],
    vocab_size: int,
    eos_token_ids: list[int],
) -> tuple:
    """engine_step's (or data_parallel_step's) arguments after the graph, state and pool, as numpy arrays: the
    padded inputs, the sampling arrays, token_counts, prompt_mask, suppress and the logprobs flag.

    For data parallelism every array gets a leading replica axis, and all replicas pad to the same buckets.

    Args:
      batch: a batch the scheduler returned.
      max_num_batched_tokens, max_num_seqs: the budgets (the largest T and S buckets).
      pages_per_seq: block-table width.
      seed_of: request id -> the seed of that sample.
      vocab_size: the model's vocabulary size.
      eos_token_ids: tokens min_tokens holds back (unless a request ignores EOS).
    """

    def replica_arguments(replica_batch: ScheduledBatch, padded_sizes, force: tuple[bool, bool]):
        inputs = StepInputs.from_batch(
            replica_batch,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            pages_per_seq=pages_per_seq,
            padded_sizes=padded_sizes,
        )
        rows = replica_batch.sequences
        num_rows = inputs.logits_indices.shape[0]
        sampling = SamplingArrays.from_params(
            [s.request.sampling_params for s in rows],
            positions=[s.kv_len for s in rows],
            seeds=[seed_of(s.request.request_id) for s in rows],
            batch_size=num_rows,
        )
        return inputs, sampling, vocab_arrays(replica_batch, num_rows, vocab_size, eos_token_ids, force)

    with_logprobs = any(s.request.sampling_params.logprobs is not None for s in batch.sequences)
    if not isinstance(batch, DataParallelBatch):
        inputs, sampling, arrays = replica_arguments(batch, None, (False, False))
        return inputs, sampling, *arrays, with_logprobs
    sizes = [padded_batch_sizes(b, max_num_batched_tokens, max_num_seqs) for b in batch.replica_batches]
    padded_sizes = (max(size[0] for size in sizes), max(size[1] for size in sizes))
    # Every replica runs one program: an optional vocabulary array any replica needs, all of them get.
    needed = [vocab_arrays_needed(b) for b in batch.replica_batches]
    force = (any(n[0] for n in needed), any(n[1] for n in needed))
    per_replica = [replica_arguments(b, padded_sizes, force) for b in batch.replica_batches]
    inputs, sampling, arrays = jax.tree.map(lambda *leaves: np.stack(leaves), *per_replica)
    return inputs, sampling, *arrays, with_logprobs


def vocab_arrays_needed(batch: ScheduledBatch) -> tuple[bool, bool]:
    """Whether some row of `batch` has a penalty (token_counts, prompt_mask) and holds back stop tokens (suppress)."""
    rows = batch.sequences
    params = [s.request.sampling_params for s in rows]
    penalties = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
    suppress = any(s.request.num_output_tokens < s.request.sampling_params.min_tokens for s in rows)
    return penalties, suppress


def vocab_arrays(
    batch: ScheduledBatch, num_rows: int, vocab_size: int, eos_token_ids: list[int], force: tuple[bool, bool]
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
            params = sequence.request.sampling_params
            if sequence.request.num_output_tokens < params.min_tokens:
                stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else eos_token_ids)
                suppress[row, stop_ids] = True
    return token_counts, prompt_mask, suppress
