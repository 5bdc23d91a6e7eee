"""StepInputs: one scheduled batch as padded, bucketed arrays for the jitted step."""

import dataclasses

import jax
import numpy as np

from models.paged_forward import bucket
from pallas_kernels import AttentionMetadata
from paxkv.scheduling.scheduled_batch import ReplicaBatch


def power_of_two_bucket(n: int, maximum: int) -> int:
    """The power of two at or above n, capped at `maximum` (itself rounded up to a power of two)."""
    return min(bucket(maximum), bucket(n))


def power_of_two_buckets(maximum: int) -> list[int]:
    """The power-of-two buckets that cover 1..maximum, ascending (the sizes a step's T and S pad to)."""
    return [1 << i for i in range(num_buckets(maximum))]


def num_buckets(maximum: int) -> int:
    """How many power-of-two buckets cover 1..maximum."""
    return max(0, maximum - 1).bit_length() + 1


# A step that prefills also pads T to 1.5 times a power of two from this size up (96, 192, 384, ...). Powers of two
# alone pad a prefill step up to twice its tokens (a prompt of 180 tokens ran as 256, 261 ms against 273 for 250
# tokens, on SmolLM2 in f32), and a prefill step costs in proportion to its padded tokens; the sizes between halve
# the worst case for one more program per octave. Below this size a step's padding costs little, and a decode step
# (T = S rows, plus drafts) keeps powers of two.
MIN_HALF_STEP_TOKENS = 96


def prefill_bucket(n: int, maximum: int) -> int:
    """The prefill step size at or above n: a power of two, or 1.5 times one from MIN_HALF_STEP_TOKENS up; capped at
    `maximum`'s own size."""
    return min(_prefill_size(maximum), _prefill_size(n))


def _prefill_size(n: int) -> int:
    """The smallest power of two, or 1.5 times one of at least MIN_HALF_STEP_TOKENS, at or above n."""
    power = bucket(n)
    half_step = 3 * power // 4
    return half_step if half_step >= max(n, MIN_HALF_STEP_TOKENS) and power % 4 == 0 else power


# A step that prefills (more tokens than rows) pads T to at least this many tokens. Short prompts and prompt
# tails of 2, 4 and 8 tokens would each compile a program of their own (seconds apiece for a 30-layer model)
# to save padding that costs little once per request; pure decode steps keep T = S, where padding would cost
# every step (on CPU an 8-row matmul costs ~1.6x a 1-row one).
MIN_PREFILL_TOKENS = 16

# Where EngineConfig.min_padded_seqs is not given: a TPU vector register holds 8 f32 rows (sublanes), so a step of
# 1, 2 or 4 rows costs what one of 8 does there, and their programs would only add compiles (vLLM's TPU runner pads
# to 8 too). On CPU a 1-row decode is much cheaper than an 8-row one (see `bucket`).
DEFAULT_MIN_PADDED_SEQS = {"tpu": 8}


