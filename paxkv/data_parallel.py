"""Data parallelism: one scheduler over D data replicas, each with its own partition of the page pool.

The pool's page axis is split on the mesh's "data" axis: replica r owns global pages [r * N, (r + 1) * N),
which it sees as local pages [0, N) (local page 0 is its null page). Each replica has its own page
allocator and prefix cache, so block tables and slots index within the replica's shard, and the step
runs every replica's ragged batch at once, each on its own devices (step.data_parallel_step).

Routing is decided once, at admission, and is deterministic: a request goes to the replica whose prefix
cache holds the longest prefix of its prompt (when prefix caching is on), else to the least loaded one,
else the lowest-numbered. It stays there, preemptions included, so every process of a multi-host run,
running this same code on the same requests, makes the same plan.
"""

import dataclasses
from collections.abc import Callable, Mapping

from paxkv.page_allocator import PageAllocator
from paxkv.prefix_trie import PrefixTrie
from paxkv.request import Request
from paxkv.scheduled_batch import ScheduledBatch, ScheduledSequence
from paxkv.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class DataParallelBatch:
    """One step over every replica: each replica's batch (local pages) and the page moves in global pages."""

    replica_batches: list[ScheduledBatch]
    pages_per_replica: int

    @property
    def sequences(self) -> list[ScheduledSequence]:
        """Every replica's sequences, replica 0's first; the engine's row order."""
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
    def preempted_request_ids(self) -> list[str]:
        """Requests preempted by recompute while building the batch, replica by replica."""
        return [request_id for batch in self.replica_batches for request_id in batch.preempted_request_ids]

    @property
    def page_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write page pairs, as global pages of the whole pool."""
        return self._global(lambda batch: batch.page_copies, (True, True))

    @property
    def swap_out(self) -> list[tuple[int, int]]:
        """(global device page, host slot) pairs to copy out before the step."""
        return self._global(lambda batch: batch.swap_out, (True, False))

    @property
    def swap_in(self) -> list[tuple[int, int]]:
        """(host slot, global device page) pairs to copy in before the step."""
        return self._global(lambda batch: batch.swap_in, (False, True))

    def _global(self, moves: Callable[[ScheduledBatch], list], is_page: tuple[bool, bool]) -> list[tuple[int, int]]:
        """A move list of every replica with its local pages turned into global ones (host slots are shared)."""
        result = []
        for replica, batch in enumerate(self.replica_batches):
            offset = replica * self.pages_per_replica
            for pair in moves(batch):
                result.append(
                    tuple(value + offset if page else value for value, page in zip(pair, is_page, strict=True))
                )
        return result


class DataParallelScheduler:
    """The single, deterministic scheduler of a data-parallel engine: it routes each request to one replica,
    whose own continuous-batching Scheduler plans its share of every step under per-replica budgets."""

    def __init__(
        self,
        make_replica: Callable[[PageAllocator, PrefixTrie | None], Scheduler],
        *,
        num_replicas: int,
        pages_per_replica: int,
        page_size: int,
        enable_prefix_caching: bool,
    ):
        """Creates one allocator, prefix cache and Scheduler per replica.

        Args:
          make_replica: builds a replica's Scheduler over its allocator and prefix cache (same budgets for all).
          num_replicas: D, the mesh's "data" size.
          pages_per_replica: N, pages in each replica's partition, its null page included.
          page_size: tokens per page.
          enable_prefix_caching: give each replica a prefix cache.
        """
        self.pages_per_replica = pages_per_replica
        self.page_size = page_size
        self.allocators = [PageAllocator(pages_per_replica) for _ in range(num_replicas)]
        self.prefix_tries = [
            PrefixTrie(allocator, page_size) if enable_prefix_caching else None for allocator in self.allocators
        ]
        self.replicas = [make_replica(a, t) for a, t in zip(self.allocators, self.prefix_tries, strict=True)]
        self._replica_of: dict[str, int] = {}  # unfinished request id (forked samples included) -> replica

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
    def num_prefix_query_tokens(self) -> int:
        """Prompt tokens looked up in the prefix caches."""
        return sum(replica.num_prefix_query_tokens for replica in self.replicas)

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Prompt tokens found there."""
        return sum(replica.num_prefix_hit_tokens for replica in self.replicas)

    def has_unfinished_requests(self) -> bool:
        """Whether any replica has a waiting or running request."""
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def add_request(self, request: Request) -> None:
        """Routes a fresh request to a replica and queues it there (ValueError, changing nothing, if it can never fit).

        Args:
          request: a fresh request, as Scheduler.add_request takes.
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

    def schedule(self) -> DataParallelBatch:
        """Every replica plans its share of the step."""
        batches = [replica.schedule() for replica in self.replicas]
        return DataParallelBatch(batches, self.pages_per_replica)

    def take_forked(self) -> list[Request]:
        """Sibling samples forked since the last call, on every replica (they stay on their parent's)."""
        forked = []
        for index, replica in enumerate(self.replicas):
            for request in replica.take_forked():
                request.replica = index
                self._replica_of[request.request_id] = index
                forked.append(request)
        return forked

    def update(self, batch: DataParallelBatch, sampled_tokens: Mapping[str, int]) -> list[Request]:
        """Records a finished step on every replica; returns the requests that finished, replica by replica.

        Args:
          batch: the batch schedule() returned last.
          sampled_tokens: request_id -> sampled token, as Scheduler.update.
        """
        finished = []
        for replica, replica_batch in zip(self.replicas, batch.replica_batches, strict=True):
            finished += replica.update(replica_batch, sampled_tokens)
        for request in finished:
            self._replica_of.pop(request.request_id, None)
        return finished

    def abort(self, request_id: str) -> Request | None:
        """Aborts a request on its replica (None if it is unknown or finished).

        Args:
          request_id: the id given at add_request (or a forked sample's).
        """
        replica = self._replica_of.pop(request_id, None)
        return None if replica is None else self.replicas[replica].abort(request_id)

    def finish(self, request: Request, finish_reason: str) -> None:
        """Finishes a request on its replica (see Scheduler.finish)."""
        self._replica_of.pop(request.request_id, None)
        self.replicas[request.replica].finish(request, finish_reason)

    def check_page_invariants(self) -> None:
        """Checks every replica's page accounting (see PageSharing.check_page_invariants)."""
        for replica in self.replicas:
            replica.check_page_invariants()


class PartitionedPages:
    """Totals over the replicas' allocators, read like one PageAllocator's counters."""

    def __init__(self, allocators: list[PageAllocator]):
        self.allocators = allocators

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
        """Allocated pages over all replicas."""
        return sum(allocator.num_used_pages for allocator in self.allocators)

    def check_invariants(self) -> None:
        """Checks every replica's allocator."""
        for allocator in self.allocators:
            allocator.check_invariants()
