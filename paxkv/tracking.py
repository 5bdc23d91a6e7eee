"""Engine-side state of each request: its samples' seeds, streamed text and logprobs, and the outputs they make."""

import dataclasses

from paxkv.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paxkv.request import Request


class SampleState:
    """One sample (one scheduler Request) of a caller's request: its seed, streamed text and logprobs."""

    def __init__(self, request: Request, seed: int, detokenizer):
        self.request = request
        self.seed = seed
        self.detokenizer = detokenizer
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.stop_reason: str | int | None = None

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
            stop_reason=self.stop_reason,
        )


@dataclasses.dataclass
class RequestGroup:
    """A caller's request: n samples (sample 0 carries the caller's id; the others appear when it forks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_samples: int
    metrics: RequestMetrics
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


def append_logprobs(sample: SampleState, sampled, row: int, tokenizer) -> None:
    """Record the sampled token's log-probability and the requested top-k at this position.

    Args:
      sample: the sample that advanced.
      sampled: the step's SampledTokens, on the host.
      row: the sample's row in the step.
      tokenizer: the model's tokenizer (for decoded_token), or None.
    """
    token_id = int(sampled.tokens[row])
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
