"""RequestPages: the pages one replica's requests hold, as the scheduler grows, rolls back and frees them."""

from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.page_sharing import SampleForks
from paxkv.scheduling.request import Request
from paxkv.scheduling.scheduled_batch import ScheduledSequence


class RequestPages:
    """Page mechanics for a ReplicaScheduler, which decides who gets pages: a request's next tokens laid out in its
    pages (copying a shared partial page before it is written), pages past rejected drafts given back, and a
    request's pages freed. Collects the step's copy-on-write pairs."""

    def __init__(self, allocator: PageAllocator, forks: SampleForks, page_size: int):
        self.allocator = allocator
        self.forks = forks
        self.page_size = page_size
        self.page_copies: list[tuple[int, int]] = []  # (source, destination) of this step, before it runs

    def num_new_pages(self, request: Request, num_new_tokens: int) -> int:
        """The pages a request lacks to hold its computed tokens plus `num_new_tokens`."""
        num_pages = Request.num_pages_needed(self.page_size, request.num_computed_tokens + num_new_tokens)
        return max(num_pages - len(request.block_table), 0)

    def num_pages_to_grow(self, request: Request, num_new_tokens: int) -> int:
        """The pages grow() takes for `num_new_tokens`: the lacking ones and a copy of a shared page it writes into."""
        return self.num_new_pages(request, num_new_tokens) + (self.forks.shared_write_page(request) is not None)

    def grow(self, request: Request, num_new_tokens: int, drafts: list[int] = ()) -> ScheduledSequence:
        """Allocates the pages for a request's next `num_new_tokens` tokens (the last len(drafts) of them drafts past
        its last token) and describes them as one sequence; growing a sequence already planned this step re-plans it.

        Args:
          request: a running request.
          num_new_tokens: tokens it computes this step, drafts included.
          drafts: speculative tokens after its last known one.
        """
        shared = self.forks.shared_write_page(request)
        if shared is not None:  # copy on write: the sample takes its own copy of the partial page
            source = request.block_table[shared]
            (copy,) = self.allocator.allocate(1)
            self.page_copies.append((source, copy))
            request.block_table[shared] = copy
            self.allocator.free([source])
        request.block_table.extend(self.allocator.allocate(self.num_new_pages(request, num_new_tokens)))
        start = request.num_computed_tokens
        positions = list(range(start, start + num_new_tokens))
        slots = [request.block_table[p // self.page_size] * self.page_size + p % self.page_size for p in positions]
        num_known = num_new_tokens - len(drafts)
        return ScheduledSequence(
            request=request,
            token_ids=request.all_token_ids[start : start + num_known] + list(drafts),
            positions=positions,
            slots=slots,
            block_table=list(request.block_table),
            kv_len=start + num_new_tokens,
            completes_prompt=start + num_known == request.num_tokens,
            num_draft_tokens=len(drafts),
        )

    def shrink(self, sequence: ScheduledSequence, num_new_tokens: int) -> ScheduledSequence:
        """Re-plan a prefill chunk planned this step to its first `num_new_tokens` tokens, giving back the pages only
        the rest would have filled (they are allocated again when the rest is scheduled).

        Args:
          sequence: a sequence grow() planned this step, without drafts.
          num_new_tokens: tokens it keeps, at least 1.
        """
        request = sequence.request
        self.roll_back(request, request.num_computed_tokens + num_new_tokens)
        return self.grow(request, num_new_tokens)

    def roll_back(self, request: Request, num_tokens: int | None = None) -> None:
        """Give back the pages past a request's first `num_tokens` (by default its computed tokens: after a step, the
        pages past them hold only rejected drafts)."""
        num_tokens = request.num_computed_tokens if num_tokens is None else num_tokens
        num_pages = Request.num_pages_needed(self.page_size, num_tokens)
        if len(request.block_table) > num_pages:
            self.allocator.free(request.block_table[num_pages:])
            del request.block_table[num_pages:]

    def free(self, request: Request) -> None:
        """Returns a request's pages to the pool and resets its progress through the KV cache."""
        self.allocator.free(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.num_draft_computed = 0
        request.num_cached_pages = 0
