"""Host-side KV page allocator: a free list plus a ref count per page, with page 0 reserved as the null page."""

import collections
import operator
from collections.abc import Iterable

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free; nothing is allocated."""


class PageAllocator:
    """Hands out pages 1..num_pages-1 in deterministic LIFO order (fresh pool: 1, 2, 3, ...) and counts holders."""

    def __init__(self, num_pages: int):
        """Creates an allocator over a pool of `num_pages` pages, of which page 0 is never handed out.

        Args:
          num_pages: the pool size, including the reserved null page 0; at least 2.
        """
        num_pages = operator.index(num_pages)
        if num_pages < 2:
            raise ValueError(
                f"num_pages must be at least 2 (page 0 is the reserved null page), got {num_pages}; raise num_pages"
            )
        self._num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._generations = [0] * num_pages  # [page]: times handed out (generation())
        # A stack: the next page handed out is the last one. Reversed so a fresh pool hands out 1, 2, 3, ...
        self._free_pages = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def num_pages(self) -> int:
        """The pool size, including the reserved null page."""
        return self._num_pages

    @property
    def num_total_pages(self) -> int:
        """The number of usable pages: every page except the null page."""
        return self._num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """The number of pages that can be allocated now."""
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        """The number of pages with at least one holder."""
        return self.num_total_pages - self.num_free_pages

    def can_allocate(self, num_pages: int) -> bool:
        """Returns whether allocate(num_pages) would succeed.

        Args:
          num_pages: the number of pages wanted; not negative.
        """
        return self._check_count(num_pages) <= len(self._free_pages)

    def allocate(self, num_pages: int) -> list[int]:
        """Takes `num_pages` free pages, each with ref count 1, or raises OutOfPagesError and takes none.

        Args:
          num_pages: the number of pages wanted; not negative.
        Returns:
          The pages, distinct and never the null page.
        """
        num_pages = self._check_count(num_pages)
        if num_pages > len(self._free_pages):
            raise OutOfPagesError(
                f"cannot allocate {num_pages} pages: only {len(self._free_pages)} of {self.num_total_pages} are free; "
                "free finished sequences' pages or raise num_pages"
            )
        if num_pages == 0:
            return []
        pages = self._free_pages[-num_pages:]
        del self._free_pages[-num_pages:]
        pages.reverse()
        for page in pages:
            self._ref_counts[page] = 1
            self._generations[page] += 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Adds one holder to each page, counting repeats; raises ValueError and changes nothing unless all are live.

        Args:
          pages: live pages to share, e.g. cached prefix pages or a parent sequence's pages.
        """
        pages = [self._check_page(page, "incref") for page in pages]
        for page in pages:
            if self._ref_counts[page] == 0:
                raise ValueError(f"cannot incref page {page}: it is free; only allocated pages can be shared")
        for page in pages:
            self._ref_counts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one holder from each page, counting repeats; raises ValueError and changes nothing on a double free.

        Pages left with no holder go back so that the next allocation of as many hands them out in the order given:
        a freed block table comes back front to back, as a fresh pool's pages do. (Pushed in the given order, it came
        back last page first, so a sequence's pages lay at falling addresses, which a CPU's prefetchers do not
        follow from page to page.)

        Args:
          pages: pages the caller holds; each one left with no holder returns to the free list.
        """
        num_drops = collections.Counter(self._check_page(page, "free") for page in pages)
        for page, num_drops_of_page in num_drops.items():
            if num_drops_of_page > self._ref_counts[page]:
                raise ValueError(
                    f"cannot free page {page} {num_drops_of_page} time(s): it has ref count {self._ref_counts[page]} "
                    "(double free); free only pages you hold"
                )
        for page in reversed(num_drops):  # the stack's top is the first page given
            self._ref_counts[page] -= num_drops[page]
            if self._ref_counts[page] == 0:
                self._free_pages.append(page)

    def ref_count(self, page: int) -> int:
        """Returns how many holders a page has; 0 means it is free.

        Args:
          page: a page in 0..num_pages-1.
        """
        page = operator.index(page)
        if not 0 <= page < self._num_pages:
            raise ValueError(f"page {page} is outside the pool 0..{self._num_pages - 1}")
        return self._ref_counts[page]

    def generation(self, page: int) -> int:
        """How many times a page has been handed out: what was written in it under an earlier generation is gone
        (a record of a page's contents keeps the generation it was made under).

        Args:
          page: a page in 0..num_pages-1.
        """
        self.ref_count(page)  # checks the page
        return self._generations[page]

    def check_invariants(self) -> None:
        """Raises AssertionError unless the free list and the ref counts agree; costs O(num_pages)."""
        assert self._ref_counts[NULL_PAGE] == 0, f"null page has ref count {self._ref_counts[NULL_PAGE]}, expected 0"
        repeated = sorted(page for page, count in collections.Counter(self._free_pages).items() if count > 1)
        assert not repeated, f"free list holds pages more than once: {repeated}"
        free_page_set = set(self._free_pages)
        assert NULL_PAGE not in free_page_set, "null page is on the free list"
        outside = sorted(page for page in free_page_set if not 0 < page < self._num_pages)
        assert not outside, f"free list holds pages outside the pool: {outside}"
        num_live_pages = 0
        for page in range(1, self._num_pages):
            ref_count = self._ref_counts[page]
            assert ref_count >= 0, f"page {page} has negative ref count {ref_count}"
            is_free = page in free_page_set
            assert is_free == (ref_count == 0), (
                f"page {page} is {'free' if is_free else 'not free'} but has ref count {ref_count}"
            )
            num_live_pages += ref_count > 0
        assert len(self._free_pages) + num_live_pages == self.num_total_pages, (
            f"{len(self._free_pages)} free + {num_live_pages} live pages != {self.num_total_pages} total"
        )

    def _check_count(self, num_pages: int) -> int:
        """Returns `num_pages` as an int, or raises ValueError if it is negative."""
        num_pages = operator.index(num_pages)
        if num_pages < 0:
            raise ValueError(f"the number of pages must not be negative, got {num_pages}")
        return num_pages

    def _check_page(self, page: int, action: str) -> int:
        """Returns `page` as an int, or raises ValueError if it is the null page or outside the pool."""
        page = operator.index(page)
        if page == NULL_PAGE:
            raise ValueError(f"cannot {action} page 0: it is the reserved null page and is never allocated")
        if not 0 < page < self._num_pages:
            raise ValueError(f"cannot {action} page {page}: it is outside the pool 1..{self._num_pages - 1}")
        return page
