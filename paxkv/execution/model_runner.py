"""ModelRunner: one scheduled batch to one device step: the page moves before it, its StepBatch, the jitted step."""

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import numpy as np

import models
from models.paged_forward import bucket
from pallas_kernels import pages_for
from paxkv.config import EngineConfig
from paxkv.execution.ahead_compiler import AheadCompiler, abstract
from paxkv.execution.aot import (
    AbstractEngine,
    check_step_fits,
    compile_chained_step,
    compile_step,
    device_memory,
    step_buckets,
)
from paxkv.execution.chained_decode import ChainArrays, ChainedRows, chained_decode_step, first_pass_batch
from paxkv.execution.draft_proposer import DraftModelProposer
from paxkv.execution.kv_pool import KVPool
from paxkv.execution.step import (
    SampledTokens,
    StepBatch,
    compile_forward,
    compile_sampling,
    copy_pages,
    page_copy_arrays,
    run_step,
    step_model,
)
from paxkv.execution.step_arguments import build_step_batch, empty_step_batch
from paxkv.execution.step_inputs import StepPadding, padded_draft_rows, padded_sizes
from paxkv.execution.verification import emitted_candidates
from paxkv.parallel.distributed import host_value
from paxkv.scheduling.preemption import PreemptionPolicy
from paxkv.scheduling.scheduled_batch import ScheduledBatch, SpeculatingStep

logger = logging.getLogger(__name__)


class LiveRows:
    """A step's SampledTokens read on the host: each field ([D, S + R, ...] on the device) is fetched on its first
    read, in one transfer, and the candidate rows picked in numpy (no device op per step).

    The candidates are, for each live sequence in batch order, its usual row and then its draft rows, so a
    sequence with k drafts owns candidates [offset, offset + 1 + k) (paxkv.execution.verification).
    """

    def __init__(self, sampled: SampledTokens, batch: ScheduledBatch, num_rows: int, num_draft_rows: int):
        """Wraps the step's output.

        Args:
          sampled: the step's SampledTokens, every leaf [D, S + R, ...] (num_accepted [D, S]).
          batch: the step's batch, as it ran.
          num_rows, num_draft_rows: S and R, the padded row counts of every replica.
        """
        self.batch = batch  # the batch as it ran (a draft model's drafts filled in)
        self._sampled, self._fields = sampled, {}
        rows, self._offsets, self._num_drafts, live = [], [], [], []
        width = num_rows + num_draft_rows
        for replica, replica_batch in enumerate(batch.replica_batches):
            draft_row = num_rows
            for row, sequence in enumerate(replica_batch.sequences):
                self._offsets.append(len(rows))
                self._num_drafts.append(sequence.num_draft_tokens)
                live.append(replica * num_rows + row)
                rows.append(replica * width + row)
                rows += [replica * width + draft_row + j for j in range(sequence.num_draft_tokens)]
                draft_row += sequence.num_draft_tokens
        self._rows, self._live = np.asarray(rows, dtype=np.int64), np.asarray(live, dtype=np.int64)
        self._num_accepted = None

    def __getattr__(self, name: str) -> np.ndarray:
        """The field `name` of SampledTokens (tokens, logprobs, ranks, top_ids, top_logprobs), candidates by index."""
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._fields:
            value = host_value(getattr(self._sampled, name))
            self._fields[name] = value.reshape(-1, *value.shape[2:])[self._rows]
        return self._fields[name]

    def emitted(self, sequence_index: int) -> list[int]:
        """The candidates whose tokens the sequence emits, in order: one without drafts, 1 + accepted with them.

        Args:
          sequence_index: the sequence's place in batch.sequences.
        """
        offset, num_drafts = self._offsets[sequence_index], self._num_drafts[sequence_index]
        if not num_drafts:
            return [offset]
        return [offset + c for c in emitted_candidates(num_drafts, self.num_accepted(sequence_index))]

    def num_accepted(self, sequence_index: int) -> int:
        """How many of the sequence's drafts its samples accepted."""
        if self._num_accepted is None:
            self._num_accepted = host_value(self._sampled.num_accepted).reshape(-1)[self._live]
        return int(self._num_accepted[sequence_index])


