"""The engine's scheduler: D >= 1 data replicas, each with its own partition of the page pool.

One replica is the normal case of D. The pool's page axis is split on the mesh's "data" axis (D = 1: not
split): replica r owns global pages [r * N, (r + 1) * N), which it sees as local pages [0, N) (local page 0
is its null page). Each replica has its own page allocator, prefix cache and ReplicaScheduler, so block
tables and slots index within the replica's partition, and the step runs every replica's ragged batch at
once, each on its own devices (execution.step.run_step).

Routing is decided once, at admission, and is deterministic: a request goes to the replica whose prefix
cache holds the longest prefix of its prompt (when prefix caching is on), else to the least loaded one,
else the lowest-numbered. It stays there, preemptions included, so every process of a multi-host run,
running this same code on the same requests, makes the same plan.
"""

from collections.abc import Mapping, Sequence
from typing import Protocol

from paxkv.scheduling.decode_chaining import can_chain
from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.preemption import PreemptionPolicy
from paxkv.scheduling.prefix_trie import PrefixTrie
from paxkv.scheduling.replica_scheduler import ReplicaScheduler
from paxkv.scheduling.request import Request
from paxkv.scheduling.scheduled_batch import ScheduledBatch, StepOutcome
from paxkv.scheduling.swap_slots import HostSlotAllocator


class SchedulerInterface(Protocol):
    """What the engine asks of a scheduler: requests in, one batch per step, the step's tokens back."""

    def add_request(self, request: Request) -> None: ...
    def schedule(self, max_decode_steps: int = 1) -> ScheduledBatch: ...
    def update(self, batch: ScheduledBatch, sampled_tokens: Mapping[str, int | Sequence[int]]) -> StepOutcome: ...
    def abort(self, request_id: str) -> Request | None: ...
    def finish(self, request: Request, finish_reason: str) -> None: ...
    def stop_at_string(self, request: Request, stop: str, num_output_tokens: int | None = None) -> None: ...
    def has_unfinished_requests(self) -> bool: ...


