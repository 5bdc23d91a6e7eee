"""OutputProcessor: the callers' side of each step: samples' seeds, streamed text and logprobs, RequestOutputs.

It turns sampled tokens into text and output records, and finds stop strings in that text; what stops a
request is decided and recorded by the scheduler alone (paxkv.scheduling.stopping has the rules).
"""

import dataclasses
import time

import numpy as np

from paxkv.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paxkv.scheduling.request import Request
from paxkv.scheduling.scheduled_batch import ScheduledBatch
from paxkv.scheduling.scheduler import SchedulerInterface
from paxkv.scheduling.stopping import NONFINITE_TOKEN, ended_by_stop_token, find_stop_string


class SampleState:
    """One sample (one scheduler Request) of a caller's request: its seed, streamed text and logprobs."""

    def __init__(self, request: Request, seed: int, detokenizer):
        self.request = request
        self.seed = seed
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0

    def completion(self) -> CompletionOutput:
        """This sample's CompletionOutput so far."""
        request = self.request
        with_logprobs = request.sampling_params.logprobs is not None
        return CompletionOutput(
            index=request.sample_index,
            text=self.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=list(self.logprobs) if with_logprobs else None,
            cumulative_logprob=self.cumulative_logprob if with_logprobs else None,
            stop_reason=request.stop_reason,
        )


@dataclasses.dataclass
class RequestGroup:
    """A caller's request: n samples (sample 0 carries the caller's id; the others appear when it forks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_samples: int
    metrics: RequestMetrics
    final_only: bool = False  # steps make its output only once it has finished
    samples: list[SampleState] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Whether every sample exists and has finished."""
        return len(self.samples) == self.num_samples and all(s.request.is_finished for s in self.samples)

    def unfinished_request_ids(self) -> list[str]:
        """Scheduler ids of the samples still waiting or running."""
        return [s.request.request_id for s in self.samples if not s.request.is_finished]

    def output(self) -> RequestOutput:
        """The request's RequestOutput: one CompletionOutput per sample, in sample order."""
        samples = sorted(self.samples, key=lambda s: s.request.sample_index)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[sample.completion() for sample in samples],
            finished=self.finished,
            metrics=self.metrics,
        )


