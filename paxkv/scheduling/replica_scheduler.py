"""Continuous batching in one page partition: chunked prefill and decodes under token and sequence budgets."""

import bisect
import collections
import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

from paxkv.scheduling.decode_chaining import PLACEHOLDER_TOKEN, most_passes
from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.page_sharing import PrefixSharing, SampleForks, check_page_invariants
from paxkv.scheduling.preemption import PreemptionPolicy
from paxkv.scheduling.prefix_trie import PrefixTrie
from paxkv.scheduling.request import Request, RequestStatus
from paxkv.scheduling.request_checks import check_fits_replica, check_positive_integers
from paxkv.scheduling.request_pages import RequestPages
from paxkv.scheduling.scheduled_batch import ReplicaBatch, ScheduledSequence, StepOutcome
from paxkv.scheduling.step_fitting import fit_to_step_size
from paxkv.scheduling.stopping import append_tokens
from paxkv.scheduling.swap_slots import HostSlotAllocator

logger = logging.getLogger(__name__)


def _run_order(request: Request) -> tuple[int, int]:
    """Running requests go by priority, then arrival: the last one is the first victim."""
    return request.priority, request.arrival_index


class ReplicaScheduler:
    """FIFO continuous batching over one replica's pages: running requests first, then waiting ones, preempting the
    newest when out of pages. paxkv.scheduling.scheduler.Scheduler routes requests to one of these per data replica."""

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        prefix_trie: PrefixTrie | None = None,
        swap_slots: HostSlotAllocator | None = None,
        preemption: PreemptionPolicy | None = None,
        watermark_pages: int = 0,
        drafter=None,
        step_sizes: Sequence[int] = (),
    ):
        """Args:
        allocator: the page pool, which this scheduler hands out; its only user.
        page_size: tokens per page.
        max_num_seqs: the most sequences in one step (and running at once).
        max_num_batched_tokens: the most new tokens in one step, prefill chunks and decodes together.
        max_model_len: the most tokens (prompt plus output) one request may reach.
        eos_token_ids: tokens that stop a request unless its sampling params say ignore_eos.
        prefix_trie: a prefix cache over the same allocator, or None for no caching.
        swap_slots: the host pool's free list, or None for no swapping.
        preemption: chooses recompute or swap per victim; None means recompute.
        watermark_pages: pages admission leaves free (while anything runs), against immediate preemption.
        drafter: proposes speculative drafts for decoding requests (paxkv.speculation.drafter), or None.
        step_sizes: the token counts the model runner pads a step to, ascending; with them, a step whose prefill
          chunks would pad it far up to the next size is trimmed to the size below (step_fitting.fit_to_step_size).
        """
        check_positive_integers(
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(token_id) for token_id in eos_token_ids)
        # Every waiting request arrived after every running one: admission is FIFO and the newest running is
        # preempted to the front of the queue. So both lists stay in arrival order.
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_preemptions_by_kind = {"recompute": 0, "swap": 0}
        self.prefix_trie = prefix_trie
        self.swap_slots = swap_slots
        self.preemption = preemption
        self.watermark_pages = watermark_pages
        self.drafter = drafter
        self.step_sizes = sorted(step_sizes)
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._slots_to_free: list[int] = []
        # Prompt tokens looked up in the prefix cache at first admission, and those found there.
        # Recomputation after a preemption is neither (vllm #25780: it would inflate the hit rate).
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._num_arrivals = 0
        self._unfinished: dict[str, Request] = {}
        self.prefix_sharing = PrefixSharing(allocator, prefix_trie, page_size)
        self.forks = SampleForks(allocator, page_size)
        # Samples forked while the current schedule() or update() runs; returned with its result.
        self._forked: list[Request] = []
        self.pages = RequestPages(allocator, self.forks, page_size)

    @property
    def num_waiting(self) -> int:
        """The number of requests queued for admission, preempted ones included."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """The number of requests holding pages."""
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Returns whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Queues a request, or raises ValueError (leaving the scheduler unchanged) if it can never fit.

        Args:
          request: a fresh request: WAITING, no output, no pages; its request_id unique among unfinished ones.
        """
        if request.request_id in self._unfinished:
            raise ValueError(f"request_id {request.request_id!r} is already queued or running; use a unique id")
        if request.status is not RequestStatus.WAITING or request.block_table or request.num_computed_tokens:
            raise ValueError(
                f"request {request.request_id!r} is not fresh (status {request.status.name}); make a new one"
            )
        check_fits_replica(
            request, self.page_size, self.max_model_len, self.allocator.num_total_pages, self.max_num_seqs
        )
        request.fork_pending = request.sampling_params.n > 1
        request.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self._unfinished[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> ReplicaBatch:
        """Picks this step's sequences and tokens, allocating their pages and preempting when the pool runs dry."""
        token_budget = self.max_num_batched_tokens
        sequences: list[ScheduledSequence] = []
        preempted: list[str] = []
        self.pages.page_copies, self._swap_out, self._swap_in, self._forked = [], [], [], []

        # Running requests, oldest first: each continues its prefill or decodes one token.
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_uncomputed_tokens, token_budget)
            assert num_new_tokens > 0, f"request {request.request_id!r} has nothing to compute; call update first"
            while not self._ensure_pages(request, num_new_tokens):
                victim = self.running[-1]
                if victim is request and index == 0:
                    raise RuntimeError(
                        f"request {request.request_id!r} cannot get pages even alone in the pool; "
                        "add_request should have rejected it"
                    )
                self.preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            sequences.append(self.pages.grow(request, num_new_tokens))
            token_budget -= num_new_tokens
            index += 1

        # Waiting requests in FIFO order; the first that does not fit blocks the rest, so none overtakes another.
        # After a preemption the pool is tight: admitting now would only start a request to preempt it again.
        while self.waiting and token_budget > 0 and not preempted:
            request = self.waiting[0]
            if self.forks.seats_taken(self.running) + self.forks.seats(request) > self.max_num_seqs:
                break
            swapped = bool(request.swapped_slots)
            num_matched_tokens = 0 if swapped else self.prefix_sharing.match(request)
            if not swapped and self.prefix_sharing.next_page_in_flight(request, self.running):
                # A running request is computing this request's next page right now: wait a step and share it
                # from the cache instead of computing a duplicate (FIFO: the requests behind wait too).
                self.pages.free(request)
                break
            fork_now = self.forks.ready(request)
            request.fork_pending = request.fork_pending and not fork_now
            num_new_tokens = min(request.num_uncomputed_tokens, token_budget)
            reserve = self.watermark_pages if self.running else 0
            if not self._ensure_pages(request, num_new_tokens, reserve):
                if not swapped:
                    self.pages.free(request)  # give back the matched pages; the match is retried next step
                request.fork_pending = request.fork_pending or fork_now
                break
            if self.prefix_trie is not None and request.num_preemptions == 0:
                self.num_prefix_query_tokens += request.num_prompt_tokens
                self.num_prefix_hit_tokens += num_matched_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_run_order)
            if swapped:
                self._swap_back_in(request)
            if fork_now:
                self._fork(request)  # the siblings compute the last prompt token next step
            sequences.append(self.pages.grow(request, num_new_tokens))
            token_budget -= num_new_tokens

        if self.drafter is not None and token_budget > 0:
            token_budget -= self._add_drafts(sequences, token_budget)
        num_batched_tokens = self.max_num_batched_tokens - token_budget
        num_batched_tokens -= fit_to_step_size(sequences, num_batched_tokens, self.step_sizes, self.pages)
        return ReplicaBatch(
            sequences=sequences,
            num_batched_tokens=num_batched_tokens,
            preempted_request_ids=preempted,
            page_copies=self.pages.page_copies,
            swap_out=self._swap_out,
            swap_in=self._swap_in,
            forked=self._forked,
        )

    def update(self, batch: ReplicaBatch, sampled_tokens: Mapping[str, int | Sequence[int]]) -> StepOutcome:
        """Records a finished step: advances each sequence, appends sampled tokens, finishes and frees requests.

        A sequence with drafts keeps the KV of the ones accepted; the pages holding only rejected ones go back to
        the pool now, and the prefix cache is offered only pages of verified tokens. Its tokens are appended one
        by one, and the first that stops it drops the rest. Stop strings need detokenized text: the output
        processor finds them and stop_at_string records them.

        Args:
          batch: the batch returned by the last schedule().
          sampled_tokens: request_id to the token sampled after its chunk, for each sequence that completes_prompt;
            for a sequence with drafts, the accepted drafts followed by the token sampled after them.
        Returns:
          The requests that finished in this step, in batch order, the samples forked (they run from the next
          step on), and how many of its tokens each request took.
        """
        # The step has copied the swapped-in pages to the device: their host slots are free again.
        if self._slots_to_free:
            self.swap_slots.free(self._slots_to_free)
            self._slots_to_free = []
        finished, self._forked, num_taken, num_skipped = [], [], {}, 0
        for sequence in batch.sequences:
            request = sequence.request
            if request.status is not RequestStatus.RUNNING:
                continue  # Aborted (or preempted by a later schedule) since this batch was built.
            tokens = sequence.tokens_given(sampled_tokens)
            num_rejected = sequence.num_draft_tokens - (len(tokens) - 1 if tokens else 0)
            request.num_computed_tokens += sequence.num_new_tokens - num_rejected
            speculated = sequence.num_draft_tokens and self.drafter is not None  # not a chained step's placeholders
            if speculated and self.drafter.config.method == "draft_model":
                # The draft ran over every token of this request before its drafts (caught up), and its KV of the
                # accepted drafts holds: it now covers what the target's does.
                previous, request.num_draft_computed = request.num_draft_computed, request.num_computed_tokens
                self.prefix_sharing.note_draft_kv(request, previous)
            if sequence.num_draft_tokens:
                self.pages.roll_back(request)
            if speculated:
                self.drafter.observe_verified(request, sequence.num_draft_tokens, len(tokens) - 1)
            finish_reason = None
            if tokens:  # the sequence completed its prompt
                num_taken[request.request_id], finish_reason = append_tokens(
                    request, tokens, self.eos_token_ids, self.max_model_len
                )
                if sequence.num_draft_tokens and not speculated:
                    # A chained row stops on the device at the token that stops it here: its later passes wrote no
                    # KV, so they are not computed tokens (nor, once full, cacheable pages).
                    skipped = len(tokens) - num_taken[request.request_id]
                    request.num_computed_tokens -= skipped
                    num_skipped += skipped
            self.prefix_sharing.cache_full_pages(request)
            if self.forks.ready(request):
                request.fork_pending = False
                self._fork(request)
            if finish_reason is not None:
                self.finish(request, finish_reason)
                finished.append(request)
        return StepOutcome(finished, self._forked, num_taken, num_skipped)

    def abort(self, request_id: str) -> Request | None:
        """Finishes a waiting or running request with "abort" and frees its pages; unknown or finished ids are ignored.

        Args:
          request_id: the id given at add_request.
        Returns:
          The aborted request, or None if no unfinished request has this id.
        """
        request = self._unfinished.get(request_id)
        if request is None:
            return None
        self.finish(request, "abort")
        return request

    def finish(self, request: Request, finish_reason: str) -> None:
        """Marks an unfinished request finished, frees its pages and drops it from the queues.

        Args:
          request: a waiting or running request of this scheduler.
          finish_reason: "stop", "length", "abort" or "error".
        """
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            raise ValueError(f"request {request.request_id!r} has already finished ({request.finish_reason})")
        self.pages.free(request)
        if request.swapped_slots:
            self.swap_slots.free(request.swapped_slots)
            request.swapped_slots = []
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = finish_reason
        del self._unfinished[request.request_id]

    def stop_at_string(self, request: Request, stop: str, num_output_tokens: int | None = None) -> None:
        """Records that a stop string ended the request: finishes it with "stop", or, when its last token already
        finished it (by length), makes that the reason.

        Args:
          request: a request of this scheduler whose text now contains `stop`.
          stop: the stop string found.
          num_output_tokens: the tokens up to the one that completed the string, where the step appended more
            (accepted drafts after it); the later ones are dropped.
        """
        if num_output_tokens is not None:
            del request.output_token_ids[num_output_tokens:]
        if not request.is_finished:
            self.finish(request, "stop")
        request.finish_reason, request.stop_reason = "stop", stop

    def preempt(self, request: Request) -> None:
        """Takes a running request's pages and requeues it at the front, by recompute or by swap.

        Recompute frees the pages; its tokens are computed again on resume (the prefix cache may give some
        back). Swap copies the pages to host slots (before the next step's writes), frees them, and keeps
        the computed tokens; on resume they are copied into whatever pages are free then.

        Args:
          request: a running request; the scheduler picks the lowest-priority, newest one.
        """
        self.running.remove(request)
        kind = "recompute"
        if self.preemption is not None and self.swap_slots is not None:
            kind = self.preemption.choose(
                self.prefix_sharing.tokens_to_recompute(request),
                len(request.block_table),
                self.swap_slots.num_free_slots,
            )
        num_tokens, num_pages = request.num_computed_tokens, len(request.block_table)
        if kind == "swap":
            slots = self.swap_slots.allocate(num_pages)
            self._swap_out += zip(request.block_table, slots, strict=True)
            self.allocator.free(request.block_table)
            request.block_table = []
            request.swapped_slots = slots
        else:
            self.pages.free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_kind[kind] += 1
        self.waiting.appendleft(request)
        counts = (num_tokens, num_pages, request.num_preemptions, self.num_preemptions)
        logger.info("preempted request %r by %s (%d computed tokens, %d pages; preemption %d of this request, "
                    "%d in all)", request.request_id, kind, *counts)  # fmt: skip

    def _ensure_pages(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Whether the pool has the pages a request lacks for `num_new_tokens` more tokens (and a copy of a shared
        page it writes into) with `reserve` pages to spare, evicting idle cached pages, least recently used
        first, only when the free list alone falls short."""
        num_pages = self.pages.num_pages_to_grow(request, num_new_tokens)
        if self.allocator.can_allocate(num_pages + reserve):
            return True
        if self.prefix_trie is not None:
            self.prefix_trie.evict(num_pages + reserve - self.allocator.num_free_pages)
        return self.allocator.can_allocate(num_pages + reserve)

    def chain_decodes(self, batch: ReplicaBatch, max_steps: int) -> ReplicaBatch:
        """Re-plan a step of decodes (decode_chaining.can_chain) as up to max_steps chained decode passes: each
        sequence takes as many as its request allows (decode_chaining.most_passes) and its pages hold, and takes more
        pages (evicting idle cached ones, as a plain decode would) only while the watermark's stay free; it never
        preempts, and keeps at least the one pass it had.

        Args:
          batch: the step schedule() just planned, every sequence a decode.
          max_steps: the chain's length, num_scheduler_steps.
        """
        sequences, num_tokens = [], 0
        for sequence in batch.sequences:
            request = sequence.request
            count = most_passes(request, max_steps, self.max_model_len) - 1
            while count and (
                self.pages.num_new_pages(request, 1 + count)
                and not self._ensure_pages(request, 1 + count, self.watermark_pages)
            ):
                count -= 1
            if count:
                sequence = self.pages.grow(request, 1 + count, [PLACEHOLDER_TOKEN] * count)
            sequences.append(sequence)
            num_tokens += sequence.num_new_tokens
        if num_tokens == len(sequences):
            return batch  # no sequence could take a second pass: a plain step
        return dataclasses.replace(batch, sequences=sequences, num_batched_tokens=num_tokens, decode_steps=max_steps)

    def _add_drafts(self, sequences: list[ScheduledSequence], token_budget: int) -> int:
        """Give the decoding sequences the drafts the drafter approves, within the token budget and the free pages
        above the watermark (speculation never preempts or evicts); return how many.

        Args:
          sequences: this step's sequences, re-planned in place.
          token_budget: tokens the step may still take.
        """
        num_tokens = self.max_num_batched_tokens - token_budget
        added = 0
        chosen = self.drafter.choose(sequences, num_tokens, token_budget, self.max_model_len, not self.waiting)
        for index, drafts in chosen:
            request = sequences[index].request
            count = len(drafts)
            while count and not self.allocator.can_allocate(
                self.pages.num_new_pages(request, 1 + count) + self.watermark_pages
            ):
                count -= 1
            if count:
                sequences[index] = self.pages.grow(request, 1 + count, drafts[:count])
                added += count
        return added

    def _fork(self, request: Request) -> None:
        """Start samples 1..n-1 of a running request (SampleForks.fork); they are returned with this call's result."""
        for sibling in self.forks.fork(request, self.running):
            self._unfinished[sibling.request_id] = sibling
            self._forked.append(sibling)

    def _swap_back_in(self, request: Request) -> None:
        """Give a swapped-out request fresh pages and schedule its host slots' copy into them."""
        slots, request.swapped_slots = request.swapped_slots, []
        pages = self.allocator.allocate(len(slots))
        self._swap_in += zip(slots, pages, strict=True)
        self._slots_to_free += slots
        request.block_table = pages

    def check_page_invariants(self) -> None:
        """Raises AssertionError unless this replica's page accounting holds (page_sharing.check_page_invariants)."""
        check_page_invariants(self.allocator, self.running, self.waiting, self.prefix_trie)