def program_keys(shape: tuple) -> tuple[tuple, tuple]:
    """The names of a step shape's two programs (T, S, token counts?, suppress?, logprobs?, all greedy?, R), as the
    runner notes them and the AheadCompiler keeps them: ("forward", T, S, R) and ("sampling", S, R, the variant)."""
    num_tokens, num_rows, *variant, num_draft_rows = shape
    return ("forward", num_tokens, num_rows, num_draft_rows), ("sampling", num_rows, num_draft_rows, *variant)


class ModelRunner:
    """Runs an engine's steps on its devices: moves pages (swap out and in, copy-on-write), lays the batch out as
    padded arrays, and runs the step (execution.step.run_step) over the pool, which it donates and replaces."""

    def __init__(
        self,
        loaded: models.LoadedModel,
        pool: KVPool,
        preemption: PreemptionPolicy,
        config: EngineConfig,
        *,
        max_model_len: int,
        mesh,
        draft: models.LoadedModel | None = None,
    ):
        """Args:
        loaded: the model.
        pool: its page pool (the runner replaces pool.kv_caches after every step).
        preemption: the policy whose prefill and transfer rates the runner measures.
        config: the engine's budgets.
        max_model_len: the context, which sets the block-table width.
        mesh: the engine's mesh, or None for one device.
        draft: a speculative draft model, whose layers follow the target's in the pool, or None.
        """
        self.loaded, self.pool, self.preemption, self.config, self.mesh = loaded, pool, preemption, config, mesh
        loaded.pack_for_native_matmul(mesh)  # f32 projections as the native CPU matmul's panels, where that pays
        self.pages_per_seq = pages_for(max_model_len, config.page_size)
        platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        self.padding = StepPadding.for_platform(platform, config.min_padded_seqs, config.min_padded_tokens)
        self.ahead = AheadCompiler(mesh)  # speculating steps' programs (a draft model's too), compiled before use
        self.draft = None
        if draft is not None:
            draft.pack_for_native_matmul(mesh)  # a draft model runs the same matmuls at the same rows
            self.draft = DraftModelProposer(
                draft,
                config.speculative_config.num_speculative_tokens,
                page_size=config.page_size,
                pages_per_seq=self.pages_per_seq,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                padding=self.padding,
                mesh=mesh,
                ahead=self.ahead,
            )
        # The steps take the weights as the state's flat list of arrays (StaticGraph), read once here, after
        # packing: nothing changes the state's arrays later.
        self._graph, self._weights = step_model(loaded.graphdef, loaded.state)
        self.native = loaded.model.native_matmul  # the native CPU kernels run here: greedy sampling may take one too
        self.num_ahead_steps = 0  # steps whose forward was compiled ahead
        # (T bucket, S bucket, penalties?, suppress?, logprobs?, all greedy?, R draft rows): each one a (forward,
        # sampling) pair, the forward's program keyed by (T, S, R) and the sampling's by the rest.
        self.step_shapes: set[tuple[int, int, bool, bool, bool, bool, int]] = set()
        self._ran_programs: set[tuple] = set()  # program_keys of every shape run (jitted or compiled ahead)
        self.last_step_compiled = False  # whether the last step's programs were new here (its time includes compiling)
        # Whether it ran a program compiled ahead for the first time: a new executable's first run costs more than
        # its later ones (measured: a SmolLM2 step of 8 tokens and 8 drafts, 143-164 ms against 82 later).
        self.last_step_first_run = False
        self.num_pages_swapped = 0

    def step_batch(self, batch: ScheduledBatch, seed_of: Callable[[str], int]) -> tuple[StepBatch, bool]:
        """The step's batch argument (every leaf [D, ...]) and logprobs flag for `batch` (execution.step_arguments).

        Args:
          batch: a batch the scheduler returned.
          seed_of: request id -> the seed of that sample.
        """
        return build_step_batch(
            batch,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            pages_per_seq=self.pages_per_seq,
            seed_of=seed_of,
            vocab_size=self.loaded.config.vocab_size,
            eos_token_ids=list(self.loaded.generation_config.eos_token_ids),
            padding=self.padding,
        )

    def run(self, batch: ScheduledBatch, seed_of: Callable[[str], int]) -> LiveRows | ChainedRows:
        """Move the batch's pages, run the step, and return its sampled tokens, read on the host as they are needed
        (LiveRows: each sequence's candidates, and the ones it emits; ChainedRows for chained decode passes).

        Args:
          batch: a batch the scheduler returned.
          seed_of: request id -> the seed of that sample.
        """
        self.move_pages(batch)
        if batch.decode_steps > 1:
            return self._run_chained(batch, seed_of)
        if self.draft is not None:  # the draft model runs first: its drafts fill the scheduler's placeholders
            batch, draft_layers = self.draft.fill(batch, self.draft_layers, seed_of)
            self.pool.kv_caches = self.target_layers + draft_layers
        start = time.monotonic()  # the target's step alone: the prefill rate the preemption policy plans by
        step_batch, with_logprobs = self.step_batch(batch, seed_of)
        greedy_only = step_batch.greedy_only()
        inputs = step_batch.inputs
        num_tokens, num_rows = inputs.tokens.shape[-1], inputs.logits_indices.shape[-1]
        num_draft_rows = 0 if step_batch.drafts is None else step_batch.drafts.tokens.shape[-1]
        vocab_arrays = step_batch.token_counts is not None, step_batch.suppress is not None
        shape = (num_tokens, num_rows, *vocab_arrays, with_logprobs, greedy_only, num_draft_rows)
        forward, sampling = (self.ahead.program(key) for key in program_keys(shape))
        new_programs, first_ahead_run = self._record(shape, (forward, sampling))
        self.num_ahead_steps += forward is not None
        self.last_step_first_run = first_ahead_run or (self.draft is not None and self.draft.last_fill_first_run)
        self.last_step_compiled = new_programs or (self.draft is not None and self.draft.last_fill_compiled)
        # Under the mesh, a Pallas kernel runs per model shard (models.sharding.attention_on_mesh).
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            sampled, target_layers = run_step(
                self._graph,
                self._weights,
                self.target_layers,
                step_batch,
                with_logprobs,
                greedy_only,
                forward=forward,
                sampling=sampling,
                native=self.native,
            )
        self.pool.kv_caches = target_layers + self.draft_layers
        if batch.num_batched_tokens >= self.config.max_num_batched_tokens // 2:  # mostly prefill: a rate to plan by
            jax.block_until_ready(sampled.tokens)
            self.preemption.observe_prefill(batch.num_batched_tokens, time.monotonic() - start)
        # [D, S + R, ...] -> the live candidates, replica by replica (the caller fetches only the fields it reads).
        return LiveRows(sampled, batch, num_rows, num_draft_rows)

    def _run_chained(self, batch: ScheduledBatch, seed_of: Callable[[str], int]) -> ChainedRows:
        """Run a chained step's decode passes in one program (execution.chained_decode) and read its samples."""
        step_batch, with_logprobs = self.step_batch(first_pass_batch(batch), seed_of)
        if with_logprobs or step_batch.token_counts is not None or step_batch.suppress is not None:
            raise ValueError("a chained step samples plainly: no logprobs, penalties or min_tokens (decode_chaining)")
        num_rows = step_batch.inputs.logits_indices.shape[-1]
        greedy_only = step_batch.greedy_only()
        key = ("chained", step_batch.inputs.tokens.shape[-1], num_rows, batch.decode_steps, greedy_only)
        self.last_step_compiled = key not in self._ran_programs
        self.last_step_first_run = False
        self._ran_programs.add(key)
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            samples, num_run, target_layers = chained_decode_step(
                self._graph,
                self._weights,
                self.target_layers,
                step_batch,
                ChainArrays.from_batch(batch, num_rows, list(self.loaded.generation_config.eos_token_ids)),
                greedy_only,
                self.native,
            )
        self.pool.kv_caches = target_layers + self.draft_layers
        return ChainedRows(samples, num_run, batch)

    def warm_up(self) -> int:
        """Compile every plain step program the budgets allow by running each (T, S) bucket on padding alone (which
        writes only the null page), so no request waits for a compile of those; returns how many step shapes ran.

        Each bucket runs its all-greedy sampling, and the first bucket of each S also the sampling that draws.
        Programs with penalties, min_tokens, logprobs or drafts still compile on first use (each sampling variant
        is a small program of its own).
        """
        num_replicas = self.pool.num_replicas
        buckets = step_buckets(self.config.max_num_batched_tokens, self.config.max_num_seqs, self.padding)
        num_runs, rows_drawn = 0, set()
        for num_tokens, num_rows in buckets:
            step_batch = empty_step_batch(
                num_replicas,
                num_tokens,
                num_rows,
                pages_per_seq=self.pages_per_seq,
                vocab_size=self.loaded.config.vocab_size,
            )
            for greedy_only in (True,) if num_rows in rows_drawn else (True, False):
                with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
                    sampled, target_layers = run_step(
                        self._graph,
                        self._weights,
                        self.target_layers,
                        step_batch,
                        greedy_only=greedy_only,
                        native=self.native,
                    )
                self.pool.kv_caches = target_layers + self.draft_layers
                jax.block_until_ready(sampled.tokens)
                self._record((num_tokens, num_rows, False, False, False, greedy_only, 0))
                num_runs += 1
            rows_drawn.add(num_rows)
        return num_runs

    @property
    def target_layers(self) -> list:
        """The target model's layers of the pool."""
        return self.pool.kv_caches[: self.pool.num_target_layers]

    @property
    def draft_layers(self) -> list:
        """The draft model's layers of the pool (none without one)."""
        return self.pool.kv_caches[self.pool.num_target_layers :]

    def has_compiled(self, step: SpeculatingStep) -> bool:
        """Whether a speculating step (no penalties or min_tokens) would run without compiling: this runner has run
        or compiled ahead the forward program it pads to (padded_sizes), its sampling variant, and a draft model's
        programs for it (DraftModelProposer.program_sizes)."""
        ready = all(key in self._ran_programs or self.ahead.program(key) is not None for key in self._keys(step))
        return ready and (self.draft is None or self.draft.has_compiled([list(step.draft_spans)]))

    def compile_ahead(self, step: SpeculatingStep) -> None:
        """Have the programs of such a step that are not compiled yet compiled on the AheadCompiler's worker, so
        that a later step runs them without waiting for a compile."""
        if self.draft is not None:
            self.draft.compile_ahead([list(step.draft_spans)], self.draft_layers)
        if self.has_compiled(dataclasses.replace(step, draft_spans=())):
            return
        forward, sampling = self._keys(step)
        _, padded_tokens, padded_seqs, num_draft_rows = forward
        batch = empty_step_batch(
            self.pool.num_replicas,
            padded_tokens,
            padded_seqs,
            pages_per_seq=self.pages_per_seq,
            vocab_size=self.loaded.config.vocab_size,
            draft_row_bucket=num_draft_rows,
        )
        graph, batch = self._graph, abstract(batch)
        weights, kv_caches = abstract(self._weights), abstract(self.target_layers)
        # The sampling's input is the forward's output, shaped and sharded as the compiled forward gives it: the
        # forward is compiled ahead too (once) where only its jitted twin ran.
        self.ahead.request(forward, lambda: compile_forward(graph, weights, kv_caches, batch))
        with_logprobs, greedy_only, native = step.with_logprobs, step.greedy_only, self.native
        self.ahead.request(
            sampling, lambda: compile_sampling(self.ahead.program(forward), batch, with_logprobs, greedy_only, native)
        )

    def _keys(self, step: SpeculatingStep) -> tuple[tuple, tuple]:
        """program_keys of the shape a speculating step pads to."""
        budgets = self.config.max_num_batched_tokens, self.config.max_num_seqs
        num_tokens, num_seqs = padded_sizes(step.num_tokens, step.num_seqs, step.prefills, *budgets, self.padding)
        num_draft_rows = padded_draft_rows(step.num_drafts, budgets[0], self.padding)
        return program_keys((num_tokens, num_seqs, False, False, step.with_logprobs, step.greedy_only, num_draft_rows))

    def _record(self, shape: tuple, ahead: tuple = (None, None)) -> tuple[bool, bool]:
        """Note a step's shape; whether one of its programs was new here and not compiled ahead (the step compiled),
        and whether one compiled ahead ran for the first time.

        Args:
          shape: the step's shape, as step_shapes holds them.
          ahead: its (forward, sampling) programs compiled ahead, None where it runs the jitted one.
        """
        keys = program_keys(shape)
        new = [key not in self._ran_programs for key in keys]
        compiled = any(is_new and program is None for is_new, program in zip(new, ahead, strict=True))
        first_ahead_run = any(is_new and program is not None for is_new, program in zip(new, ahead, strict=True))
        self.step_shapes.add(shape)
        self._ran_programs.update(keys)
        return compiled, first_ahead_run

    def move_pages(self, batch: ScheduledBatch) -> None:
        """Before the step: pages out to the host (preemption by swap), back in (resumption), copies on write."""
        swap_space = self.pool.swap_space
        # A bf16 pool on one CPU device takes its pages through the native write (XLA:CPU's bf16 scatter copies the
        # pool); a pool over several devices keeps XLA's, which the partitioner splits.
        native_writes = self.native and (self.mesh is None or self.mesh.devices.size == 1)
        for moves, direction in ((batch.swap_out, "out"), (batch.swap_in, "in")):
            if not moves:
                continue
            moved, seconds = swap_space.bytes_moved, swap_space.seconds_moving
            first, second = (list(column) for column in zip(*moves, strict=True))
            if direction == "out":
                swap_space.swap_out(self.pool.kv_caches, first, second)
            else:
                self.pool.kv_caches = swap_space.swap_in(self.pool.kv_caches, first, second, native=native_writes)
            self.preemption.observe_transfer(swap_space.bytes_moved - moved, swap_space.seconds_moving - seconds)
            self.num_pages_swapped += len(moves)
        if batch.page_copies:
            sources, destinations = page_copy_arrays(batch.page_copies)
            self.pool.kv_caches = copy_pages(self.pool.kv_caches, sources, destinations, native_writes)

    def check_largest_step_fits(self) -> None:
        """Where the device reports a memory limit (TPU, GPU), compile the largest step (and the largest chained
        decode step, where decodes chain) now and refuse to start when one cannot fit beside the weights and the pool,
        rather than fail at the first large batch."""
        memory = device_memory(self.mesh)
        if memory is None:
            return  # CPU: no limit to check against
        config, loaded = self.config, self.loaded
        state = AbstractEngine(
            loaded.graphdef,
            loaded.state,
            self.target_layers,
            config.page_size,
            self.pages_per_seq,
            loaded.config.vocab_size,
            self.mesh,
        )
        num_tokens, num_seqs = bucket(config.max_num_batched_tokens), bucket(config.max_num_seqs)
        program = compile_step(state, num_tokens, num_seqs, with_logprobs=True, vocab_arrays=True)
        budgets = f"max_num_batched_tokens={config.max_num_batched_tokens}, max_num_seqs={config.max_num_seqs}"
        check_step_fits(program, *memory, what=budgets)
        if config.num_scheduler_steps > 1 and config.speculative_config is None:  # the engine chains decodes
            chained = compile_chained_step(state, num_seqs, config.num_scheduler_steps)
            chain = f"max_num_seqs={config.max_num_seqs}, num_scheduler_steps={config.num_scheduler_steps}"
            check_step_fits(chained, *memory, what=chain)
        logger.info(
            "the largest step (T=%d, S=%d) needs %.2f GiB beside its arguments; %.2f GiB of %.2f GiB are free",
            num_tokens,
            num_seqs,
            program.memory.beyond_arguments_bytes / 2**30,
            (memory[0] - memory[1]) / 2**30,
            memory[0] / 2**30,
        )