class OutputProcessor:
    """Tracks every caller's request through its samples and makes its RequestOutput after each step."""

    def __init__(self, tokenizer, eos_token_ids, seed: int):
        """Args:
        tokenizer: the model's tokenizer, or None (outputs then carry token ids and no text).
        eos_token_ids: the model's end-of-sequence tokens (left out of the text).
        seed: draws the seeds of requests that give none.
        """
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._seed_source = np.random.default_rng(seed)
        self.groups: dict[str, RequestGroup] = {}  # by the caller's id
        self.samples: dict[str, SampleState] = {}  # by scheduler request id

    def add(self, request: Request, prompt: str | None, final_only: bool = False) -> None:
        """Track a caller's request (its sample 0); sample i of n draws from seed + i.

        Args:
          request: the scheduler's request, just added.
          prompt: the prompt text, echoed in outputs.
          final_only: process() makes the request's output only once it has finished.
        """
        params = request.sampling_params
        seed = params.seed if params.seed is not None else int(self._seed_source.integers(2**31))
        metrics = RequestMetrics(arrival_time=time.monotonic())
        group = RequestGroup(request.request_id, prompt, list(request.prompt_token_ids), params.n, metrics, final_only)
        self.groups[request.request_id] = group
        self._add_sample(group, request, seed)

    def adopt(self, forked: list[Request]) -> None:
        """Track samples the scheduler forked (sample i of its parent's request)."""
        for request in forked:
            group = self.groups[request.parent_request_id]
            self._add_sample(group, request, group.samples[0].seed + request.sample_index)

    def _add_sample(self, group: RequestGroup, request: Request, seed: int) -> None:
        detokenizer = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        sample = SampleState(request, seed, detokenizer)
        group.samples.append(sample)
        self.samples[request.request_id] = sample

    def any_streaming(self) -> bool:
        """Whether a caller reads some unfinished request's outputs as they come (a request not final_only)."""
        return not all(group.final_only for group in self.groups.values())

    def seed_of(self, request_id: str) -> int:
        """The seed of a sample, by its scheduler request id."""
        return self.samples[request_id].seed

    def scheduled(self, batch: ScheduledBatch, now: float) -> None:
        """Record when each request of the batch was first scheduled."""
        for sequence in batch.sequences:
            metrics = self.groups[sequence.request.group_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now

    def process(
        self, batch: ScheduledBatch, sampled, taken: dict[str, list[int]], scheduler: SchedulerInterface
    ) -> tuple[list[RequestOutput], list[RequestGroup]]:
        """Stream the step's tokens into text and logprobs, report stop strings to the scheduler, and make the
        outputs of the requests that advanced (a final_only one's once it finished); return them and the groups that
        finished.

        Args:
          batch: the step's batch.
          sampled: the step's sampled tokens (ModelRunner.run's LiveRows), indexed by candidate.
          taken: request id -> the candidates of the tokens appended to it, in order (the sequences that completed
            their prompt; more than one where drafts were accepted).
          scheduler: records stop strings (stop_at_string).
        """
        advanced: dict[str, RequestGroup] = {}  # in batch order
        now = time.monotonic()
        for sequence in batch.sequences:
            request = sequence.request
            if request.request_id not in taken:
                continue
            sample = self.samples[request.request_id]
            group = self.groups[request.group_id]
            candidates = taken[request.request_id]
            # The tokens before this step's, so a stop string in the text can cut the tokens after it.
            num_before = request.num_output_tokens - sum(int(sampled.tokens[c]) != NONFINITE_TOKEN for c in candidates)
            for position, candidate in enumerate(candidates):
                token_id = int(sampled.tokens[candidate])
                if token_id == NONFINITE_TOKEN:  # it finished with "error", and no token
                    if sample.detokenizer is not None:
                        sample.text += sample.detokenizer.flush()
                    break
                group.metrics.first_token_time = group.metrics.first_token_time or now
                group.metrics.num_generated_tokens += 1
                if request.sampling_params.logprobs is not None:
                    self._append_logprobs(sample, sampled, candidate)
                last = position == len(candidates) - 1
                if self._append_text(sample, token_id, scheduler, num_before + position + 1, last):
                    break
            if request.is_finished:
                del self.samples[request.request_id]
            advanced[group.request_id] = group
        finished = [group for group in advanced.values() if group.finished]
        for group in finished:
            group.metrics.finished_time = now
            del self.groups[group.request_id]
        # An output copies the request's prompt and tokens: 0.17 ms a step for 32 requests of 128 + 128 tokens, about
        # 2% of the random 20M Llama's step, built for LLM.generate to drop.
        outputs = [group.output() for group in advanced.values() if group.finished or not group.final_only]
        return outputs, finished

    def _append_text(
        self, sample: SampleState, token_id: int, scheduler: SchedulerInterface, num_tokens: int, last: bool
    ) -> bool:
        """Stream the token's text; at the first stop string, cut the text there, tell the scheduler (which drops
        any later tokens of the step), and return True.

        Args:
          sample: the sample.
          token_id: its next token.
          scheduler: records the stop string.
          num_tokens: the sample's output tokens up to this one.
          last: whether it is the sample's last token of the step (after which a finished sample's text ends).
        """
        request = sample.request
        if sample.detokenizer is None or (last and ended_by_stop_token(request, token_id, self.eos_token_ids)):
            return False  # no text without a tokenizer; the token that stopped generation is not part of the text
        sample.text += sample.detokenizer.step(token_id)
        if last and request.is_finished:
            sample.text += sample.detokenizer.flush()
        found = find_stop_string(sample.text, request.sampling_params.stop)
        if found is None:
            return False
        index, stop = found
        sample.text = sample.text[:index]
        scheduler.stop_at_string(request, stop, num_tokens if not last else None)
        return True

    def _append_logprobs(self, sample: SampleState, sampled, row: int) -> None:
        """Record the sampled token's log-probability and the requested top-k at this position."""
        token_id = int(sampled.tokens[row])
        tokenizer = self.tokenizer
        decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
        entry = {}
        num_top = sample.request.sampling_params.logprobs
        top_ids, top_values = sampled.top_ids[row, :num_top], sampled.top_logprobs[row, :num_top]
        for rank, (top_id, top_value) in enumerate(zip(top_ids, top_values, strict=True), start=1):
            entry[int(top_id)] = Logprob(float(top_value), rank, decode(int(top_id)))
        token_logprob = float(sampled.logprobs[row])
        entry.setdefault(token_id, Logprob(token_logprob, int(sampled.ranks[row]), decode(token_id)))
        sample.logprobs.append(entry)
        sample.cumulative_logprob += token_logprob

    def abort(self, request_id: str) -> tuple[RequestGroup | None, list[str]]:
        """Stop tracking a caller's request; return it and the scheduler ids of its unfinished samples."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None, []
        unfinished = group.unfinished_request_ids()
        for sample_id in unfinished:
            del self.samples[sample_id]
        group.num_samples = len(group.samples)  # samples a pending fork never made do not exist
        group.metrics.finished_time = time.monotonic()
        return group, unfinished

    def withdraw(self, request_id: str) -> None:
        """Forget a request that never ran (ValueError if it is unknown or has run)."""
        group = self.groups.get(request_id)
        if group is None or group.metrics.first_scheduled_time is not None:
            raise ValueError(f"request {request_id!r} cannot be withdrawn: it is unknown or has already run")
        del self.groups[request_id], self.samples[request_id]
