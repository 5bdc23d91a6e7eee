"""Engine: requests in, one jitted step per call, outputs out; the caller drives the loop."""

import contextlib
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

import models
from models.paged_forward import bucket
from paxkv.aot import AbstractEngine, check_step_fits, compile_step, device_memory
from paxkv.config import EngineConfig
from paxkv.distributed import agree_across_processes, host_value
from paxkv.kv_cache import allocate_pool, kv_bytes_per_page, kv_bytes_per_token, kv_storage_dtype
from paxkv.mesh import engine_mesh, num_scale_groups
from paxkv.metrics import EngineMetrics
from paxkv.outputs import RequestMetrics, RequestOutput
from paxkv.preemption import PreemptionPolicy
from paxkv.request import Request
from paxkv.sampling_params import SamplingParams
from paxkv.scheduled_batch import ScheduledBatch
from paxkv.scheduler import Scheduler
from paxkv.step import (
    SampledTokens,
    StepBatch,
    copy_pages,
    engine_step,
    num_step_compilations,
    page_copy_arrays,
    static_graph,
)
from paxkv.step_arguments import build_step_batch
from paxkv.step_inputs import num_buckets
from paxkv.swap import HostSwapSpace
from paxkv.tracking import RequestGroup, SampleState, append_logprobs

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching over one page pool with a jitted ragged step."""

    def __init__(self, loaded: models.LoadedModel, config: EngineConfig | None = None):
        """Allocate the page pool and the scheduler for `loaded`.

        Args:
          loaded: a models.LoadedModel.
          config: pool size, budgets and context length.
        """
        self.loaded = loaded
        self.config = config = config or EngineConfig()
        model_config = loaded.config
        self.max_model_len = config.max_model_len or min(model_config.max_position_embeddings, 4096)
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context of "
                f"{model_config.max_position_embeddings}; lower max_model_len"
            )
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, jax.tree.leaves(loaded.state)[0].dtype)
        self.mesh = engine_mesh(loaded, config.mesh_shape)
        shape = (model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, kv_dtype, config.page_size)
        num_groups = num_scale_groups(model_config.num_kv_heads, self.mesh)
        bytes_per_page = kv_bytes_per_page(*shape, num_groups)
        num_pages = config.num_pages or config.kv_cache_memory_bytes // bytes_per_page
        preemption_mode = config.preemption_mode
        if jax.process_count() > 1:
            num_pages, preemption_mode = agree_across_processes(num_pages, preemption_mode)
        # Data parallelism splits the pool into equal partitions, one per replica, each with its null page.
        self.num_replicas = self.mesh.shape["data"] if self.mesh is not None else 1
        pages_per_replica = num_pages // self.num_replicas
        num_pages = pages_per_replica * self.num_replicas
        if pages_per_replica - 1 < config.max_num_seqs:
            source = (
                f"num_pages={config.num_pages}"
                if config.num_pages
                else (f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} ({num_pages} pages)")
            )
            per_replica = f" per data replica (of {self.num_replicas})" if self.num_replicas > 1 else ""
            raise ValueError(
                f"{source} leaves {max(pages_per_replica - 1, 0)} usable pages{per_replica} (page 0 is reserved), "
                f"too few to hold even one page for each of max_num_seqs={config.max_num_seqs} sequences; raise "
                "num_pages or kv_cache_memory_bytes, or lower max_num_seqs"
            )
        try:
            self.kv_caches = allocate_pool(model_config, num_pages, config.page_size, kv_dtype, self.mesh)
        except (RuntimeError, MemoryError) as e:  # XLA reports a failed allocation as a RuntimeError
            gib = num_pages * bytes_per_page / 2**30
            raise ValueError(
                f"cannot allocate the KV page pool ({num_pages} pages, {gib:.2f} GiB): {str(e)[:200]}; "
                "lower kv_cache_memory_bytes or num_pages"
            ) from None
        num_host_slots = config.swap_space_bytes // bytes_per_page if preemption_mode != "recompute" else 0
        if preemption_mode == "swap" and num_host_slots == 0:
            raise ValueError(
                f"preemption_mode='swap' needs a host pool of at least one page ({bytes_per_page} bytes), but "
                f"swap_space_bytes={config.swap_space_bytes}; raise swap_space_bytes or use 'auto' or 'recompute'"
            )
        self.swap_space = HostSwapSpace(self.kv_caches, num_host_slots) if num_host_slots else None
        self.preemption = PreemptionPolicy(preemption_mode, bytes_per_page, num_host_slots)
        self.scheduler = Scheduler(
            num_replicas=self.num_replicas,
            pages_per_replica=pages_per_replica,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_ids=loaded.generation_config.eos_token_ids,
            swap_slots=self.swap_space.slots if self.swap_space is not None else None,
            preemption=self.preemption,
            watermark_pages=int(config.watermark * (pages_per_replica - 1)),
        )
        self.pages_per_seq = -(-self.max_model_len // config.page_size)
        self._seed_source = np.random.default_rng(config.seed)
        # Each caller's request by its id, and each of its samples by scheduler request id.
        self._groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, SampleState] = {}
        self._graph = static_graph(loaded.graphdef)
        # (T bucket, S bucket, penalties?, suppress?, logprobs?): each distinct one is one step program.
        self.step_shapes: set[tuple[int, int, bool, bool, bool]] = set()
        self.metrics = EngineMetrics(num_total_pages=self.scheduler.num_total_pages, page_size=config.page_size)
        self.kv_cache_bytes = num_pages * bytes_per_page
        self.kv_bytes_per_token = kv_bytes_per_token(*shape, num_groups)
        self.kv_dtype = kv_dtype
        logger.info(
            "page pool: %d pages of %d tokens (page 0 of each of %d partitions reserved) = %d tokens of KV, %s, "
            "%d bytes per token, %.1f MiB",
            num_pages,
            config.page_size,
            self.num_replicas,
            self.scheduler.num_total_pages * config.page_size,
            kv_dtype.name,
            self.kv_bytes_per_token,
            self.kv_cache_bytes / 2**20,
        )
        self._check_largest_step_fits()

    def _check_largest_step_fits(self) -> None:
        """Where the device reports a memory limit (TPU, GPU), compile the largest step now and refuse to start when
        it cannot fit beside the weights and the pool, rather than fail at the first large batch."""
        memory = device_memory(self.mesh)
        if memory is None:
            return  # CPU: no limit to check against
        config, loaded = self.config, self.loaded
        state = AbstractEngine(
            loaded.graphdef,
            loaded.state,
            self.kv_caches,
            config.page_size,
            self.pages_per_seq,
            loaded.config.vocab_size,
            self.mesh,
        )
        num_tokens, num_seqs = bucket(config.max_num_batched_tokens), bucket(config.max_num_seqs)
        program = compile_step(state, num_tokens, num_seqs, with_logprobs=True, vocab_arrays=True)
        budgets = f"max_num_batched_tokens={config.max_num_batched_tokens}, max_num_seqs={config.max_num_seqs}"
        check_step_fits(program, *memory, what=budgets)
        logger.info(
            "the largest step (T=%d, S=%d) needs %.2f GiB beside its arguments; %.2f GiB of %.2f GiB are free",
            num_tokens,
            num_seqs,
            program.memory.beyond_arguments_bytes / 2**30,
            (memory[0] - memory[1]) / 2**30,
            memory[0] / 2**30,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids,
        sampling_params: SamplingParams | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; raise ValueError (and change nothing) when it is malformed or can never fit.

        Args:
          request_id: a unique id.
          prompt_token_ids: the prompt's token ids.
          sampling_params: how to sample; SamplingParams() when None.
          prompt: the prompt text, echoed in outputs.
          cache_salt: requests with different salts never share cached KV pages (tenant isolation).
          priority: lower runs first and is preempted last (as vLLM's); ties go by arrival.
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority must be an int, not {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"request {request_id!r}: cache_salt must be a string or None, not {cache_salt!r}")
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"request {request_id!r}: sampling_params must be a SamplingParams, not {sampling_params!r}"
            )
        try:
            prompt_token_ids = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a list of ints") from None
        vocab_size = self.loaded.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}; "
                "tokenize with this model's tokenizer"
            )
        bad_stops = [t for t in sampling_params.stop_token_ids if t >= vocab_size]
        if bad_stops:
            raise ValueError(
                f"request {request_id!r} has stop_token_ids outside the vocabulary [0, {vocab_size}): {bad_stops[:5]}"
            )
        if request_id in self._groups or "#" in request_id:
            raise ValueError(
                f"request id {request_id!r} is already in use or contains '#' (reserved for the samples of n > 1); "
                "give each request a unique id without '#'"
            )
        request = Request(request_id, prompt_token_ids, sampling_params, cache_salt=cache_salt, priority=priority)
        self.scheduler.add_request(request)
        # Sample i of n draws from seed + i: distinct streams, reproducible from the one seed.
        seed = sampling_params.seed if sampling_params.seed is not None else int(self._seed_source.integers(2**31))
        group = RequestGroup(
            request_id,
            prompt,
            list(prompt_token_ids),
            sampling_params.n,
            RequestMetrics(arrival_time=time.monotonic()),
        )
        self._groups[request_id] = group
        self._add_sample(group, request, seed)
        self.metrics.num_requests += 1

    def _add_sample(self, group: RequestGroup, request: Request, seed: int) -> None:
        """Track one sample of `group` (sample 0 at add_request, the others as the scheduler forks them)."""
        tokenizer = self.loaded.tokenizer
        sample = SampleState(request, seed, tokenizer.detokenizer() if tokenizer is not None else None)
        group.samples.append(sample)
        self._samples[request.request_id] = sample

    def _adopt_forks(self) -> None:
        """Start tracking the sibling samples the scheduler forked since the last call."""
        for request in self.scheduler.take_forked():
            group = self._groups[request.parent_request_id]
            self._add_sample(group, request, group.samples[0].seed + request.sample_index)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its output so far comes back with finish_reason "abort".

        Args:
          request_id: the id given to add_request.
        """
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for sample_id in group.unfinished_request_ids():
            self.scheduler.abort(sample_id)
            del self._samples[sample_id]
        group.num_samples = len(group.samples)  # samples a pending fork never made do not exist
        group.metrics.finished_time = time.monotonic()
        self.metrics.num_aborted_requests += 1
        self._refresh_pool_gauges()
        return group.output()

    def withdraw(self, request_id: str) -> None:
        """Undo add_request for a request that has not been scheduled yet, leaving no trace in the metrics.

        Args:
          request_id: the id given to add_request.
        """
        group = self._groups.get(request_id)
        if group is None or group.metrics.first_scheduled_time is not None:
            raise ValueError(f"request {request_id!r} cannot be withdrawn: it is unknown or has already run")
        self.scheduler.abort(request_id)
        del self._groups[request_id], self._samples[request_id]
        self.metrics.num_requests -= 1

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far (counted by the scheduler)."""
        return self.scheduler.num_preemptions

    @property
    def max_step_programs(self) -> int:
        """The most distinct step programs this engine can need: T buckets x S buckets x 8 optional parts."""
        config = self.config
        return num_buckets(config.max_num_batched_tokens) * num_buckets(config.max_num_seqs) * 8

    @property
    def num_compilations(self) -> int:
        """Distinct step programs compiled so far in this process."""
        return num_step_compilations()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the requests that advanced or finished."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        self._adopt_forks()
        pages_in_step = self._num_request_pages()  # before finished requests free theirs
        for sequence in batch.sequences:
            metrics = self._groups[sequence.request.group_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or start
        self._move_pages(batch)
        step_start = time.monotonic()
        sampled_tokens = self._run(batch)
        tokens = host_value(sampled_tokens.tokens)
        if batch.num_batched_tokens >= self.config.max_num_batched_tokens // 2:  # mostly prefill: a rate to plan by
            self.preemption.observe_prefill(batch.num_batched_tokens, time.monotonic() - step_start)
        sampled = {}
        for row, sequence in enumerate(batch.sequences):
            if sequence.completes_prompt:
                sampled[sequence.request.request_id] = int(tokens[row])
        self.scheduler.update(batch, sampled)
        self._adopt_forks()
        advanced: dict[str, RequestGroup] = {}  # in batch order
        now = time.monotonic()
        host_logprobs = None
        for row, sequence in enumerate(batch.sequences):
            request_id = sequence.request.request_id
            if request_id not in sampled:
                continue
            sample = self._samples[request_id]
            group = self._groups[sequence.request.group_id]
            group.metrics.first_token_time = group.metrics.first_token_time or now
            group.metrics.num_generated_tokens += 1
            if sample.request.sampling_params.logprobs is not None:
                host_logprobs = host_logprobs or jax.tree.map(host_value, sampled_tokens)
                append_logprobs(sample, host_logprobs, row, self.loaded.tokenizer)
            self._append_text(sample, sampled[request_id])
            if sample.request.is_finished:
                del self._samples[request_id]
            advanced[group.request_id] = group
        outputs = []
        for group in advanced.values():
            if group.finished:
                group.metrics.finished_time = now
                del self._groups[group.request_id]
                self.metrics.num_finished_requests += 1
                self.metrics.num_prompt_tokens += len(group.prompt_token_ids)
            outputs.append(group.output())
        self.metrics.num_generated_tokens += len(sampled)
        self.metrics.num_preemptions = self.scheduler.num_preemptions
        self.metrics.num_preemptions_recompute = self.scheduler.num_preemptions_by_kind["recompute"]
        self.metrics.num_preemptions_swap = self.scheduler.num_preemptions_by_kind["swap"]
        self.metrics.num_compilations = num_step_compilations()
        self._refresh_pool_gauges(start=start, num_tokens=batch.num_batched_tokens, peak=pages_in_step)
        return outputs

    def _num_request_pages(self) -> int:
        """Distinct pages running requests hold (a shared prefix page counts once)."""
        return len({(request.replica, page) for request in self.scheduler.running for page in request.block_table})

    def _refresh_pool_gauges(self, *, start: float | None = None, num_tokens: int = 0, peak: int = 0) -> None:
        """Update the pool gauges; with `start`, also account a step that began then and held `peak` pages."""
        used = self._num_request_pages()
        metrics = self.metrics
        # Every allocated page is held by a request, or else only by the prefix cache (idle).
        metrics.kv_pages_cached_idle = self.scheduler.num_used_pages - used
        metrics.prefix_query_tokens = self.scheduler.num_prefix_query_tokens
        metrics.prefix_hit_tokens = self.scheduler.num_prefix_hit_tokens
        if self.config.enable_prefix_caching:
            metrics.kv_pages_cached = self.scheduler.num_cached_pages
            metrics.prefix_evictions = self.scheduler.num_evictions
        if start is None:
            self.metrics.kv_pages_used = used
            return
        running = self.scheduler.running
        allocated = sum(len(request.block_table) for request in running) * self.config.page_size
        filled = sum(request.num_computed_tokens for request in running)
        self.metrics.record_step(start, num_tokens, used, allocated, filled, peak_kv_pages=peak)

    def step_batch(self, batch: ScheduledBatch) -> tuple[StepBatch, bool]:
        """The step's batch argument and logprobs flag for `batch` (see paxkv.step_arguments).

        Args:
          batch: a batch the scheduler returned.
        """
        return build_step_batch(
            batch,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            pages_per_seq=self.pages_per_seq,
            seed_of=lambda request_id: self._samples[request_id].seed,
            vocab_size=self.loaded.config.vocab_size,
            eos_token_ids=list(self.loaded.generation_config.eos_token_ids),
        )

    def _move_pages(self, batch: ScheduledBatch) -> None:
        """Before the step: pages out to the host (preemption by swap), back in (resumption), copies on write."""
        for moves, direction in ((batch.swap_out, "out"), (batch.swap_in, "in")):
            if not moves:
                continue
            moved, seconds = self.swap_space.bytes_moved, self.swap_space.seconds_moving
            first, second = (list(column) for column in zip(*moves, strict=True))
            if direction == "out":
                self.swap_space.swap_out(self.kv_caches, first, second)
            else:
                self.kv_caches = self.swap_space.swap_in(self.kv_caches, first, second)
            self.preemption.observe_transfer(
                self.swap_space.bytes_moved - moved, self.swap_space.seconds_moving - seconds
            )
            self.metrics.num_pages_swapped += len(moves)
        if batch.page_copies:
            self.kv_caches = copy_pages(self.kv_caches, *page_copy_arrays(batch.page_copies))

    def _run(self, batch: ScheduledBatch) -> SampledTokens:
        """Run the jitted step on `batch` (the pool is donated and replaced) and return its sampled tokens, one row
        per sequence of batch.sequences (the replicas' live rows in order)."""
        step_batch, with_logprobs = self.step_batch(batch)
        inputs = step_batch.inputs
        num_tokens, num_rows = inputs.tokens.shape[-1], inputs.logits_indices.shape[-1]
        shape = (num_tokens, num_rows, step_batch.token_counts is not None, step_batch.suppress is not None)
        self.step_shapes.add((*shape, with_logprobs))
        # Under the mesh, a Pallas kernel runs per model shard (models.sharding.attention_on_mesh).
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            sampled, self.kv_caches = engine_step(
                self._graph, self.loaded.state, self.kv_caches, step_batch, with_logprobs
            )
        # [D, S, ...] -> the live rows, replica by replica (still on the device: the caller fetches what it reads).
        rows = jnp.asarray(
            [replica * num_rows + row for replica, b in enumerate(batch.replica_batches) for row in range(b.num_seqs)]
        )
        return jax.tree.map(lambda leaf: leaf.reshape(leaf.shape[0] * leaf.shape[1], *leaf.shape[2:])[rows], sampled)

    def _append_text(self, tracked: SampleState, token_id: int) -> None:
        """Stream the token's text and end the request at the first stop string (which is cut off)."""
        request = tracked.request
        params = request.sampling_params
        is_stop_token = request.finish_reason == "stop" and (
            token_id in params.stop_token_ids or token_id in self.loaded.generation_config.eos_token_ids
        )
        if is_stop_token and token_id in params.stop_token_ids:
            tracked.stop_reason = token_id
        if tracked.detokenizer is None or is_stop_token:
            return  # no text without a tokenizer; the token that stopped generation is not part of the text
        tracked.text += tracked.detokenizer.step(token_id)
        if request.is_finished:
            tracked.text += tracked.detokenizer.flush()
        for stop in params.stop:
            index = tracked.text.find(stop)
            if index >= 0:
                tracked.text = tracked.text[:index]
                tracked.stop_reason = stop
                if request.is_finished:
                    request.finish_reason = "stop"  # the stop string came with the last token
                else:
                    self.scheduler.finish(request, "stop")
                break
