"""What the engine returns: RequestOutput with one CompletionOutput per sample, and timing metrics."""

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running, then "stop", "length" or "abort"
    logprobs: list[float] | None = None  # log-probability of each generated token, when asked for


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) and derived rates of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after a step: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
