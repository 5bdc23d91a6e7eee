"""PrefixTrie on its own, and a hypothesis state machine driving allocator + trie + scheduler with a fake model."""

import zlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.prefix_trie import PrefixTrie
from paxkv.scheduling.replica_scheduler import ReplicaScheduler
from paxkv.scheduling.request import Request, RequestStatus
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import ReplicaBatch

PAGE_SIZE = 4


def _trie(num_pages=16):
    allocator = PageAllocator(num_pages)
    return allocator, PrefixTrie(allocator, PAGE_SIZE)


def test_match_returns_the_longest_run_and_leaves_the_last_token():
    allocator, trie = _trie()
    pages = allocator.allocate(3)
    tokens = list(range(12))
    assert trie.insert(tokens, pages) == 3
    assert [allocator.ref_count(p) for p in pages] == [2, 2, 2]  # the request's and the trie's
    assert trie.match(tokens) == pages[:2]  # 12 tokens: the third page would cover the last token
    assert trie.match(tokens + [99]) == pages
    assert trie.match(tokens[:8] + [50, 51, 52, 53, 54]) == pages[:2]  # diverges inside page 3
    assert trie.match([0, 1, 2, 7, 8]) == []  # diverges inside page 1
    assert trie.match(tokens[:4] + [9]) == pages[:1]  # a strict prefix, one token past a page boundary


def test_salts_never_share():
    allocator, trie = _trie()
    pages = allocator.allocate(2)
    trie.insert(list(range(8)), pages, salt="tenant-a")
    assert trie.match(list(range(9)), salt="tenant-a") == pages
    assert trie.match(list(range(9)), salt="tenant-b") == []
    assert trie.match(list(range(9))) == []


def test_insert_keeps_the_first_copy_of_a_page():
    allocator, trie = _trie()
    first, second = allocator.allocate(1), allocator.allocate(1)
    assert trie.insert([1, 2, 3, 4], first) == 1
    assert trie.insert([1, 2, 3, 4], second) == 0
    assert allocator.ref_count(second[0]) == 1 and trie.match([1, 2, 3, 4, 5]) == first


def test_eviction_takes_idle_leaves_least_recently_used_first():
    allocator, trie = _trie(num_pages=8)
    a, b = allocator.allocate(2), allocator.allocate(2)
    trie.insert([1] * 8, a)  # chain a0 -> a1
    trie.insert([2] * 8, b)  # chain b0 -> b1
    allocator.free(a + b)  # the requests finish: all four pages are idle
    trie.match([2] * 9)  # b was used last
    assert trie.num_idle_pages() == 4
    assert trie.evict(1) == 1 and allocator.ref_count(a[1]) == 0  # a's leaf first
    assert trie.evict(2) == 2 and allocator.ref_count(a[0]) == 0 and allocator.ref_count(b[1]) == 0
    assert trie.match([2] * 9) == b[:1]


def test_eviction_never_touches_a_page_a_request_holds():
    allocator, trie = _trie(num_pages=8)
    held = allocator.allocate(2)
    trie.insert([3] * 8, held)
    assert trie.evict(5) == 0
    assert [allocator.ref_count(p) for p in held] == [2, 2]
    allocator.free(held[1:])  # only the leaf becomes idle
    assert trie.evict(5) == 1 and trie.match([3] * 9) == held[:1]


# --- The state machine: requests with shared prefixes, salts, n > 1, aborts and evictions. ---


def fake_token(request_id: str, position: int) -> int:
    """The fake model's sample: a function of (request id, position) only."""
    return 1 + zlib.crc32(f"{request_id}:{position}".encode()) % 9


