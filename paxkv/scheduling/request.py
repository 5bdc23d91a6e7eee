"""Host state of one request: its tokens, sampling params, status, block table and progress through the KV cache."""

import dataclasses
import enum
import time

from pallas_kernels import pages_for
from paxkv.scheduling.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


class RequestStatus(enum.Enum):
    """Where a request is: queued for pages, holding pages and being stepped, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One request's host state; the scheduler owns every field after add_request.

    The KV of all_token_ids[:num_computed_tokens] lies in the pages of block_table. The last output token is
    appended before its KV is computed, so a decoding request has exactly one uncomputed token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    # What stopped it, as vLLM reports it: the stop token of stop_token_ids, or the stop string; None otherwise.
    stop_reason: int | str | None = None
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    # A speculative draft model's KV lies in the same pages for all_token_ids[:num_draft_computed] only: the draft
    # runs over a request's tokens lazily, catching up when the request next drafts (DraftModelProposer); a prefix
    # hit reaches as far as the matched pages that the draft's KV filled (PrefixSharing.note_draft_kv).
    num_draft_computed: int = 0
    # Set by Scheduler.add_request; the scheduler orders and preempts by it, never by arrival_time.
    arrival_index: int = -1
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    num_preemptions: int = 0
    # Requests with different salts never share cached pages (tenant isolation).
    cache_salt: str | None = None
    # Leading pages of block_table already offered to the prefix cache (matched there or inserted).
    num_cached_pages: int = 0
    # Parallel sampling (n > 1): the request computes its prompt but the last token, then forks into
    # n samples sharing those pages; sample i > 0 is a sibling request "{parent}#{i}".
    fork_pending: bool = False
    parent_request_id: str | None = None
    sample_index: int = 0
    # Lower values run first and are preempted last (as vLLM's priority); ties go by arrival.
    priority: int = 0
    # Host swap slots holding this request's pages while it is preempted by swap (its computed tokens kept).
    swapped_slots: list[int] = dataclasses.field(default_factory=list)
    # The data replica whose pages the request holds (data parallelism; 0 otherwise). Set at admission.
    replica: int = 0

    def __post_init__(self):
        """Copy the prompt into a list of ints so callers' lists are never shared."""
        self.prompt_token_ids = [int(token_id) for token_id in self.prompt_token_ids]

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt followed by the output tokens so far."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """The number of prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """The number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """The number of tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """The tokens to compute now: the rest of the prompt (but its last token while a fork is pending), or 1
        when decoding."""
        return self.num_tokens - int(self.fork_pending) - self.num_computed_tokens

    @property
    def group_id(self) -> str:
        """The id the caller gave: the parent's for every sample of a parallel-sampling request."""
        return self.parent_request_id or self.request_id

    @property
    def is_finished(self) -> bool:
        """Whether the request has finished, for any reason."""
        return self.status is RequestStatus.FINISHED

    @staticmethod
    def num_pages_needed(page_size: int, num_tokens: int) -> int:
        """Returns how many pages hold `num_tokens` tokens (pallas_kernels.pages_for).

        Args:
          page_size: tokens per page; positive.
          num_tokens: tokens to hold; not negative.
        """
        return pages_for(num_tokens, page_size)
