"""A draft model's proposals: before each step, a smaller model with the target's vocabulary drafts the tokens the
step verifies, in one jitted program per step.

The draft keeps its KV in the same pages as the target (its layers follow the target's in the pool), and runs over
the drafting rows only, so a step without drafts runs no draft at all. Its KV therefore lags the target's where a
request did not draft (a prefill, a plain step); Request.num_draft_computed says how far it reaches. A drafting row
runs, in one program:
- first its tokens the draft lacks, through its last token (a prefill chunk of the skipped tokens, or just the last
  token when it drafted the step before), which writes their draft KV and gives its first draft from the last
  token's logits;
- then k single-token iterations (a fori_loop): iteration j writes the KV of draft j and drafts token j + 1.
Whatever the verification accepts, the draft KV up to the last accepted token is then valid, exactly as the
target's is; rejected positions are overwritten by the next step that reaches them.

Each draft is the draft model's sample with the request's own settings and the very key, fold_in(seed, position),
that the target samples that position with: the draft and the target add the same Gumbel noise to their logits
(jax.random.categorical is a Gumbel-max draw), so the two draws agree whenever the noise leaves both models the same
winner ("coupled" drafts; greedy rows are argmax on both sides). The step's verification
(paxkv.execution.verification) keeps a draft only where it equals the target's own sample there, so every emitted
token is the sample plain decoding draws: lossless, and the same output whichever draft model runs. Compared with
Leviathan et al.'s rule (accept with probability min(1, p/q), acceptance 1 - TV(p, q)), coupling accepts with
probability at least (1 - TV) / (1 + TV) per token, equal where p = q, and keeps seeded output independent of the
draft and of speculation itself.
"""

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import models
from models.paged_forward import logits_over_pages
from pallas_kernels import AttentionMetadata
from paxkv.config import SpeculativeConfig
from paxkv.execution.ahead_compiler import AheadCompiler, abstract
from paxkv.execution.sampler import SamplingArrays, sample
from paxkv.execution.step import StaticGraph, per_replica, replicated, step_model
from paxkv.execution.step_inputs import NO_PADDING, StepInputs, StepPadding, padded_sizes, shared_padded_sizes
from paxkv.parallel.distributed import host_value
from paxkv.scheduling.scheduled_batch import ReplicaBatch, ScheduledBatch, ScheduledSequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProposingRows:
    """The rows of a step that speculate (leaves [D, R], R = S the step's row bucket; padding rows draft nothing)."""

    rows: jax.Array  # i32[D, R] each one's row in the step (0 for padding)
    positions: jax.Array  # i32[D, R] the position of its last token (its drafts follow it)
    num_drafts: jax.Array  # i32[D, R] how many drafts it wants (0 for padding)
    sampling: SamplingArrays  # [D, R] its request's settings and seed at its first draft's position (padding: greedy)