class ContentModel:
    """A device stand-in whose 'KV' at a position is (salt, every token up to it), as real attention's is.

    It applies page copies, writes each token's entry and checks every entry each sequence reads,
    so a page shared across salts or holding another prefix's KV fails the check.
    """

    def __init__(self):
        self.kv: dict[int, tuple] = {}

    def step(self, batch: ReplicaBatch) -> dict[str, int]:
        for source, destination in batch.page_copies:
            for offset in range(PAGE_SIZE):
                if source * PAGE_SIZE + offset in self.kv:
                    self.kv[destination * PAGE_SIZE + offset] = self.kv[source * PAGE_SIZE + offset]
        for sequence in batch.sequences:
            request = sequence.request
            tokens = request.all_token_ids
            for slot, position in zip(sequence.slots, sequence.positions, strict=True):
                self.kv[slot] = (request.cache_salt, tuple(tokens[: position + 1]))
        sampled = {}
        for sequence in batch.sequences:
            request = sequence.request
            tokens = request.all_token_ids
            for position in range(sequence.kv_len):
                slot = sequence.block_table[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
                assert self.kv.get(slot) == (request.cache_salt, tuple(tokens[: position + 1])), (
                    f"{request.request_id} reads wrong KV at position {position}"
                )
            if sequence.completes_prompt:
                sampled[request.request_id] = fake_token(request.request_id, sequence.kv_len)
        return sampled


PREFIXES = [[5] * 9, [5] * 8 + [6], [7, 8, 9, 1, 2, 3, 4, 5], []]


class SchedulerWithCache(RuleBasedStateMachine):
    """Random admissions, steps, aborts and evictions; page accounting is checked after every one."""

    def __init__(self):
        super().__init__()
        # 11 usable pages against requests of up to 6 pages each, n up to 3: preemption and eviction happen.
        self.allocator = PageAllocator(12)
        self.trie = PrefixTrie(self.allocator, PAGE_SIZE)
        self.scheduler = ReplicaScheduler(
            self.allocator,
            page_size=PAGE_SIZE,
            max_num_seqs=4,
            max_num_batched_tokens=12,
            max_model_len=40,
            prefix_trie=self.trie,
        )
        self.model = ContentModel()
        self.requests: dict[str, Request] = {}
        self.count = 0

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES))),
        suffix=st.lists(st.integers(1, 4), min_size=1, max_size=6),
        salt=st.sampled_from([None, "a"]),
        n=st.sampled_from([1, 1, 2, 3]),
        max_tokens=st.integers(1, 6),
    )
    def add(self, prefix, suffix, salt, n, max_tokens):
        request = Request(
            f"r{self.count}",
            PREFIXES[prefix] + suffix,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n),
            cache_salt=salt,
        )
        self.count += 1
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(num_steps=st.integers(1, 8))
    def step(self, num_steps):
        for _ in range(num_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            batch = self.scheduler.schedule()
            assert not batch.is_empty  # progress: nothing deadlocks
            outcome = self.scheduler.update(batch, self.model.step(batch))
            for request in batch.forked + outcome.forked:
                self.requests[request.request_id] = request
            self.scheduler.check_page_invariants()

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(index=st.integers(0, 50))
    def abort(self, index):
        unfinished = [r for r in self.requests.values() if not r.is_finished]
        request = unfinished[index % len(unfinished)]
        assert self.scheduler.abort(request.request_id) is request

    @rule(num_pages=st.integers(1, 6))
    def evict(self, num_pages):
        idle = self.trie.num_idle_pages()
        assert self.trie.evict(num_pages) == min(num_pages, idle) or idle > 0

    @invariant()
    def pages_are_accounted_for(self):
        # Ref count = block tables holding the page + the trie's hold; free iff ref count 0.
        self.scheduler.check_page_invariants()
        for page in self.trie.cached_pages():
            assert self.allocator.ref_count(page) >= 1, f"the trie holds page {page}, which is free"
        assert len(self.trie.cached_pages()) == self.trie.num_cached_pages

    def teardown(self):
        for request in list(self.requests.values()):
            if not request.is_finished:
                self.scheduler.abort(request.request_id)
        self.scheduler.check_page_invariants()
        total = self.allocator.num_total_pages
        assert self.allocator.num_free_pages + self.trie.num_idle_pages() == total
        assert self.trie.num_idle_pages() == self.trie.num_cached_pages  # nothing else holds a page
        for request in self.requests.values():
            assert request.status is RequestStatus.FINISHED and not request.block_table


SchedulerWithCache.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_with_cache = SchedulerWithCache.TestCase


def test_samples_outputs_do_not_depend_on_caching():
    """The same workload with and without the cache gives the same tokens (the fake model is content-checked)."""

    def run(with_cache: bool) -> dict[str, list[int]]:
        allocator = PageAllocator(40)
        trie = PrefixTrie(allocator, PAGE_SIZE) if with_cache else None
        scheduler = ReplicaScheduler(
            allocator,
            page_size=PAGE_SIZE,
            max_num_seqs=6,
            max_num_batched_tokens=10,
            max_model_len=48,
            prefix_trie=trie,
        )
        model, requests = ContentModel(), []
        for index in range(6):
            prompt = [5] * 10 + [index % 3 + 1] * (index + 1)
            request = Request(f"r{index}", prompt, SamplingParams(max_tokens=5, ignore_eos=True, n=1 + index % 2))
            scheduler.add_request(request)
            requests.append(request)
        while scheduler.has_unfinished_requests():
            batch = scheduler.schedule()
            requests += batch.forked + scheduler.update(batch, model.step(batch)).forked
            scheduler.check_page_invariants()
        if with_cache:
            assert scheduler.num_prefix_hit_tokens > 0
        return {r.request_id: r.output_token_ids for r in requests}

    cached, uncached = run(True), run(False)
    assert cached == uncached and len(cached) == 9  # 6 requests, 3 of them with 2 samples


@pytest.mark.parametrize("prompt_length", [1, 4, 5, 7])
def test_fork_copies_the_shared_partial_page_for_every_sample_but_the_last(prompt_length):
    allocator = PageAllocator(32)
    scheduler = ReplicaScheduler(
        allocator, page_size=PAGE_SIZE, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32
    )
    parent = Request("p", list(range(1, prompt_length + 1)), SamplingParams(max_tokens=3, ignore_eos=True, n=3))
    scheduler.add_request(parent)
    model, samples, copies = ContentModel(), [parent], []
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        copies += batch.page_copies
        samples += batch.forked + scheduler.update(batch, model.step(batch)).forked
        scheduler.check_page_invariants()
        tables = [r.block_table for r in samples if not r.is_finished and r.num_computed_tokens >= prompt_length]
        last_pages = [table[(prompt_length - 1) // PAGE_SIZE] for table in tables]
        assert len(set(last_pages)) == len(
            last_pages
        )  # once written, each sample's page with the last token is its own
    shared_partial = (prompt_length - 1) % PAGE_SIZE != 0
    assert len(copies) == (2 if shared_partial else 0)
    assert [s.request_id for s in samples] == ["p", "p#1", "p#2"]
    assert len({tuple(s.output_token_ids) for s in samples}) == 3


def test_a_request_waits_a_step_for_a_prefix_page_being_computed():
    """Two prompts sharing 5 pages arrive together: the second waits for the first's pages instead of duplicating."""
    allocator = PageAllocator(32)
    trie = PrefixTrie(allocator, PAGE_SIZE)
    scheduler = ReplicaScheduler(
        allocator, page_size=PAGE_SIZE, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, prefix_trie=trie
    )
    first, second = (
        Request(name, [5] * 20 + [last], SamplingParams(max_tokens=2)) for name, last in (("a", 1), ("b", 2))
    )
    scheduler.add_request(first)
    scheduler.add_request(second)
    model = ContentModel()
    batch = scheduler.schedule()
    assert [s.request.request_id for s in batch.sequences] == ["a"]  # b waits: a is computing its pages
    scheduler.update(batch, model.step(batch))
    batch = scheduler.schedule()
    assert [(s.request.request_id, s.positions[0]) for s in batch.sequences] == [("a", 21), ("b", 20)]
    assert scheduler.num_prefix_hit_tokens == 20 and second.block_table[:5] == first.block_table[:5]
