"""The scheduler's page sharing: prefix-cache matching and insertion, n > 1 forks, copy-on-write, swap-in."""

import collections

from paxkv.request import Request, RequestStatus


class PageSharing:
    """Scheduler methods that share pages between requests; mixed into Scheduler, whose state they use."""

    def _num_seats(self, request: Request) -> int:
        """Sequence rows a request will take: n while its fork is pending, else 1."""
        return request.sampling_params.n if request.fork_pending else 1

    def _num_seats_taken(self) -> int:
        """Rows the running requests take, counting the siblings pending forks will add."""
        return sum(self._num_seats(request) for request in self.running)

    def _fork_ready(self, request: Request) -> bool:
        """Whether a request with a pending fork has computed all its prompt but the last token."""
        return request.fork_pending and request.num_computed_tokens == request.num_prompt_tokens - 1

    def _fork(self, request: Request) -> None:
        """Start samples 1..n-1 of a running request, sharing its pages (incref), right after it in running."""
        siblings = []
        for index in range(1, request.sampling_params.n):
            sibling = Request(
                f"{request.request_id}#{index}",
                request.prompt_token_ids,
                request.sampling_params,
                status=RequestStatus.RUNNING,
                block_table=list(request.block_table),
                num_computed_tokens=request.num_computed_tokens,
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
            self._unfinished[sibling.request_id] = sibling
            siblings.append(sibling)
        position = self.running.index(request) + 1
        self.running[position:position] = siblings
        self._forked.extend(siblings)

    def _shared_write_page(self, request: Request) -> int | None:
        """The block-table index of a partially filled page the request will write next and shares, if any."""
        start = request.num_computed_tokens
        index = start // self.page_size
        if start % self.page_size and index < len(request.block_table):
            if self.allocator.ref_count(request.block_table[index]) > 1:
                return index
        return None

    def _match_prefix(self, request: Request) -> int:
        """Start a request with no pages on its longest cached prefix (shared by incref); return its tokens."""
        if self.prefix_trie is None or request.block_table:
            return 0
        pages = self.prefix_trie.match(request.all_token_ids, request.cache_salt)
        self.allocator.incref(pages)
        request.block_table = list(pages)
        request.num_cached_pages = len(pages)
        request.num_computed_tokens = len(pages) * self.page_size
        return request.num_computed_tokens

    def _next_page_in_flight(self, request: Request) -> bool:
        """Whether a running request with the same salt will fill, but has not yet filled, the full page this
        request would compute next (past its cached pages), with the same tokens up to that page's end."""
        if self.prefix_trie is None:
            return False
        page_end = (len(request.block_table) + 1) * self.page_size
        if page_end > request.num_tokens - 1:  # the next page would hold the last token: never matched anyway
            return False
        prefix = request.all_token_ids[:page_end]
        for other in self.running:
            if other.cache_salt != request.cache_salt or other.num_computed_tokens >= page_end:
                continue
            if other.num_tokens >= page_end and other.all_token_ids[:page_end] == prefix:
                return True
        return False

    def _cache_full_pages(self, request: Request) -> None:
        """Offer the prefix cache the request's pages that its computed tokens have filled since last time."""
        if self.prefix_trie is None:
            return
        num_full_pages = request.num_computed_tokens // self.page_size
        if num_full_pages > request.num_cached_pages:
            tokens = request.all_token_ids[: num_full_pages * self.page_size]
            self.prefix_trie.insert(tokens, request.block_table[:num_full_pages], request.cache_salt)
            request.num_cached_pages = num_full_pages

    def check_page_invariants(self) -> None:
        """Raises AssertionError unless every page's ref count is its holders: block tables plus the trie."""
        self.allocator.check_invariants()
        holders = collections.Counter(page for request in self.running for page in request.block_table)
        for request in self.waiting:
            assert not request.block_table, f"waiting request {request.request_id!r} holds pages"
        cached = self.prefix_trie.cached_pages() if self.prefix_trie is not None else []
        assert len(cached) == len(set(cached)), "the trie holds a page twice"
        holders.update(cached)
        for page in range(1, self.allocator.num_pages):
            assert self.allocator.ref_count(page) == holders[page], (
                f"page {page} has ref count {self.allocator.ref_count(page)} but {holders[page]} holders"
            )

    def _tokens_to_recompute(self, request: Request) -> int:
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

    def _swap_back_in(self, request: Request) -> None:
        """Give a swapped-out request fresh pages and schedule its host slots' copy into them."""
        slots, request.swapped_slots = request.swapped_slots, []
        pages = self.allocator.allocate(len(slots))
        self._swap_in += zip(slots, pages, strict=True)
        self._slots_to_free += slots
        request.block_table = pages
