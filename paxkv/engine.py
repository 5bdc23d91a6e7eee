"""Engine: requests in, one jitted step per call, outputs out; the caller drives the loop."""

import logging
import time

import jax.numpy as jnp
import numpy as np

import models
from paxkv.config import EngineConfig
from paxkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paxkv.page_allocator import PageAllocator
from paxkv.request import Request
from paxkv.sampler import SamplingArrays
from paxkv.sampling_params import SamplingParams
from paxkv.scheduler import ScheduledBatch, Scheduler
from paxkv.step import engine_step, num_step_compilations
from paxkv.step_inputs import StepInputs

logger = logging.getLogger(__name__)


class _Tracked:
    """Engine-side state of one request: its seed, streamed text and metrics."""

    def __init__(self, request: Request, prompt: str | None, seed: int, detokenizer):
        self.request = request
        self.prompt = prompt
        self.seed = seed
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[float] = []
        self.metrics = RequestMetrics(arrival_time=time.monotonic())


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
        kv_dtype = jnp.float32
        bytes_per_token = 2 * model_config.num_kv_heads * model_config.head_dim * 4 * model_config.num_layers
        num_pages = config.num_pages or max(2, config.kv_cache_memory_bytes // (bytes_per_token * config.page_size))
        self.allocator = PageAllocator(num_pages)
        self.scheduler = Scheduler(
            self.allocator,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=loaded.generation_config.eos_token_ids,
        )
        self.kv_caches = models.allocate_kv_caches(model_config, num_pages, config.page_size, kv_dtype)
        self.pages_per_seq = -(-self.max_model_len // config.page_size)
        self._seed_source = np.random.default_rng(config.seed)
        self._tracked: dict[str, _Tracked] = {}
        logger.info(
            "page pool: %d pages of %d tokens = %d tokens, %d bytes per token",
            num_pages,
            config.page_size,
            (num_pages - 1) * config.page_size,
            bytes_per_token,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids,
        sampling_params: SamplingParams | None = None,
        prompt: str | None = None,
    ) -> None:
        """Queue a request; raise ValueError (and change nothing) when it is malformed or can never fit.

        Args:
          request_id: a unique id.
          prompt_token_ids: the prompt's token ids.
          sampling_params: how to sample; SamplingParams() when None.
          prompt: the prompt text, echoed in outputs.
        """
        sampling_params = sampling_params or SamplingParams()
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        vocab_size = self.loaded.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}; "
                "tokenize with this model's tokenizer"
            )
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id")
        request = Request(request_id, prompt_token_ids, sampling_params)
        self.scheduler.add_request(request)
        seed = sampling_params.seed if sampling_params.seed is not None else int(self._seed_source.integers(2**31))
        tokenizer = self.loaded.tokenizer
        detokenizer = tokenizer.detokenizer() if tokenizer is not None else None
        self._tracked[request_id] = _Tracked(request, prompt, seed, detokenizer)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its output so far comes back with finish_reason "abort".

        Args:
          request_id: the id given to add_request.
        """
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._output(self._tracked.pop(request_id))

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far (counted by the scheduler)."""
        return self.scheduler.num_preemptions

    @property
    def num_compilations(self) -> int:
        """Distinct step programs compiled so far in this process."""
        return num_step_compilations()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the requests that advanced or finished."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        tokens, logprobs = self._run(batch)
        sampled = {}
        for row, sequence in enumerate(batch.sequences):
            if sequence.completes_prompt:
                sampled[sequence.request.request_id] = int(tokens[row])
        self.scheduler.update(batch, sampled)
        outputs = []
        now = time.monotonic()
        for row, sequence in enumerate(batch.sequences):
            request_id = sequence.request.request_id
            if request_id not in sampled:
                continue
            tracked = self._tracked[request_id]
            tracked.metrics.first_token_time = tracked.metrics.first_token_time or now
            tracked.logprobs.append(float(logprobs[row]))
            self._append_text(tracked, sampled[request_id])
            if tracked.request.is_finished:
                tracked.metrics.finished_time = now
                del self._tracked[request_id]
            outputs.append(self._output(tracked))
        return outputs

    def _run(self, batch: ScheduledBatch) -> tuple[np.ndarray, np.ndarray]:
        """Build the padded inputs, run the jitted step, and fetch the sampled tokens."""
        inputs = StepInputs.from_batch(
            batch,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            pages_per_seq=self.pages_per_seq,
        )
        rows = batch.sequences
        num_rows = inputs.logits_indices.shape[0]
        sampling = SamplingArrays.from_params(
            [s.request.sampling_params for s in rows],
            positions=[s.kv_len for s in rows],
            seeds=[self._tracked[s.request.request_id].seed for s in rows],
            batch_size=num_rows,
        )
        token_counts, prompt_mask, suppress = self._vocab_arrays(batch, num_rows)
        tokens, logprobs, self.kv_caches = engine_step(
            self.loaded.graphdef,
            self.loaded.state,
            self.kv_caches,
            inputs,
            sampling,
            token_counts,
            prompt_mask,
            suppress,
        )
        return np.asarray(tokens), np.asarray(logprobs)

    def _vocab_arrays(self, batch: ScheduledBatch, num_rows: int):
        """Per-row vocabulary arrays for penalties and min_tokens, built only when some row needs them."""
        vocab_size = self.loaded.config.vocab_size
        rows = batch.sequences
        params = [s.request.sampling_params for s in rows]
        token_counts = prompt_mask = suppress = None
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            token_counts = np.zeros((num_rows, vocab_size), np.int32)
            prompt_mask = np.zeros((num_rows, vocab_size), bool)
            for row, sequence in enumerate(rows):
                np.add.at(token_counts[row], sequence.request.output_token_ids, 1)
                prompt_mask[row, sequence.request.prompt_token_ids] = True
        eos_ids = list(self.loaded.generation_config.eos_token_ids)
        needs_suppress = [s.request.num_output_tokens < s.request.sampling_params.min_tokens for s in rows]
        if any(needs_suppress):
            suppress = np.zeros((num_rows, vocab_size), bool)
            for row, sequence in enumerate(rows):
                if needs_suppress[row]:
                    params_row = sequence.request.sampling_params
                    stop_ids = list(params_row.stop_token_ids) + ([] if params_row.ignore_eos else eos_ids)
                    suppress[row, stop_ids] = True
        return token_counts, prompt_mask, suppress

    def _append_text(self, tracked: _Tracked, token_id: int) -> None:
        """Stream the token's text and end the request at the first stop string (which is cut off)."""
        if tracked.detokenizer is None:
            return
        request = tracked.request
        params = request.sampling_params
        is_stop_token = request.finish_reason == "stop" and (
            token_id in params.stop_token_ids or token_id in self.loaded.generation_config.eos_token_ids
        )
        if is_stop_token:
            return  # the token that stopped generation is not part of the text
        tracked.text += tracked.detokenizer.step(token_id)
        if request.is_finished:
            tracked.text += tracked.detokenizer.flush()
        for stop in params.stop:
            index = tracked.text.find(stop)
            if index >= 0:
                tracked.text = tracked.text[:index]
                if request.is_finished:
                    request.finish_reason = "stop"  # the stop string came with the last token
                else:
                    self.scheduler.finish(request, "stop")
                break

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        completion = CompletionOutput(
            index=0,
            text=tracked.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=list(tracked.logprobs) if request.sampling_params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion],
            finished=request.is_finished,
            metrics=tracked.metrics,
        )