@functools.partial(jax.jit, static_argnums=(0, 5, 6), donate_argnums=2)
def propose_drafts(
    graph: StaticGraph,
    weights: list,  # the draft's state's leaves (StaticGraph)
    kv_caches: list,  # the draft's layers of the pool, donated
    inputs: StepInputs,  # [D, ...] the step's tokens without drafts
    proposing: ProposingRows,  # [D, R]
    page_size: int,
    num_speculative_tokens: int,  # K
) -> tuple[jax.Array, list]:  # (i32[D, R, K] drafts, kv_caches)
    """Write the draft KV of the step's tokens and draft up to K tokens for each proposing row, each sampled with the
    key the target samples its position with (coupled drafts; greedy rows take the argmax)."""

    def replica_drafts(weights, kv_caches, inputs, proposing):
        model = graph.model(weights)
        local = jax.tree.map(lambda leaf: leaf[0], inputs)
        proposing = jax.tree.map(lambda leaf: leaf[0], proposing)
        rows, positions, num_drafts = proposing.rows, proposing.positions, proposing.num_drafts  # i32[R] each

        def draw(logits: jax.Array, j) -> jax.Array:  # f32[R, vocab] -> i32[R, 1], the samples of draft j
            sampling = dataclasses.replace(proposing.sampling, positions=proposing.sampling.positions + j)
            return sample(replicated(logits), sampling)[0][:, None]

        logits, kv_caches = logits_over_pages(
            model, local.tokens, local.positions, kv_caches, local.metadata, local.logits_indices[rows]
        )  # f32[R, vocab]
        drafts = jnp.zeros((rows.shape[0], num_speculative_tokens + 1), jnp.int32)  # [R, K + 1]
        drafts = drafts.at[:, :1].set(draw(logits, 0))
        block_tables = local.metadata.block_tables[rows]  # i32[R, P]
        num_rows = rows.shape[0]

        def draft_one(j, carry):
            drafts, kv_caches = carry
            live = j < num_drafts  # bool[R]: the row still drafts (padding never does)
            position = jnp.where(live, positions + 1 + j, 0)  # draft j's position
            page = jnp.take_along_axis(
                block_tables, jnp.minimum(position // page_size, block_tables.shape[1] - 1)[:, None], axis=1
            )[:, 0]
            metadata = AttentionMetadata(
                slots=jnp.where(live, page * page_size + position % page_size, 0),  # rows done write the null page
                block_tables=block_tables,
                cu_q_lens=jnp.arange(num_rows + 1, dtype=jnp.int32),
                kv_lens=position + 1,
                num_seqs=jnp.full((1,), num_rows, jnp.int32),
            )
            tokens = jax.lax.dynamic_slice_in_dim(drafts, j, 1, axis=1)[:, 0]
            logits, kv_caches = logits_over_pages(
                model, tokens, position, kv_caches, metadata, jnp.arange(num_rows, dtype=jnp.int32)
            )
            return jax.lax.dynamic_update_slice_in_dim(drafts, draw(logits, j + 1), j + 1, axis=1), kv_caches

        drafts, kv_caches = jax.lax.fori_loop(0, jnp.max(num_drafts), draft_one, (drafts, kv_caches))
        return drafts[None, :, :num_speculative_tokens], kv_caches

    return per_replica(replica_drafts, inputs.tokens.shape[0], (weights,), (kv_caches, inputs, proposing))


def num_draft_compilations() -> int:
    """How many draft programs (one per (T, S) bucket and replica count) this process has compiled."""
    return propose_drafts._cache_size()


def last_position(sequence: ScheduledSequence) -> int:
    """The position of a drafting sequence's last token before its drafts (its drafts follow it)."""
    return sequence.positions[sequence.num_new_tokens - sequence.num_draft_tokens - 1]


def draft_span(sequence: ScheduledSequence, start: int, stop: int, page_size: int) -> ScheduledSequence:
    """What the draft model runs for a drafting sequence: its request's tokens at positions [start, stop), which the
    draft's KV lacks (stop - 1 at most the sequence's last token), written to their slots in the request's pages."""
    positions = list(range(start, stop))
    block_table = sequence.block_table
    return dataclasses.replace(
        sequence,
        token_ids=sequence.request.all_token_ids[start:stop],
        positions=positions,
        slots=[block_table[p // page_size] * page_size + p % page_size for p in positions],
        kv_len=stop,
        completes_prompt=True,
        num_draft_tokens=0,
    )


class DraftModelProposer:
    """Runs a draft model beside the target: fills in the drafts the scheduler reserved room for (placeholders
    until then), over the drafting rows only.

    The draft's KV follows the target's lazily: a step in which no row drafts runs no draft model at all (so
    adaptive speculation that drafts nothing costs nothing), and a row that drafts first catches the draft up over
    the tokens it skipped (Request.num_draft_computed; its whole prompt the first time), in the drafting program
    itself, or in catch-up programs before it when the catch-ups exceed the token budget (which Drafter.choose
    lets only the first row catching up in a step do).
    """

    def __init__(
        self,
        draft: models.LoadedModel,
        num_speculative_tokens: int,
        *,
        page_size: int,
        pages_per_seq: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        padding: StepPadding = NO_PADDING,
        mesh,
        ahead: AheadCompiler | None = None,
    ):
        """Args:
        draft: the loaded draft model (load_draft_model).
        num_speculative_tokens: K, the most drafts a row asks for.
        page_size, pages_per_seq: the pool's page size and block-table width.
        max_num_batched_tokens, max_num_seqs: the step budgets (its largest buckets).
        padding: the smallest T and S buckets, as the target's step.
        mesh: the engine's mesh, or None for one device.
        ahead: the worker that compiles draft programs ahead of use (has_compiled, compile_ahead), or None.
        """
        self.draft = draft
        self.num_drafts = num_speculative_tokens
        self.page_size, self.pages_per_seq = page_size, pages_per_seq
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.padding = padding
        self.mesh, self.ahead = mesh, ahead
        self._graph, self._weights = step_model(draft.graphdef, draft.state)
        self._ran: set[tuple[int, int]] = set()  # (T, S) of the draft programs this proposer has run
        self.last_fill_sizes: list[tuple[int, int]] = []  # (T, S) of the programs the last fill ran, in order
        self.num_drafting_programs = 0  # draft programs run that drafted (at most one a step)
        self.num_catch_up_programs = 0  # programs that only caught the draft up, before a drafting one
        self.num_catch_up_tokens = 0  # tokens the draft ran before a drafting row's last token (catching up)
        self.last_fill_compiled = False  # whether the last fill compiled a draft program
        self.last_catch_up_tokens = 0  # the last fill's catch-up tokens (the most of any replica)
        self.last_fill_seconds = 0.0  # the last fill's wall time, drafts on the host
        self.last_fill_first_run = False  # whether the last fill ran a program compiled ahead for the first time

    def fill(
        self, batch: ScheduledBatch, kv_caches: list, seed_of: Callable[[str], int]
    ) -> tuple[ScheduledBatch, list]:
        """Catch the draft up over the drafting rows' tokens and return the batch with their drafts filled in, and
        the draft layers; the batch as it is where no row drafts.

        Args:
          batch: the scheduled step, its drafts placeholders.
          kv_caches: the draft's layers of the pool (donated).
          seed_of: request id -> the seed of its samples (the target's: drafts are drawn with the same keys).
        """
        self.last_fill_compiled, self.last_catch_up_tokens, self.last_fill_sizes = False, 0, []
        self.last_fill_first_run = False
        start = time.monotonic()
        drafting = [[s for s in replica.sequences if s.num_draft_tokens] for replica in batch.replica_batches]
        if not any(drafting):
            return batch, kv_caches
        compiled_before = num_draft_compilations()
        # Per replica, each drafting row's tokens the draft lacks: [start, stop), stop - 1 its last token.
        spans = [
            [(s, min(s.request.num_draft_computed, last_position(s)), last_position(s) + 1) for s in rows]
            for rows in drafting
        ]
        catch_ups = [sum(stop - start - 1 for _, start, stop in rows) for rows in spans]
        self.last_catch_up_tokens = max(catch_ups)  # per replica, as the step's tokens are counted
        self.num_catch_up_tokens += sum(catch_ups)
        if max(sum(stop - start for _, start, stop in rows) for rows in spans) > self.max_num_batched_tokens:
            for chunk in _catch_up_chunks(spans, self.max_num_batched_tokens):
                _, kv_caches = self._run(chunk, kv_caches, [[] for _ in chunk], seed_of)
                self.num_catch_up_programs += 1
            spans = [[(s, stop - 1, stop) for s, _, stop in rows] for rows in spans]
        drafts, kv_caches = self._run(spans, kv_caches, drafting, seed_of)
        self.num_drafting_programs += 1
        self.last_fill_compiled = num_draft_compilations() > compiled_before
        batch = _with_drafts(batch, host_value(drafts))
        self.last_fill_seconds = time.monotonic() - start
        return batch, kv_caches

    def program_sizes(self, spans: list[list[int]]) -> list[tuple[int, int]]:
        """The (T, S) of the programs fill runs for drafting rows whose draft spans (the tokens it runs for each: its
        catch-up and its last token) are `spans` per replica: catch-up programs first where they exceed the token
        budget, then the drafting one.

        Args:
          spans: per replica, per drafting row, its span's length (at least 1); no rows: no programs.
        """
        if not any(spans):
            return []
        budgets = self.max_num_batched_tokens, self.max_num_seqs, self.padding

        def shared(replicas: list[list[int]]) -> tuple[int, int]:  # the (T, S) replicas of these spans share
            sizes = [padded_sizes(sum(rows), len(rows), any(n > 1 for n in rows), *budgets) for rows in replicas]
            return max(t for t, _ in sizes), max(s for _, s in sizes)

        if max(sum(rows) for rows in spans) <= self.max_num_batched_tokens:
            return [shared(spans)]
        spans_as_tuples = [[(None, 0, length) for length in rows] for rows in spans]
        chunks = _catch_up_chunks(spans_as_tuples, self.max_num_batched_tokens)
        catch_ups = [shared([[stop - start for _, start, stop in rows] for rows in chunk]) for chunk in chunks]
        return [*catch_ups, shared([[1] * len(rows) for rows in spans])]

    def has_compiled(self, spans: list[list[int]]) -> bool:
        """Whether fill would run drafting rows of these spans (program_sizes) without compiling."""
        return all(size in self._ran or self._ahead_program(size) is not None for size in self.program_sizes(spans))

    def compile_ahead(self, spans: list[list[int]], kv_caches: list) -> None:
        """Have the programs fill would run for drafting rows of these spans compiled on the ahead compiler's
        worker, those not compiled yet.

        Args:
          spans: as program_sizes takes them.
          kv_caches: the draft's layers of the pool (only their shapes and shardings are read).
        """
        sizes = [size for size in self.program_sizes(spans) if size not in self._ran]
        if self.ahead is None or not sizes:
            return
        weights, kv_caches = abstract(self._weights), abstract(kv_caches)
        for size in sizes:
            self.ahead.request(("draft", *size), functools.partial(self._compile, size, weights, kv_caches))

    def _compile(self, size: tuple[int, int], weights: list, kv_caches: list) -> jax.stages.Compiled:
        """The draft program of a (T, S) size, compiled for every replica's padding rows."""
        num_tokens, num_rows = size
        num_replicas = 1 if self.mesh is None else self.mesh.shape["data"]
        empty = ReplicaBatch(sequences=[], num_batched_tokens=0, preempted_request_ids=[])
        inputs = StepInputs.from_batch(
            empty,
            max_num_batched_tokens=num_tokens,
            max_num_seqs=num_rows,
            pages_per_seq=self.pages_per_seq,
            padded_sizes=size,
        )
        inputs = jax.tree.map(lambda leaf: np.stack([leaf] * num_replicas), inputs)
        proposing = _proposing_rows([[] for _ in range(num_replicas)], num_rows, lambda _: 0)
        traced = propose_drafts.trace(
            self._graph, weights, kv_caches, abstract(inputs), abstract(proposing), self.page_size, self.num_drafts
        )
        return traced.lower().compile()

    def _ahead_program(self, size: tuple[int, int]) -> jax.stages.Compiled | None:
        """The draft program of a (T, S) size compiled ahead, if it is."""
        return None if self.ahead is None else self.ahead.program(("draft", *size))

    def _run(
        self,
        spans: list[list[tuple[ScheduledSequence, int, int]]],
        kv_caches: list,
        drafting: list[list[ScheduledSequence]],
        seed_of: Callable[[str], int],
    ) -> tuple[jax.Array, list]:
        """One draft program over every replica's spans (rows in order), drafting for `drafting`, the rows whose
        span ends at their last token (none: a catch-up program)."""
        replicas = [
            ReplicaBatch(
                sequences=[draft_span(s, start, stop, self.page_size) for s, start, stop in rows],
                num_batched_tokens=sum(stop - start for _, start, stop in rows),
                preempted_request_ids=[],
            )
            for rows in spans
        ]
        padded_sizes = shared_padded_sizes(replicas, self.max_num_batched_tokens, self.max_num_seqs, self.padding)
        inputs = [
            StepInputs.from_batch(
                replica,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                pages_per_seq=self.pages_per_seq,
                padded_sizes=padded_sizes,
            )
            for replica in replicas
        ]
        proposing = _proposing_rows(drafting, padded_sizes[1], seed_of)
        stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *inputs)
        program = self._ahead_program(padded_sizes)
        self.last_fill_first_run |= program is not None and padded_sizes not in self._ran
        self._ran.add(padded_sizes)
        self.last_fill_sizes.append(padded_sizes)
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            if program is not None:
                return program(self._weights, kv_caches, stacked, proposing)
            return propose_drafts(
                self._graph, self._weights, kv_caches, stacked, proposing, self.page_size, self.num_drafts
            )


def _catch_up_chunks(
    spans: list[list[tuple[ScheduledSequence, int, int]]], max_tokens: int
) -> list[list[list[tuple[ScheduledSequence, int, int]]]]:
    """The rows' tokens before their last, [start, stop - 1), in programs of at most `max_tokens` tokens: per
    program, per replica, (sequence, start, stop) pieces in row order (a row's tokens may span programs)."""
    per_replica = []
    for rows in spans:
        chunks, chunk, room = [], [], max_tokens
        for sequence, start, stop in rows:
            while start < stop - 1:
                take = min(stop - 1 - start, room)
                chunk.append((sequence, start, start + take))
                start, room = start + take, room - take
                if not room:
                    chunks.append(chunk)
                    chunk, room = [], max_tokens
        if chunk:
            chunks.append(chunk)
        per_replica.append(chunks)
    num_programs = max(len(chunks) for chunks in per_replica)
    return [[chunks[i] if i < len(chunks) else [] for chunks in per_replica] for i in range(num_programs)]


def _proposing_rows(
    drafting: list[list[ScheduledSequence]], num_rows: int, seed_of: Callable[[str], int]
) -> ProposingRows:
    """Per replica, the drafting sequences (the program's first rows, in order), padded to the program's S rows:
    one draft program per (T, S) bucket, at the price of padding rows in the drafting loop when few rows speculate."""
    rows, positions, num_drafts = (np.zeros((len(drafting), num_rows), np.int32) for _ in range(3))
    samplings = []
    for replica, sequences in enumerate(drafting):
        params, first_positions, seeds = [], [], []
        for place, sequence in enumerate(sequences):
            rows[replica, place] = place
            positions[replica, place] = last_position(sequence)
            num_drafts[replica, place] = sequence.num_draft_tokens
            params.append(sequence.request.sampling_params)
            first_positions.append(int(positions[replica, place]) + 1)
            seeds.append(seed_of(sequence.request.request_id))
        samplings.append(SamplingArrays.from_params(params, first_positions, seeds, batch_size=num_rows))
    sampling = jax.tree.map(lambda *leaves: np.stack(leaves), *samplings)
    return ProposingRows(rows, positions, num_drafts, sampling)


def _with_drafts(batch: ScheduledBatch, drafts: np.ndarray) -> ScheduledBatch:
    """The batch with each speculating sequence's placeholder drafts replaced by drafts[replica, place, :count]."""
    replicas = []
    for replica, replica_batch in enumerate(batch.replica_batches):
        sequences, place = [], 0
        for sequence in replica_batch.sequences:
            count = sequence.num_draft_tokens
            if count:
                proposed = [int(token) for token in drafts[replica, place, :count]]
                sequence = dataclasses.replace(sequence, token_ids=sequence.token_ids[:-count] + proposed)
                place += 1
            sequences.append(sequence)
        replicas.append(dataclasses.replace(replica_batch, sequences=sequences))
    return dataclasses.replace(batch, replica_batches=replicas)


def load_draft_model(
    speculative: SpeculativeConfig | None, target: models.LoadedModel, mesh, max_model_len: int
) -> models.LoadedModel | None:
    """The speculative draft model, loaded as the target was (dtypes, attention, mesh), or None unless the method is
    draft_model; raise ValueError naming the fix when it cannot draft for the target.

    Args:
      speculative: the engine's speculative config, or None.
      target: the loaded target model.
      mesh: the engine's mesh, or None.
      max_model_len: the engine's context, which the draft must cover too.
    """
    if speculative is None or speculative.method != "draft_model":
        return None
    path = speculative.model
    model = target.model
    first_attention = model.layers[0].attention
    try:
        draft = models.load(
            path,
            str(jnp.dtype(model.embed.get_value().dtype)),
            mesh=mesh,
            attention_impl=first_attention.attention_impl,
            compute_dtype=str(jnp.dtype(model.compute_dtype)),
            require_tokenizer=False,
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative draft model {path!r}: {e}") from None
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model {path!r} has a vocabulary of {draft.config.vocab_size} tokens and the target "
            f"{target.config.vocab_size}; a draft must share the target's tokenizer: choose a draft of its family"
        )
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model {path!r} has a context of {draft.config.max_position_embeddings} tokens, shorter than "
            f"max_model_len={max_model_len}; lower max_model_len or choose a draft with a longer context"
        )
    return draft
