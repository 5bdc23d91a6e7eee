"""Prefix cache: a radix trie of full KV pages keyed by their tokens, shared by reference count, evicted LRU."""

import dataclasses
import heapq
import itertools
from collections.abc import Sequence

from paxkv.scheduling.page_allocator import PageAllocator


@dataclasses.dataclass(eq=False)
class _Node:
    """One cached full page: the page_size tokens it holds, after its parent's tokens."""

    page: int
    parent: "_Node | None"
    key: tuple[int, ...]
    children: dict[tuple[int, ...], "_Node"] = dataclasses.field(default_factory=dict)
    last_used: int = 0


class PrefixTrie:
    """Full pages of computed KV, keyed by (salt, every token up to the page's end), one page per node.

    The trie holds one reference on each page it caches (allocator.incref). A page that only the
    trie holds is cached-idle: it stays resident, and is evicted, least recently used leaves
    first, only when the allocator cannot satisfy a request. Requests with different salts never
    share a node: each salt has its own root.
    """

    def __init__(self, allocator: PageAllocator, page_size: int):
        """Creates an empty trie over `allocator`'s pages.

        Args:
          allocator: the pool whose pages the trie caches (and holds one reference on).
          page_size: tokens per page; each node is one full page.
        """
        self.allocator = allocator
        self.page_size = page_size
        self._roots: dict[str | None, _Node] = {}
        self._clock = itertools.count(1)
        self._num_nodes = 0
        self.num_evictions = 0

    @property
    def num_cached_pages(self) -> int:
        """Pages the trie holds, whether or not a request also holds them."""
        return self._num_nodes

    def num_idle_pages(self) -> int:
        """Cached pages no request holds: free for the taking by eviction. O(cached pages)."""
        return sum(1 for node in self._nodes() if self.allocator.ref_count(node.page) == 1)

    def cached_pages(self) -> list[int]:
        """Every page the trie holds (for invariant checks)."""
        return [node.page for node in self._nodes()]

    def match(self, token_ids: Sequence[int], salt: str | None = None, touch: bool = True) -> list[int]:
        """The pages of the longest cached run of full pages that prefixes `token_ids`, leaving its last token out.

        The last token is never covered, so the caller always computes at least one token and
        gets logits to sample from. The pages are returned without a new reference; the caller
        increfs the ones it keeps. Matched nodes count as just used.

        Args:
          token_ids: a prompt (or prompt plus output, on resume).
          salt: the request's cache salt; only pages inserted with the same salt match.
          touch: count the matched nodes as just used (False for a look that takes nothing).
        """
        node = self._roots.get(salt)
        pages = []
        now = next(self._clock)
        max_pages = (len(token_ids) - 1) // self.page_size
        for index in range(max_pages):
            if node is None:
                break
            node = node.children.get(self._chunk(token_ids, index))
            if node is None:
                break
            if touch:
                node.last_used = now
            pages.append(node.page)
        return pages

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], salt: str | None = None) -> int:
        """Caches the full pages of a sequence: page i holds tokens[i * page_size:(i + 1) * page_size].

        Pages already cached under the same tokens are kept as they are (the new page is simply
        not cached); new nodes take one reference on their page.

        Args:
          token_ids: at least len(pages) * page_size tokens whose KV is in `pages`.
          pages: the sequence's first full pages, in order.
          salt: the request's cache salt.
        Returns:
          The number of pages newly cached.
        """
        if len(token_ids) < len(pages) * self.page_size:
            raise ValueError(f"{len(pages)} full pages need {len(pages) * self.page_size} tokens, got {len(token_ids)}")
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = _Node(page=-1, parent=None, key=())
        now = next(self._clock)
        num_new = 0
        for index, page in enumerate(pages):
            key = self._chunk(token_ids, index)
            child = node.children.get(key)
            if child is None:
                self.allocator.incref([page])
                child = node.children[key] = _Node(page=page, parent=node, key=key)
                self._num_nodes += 1
                num_new += 1
            child.last_used = now
            node = child
        return num_new

    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` cached-idle pages, least recently used leaves first.

        A node is evictable when it is a leaf and no request holds its page; evicting a leaf can
        make its parent one. Pages a request still holds are never touched.

        Args:
          num_pages: how many free pages the caller is short of.
        Returns:
          The number of pages freed.
        """
        if num_pages <= 0:
            return 0
        heap = [(node.last_used, id(node), node) for node in self._nodes() if self._evictable(node)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self.allocator.free([node.page])
            self._num_nodes -= 1
            self.num_evictions += 1
            freed += 1
            if parent.parent is not None and self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def clear(self) -> None:
        """Drops every cached page (the trie's references only)."""
        for node in list(self._nodes()):
            self.allocator.free([node.page])
        self._roots.clear()
        self._num_nodes = 0

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.allocator.ref_count(node.page) == 1

    def _chunk(self, token_ids: Sequence[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.page_size : (index + 1) * self.page_size])

    def _nodes(self):
        """Every page node, depth first."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node