class Scheduler:
    """The single, deterministic scheduler of an engine: it routes each request to one of D >= 1 replicas, whose
    own continuous-batching ReplicaScheduler plans its share of every step under per-replica budgets."""

    def __init__(
        self,
        *,
        num_replicas: int,
        pages_per_replica: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        eos_token_ids=(),
        swap_slots: HostSlotAllocator | None = None,
        preemption: PreemptionPolicy | None = None,
        watermark_pages: int = 0,
        drafter=None,
        step_sizes=(),
    ):
        """Creates one allocator, prefix cache and ReplicaScheduler per replica.

        Args:
          num_replicas: D, the mesh's "data" size (1 without data parallelism).
          pages_per_replica: N, pages in each replica's partition, its null page included.
          page_size: tokens per page.
          max_num_seqs, max_num_batched_tokens: per-replica budgets of one step.
          max_model_len: the most tokens one request may reach.
          enable_prefix_caching: give each replica a prefix cache.
          eos_token_ids: tokens that stop a request unless its sampling params say ignore_eos.
          swap_slots: the host swap pool's free list (shared by every replica), or None for no swapping.
          preemption: chooses recompute or swap per victim; None means recompute.
          watermark_pages: pages each replica's admission leaves free.
          drafter: a paxkv.speculation.drafter.Drafter shared by the replicas, or None for no speculation.
          step_sizes: the token counts the model runner pads a step to (ReplicaScheduler's).
        """
        self.pages_per_replica = pages_per_replica
        self.page_size = page_size
        self.allocators = [PageAllocator(pages_per_replica) for _ in range(num_replicas)]
        self.prefix_tries = [
            PrefixTrie(allocator, page_size) if enable_prefix_caching else None for allocator in self.allocators
        ]
        self.replicas = [
            ReplicaScheduler(
                allocator,
                page_size=page_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                eos_token_ids=eos_token_ids,
                prefix_trie=trie,
                swap_slots=swap_slots,
                preemption=preemption,
                watermark_pages=watermark_pages,
                drafter=drafter,
                step_sizes=step_sizes,
            )
            for allocator, trie in zip(self.allocators, self.prefix_tries, strict=True)
        ]
        self._replica_of: dict[str, int] = {}  # unfinished request id (forked samples included) -> replica
        self.drafter = drafter

    @property
    def num_replicas(self) -> int:
        """D."""
        return len(self.replicas)

    @property
    def running(self) -> list[Request]:
        """Running requests, replica by replica."""
        return [request for replica in self.replicas for request in replica.running]

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests, replica by replica."""
        return [request for replica in self.replicas for request in replica.waiting]

    @property
    def num_preemptions(self) -> int:
        """Preemptions over all replicas."""
        return sum(replica.num_preemptions for replica in self.replicas)

    @property
    def num_preemptions_by_kind(self) -> dict[str, int]:
        """Preemptions by kind ("recompute", "swap") over all replicas."""
        return {kind: sum(r.num_preemptions_by_kind[kind] for r in self.replicas) for kind in ("recompute", "swap")}

    @property
    def speculation_counts(self) -> dict:
        """The drafter's counts over all replicas (Drafter.counts); empty without speculation."""
        return {} if self.drafter is None else self.drafter.counts()

    @property
    def num_prefix_query_tokens(self) -> int:
        """Prompt tokens looked up in the prefix caches."""
        return sum(replica.num_prefix_query_tokens for replica in self.replicas)

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Prompt tokens found there."""
        return sum(replica.num_prefix_hit_tokens for replica in self.replicas)

    @property
    def num_total_pages(self) -> int:
        """Usable pages over all replicas (each replica's null page left out)."""
        return sum(allocator.num_total_pages for allocator in self.allocators)

    @property
    def num_free_pages(self) -> int:
        """Free pages over all replicas."""
        return sum(allocator.num_free_pages for allocator in self.allocators)

    @property
    def num_used_pages(self) -> int:
        """Allocated pages over all replicas (held by requests or only by a prefix cache)."""
        return sum(allocator.num_used_pages for allocator in self.allocators)

    @property
    def num_request_pages(self) -> int:
        """Distinct pages running requests hold (a shared prefix page counts once), counted replica by replica."""
        # set.union fills each replica's set in C: a set of (replica, page) tuples built in Python took 2.4 ms of
        # every step at 64 requests of 1800 tokens, and the engine counts twice a step.
        return sum(len(set().union(*(r.block_table for r in replica.running))) for replica in self.replicas)

    @property
    def kv_slots(self) -> tuple[int, int]:
        """(token slots in the running requests' pages, slots of them holding a computed token)."""
        running = self.running
        allocated = sum(len(request.block_table) for request in running) * self.page_size
        return allocated, sum(request.num_computed_tokens for request in running)

    @property
    def num_cached_pages(self) -> int:
        """Pages the prefix caches hold."""
        return sum(trie.num_cached_pages for trie in self.prefix_tries if trie is not None)

    @property
    def num_evictions(self) -> int:
        """Cached pages evicted so far."""
        return sum(trie.num_evictions for trie in self.prefix_tries if trie is not None)

    def has_unfinished_requests(self) -> bool:
        """Whether any replica has a waiting or running request."""
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def add_request(self, request: Request) -> None:
        """Routes a fresh request to a replica and queues it there (ValueError, changing nothing, if it can never fit).

        Args:
          request: a fresh request, as ReplicaScheduler.add_request takes.
        """
        replica = self.route(request)
        self.replicas[replica].add_request(request)
        request.replica = replica
        self._replica_of[request.request_id] = replica

    def route(self, request: Request) -> int:
        """The replica a request goes to: longest cached prefix, then least load (pages it will need), then index.

        Args:
          request: the request to place.
        """

        def preference(replica: int) -> tuple[int, int, int]:
            trie = self.prefix_tries[replica]
            matched = len(trie.match(request.all_token_ids, request.cache_salt, touch=False)) if trie else 0
            return -matched, self._load(replica), replica

        return min(range(self.num_replicas), key=preference)

    def _load(self, replica: int) -> int:
        """Pages a replica's unfinished requests need at their longest (prompt plus max_tokens)."""
        scheduler = self.replicas[replica]
        return sum(
            Request.num_pages_needed(self.page_size, r.num_prompt_tokens + r.sampling_params.max_tokens)
            * (r.sampling_params.n if r.fork_pending else 1)
            for r in (*scheduler.running, *scheduler.waiting)
        )

    def schedule(self, max_decode_steps: int = 1) -> ScheduledBatch:
        """Every replica plans its share of the step (samples forked at admission come back in batch.forked).

        Args:
          max_decode_steps: where every replica's step only decodes (decode_chaining.can_chain), run up to this many
            chained decode passes in it (1: one token per sequence, always).
        """
        batches = [replica.schedule() for replica in self.replicas]
        if (
            max_decode_steps > 1
            and any(batch.sequences for batch in batches)
            and all(can_chain(b, r.num_waiting) for b, r in zip(batches, self.replicas, strict=True))
        ):
            batches = [r.chain_decodes(b, max_decode_steps) for b, r in zip(batches, self.replicas, strict=True)]
        batch = ScheduledBatch(batches, self.pages_per_replica)
        self._track(batch.forked)
        return batch

    def update(self, batch: ScheduledBatch, sampled_tokens: Mapping[str, int | Sequence[int]]) -> StepOutcome:
        """Records a finished step on every replica: the requests that finished and the samples forked, replica by
        replica, how many of its tokens each request took, and the chained passes that computed nothing.

        Args:
          batch: the batch schedule() returned last.
          sampled_tokens: request_id -> its token (or its accepted drafts and one more), as ReplicaScheduler.update.
        """
        finished, forked, num_taken, num_skipped = [], [], {}, 0
        for replica, replica_batch in zip(self.replicas, batch.replica_batches, strict=True):
            outcome = replica.update(replica_batch, sampled_tokens)
            finished += outcome.finished
            forked += outcome.forked
            num_taken.update(outcome.num_taken)
            num_skipped += outcome.num_skipped_passes
        for request in finished:
            self._replica_of.pop(request.request_id, None)
        self._track(forked)
        return StepOutcome(finished, forked, num_taken, num_skipped)

    def _track(self, forked: list[Request]) -> None:
        """Samples stay on their parent's replica."""
        for request in forked:
            self._replica_of[request.request_id] = request.replica

    def abort(self, request_id: str) -> Request | None:
        """Aborts a request on its replica (None if it is unknown or finished).

        Args:
          request_id: the id given at add_request (or a forked sample's).
        """
        replica = self._replica_of.pop(request_id, None)
        return None if replica is None else self.replicas[replica].abort(request_id)

    def finish(self, request: Request, finish_reason: str) -> None:
        """Finishes a request on its replica (see ReplicaScheduler.finish)."""
        self._replica_of.pop(request.request_id, None)
        self.replicas[request.replica].finish(request, finish_reason)

    def stop_at_string(self, request: Request, stop: str, num_output_tokens: int | None = None) -> None:
        """Records that a stop string ended a request, on its replica (see ReplicaScheduler.stop_at_string)."""
        self._replica_of.pop(request.request_id, None)
        self.replicas[request.replica].stop_at_string(request, stop, num_output_tokens)

    def check_page_invariants(self) -> None:
        """Checks every replica's page accounting (see PageSharing.check_page_invariants)."""
        for replica in self.replicas:
            replica.check_page_invariants()
