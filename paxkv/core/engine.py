"""Engine: requests in, one jitted step per call, outputs out; the caller drives the loop.

A step reads top to bottom: the scheduler picks the batch, the model runner runs it on the devices, the
scheduler records the sampled tokens (and decides who stops), and the output processor turns them into text
and RequestOutputs.
"""

import time

import jax

import models
from models.packed_weights import num_parameters
from paxkv.config import EngineConfig
from paxkv.core.metrics import EngineMetrics
from paxkv.core.output_processor import OutputProcessor
from paxkv.core.outputs import RequestOutput
from paxkv.execution.chained_decode import num_chained_compilations
from paxkv.execution.draft_proposer import load_draft_model, num_draft_compilations
from paxkv.execution.kv_pool import KVPool
from paxkv.execution.model_runner import ModelRunner
from paxkv.execution.step import num_step_compilations
from paxkv.execution.step_inputs import num_buckets
from paxkv.execution.verification import num_draft_rows
from paxkv.parallel.mesh import engine_mesh
from paxkv.scheduling.preemption import PreemptionPolicy
from paxkv.scheduling.request import Request
from paxkv.scheduling.request_checks import check_request
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import ScheduledBatch
from paxkv.scheduling.scheduler import Scheduler
from paxkv.scheduling.stopping import NONFINITE_TOKEN
from paxkv.speculation.drafter import Drafter

# Catch-ups of at least this many tokens are timed as a draft model's catch-up cost (its drafting a small part).
MIN_MEASURED_CATCH_UP = 64


