"""Chained decode passes (EngineConfig.num_scheduler_steps): K decode passes of every row in one device program, each
pass's sampled token the next pass's input, so the host schedules, dispatches and reads back once per K tokens.

The scheduler plans such a step as decodes with placeholder drafts (paxkv.scheduling.decode_chaining); the runner
lays out its first pass as a plain decode step (first_pass_batch), adds each pass's KV slot per row (ChainArrays),
and returns the samples as ChainedRows, with the batch's placeholders filled by them. Pass j of a row computes the
KV of its token at position p + j (p: its last known token's) and samples position p + j + 1 with that position's
key, with the forward and the sampler of a plain step, so its tokens are those of one plain step per token.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.paged_forward import bucket, logits_over_pages
from pallas_kernels import AttentionMetadata
from paxkv.execution.step import StaticGraph, StepBatch, per_replica, replicated, sample_rows
from paxkv.parallel.distributed import host_value
from paxkv.scheduling.scheduled_batch import ScheduledBatch
from paxkv.scheduling.stopping import NONFINITE_TOKEN, stop_token_ids

# The stop-token columns of ChainArrays are a power of two, at least this many (EOS sets are 1-3 tokens): fewer
# shapes to compile.
MIN_STOP_IDS = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChainArrays:
    """Where each pass of a chained step writes (leaves [D, ...]; padding rows run no pass)."""

    slots: jax.Array  # i32[D, K, S] the KV slot of each row's input token at pass j (0, the null page, past its passes)
    num_passes: jax.Array  # i32[D, S] the passes each row runs (0 for padding rows)
    # i32[D, S, M] the tokens that end each row's request (EOS unless it ignores it, its stop_token_ids; -1 pads):
    # a row that samples one runs no more passes, and the chain ends once every row has ended.
    stop_ids: jax.Array

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, num_rows: int, eos_token_ids: list[int]) -> "ChainArrays":
        """The arrays of a chained batch (numpy), its rows padded to num_rows.

        Args:
          batch: a batch the scheduler chained (batch.decode_steps > 1), placeholders and all.
          num_rows: S, the rows of the first pass's StepBatch.
          eos_token_ids: the model's end-of-sequence tokens.
        """
        num_steps, num_replicas = batch.decode_steps, len(batch.replica_batches)
        stops = [stop_token_ids(s.request, eos_token_ids) for s in batch.sequences]
        slots = np.zeros((num_replicas, num_steps, num_rows), np.int32)
        num_passes = np.zeros((num_replicas, num_rows), np.int32)
        stop_ids = np.full((num_replicas, num_rows, bucket(max(map(len, stops)), MIN_STOP_IDS)), -1, np.int32)
        stops = iter(stops)
        for replica, replica_batch in enumerate(batch.replica_batches):
            for row, sequence in enumerate(replica_batch.sequences):
                slots[replica, : sequence.num_new_tokens, row] = sequence.slots
                num_passes[replica, row] = sequence.num_new_tokens
                ids = next(stops)
                stop_ids[replica, row, : len(ids)] = ids
        return cls(slots, num_passes, stop_ids)


def first_pass_batch(batch: ScheduledBatch) -> ScheduledBatch:
    """A chained batch's first pass as a plain decode step: each sequence's last known token alone."""

    def first(sequence):
        return dataclasses.replace(
            sequence,
            token_ids=sequence.token_ids[:1],
            positions=sequence.positions[:1],
            slots=sequence.slots[:1],
            kv_len=sequence.positions[0] + 1,
            num_draft_tokens=0,
        )

    replicas = [
        dataclasses.replace(b, sequences=[first(s) for s in b.sequences], num_batched_tokens=b.num_seqs, decode_steps=1)
        for b in batch.replica_batches
    ]
    return dataclasses.replace(batch, replica_batches=replicas)


# Loop-invariant code motion stays off: XLA:CPU gathers a bf16 embedding's rows through f32, and with the pass on it
# moved that conversion out of the loop, of the whole table, every run (SmolLM2 in bf16: 113 MB of f32 written per
# chain, and batch 1 at 8 passes 0.8x plain steps' speed; test_chained_decode checks the program for it).
@functools.partial(
    jax.jit,
    static_argnums=(0, 5, 6),
    donate_argnums=2,
    compiler_options={"xla_disable_hlo_passes": "while-loop-invariant-code-motion"},
)
def chained_decode_step(
    graph: StaticGraph,
    weights: list[jax.Array],  # the state's leaves (StaticGraph)
    kv_caches: list[jax.Array],  # donated, as forward_step's
    batch: StepBatch,  # [D, ...] the first pass as a plain decode step (no vocabulary arrays or drafts)
    chain: ChainArrays,  # [D, K, S] and [D, S]
    greedy_only: bool,
    native: bool,
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:  # (i32[D, S, K] samples, i32[D] passes run, kv_caches)
    """Run every row's passes: pass j writes the KV of the row's token j (its last known one, then its samples) and
    samples the next, as forward_step and sample_step would one step at a time. A row stops after its passes or
    its first stop token, and the chain once every row has stopped; a row's samples after it stopped are left 0."""

    def replica_chain(weights, kv_caches, batch, chain):
        local = jax.tree.map(lambda leaf: leaf[0], batch)
        chain = jax.tree.map(lambda leaf: leaf[0], chain)
        inputs = local.inputs
        model = graph.model(weights)
        num_steps, num_rows = chain.slots.shape  # K, S
        rows = jnp.arange(num_rows, dtype=jnp.int32)
        num_live = inputs.metadata.num_seqs  # i32[1]: the rows of real sequences come first
        first_tokens = inputs.tokens[inputs.logits_indices]  # i32[S] each row's last known token
        first_positions = inputs.positions[inputs.logits_indices]  # i32[S]
        sampling_batch = dataclasses.replace(local, inputs=None)

        def one_pass(carry):
            j, tokens, ended, samples, kv_caches = carry
            live = (j < chain.num_passes) & ~ended  # bool[S]: the row still runs (padding rows never do)
            positions = jnp.where(live, first_positions + j, 0)
            metadata = AttentionMetadata(
                slots=jnp.where(live, chain.slots[j], 0),  # rows done write the null page
                block_tables=inputs.metadata.block_tables,
                cu_q_lens=jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), num_live[0]),
                kv_lens=jnp.where(rows < num_live[0], positions + 1, 0),
                num_seqs=num_live,
            )
            logits, kv_caches = logits_over_pages(model, tokens, positions, kv_caches, metadata, rows)
            sampling = dataclasses.replace(local.sampling, positions=local.sampling.positions + j)
            step_batch = dataclasses.replace(sampling_batch, sampling=sampling)
            sampled = sample_rows(replicated(logits), step_batch, False, greedy_only, native).tokens  # i32[S]
            written = jnp.where(live, sampled, 0)  # a row done keeps 0 (its input was a dummy)
            samples = jax.lax.dynamic_update_slice_in_dim(samples, written[:, None], j, axis=1)
            # A row that sampled a stop token, or none (non-finite logits: it finished with an error), is done.
            stops = jnp.any(sampled[:, None] == chain.stop_ids, axis=1) | (sampled == NONFINITE_TOKEN)
            return j + 1, jnp.maximum(sampled, 0), ended | (live & stops), samples, kv_caches

        def runs(carry):
            j, _, ended, _, _ = carry
            return jnp.any((j < chain.num_passes) & ~ended)

        samples = jnp.zeros((num_rows, num_steps), jnp.int32)
        carry = (jnp.int32(0), first_tokens, jnp.zeros(num_rows, bool), samples, kv_caches)
        num_run, _, _, samples, kv_caches = jax.lax.while_loop(runs, one_pass, carry)
        return samples[None], num_run[None], kv_caches

    num_replicas = batch.inputs.tokens.shape[0]
    return per_replica(replica_chain, num_replicas, (weights,), (kv_caches, batch, chain))


