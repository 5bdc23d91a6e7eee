"""What one engine step runs: the scheduled sequences, and the page moves to do before it."""

import dataclasses

from paxkv.request import Request


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: the tokens whose KV it computes now, and where that KV goes."""

    request: Request
    token_ids: list[int]  # [num_new_tokens]
    positions: list[int]  # [num_new_tokens], contiguous from the request's num_computed_tokens before the step
    slots: list[int]  # [num_new_tokens], page * page_size + offset
    block_table: list[int]  # [num_pages], a copy: the pages the sequence reads, covering kv_len tokens
    kv_len: int  # tokens in the pages after this step: num_computed_tokens + num_new_tokens
    # Whether this chunk reaches the last known token, so the step samples one token after it (decodes always do).
    completes_prompt: bool

    @property
    def num_new_tokens(self) -> int:
        """The number of tokens computed for this sequence in this step."""
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One engine step: sequences in row order (running ones oldest first, then newly admitted ones) and totals."""

    sequences: list[ScheduledSequence]
    num_batched_tokens: int
    # Requests preempted by recompute while building this batch, newest first.
    preempted_request_ids: list[str]
    # (source, destination) pages to copy on the device before the step: copy-on-write of a shared partial
    # page that a sample is about to write into.
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # (device page, host slot) to copy out before the step (preemption by swap), and (host slot, device page)
    # to copy in (resumption), both before the step's own writes.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        """The number of sequences in the batch."""
        return len(self.sequences)

    @property
    def is_empty(self) -> bool:
        """Whether nothing was scheduled."""
        return not self.sequences