class Engine:
    """Continuous batching over one page pool (in D >= 1 replica partitions) with a jitted ragged step."""

    def __init__(self, loaded: models.LoadedModel, config: EngineConfig | None = None):
        """Allocate the page pool and the scheduler for `loaded`.

        Args:
          loaded: a models.LoadedModel.
          config: pool size, budgets and context length.
        """
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        self.max_model_len = config.context_length(loaded.config.max_position_embeddings)
        self.mesh = engine_mesh(loaded, config.mesh_shape)
        speculative = config.speculative_config
        draft = load_draft_model(speculative, loaded, self.mesh, self.max_model_len)  # None unless draft_model
        self.pool = pool = KVPool(loaded.config, config, loaded.model.compute_dtype, self.mesh, draft and draft.config)
        self.preemption = PreemptionPolicy(pool.preemption_mode, pool.bytes_per_page, pool.num_host_slots)
        self.runner = ModelRunner(
            loaded, pool, self.preemption, config, max_model_len=self.max_model_len, mesh=self.mesh, draft=draft
        )
        self.drafter, self._draft_size_ratio = None, None
        if speculative is not None:
            runner = self.runner
            self.drafter = Drafter(
                speculative,
                jax.process_count(),
                has_compiled=runner.has_compiled,
                compile_ahead=runner.compile_ahead,
                catch_up_seconds_per_token=self._draft_prefill_seconds_per_token,
            )
        self.scheduler = Scheduler(
            num_replicas=pool.num_replicas,
            pages_per_replica=pool.pages_per_replica,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_ids=loaded.generation_config.eos_token_ids,
            swap_slots=pool.swap_space.slots if pool.swap_space is not None else None,
            preemption=self.preemption,
            watermark_pages=int(config.watermark * (pool.pages_per_replica - 1)),
            drafter=self.drafter,
            step_sizes=self.runner.padding.token_buckets(config.max_num_batched_tokens),  # the sizes steps pad to
        )
        self.outputs = OutputProcessor(loaded.tokenizer, loaded.generation_config.eos_token_ids, config.seed)
        self.metrics = EngineMetrics(num_total_pages=self.scheduler.num_total_pages, page_size=config.page_size)
        pool.log()
        self.runner.check_largest_step_fits()

    @property
    def kv_caches(self):
        """The device page pool, one entry per layer, a draft model's after the target's (replaced every step)."""
        return self.pool.kv_caches

    @property
    def max_step_programs(self) -> int:
        """The most distinct step programs this engine can need: a forward per (T bucket, S bucket) and a sampling
        per (S bucket, 16 variants: penalties, min_tokens, logprobs, all greedy), each times the draft-row buckets
        (and none) when it speculates, a draft model's program per (T, S), and without speculation a chained decode
        program per (S bucket, greedy or not) where num_scheduler_steps > 1."""
        config = self.config
        num_seq_buckets = num_buckets(config.max_num_seqs)
        num_forwards = len(self.runner.padding.token_buckets(config.max_num_batched_tokens)) * num_seq_buckets
        programs = num_forwards + num_seq_buckets * 16
        if config.speculative_config is not None:
            programs *= 1 + num_buckets(config.max_num_seqs * config.speculative_config.num_speculative_tokens)
        elif config.num_scheduler_steps > 1:
            programs += num_seq_buckets * 2  # chained decode passes: greedy or drawing (execution.chained_decode)
        return programs + (num_forwards if self.runner.draft is not None else 0)

    @property
    def num_compilations(self) -> int:
        """Distinct step programs (a draft model's and chained decode passes' included) compiled so far: jitted ones in
        this process, and ones this engine compiled ahead of use (execution.ahead_compiler)."""
        compiled = num_step_compilations() + num_draft_compilations() + num_chained_compilations()
        return compiled + self.runner.ahead.num_programs

    def add_request(
        self,
        request_id: str,
        prompt_token_ids,
        sampling_params: SamplingParams | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        final_only: bool = False,
    ) -> None:
        """Queue a request; raise ValueError (and change nothing) when it is malformed or can never fit.

        Args:
          request_id: a unique id.
          prompt_token_ids: the prompt's token ids.
          sampling_params: how to sample; SamplingParams() when None.
          prompt: the prompt text, echoed in outputs.
          cache_salt: requests with different salts never share cached KV pages (tenant isolation).
          priority: lower runs first and is preempted last (as vLLM's); ties go by arrival.
          final_only: step() returns the request's output only once it has finished (vLLM's FINAL_ONLY output
            kind), for callers that read nothing before: no output is built for it at every step.
        """
        if request_id in self.outputs.groups or "#" in request_id:
            raise ValueError(
                f"request id {request_id!r} is already in use or contains '#' (reserved for the samples of n > 1); "
                "give each request a unique id without '#'"
            )
        sampling_params = sampling_params or SamplingParams()
        token_ids = check_request(
            request_id, prompt_token_ids, sampling_params, cache_salt, priority, self.loaded.config.vocab_size
        )
        request = Request(request_id, token_ids, sampling_params, cache_salt=cache_salt, priority=priority)
        self.scheduler.add_request(request)
        self.outputs.add(request, prompt, final_only=final_only)
        self.metrics.num_requests += 1

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the outputs of the requests that advanced (but a final_only request's only
        when it finished)."""
        start, quiet = time.monotonic(), self.runner.ahead.quiet_mark()
        # Chained decode passes (paxkv.scheduling.decode_chaining) give their tokens several at a time: only where no
        # caller reads outputs step by step, and never beside speculation, which has its own tokens per step.
        chain = self.drafter is None and not self.outputs.any_streaming()
        batch = self.scheduler.schedule(self.config.num_scheduler_steps if chain else 1)
        if batch.is_empty:
            return []
        self.outputs.adopt(batch.forked)
        self.outputs.scheduled(batch, start)
        peak_pages = self.scheduler.num_request_pages  # before finished requests free theirs
        sampled = self.runner.run(batch, self.outputs.seed_of)
        batch = sampled.batch  # as it ran: a draft model's drafts filled in
        # Each sequence's emitted candidates: its one sampled token, or its accepted drafts and one more.
        emitted = {
            sequence.request.request_id: sampled.emitted(index)
            for index, sequence in enumerate(batch.sequences)
            if sequence.completes_prompt
        }
        new_tokens = {request_id: [int(sampled.tokens[c]) for c in rows] for request_id, rows in emitted.items()}
        if self.drafter is not None:
            self._observe_step_cost(batch, time.monotonic() - start, self.runner.ahead.quiet_since(quiet))
        outcome = self.scheduler.update(batch, new_tokens)
        self.outputs.adopt(outcome.forked)
        taken = {request_id: emitted[request_id][:count] for request_id, count in outcome.num_taken.items()}
        outputs, finished = self.outputs.process(batch, sampled, taken, self.scheduler)
        num_generated = sum(int(sampled.tokens[c]) != NONFINITE_TOKEN for rows in taken.values() for c in rows)
        if self.drafter is not None:
            self.drafter.budget.observe_emitted(num_generated)
        num_computed = batch.num_batched_tokens - outcome.num_skipped_passes  # a stopped chained row's wrote no KV
        self.metrics.record_step(start, self.scheduler, num_computed, peak_pages, finished, num_generated)
        self.metrics.num_pages_swapped = self.runner.num_pages_swapped
        self.metrics.num_compilations = self.num_compilations
        return outputs

    def _draft_prefill_seconds_per_token(self) -> float:
        """A draft model's catch-up cost per token before one is measured: the target's prefill rate, scaled by the
        two models' parameter counts."""
        if self._draft_size_ratio is None:
            draft, target = (num_parameters(m.state) for m in (self.runner.draft.draft, self.loaded))
            self._draft_size_ratio = draft / target
        return self._draft_size_ratio / self.preemption.prefill_tokens_per_s

    def _observe_step_cost(self, batch: ScheduledBatch, seconds: float, alone: bool) -> None:
        """Give the draft budget the step's time: as a compile's where it compiled (what trying an unseen shape
        costs), else as its T and R's (per replica), unless a draft model first caught up over more tokens than
        the step runs (once a request: its prompt, the first time it drafts), which is no cost of the shape. Where a
        compile ran in the background meanwhile (`alone` False), the step shared the CPU with it: its time counts
        only for a shape not measured otherwise (DraftBudget.observe_step; as a plain sample, one such time once
        made plain steps look 10x dearer, so that a target-sized draft model drafted at 0.2x). The compiles
        finished in the background since the last step count as compiles too."""
        for compile_seconds in self.runner.ahead.take_compile_seconds():
            self.drafter.budget.observe_compile(compile_seconds)
        if self.runner.last_step_compiled:
            self.drafter.budget.observe_compile(seconds)
            return
        if self.runner.last_step_first_run:
            return  # a program compiled ahead, run for the first time: slower than it will be
        num_tokens = max(replica.num_batched_tokens for replica in batch.replica_batches)
        draft = self.runner.draft
        if draft is not None and draft.last_catch_up_tokens >= MIN_MEASURED_CATCH_UP and alone:
            self.drafter.budget.observe_catch_up(draft.last_catch_up_tokens, draft.last_fill_seconds)
        if draft is not None and draft.last_catch_up_tokens > num_tokens:
            return
        num_drafts = max(num_draft_rows(replica) for replica in batch.replica_batches)
        self.drafter.budget.observe_step(num_tokens, seconds, num_drafts, contended=not alone)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its output so far comes back with finish_reason "abort".

        Args:
          request_id: the id given to add_request.
        """
        group, unfinished = self.outputs.abort(request_id)
        if group is None:
            return None
        for sample_id in unfinished:
            self.scheduler.abort(sample_id)
        self.metrics.num_aborted_requests += 1
        self.metrics.observe(self.scheduler)
        return group.output()

    def withdraw(self, request_id: str) -> None:
        """Undo add_request for a request that has not been scheduled yet, leaving no trace in the metrics.

        Args:
          request_id: the id given to add_request.
        """
        self.outputs.withdraw(request_id)
        self.scheduler.abort(request_id)
        self.metrics.num_requests -= 1

    def warm_up(self) -> tuple[int, float]:
        """Compile the step programs of every (T, S) bucket now, before requests arrive (a server does this at
        start); (how many step shapes ran, seconds taken). With the persistent compilation cache, a later start
        loads them instead."""
        start = time.monotonic()
        num_shapes = self.runner.warm_up()
        self.metrics.num_compilations = self.num_compilations
        return num_shapes, time.monotonic() - start

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()
