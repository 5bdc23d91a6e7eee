"""Pages shared between requests: the prefix cache's side of scheduling, parallel-sampling forks with
copy-on-write, and the page accounting every scheduler keeps.

Two collaborators of a ReplicaScheduler, each over its replica's allocator: PrefixSharing matches new
requests against the prefix trie and offers it filled pages; SampleForks turns a request with n > 1 into n
samples sharing its prompt's pages. check_page_invariants states what the sharing must preserve.
"""

import collections

from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.prefix_trie import PrefixTrie
from paxkv.scheduling.request import Request, RequestStatus


class PrefixSharing:
    """Prefix caching for one replica: requests start on their longest cached prefix, filled pages are offered to
    the trie, and a page another request is computing right now is waited for rather than computed twice.
    Without a trie every method does nothing."""

    def __init__(self, allocator: PageAllocator, prefix_trie: PrefixTrie | None, page_size: int):
        self.allocator = allocator
        self.prefix_trie = prefix_trie
        self.page_size = page_size
        # page -> its allocation generation when a speculative draft model's KV filled it, so that a prefix hit
        # on it reuses the draft's KV too (Request.num_draft_computed).
        self._draft_filled: dict[int, int] = {}

    def match(self, request: Request) -> int:
        """Start a request with no pages on its longest cached prefix (shared by incref); return its tokens."""
        if self.prefix_trie is None or request.block_table:
            return 0
        pages = self.prefix_trie.match(request.all_token_ids, request.cache_salt)
        self.allocator.incref(pages)
        request.block_table = list(pages)
        request.num_cached_pages = len(pages)
        request.num_computed_tokens = len(pages) * self.page_size
        num_draft_pages = 0
        for page in pages:
            if self._draft_filled.get(page) != self.allocator.generation(page):
                break
            num_draft_pages += 1
        request.num_draft_computed = num_draft_pages * self.page_size
        return request.num_computed_tokens

    def note_draft_kv(self, request: Request, previous: int) -> None:
        """Record the pages that a draft model's KV of the request filled since it reached `previous` tokens."""
        if self.prefix_trie is None:
            return
        for page in request.block_table[previous // self.page_size : request.num_draft_computed // self.page_size]:
            self._draft_filled[page] = self.allocator.generation(page)

    def next_page_in_flight(self, request: Request, running: list[Request]) -> bool:
        """Whether a running request with the same salt will fill, but has not yet filled, the full page this
        request would compute next (past its cached pages), with the same tokens up to that page's end."""
        if self.prefix_trie is None:
            return False
        page_end = (len(request.block_table) + 1) * self.page_size
        if page_end > request.num_tokens - 1:  # the next page would hold the last token: never matched anyway
            return False
        prefix = request.all_token_ids[:page_end]
        for other in running:
            if other.cache_salt != request.cache_salt or other.num_computed_tokens >= page_end:
                continue
            if other.num_tokens >= page_end and other.all_token_ids[:page_end] == prefix:
                return True
        return False

    def cache_full_pages(self, request: Request) -> None:
        """Offer the trie the request's pages that its computed tokens have filled since last time (tokens a stop
        dropped, though computed, are not the request's)."""
        if self.prefix_trie is None:
            return
        num_full_pages = min(request.num_computed_tokens, request.num_tokens) // self.page_size
        if num_full_pages > request.num_cached_pages:
            tokens = request.all_token_ids[: num_full_pages * self.page_size]
            self.prefix_trie.insert(tokens, request.block_table[:num_full_pages], request.cache_salt)
            request.num_cached_pages = num_full_pages

    def tokens_to_recompute(self, request: Request) -> int:
        """Computed tokens a recompute would have to redo: all but the cached prefix that will survive.

        Preemption means pages are short, so the victim's own pages, once freed, are the first the
        cache gives up; only cached pages another request also holds can be counted on.
        """
        survivors = 0
        if self.prefix_trie is not None:
            own = collections.Counter(request.block_table)
            for page in self.prefix_trie.match(request.all_token_ids, request.cache_salt, touch=False):
                if self.allocator.ref_count(page) - 1 - own[page] <= 0:  # held by nobody but the trie and victim
                    break
                survivors += 1
        return max(request.num_computed_tokens - survivors * self.page_size, 0)


class SampleForks:
    """Parallel sampling (n > 1) for one replica: a request computes its prompt but the last token, then forks into
    n samples that share those pages; a sample about to write into a shared partial page copies it first."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size

    @staticmethod
    def seats(request: Request) -> int:
        """Sequence rows a request will take: n while its fork is pending, else 1."""
        return request.sampling_params.n if request.fork_pending else 1

    def seats_taken(self, running: list[Request]) -> int:
        """Rows the running requests take, counting the samples pending forks will add."""
        return sum(self.seats(request) for request in running)

    @staticmethod
    def ready(request: Request) -> bool:
        """Whether a request with a pending fork has computed all its prompt but the last token."""
        return request.fork_pending and request.num_computed_tokens == request.num_prompt_tokens - 1

    def fork(self, request: Request, running: list[Request]) -> list[Request]:
        """Start samples 1..n-1 of a running request, sharing its pages (incref), right after it in `running`.

        Returns:
          The new samples (sample i has id "{parent}#{i}" and parent_request_id set).
        """
        siblings = []
        for index in range(1, request.sampling_params.n):
            sibling = Request(
                f"{request.request_id}#{index}",
                request.prompt_token_ids,
                request.sampling_params,
                status=RequestStatus.RUNNING,
                block_table=list(request.block_table),
                num_computed_tokens=request.num_computed_tokens,
                num_draft_computed=request.num_draft_computed,
                arrival_index=request.arrival_index,
                arrival_time=request.arrival_time,
                cache_salt=request.cache_salt,
                num_cached_pages=request.num_cached_pages,
                parent_request_id=request.request_id,
                sample_index=index,
                priority=request.priority,
                replica=request.replica,
            )
            self.allocator.incref(sibling.block_table)
            siblings.append(sibling)
        position = running.index(request) + 1
        running[position:position] = siblings
        return siblings

    def shared_write_page(self, request: Request) -> int | None:
        """The block-table index of a partially filled page the request will write next and shares, if any."""
        start = request.num_computed_tokens
        index = start // self.page_size
        if start % self.page_size and index < len(request.block_table):
            if self.allocator.ref_count(request.block_table[index]) > 1:
                return index
        return None


def check_page_invariants(
    allocator: PageAllocator, running: list[Request], waiting, prefix_trie: PrefixTrie | None
) -> None:
    """Raises AssertionError unless every page's ref count is its holders (block tables plus the trie), no waiting
    request holds pages and the trie holds each page once.

    Args:
      allocator: a replica's pages.
      running, waiting: its scheduler's requests.
      prefix_trie: its prefix cache, or None.
    """
    allocator.check_invariants()
    holders = collections.Counter(page for request in running for page in request.block_table)
    for request in waiting:
        assert not request.block_table, f"waiting request {request.request_id!r} holds pages"
    cached = prefix_trie.cached_pages() if prefix_trie is not None else []
    assert len(cached) == len(set(cached)), "the trie holds a page twice"
    holders.update(cached)
    for page in range(1, allocator.num_pages):
        assert allocator.ref_count(page) == holders[page], (
            f"page {page} has ref count {allocator.ref_count(page)} but {holders[page]} holders"
        )
