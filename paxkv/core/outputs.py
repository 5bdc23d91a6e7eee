"""What the engine returns: RequestOutput with one CompletionOutput per sample, and timing metrics."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """The log-probability of one token under the model's raw distribution, its rank and its text."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running, then "stop", "length" or "abort"
    # When SamplingParams.logprobs = k: per generated token, {token_id: Logprob} for the k most likely tokens
    # plus the sampled one.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' log-probabilities, with logprobs
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of one request and the times and rates derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until the request was first scheduled."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second after the first one, until the request finished (None before two tokens)."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        elapsed = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / elapsed if elapsed > 0 else None

    def as_dict(self) -> dict:
        """The timestamps' derived values, for JSON."""
        return {
            "queue_time_s": self.queue_time,
            "time_to_first_token_s": self.time_to_first_token,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "num_generated_tokens": self.num_generated_tokens,
        }


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after a step: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
