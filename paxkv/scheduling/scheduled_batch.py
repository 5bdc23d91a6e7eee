"""What one engine step runs: each replica's scheduled sequences, and the page moves to do before it."""

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from paxkv.scheduling.request import Request


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
    # Tokens at the end of token_ids past the request's last token: speculative drafts this step verifies, or, in a
    # chained step (ReplicaBatch.decode_steps > 1), placeholders for the step's own samples (decode_chaining).
    num_draft_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        """The number of tokens computed for this sequence in this step."""
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        """The drafts this step verifies (the end of token_ids)."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]

    def tokens_given(self, sampled_tokens: Mapping[str, int | Sequence[int]]) -> list[int]:
        """The tokens a step gave this sequence (none unless it completes its prompt), checked against its drafts.

        Args:
          sampled_tokens: request id -> its sampled token, or its accepted drafts followed by one more token.
        """
        request_id = self.request.request_id
        if not self.completes_prompt:
            return []
        if request_id not in sampled_tokens:
            raise ValueError(
                f"no sampled token for request {request_id!r}, whose chunk completes its prompt; "
                "pass one for every sequence with completes_prompt"
            )
        given = sampled_tokens[request_id]
        tokens = [int(t) for t in given] if isinstance(given, Sequence) else [int(given)]
        drafts, num_accepted = self.draft_token_ids, len(tokens) - 1
        if not 0 <= num_accepted <= self.num_draft_tokens or tokens[:num_accepted] != drafts[:num_accepted]:
            raise ValueError(
                f"request {request_id!r} was given tokens {tokens} for drafts {drafts}; give its accepted drafts "
                "(a prefix of them) and one token after them"
            )
        return tokens


@dataclasses.dataclass(frozen=True)
class ReplicaBatch:
    """One replica's share of a step: sequences in row order (running ones oldest first, then newly admitted
    ones), totals, and page moves in the replica's own (local) pages."""

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
    # Samples forked at admission while building this batch (n > 1); they run from the next step on.
    forked: list[Request] = dataclasses.field(default_factory=list)
    # Chained decode passes (paxkv.scheduling.decode_chaining): above 1, every sequence decodes, 1 + its
    # num_draft_tokens passes, its drafts the placeholders of its own samples.
    decode_steps: int = 1

    @property
    def num_seqs(self) -> int:
        """The number of sequences in the batch."""
        return len(self.sequences)

    @property
    def is_empty(self) -> bool:
        """Whether nothing was scheduled."""
        return not self.sequences


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One engine step over D >= 1 data replicas: each replica's batch (local pages), and the page moves in
    global pages of the whole pool (replica r's local page p is global page r * pages_per_replica + p)."""

    replica_batches: list[ReplicaBatch]
    pages_per_replica: int

    @property
    def sequences(self) -> list[ScheduledSequence]:
        """Every replica's sequences, replica 0's first: the step's row order."""
        return [sequence for batch in self.replica_batches for sequence in batch.sequences]

    @property
    def num_seqs(self) -> int:
        """The number of sequences over all replicas."""
        return sum(batch.num_seqs for batch in self.replica_batches)

    @property
    def num_batched_tokens(self) -> int:
        """New tokens over all replicas."""
        return sum(batch.num_batched_tokens for batch in self.replica_batches)

    @property
    def is_empty(self) -> bool:
        """Whether no replica scheduled anything."""
        return all(batch.is_empty for batch in self.replica_batches)

    @property
    def decode_steps(self) -> int:
        """The chained decode passes the step runs (1: a plain step; decode_chaining)."""
        return max(batch.decode_steps for batch in self.replica_batches)

    @property
    def preempted_request_ids(self) -> list[str]:
        """Requests preempted by recompute while building the batch, replica by replica."""
        return [request_id for batch in self.replica_batches for request_id in batch.preempted_request_ids]

    @property
    def forked(self) -> list[Request]:
        """Samples forked while building the batch, replica by replica."""
        return [request for batch in self.replica_batches for request in batch.forked]

    @property
    def page_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write page pairs, as global pages."""
        return self._global(lambda batch: batch.page_copies, (True, True))

    @property
    def swap_out(self) -> list[tuple[int, int]]:
        """(global device page, host slot) pairs to copy out before the step."""
        return self._global(lambda batch: batch.swap_out, (True, False))

    @property
    def swap_in(self) -> list[tuple[int, int]]:
        """(host slot, global device page) pairs to copy in before the step."""
        return self._global(lambda batch: batch.swap_in, (False, True))

    def _global(self, moves: Callable[[ReplicaBatch], list], is_page: tuple[bool, bool]) -> list[tuple[int, int]]:
        """A move list of every replica with its local pages turned into global ones (host slots are shared)."""
        result = []
        for replica, batch in enumerate(self.replica_batches):
            offset = replica * self.pages_per_replica
            for pair in moves(batch):
                result.append(
                    tuple(value + offset if page else value for value, page in zip(pair, is_page, strict=True))
                )
        return result


@dataclasses.dataclass(frozen=True)
class SpeculatingStep:
    """A step being planned with drafts, as the drafter asks whether its programs are compiled (before padding)."""

    num_tokens: int  # its tokens, drafts included
    num_seqs: int  # its sequence rows
    prefills: bool  # some row runs more than one token besides its drafts
    num_drafts: int
    with_logprobs: bool  # some row asks for logprobs
    greedy_only: bool  # every row is greedy
    draft_spans: tuple[int, ...] = ()  # per drafting row, the tokens a draft model runs for it (its catch-up + 1)


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What recording a step's tokens changed: the requests that finished, the samples forked (n > 1), which run
    from the next step on, how many of its tokens each request took (fewer than given where one stopped it), and
    the chained passes that computed nothing (each row's after the token that stopped it)."""

    finished: list[Request]
    forked: list[Request]
    num_taken: dict[str, int] = dataclasses.field(default_factory=dict)
    num_skipped_passes: int = 0