def num_chained_compilations() -> int:
    """How many chained decode programs (one per row bucket, chain length and sampling variant) this process has
    compiled."""
    return chained_decode_step._cache_size()


class ChainedRows:
    """A chained step's samples on the host, as ModelRunner.run returns a step's (LiveRows): candidate c is one
    sample, each sequence's in pass order, and `batch` is the step's batch with its placeholders filled by them."""

    def __init__(self, samples: jax.Array, num_run: jax.Array, batch: ScheduledBatch):
        """Fetches the samples.

        Args:
          samples: i32[D, S, K] from chained_decode_step.
          num_run: i32[D], the passes each replica ran (fewer than K where every row stopped sooner).
          batch: the chained batch, placeholders and all.
        """
        samples = host_value(samples)
        self.num_passes_run = int(np.max(host_value(num_run)))
        tokens, self._offsets, replicas = [], [], []
        for replica, replica_batch in enumerate(batch.replica_batches):
            sequences = []
            for row, sequence in enumerate(replica_batch.sequences):
                own = samples[replica, row, : sequence.num_new_tokens].tolist()  # its samples, pass by pass
                self._offsets.append(len(tokens))
                tokens += own
                drafts = own[: sequence.num_draft_tokens]  # the placeholders' tokens: each pass's sample but the last
                sequences.append(dataclasses.replace(sequence, token_ids=sequence.token_ids[:1] + drafts))
            replicas.append(dataclasses.replace(replica_batch, sequences=sequences))
        self.tokens = np.asarray(tokens, np.int64)  # candidate -> token
        self.batch = dataclasses.replace(batch, replica_batches=replicas)
        self._counts = [s.num_new_tokens for s in self.batch.sequences]

    def emitted(self, sequence_index: int) -> list[int]:
        """The candidates of the sequence's samples, pass by pass (update() keeps those before a stop).

        Args:
          sequence_index: the sequence's place in batch.sequences.
        """
        offset = self._offsets[sequence_index]
        return list(range(offset, offset + self._counts[sequence_index]))
