"""PageAllocator: unit tests for each operation and error, and a hypothesis state machine against a ref-count model."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paxkv.scheduling.page_allocator import OutOfPagesError, PageAllocator


def ref_counts(allocator: PageAllocator) -> list[int]:
    """Returns the ref count of every page in the pool, the null page included."""
    return [allocator.ref_count(page) for page in range(allocator.num_pages)]


@pytest.mark.parametrize("num_pages", [-3, 0, 1])
def test_rejects_a_pool_without_a_usable_page(num_pages):
    with pytest.raises(ValueError, match=rf"num_pages must be at least 2 .*got {num_pages}; raise num_pages"):
        PageAllocator(num_pages)


def test_fresh_pool_has_every_page_but_the_null_page_free():
    allocator = PageAllocator(5)
    assert allocator.num_pages == 5
    assert allocator.num_total_pages == 4
    assert allocator.num_free_pages == 4
    assert allocator.num_used_pages == 0
    assert ref_counts(allocator) == [0] * 5
    allocator.check_invariants()


def test_smallest_pool_holds_one_page():
    allocator = PageAllocator(2)
    assert allocator.allocate(1) == [1]
    assert not allocator.can_allocate(1)
    with pytest.raises(OutOfPagesError, match="only 0 of 1 are free"):
        allocator.allocate(1)


def test_allocate_hands_out_fresh_pages_in_order_with_ref_count_one():
    allocator = PageAllocator(6)
    assert allocator.allocate(3) == [1, 2, 3]
    assert ref_counts(allocator) == [0, 1, 1, 1, 0, 0]
    assert allocator.num_free_pages == 2
    assert allocator.num_used_pages == 3
    allocator.check_invariants()


def test_allocate_reuses_the_most_recently_freed_pages_first():
    allocator = PageAllocator(6)
    allocator.allocate(3)
    allocator.free([2])
    assert allocator.allocate(1) == [2]
    allocator.free([1, 3])
    assert allocator.allocate(3) == [1, 3, 4]


def test_a_freed_block_table_comes_back_in_its_own_order():
    allocator = PageAllocator(12)
    first = allocator.allocate(4)
    second = allocator.allocate(5)
    allocator.free(first)
    allocator.free(second)
    # the last freed comes back first, each block table front to back, then the fresh pages
    assert allocator.allocate(11) == [*second, *first, 10, 11]
    allocator.check_invariants()


def test_allocation_order_is_deterministic():
    def run_script() -> list[list[int]]:
        allocator = PageAllocator(9)
        first = allocator.allocate(4)
        allocator.free([first[2], first[0]])
        second = allocator.allocate(3)
        allocator.incref(second)
        allocator.free(second + [first[1]])
        return [first, second, allocator.allocate(4)]

    assert run_script() == run_script()


def test_allocate_zero_pages_changes_nothing():
    allocator = PageAllocator(3)
    assert allocator.can_allocate(0)
    assert allocator.allocate(0) == []
    assert allocator.num_free_pages == 2
    allocator.allocate(2)
    assert allocator.allocate(0) == []


def test_negative_page_counts_are_rejected():
    allocator = PageAllocator(3)
    with pytest.raises(ValueError, match="must not be negative, got -1"):
        allocator.allocate(-1)
    with pytest.raises(ValueError, match="must not be negative, got -2"):
        allocator.can_allocate(-2)
    assert allocator.num_free_pages == 2


def test_can_allocate_up_to_the_free_page_count():
    allocator = PageAllocator(5)
    allocator.allocate(1)
    assert allocator.can_allocate(3)
    assert not allocator.can_allocate(4)


def test_out_of_pages_allocates_nothing():
    allocator = PageAllocator(5)
    held = allocator.allocate(2)
    with pytest.raises(OutOfPagesError, match=r"cannot allocate 3 pages: only 2 of 4 are free; .*raise num_pages"):
        allocator.allocate(3)
    assert issubclass(OutOfPagesError, RuntimeError)
    assert allocator.num_free_pages == 2
    assert ref_counts(allocator) == [0, 1, 1, 0, 0]
    assert allocator.allocate(2) == [3, 4]
    allocator.free(held)
    allocator.check_invariants()


def test_shared_page_stays_live_until_its_last_holder_frees_it():
    allocator = PageAllocator(4)
    [page] = allocator.allocate(1)
    allocator.incref([page])
    allocator.incref([page])
    assert allocator.ref_count(page) == 3
    allocator.free([page])
    allocator.free([page])
    assert allocator.ref_count(page) == 1
    assert allocator.num_free_pages == 2
    allocator.free([page])
    assert allocator.ref_count(page) == 0
    assert allocator.num_free_pages == 3
    allocator.check_invariants()


def test_repeated_pages_count_once_per_listing():
    allocator = PageAllocator(4)
    [page] = allocator.allocate(1)
    allocator.incref([page, page])
    assert allocator.ref_count(page) == 3
    allocator.free([page, page, page])
    assert allocator.ref_count(page) == 0
    assert allocator.num_free_pages == 3


def test_incref_of_a_free_page_raises_and_changes_nothing():
    allocator = PageAllocator(4)
    [live_page] = allocator.allocate(1)
    with pytest.raises(ValueError, match="cannot incref page 2: it is free; only allocated pages can be shared"):
        allocator.incref([live_page, 2])
    assert ref_counts(allocator) == [0, 1, 0, 0]


@pytest.mark.parametrize(
    ("page", "message"),
    [
        (0, "cannot incref page 0: it is the reserved null page"),
        (4, r"cannot incref page 4: it is outside the pool 1\.\.3"),
        (-1, r"cannot incref page -1: it is outside the pool 1\.\.3"),
    ],
)
def test_incref_of_a_page_outside_the_usable_pool_raises(page, message):
    allocator = PageAllocator(4)
    allocator.allocate(3)
    with pytest.raises(ValueError, match=message):
        allocator.incref([page])
    assert ref_counts(allocator) == [0, 1, 1, 1]


def test_double_free_raises_and_changes_nothing():
    allocator = PageAllocator(4)
    first, second = allocator.allocate(2)
    allocator.free([second])
    with pytest.raises(ValueError, match=r"cannot free page 2 1 time\(s\): it has ref count 0 \(double free\)"):
        allocator.free([first, second])
    with pytest.raises(ValueError, match=r"cannot free page 1 2 time\(s\): it has ref count 1 \(double free\)"):
        allocator.free([first, first])
    assert ref_counts(allocator) == [0, 1, 0, 0]
    assert allocator.num_free_pages == 2
    allocator.check_invariants()


@pytest.mark.parametrize(
    ("page", "message"),
    [
        (0, "cannot free page 0: it is the reserved null page"),
        (4, r"cannot free page 4: it is outside the pool 1\.\.3"),
    ],
)
def test_free_of_a_page_outside_the_usable_pool_raises(page, message):
    allocator = PageAllocator(4)
    held = allocator.allocate(1)
    with pytest.raises(ValueError, match=message):
        allocator.free(held + [page])
    assert ref_counts(allocator) == [0, 1, 0, 0]


def test_ref_count_of_a_page_outside_the_pool_raises():
    allocator = PageAllocator(4)
    assert allocator.ref_count(0) == 0
    with pytest.raises(ValueError, match=r"page 4 is outside the pool 0\.\.3"):
        allocator.ref_count(4)


def test_numpy_integers_are_accepted():
    allocator = PageAllocator(5)
    pages = allocator.allocate(np.int64(3))
    assert all(type(page) is int for page in pages)
    allocator.incref(np.array(pages[:1]))
    assert allocator.ref_count(np.int32(pages[0])) == 2
    allocator.free(np.array(pages))
    assert ref_counts(allocator) == [0, 1, 0, 0, 0]
    allocator.check_invariants()


def corrupt_free_list_repeat(allocator):
    allocator._free_pages.append(allocator._free_pages[-1])


def corrupt_free_list_null_page(allocator):
    allocator._free_pages.append(0)


def corrupt_null_page_ref_count(allocator):
    allocator._ref_counts[0] = 1


def corrupt_free_list_live_page(allocator):
    allocator._free_pages.append(1)


def corrupt_free_list_leak(allocator):
    allocator._free_pages.pop()


def corrupt_negative_ref_count(allocator):
    allocator._ref_counts[2] = -1


def corrupt_free_list_outside_pool(allocator):
    allocator._free_pages.append(allocator.num_pages)


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (corrupt_free_list_repeat, r"free list holds pages more than once: \[4\]"),
        (corrupt_free_list_null_page, "null page is on the free list"),
        (corrupt_null_page_ref_count, "null page has ref count 1, expected 0"),
        (corrupt_free_list_live_page, "page 1 is free but has ref count 1"),
        (corrupt_free_list_leak, "page 4 is not free but has ref count 0"),
        (corrupt_negative_ref_count, "page 2 has negative ref count -1"),
        (corrupt_free_list_outside_pool, r"free list holds pages outside the pool: \[8\]"),
    ],
)
def test_check_invariants_catches_a_corrupted_state(corrupt, message):
    allocator = PageAllocator(8)
    allocator.allocate(3)
    allocator.check_invariants()
    corrupt(allocator)
    with pytest.raises(AssertionError, match=message):
        allocator.check_invariants()


class PageAllocatorMachine(RuleBasedStateMachine):
    """Drives allocate, incref and free at random against a model of the expected ref count of each live page."""

    def __init__(self):
        super().__init__()
        self.allocator = None
        self.expected_ref_counts: dict[int, int] = {}

    @initialize(num_pages=st.integers(min_value=2, max_value=12))
    def create_allocator(self, num_pages):
        self.allocator = PageAllocator(num_pages)

    def expected_num_free_pages(self) -> int:
        """Returns the model's count of free pages."""
        return self.allocator.num_total_pages - len(self.expected_ref_counts)

    def snapshot(self) -> tuple[int, list[int]]:
        """Returns the allocator's observable state."""
        return self.allocator.num_free_pages, ref_counts(self.allocator)

    def held_references(self) -> list[int]:
        """Returns each live page once per expected holder."""
        return [page for page, count in sorted(self.expected_ref_counts.items()) for _ in range(count)]

    @rule(num_pages_wanted=st.integers(min_value=0, max_value=14))
    def allocate(self, num_pages_wanted):
        fits = num_pages_wanted <= self.expected_num_free_pages()
        assert self.allocator.can_allocate(num_pages_wanted) == fits
        if not fits:
            before = self.snapshot()
            with pytest.raises(OutOfPagesError, match=f"cannot allocate {num_pages_wanted} pages"):
                self.allocator.allocate(num_pages_wanted)
            assert self.snapshot() == before
            return
        pages = self.allocator.allocate(num_pages_wanted)
        assert len(pages) == num_pages_wanted
        assert len(set(pages)) == num_pages_wanted
        for page in pages:
            assert 0 < page < self.allocator.num_pages
            assert page not in self.expected_ref_counts
            self.expected_ref_counts[page] = 1

    @precondition(lambda self: self.expected_ref_counts)
    @rule(data=st.data())
    def incref(self, data):
        live_pages = sorted(self.expected_ref_counts)
        pages = data.draw(st.lists(st.sampled_from(live_pages), min_size=1, max_size=4), label="pages")
        self.allocator.incref(pages)
        for page in pages:
            self.expected_ref_counts[page] += 1

    @precondition(lambda self: self.expected_ref_counts)
    @rule(data=st.data())
    def free(self, data):
        references = self.held_references()
        chosen = data.draw(st.sets(st.integers(min_value=0, max_value=len(references) - 1), min_size=1), label="chosen")
        pages = [references[index] for index in sorted(chosen)]
        self.allocator.free(pages)
        for page in pages:
            self.expected_ref_counts[page] -= 1
            if self.expected_ref_counts[page] == 0:
                del self.expected_ref_counts[page]

    @rule(data=st.data())
    def free_an_unheld_page_fails(self, data):
        unheld_pages = [page for page in range(self.allocator.num_pages + 1) if page not in self.expected_ref_counts]
        page = data.draw(st.sampled_from(unheld_pages), label="page")
        before = self.snapshot()
        with pytest.raises(ValueError, match=f"cannot free page {page}"):
            self.allocator.free(self.held_references() + [page])
        assert self.snapshot() == before

    @precondition(lambda self: self.expected_ref_counts)
    @rule(data=st.data())
    def free_more_than_held_fails(self, data):
        page = data.draw(st.sampled_from(sorted(self.expected_ref_counts)), label="page")
        before = self.snapshot()
        with pytest.raises(ValueError, match=r"double free"):
            self.allocator.free([page] * (self.expected_ref_counts[page] + 1))
        assert self.snapshot() == before

    @rule(data=st.data())
    def incref_an_unheld_page_fails(self, data):
        unheld_pages = [page for page in range(self.allocator.num_pages + 1) if page not in self.expected_ref_counts]
        page = data.draw(st.sampled_from(unheld_pages), label="page")
        before = self.snapshot()
        with pytest.raises(ValueError, match=f"cannot incref page {page}"):
            self.allocator.incref(sorted(self.expected_ref_counts) + [page])
        assert self.snapshot() == before

    @invariant()
    def allocator_matches_model(self):
        self.allocator.check_invariants()
        assert 0 not in self.expected_ref_counts
        expected = [self.expected_ref_counts.get(page, 0) for page in range(self.allocator.num_pages)]
        assert ref_counts(self.allocator) == expected
        assert self.allocator.num_free_pages == self.expected_num_free_pages()
        assert self.allocator.num_used_pages == len(self.expected_ref_counts)

    def teardown(self):
        if self.allocator is None:
            return
        self.allocator.free(self.held_references())
        self.allocator.check_invariants()
        assert self.allocator.num_free_pages == self.allocator.num_total_pages
        assert ref_counts(self.allocator) == [0] * self.allocator.num_pages
        assert sorted(self.allocator.allocate(self.allocator.num_total_pages)) == list(
            range(1, self.allocator.num_pages)
        )


TestPageAllocatorMachine = PageAllocatorMachine.TestCase
TestPageAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