@dataclasses.dataclass(frozen=True)
class StepPadding:
    """The smallest buckets a step pads to: rows (S, and draft rows R) and tokens (T), each rounded up to a power
    of two and never above the token budget. Higher floors mean fewer programs to compile and more padding."""

    min_seqs: int = 1
    min_tokens: int = 1

    @classmethod
    def for_platform(cls, platform: str, min_seqs: int | None = None, min_tokens: int | None = None) -> "StepPadding":
        """The config's floors, or where not given, the platform's ("cpu", "gpu", "tpu")."""
        return cls(min_seqs or DEFAULT_MIN_PADDED_SEQS.get(platform, 1), min_tokens or 1)

    def row_floor(self, max_num_batched_tokens: int) -> int:
        """The fewest rows (or draft rows) a step pads to: never more than the token budget."""
        return min(self.min_seqs, max_num_batched_tokens)

    def token_floor(self, max_num_batched_tokens: int) -> int:
        """The fewest tokens a step pads to: never more than the token budget."""
        return min(self.min_tokens, max_num_batched_tokens)

    def token_buckets(self, max_num_batched_tokens: int) -> list[int]:
        """The T buckets a step can take, ascending, from the token floor's: powers of two up to the budget's, and
        the prefill steps' sizes between (prefill_bucket) up to the budget's."""
        floor = self.token_floor(max_num_batched_tokens)
        largest_prefill = prefill_bucket(max_num_batched_tokens, max_num_batched_tokens)
        powers = [t for t in power_of_two_buckets(max_num_batched_tokens) if t >= bucket(floor)]
        half_steps = [3 * t // 4 for t in power_of_two_buckets(max_num_batched_tokens)]
        return sorted({*powers, *(t for t in half_steps if max(floor, MIN_HALF_STEP_TOKENS) <= t <= largest_prefill)})


NO_PADDING = StepPadding()  # every bucket from 1


def padded_batch_sizes(
    batch: ReplicaBatch, max_num_batched_tokens: int, max_num_seqs: int, padding: StepPadding = NO_PADDING
) -> tuple[int, int]:
    """(T, S): the token and row buckets a batch pads to; S at least the padding's rows, T at least S (a decode of
    S rows is T = S) and at least the padding's tokens."""
    prefills = any(s.num_new_tokens - s.num_draft_tokens > 1 for s in batch.sequences)  # drafts alone are no prefill
    return padded_sizes(
        batch.num_batched_tokens, batch.num_seqs, prefills, max_num_batched_tokens, max_num_seqs, padding
    )


def padded_sizes(
    num_tokens: int,
    num_seqs: int,
    prefills: bool,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    padding: StepPadding = NO_PADDING,
) -> tuple[int, int]:
    """(T, S) for a step of `num_tokens` tokens in `num_seqs` rows, `prefills` when a row runs more than one token
    besides its drafts (padded_batch_sizes)."""
    if prefills:
        num_tokens = max(num_tokens, MIN_PREFILL_TOKENS)
    num_seqs = power_of_two_bucket(max(num_seqs, padding.row_floor(max_num_batched_tokens)), max_num_seqs)
    num_tokens = max(num_tokens, num_seqs, padding.token_floor(max_num_batched_tokens))
    token_bucket = prefill_bucket if prefills else power_of_two_bucket
    return token_bucket(num_tokens, max_num_batched_tokens), num_seqs


def padded_draft_rows(num_drafts: int, max_num_batched_tokens: int, padding: StepPadding = NO_PADDING) -> int:
    """R: the draft rows a step of `num_drafts` drafts pads to, a power of two of at least the padding's rows (as
    S), or 0 without drafts."""
    return bucket(max(num_drafts, padding.row_floor(max_num_batched_tokens))) if num_drafts else 0


def shared_padded_sizes(
    batches: list[ReplicaBatch], max_num_batched_tokens: int, max_num_seqs: int, padding: StepPadding = NO_PADDING
) -> tuple[int, int]:
    """(T, S) that every replica's batch pads to: the largest of their own buckets (data replicas share one shape)."""
    sizes = [padded_batch_sizes(b, max_num_batched_tokens, max_num_seqs, padding) for b in batches]
    return max(size[0] for size in sizes), max(size[1] for size in sizes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Padded inputs of one ragged step (T tokens, S sequence rows)."""

    tokens: jax.Array  # i32[T]; padding is token 0
    positions: jax.Array  # i32[T]
    metadata: AttentionMetadata  # slots[T], block_tables[S, P], cu_q_lens[S + 1], kv_lens[S], num_seqs[1]
    logits_indices: jax.Array  # i32[S] the last new token of each row (0 for padded rows)

    @classmethod
    def from_batch(
        cls,
        batch: ReplicaBatch,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        pages_per_seq: int,
        padded_sizes: tuple[int, int] | None = None,
        padding: StepPadding = NO_PADDING,
    ) -> "StepInputs":
        """Lay out a batch: rows in batch order, tokens contiguous per row, everything padded to buckets.

        Args:
          batch: the scheduler's batch for this step.
          max_num_batched_tokens: the token budget (largest T bucket).
          max_num_seqs: the sequence budget (largest S bucket).
          pages_per_seq: block-table width, ceil(max_model_len / page_size).
          padded_sizes: (T, S) to pad to instead of the batch's own buckets (data replicas share one shape).
          padding: the smallest buckets, where padded_sizes is not given.
        """
        num_tokens = batch.num_batched_tokens
        padded_tokens, padded_seqs = padded_sizes or padded_batch_sizes(
            batch, max_num_batched_tokens, max_num_seqs, padding
        )
        tokens = np.zeros(padded_tokens, np.int32)
        positions = np.zeros(padded_tokens, np.int32)
        slots = np.zeros(padded_tokens, np.int32)  # padded tokens write into the null page
        block_tables = np.zeros((padded_seqs, pages_per_seq), np.int32)
        cu_q_lens = np.full(padded_seqs + 1, num_tokens, np.int32)  # padded rows hold no tokens
        kv_lens = np.zeros(padded_seqs, np.int32)
        logits_indices = np.zeros(padded_seqs, np.int32)
        start = 0
        for row, sequence in enumerate(batch.sequences):
            stop = start + sequence.num_new_tokens
            tokens[start:stop] = sequence.token_ids
            positions[start:stop] = sequence.positions
            slots[start:stop] = sequence.slots
            block_tables[row, : len(sequence.block_table)] = sequence.block_table
            cu_q_lens[row] = start
            kv_lens[row] = sequence.kv_len
            logits_indices[row] = stop - 1
            start = stop
        cu_q_lens[batch.num_seqs :] = num_tokens
        metadata = AttentionMetadata(
            slots=slots,
            block_tables=block_tables,
            cu_q_lens=cu_q_lens,
            kv_lens=kv_lens,
            num_seqs=np.asarray([batch.num_seqs], np.int32),
        )
        return cls(tokens=tokens, positions=positions, metadata=metadata, logits_indices=logits_indices)
