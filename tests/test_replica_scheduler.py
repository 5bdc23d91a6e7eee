"""ReplicaScheduler: unit tests per behaviour, preemption against isolated runs, hypothesis driving a fake model."""

import collections
import logging
import zlib
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paxkv.execution.step_inputs import power_of_two_buckets
from paxkv.scheduling import step_fitting
from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.prefix_trie import PrefixTrie
from paxkv.scheduling.replica_scheduler import ReplicaScheduler
from paxkv.scheduling.request import Request, RequestStatus
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import ReplicaBatch

EOS = 0
VOCAB_SIZE = 23


def fake_token(request_id: str, position: int) -> int:
    """The fake model's sample at `position`: a function of (request_id, position) only, never of the batch."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB_SIZE


def make_scheduler(
    num_pages=64,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=256,
    step_sizes=(),
    prefix_caching=False,
):
    """A scheduler over a fresh pool, with EOS as its end-of-sequence token (and a prefix cache if asked)."""
    allocator = PageAllocator(num_pages)
    return ReplicaScheduler(
        allocator,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=(EOS,),
        prefix_trie=PrefixTrie(allocator, page_size) if prefix_caching else None,
        step_sizes=step_sizes,
    )


def make_request(request_id, num_prompt_tokens, **sampling):
    """A request whose prompt is 1, 2, ..., so prompt tokens are never EOS."""
    return Request(request_id, list(range(1, num_prompt_tokens + 1)), SamplingParams(**sampling))


class FakeModel:
    """Stands in for the device: writes each token's 'KV' into its slot and checks every read through block tables."""

    def __init__(self, shared_prefixes: bool = False):
        """shared_prefixes: requests may read KV that another request wrote for the same tokens (a prefix cache), so
        a read is checked for its position and token only, not for the request that wrote it."""
        self.kv: dict[int, tuple[str, int, int]] = {}  # slot -> (request_id, position, token_id)
        self.shared_prefixes = shared_prefixes

    def check_read(self, slot: int, request_id: str, position: int, token_id: int) -> None:
        """Asserts that `slot` holds the KV of `token_id` at `position` (written by `request_id` itself, unless
        prefixes are shared)."""
        assert slot in self.kv, f"{request_id} reads slot {slot} (position {position}), which nothing wrote"
        written = self.kv[slot][1:] if self.shared_prefixes else self.kv[slot]
        assert written == ((position, token_id) if self.shared_prefixes else (request_id, position, token_id))

    def step(self, batch: ReplicaBatch, page_size: int) -> dict[str, int]:
        """Runs one batch and returns the sampled token of each sequence that completes its prompt."""
        for sequence in batch.sequences:
            request_id = sequence.request.request_id
            for slot, position, token_id in zip(sequence.slots, sequence.positions, sequence.token_ids, strict=True):
                self.kv[slot] = (request_id, position, token_id)
        sampled = {}
        for sequence in batch.sequences:
            request = sequence.request
            all_token_ids = request.all_token_ids
            for position in range(sequence.kv_len):
                slot = sequence.block_table[position // page_size] * page_size + position % page_size
                self.check_read(slot, request.request_id, position, all_token_ids[position])
            if sequence.completes_prompt:
                sampled[request.request_id] = fake_token(request.request_id, sequence.kv_len)
        return sampled


def check_state(scheduler: ReplicaScheduler) -> None:
    """Asserts the scheduler's invariants between steps: its page accounting, and each request's state."""
    scheduler.check_page_invariants()
    for request in scheduler.waiting:
        assert request.status is RequestStatus.WAITING and not request.block_table
        assert request.num_computed_tokens == 0
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        assert len(request.block_table) == Request.num_pages_needed(scheduler.page_size, request.num_computed_tokens)
    arrival_order = [request.arrival_index for request in [*scheduler.running, *scheduler.waiting]]
    assert arrival_order == sorted(arrival_order)
    assert scheduler.num_running <= scheduler.max_num_seqs


def check_batch(scheduler: ReplicaScheduler, batch: ReplicaBatch) -> None:
    """Asserts a batch respects the budgets and its positions and slots follow the block tables."""
    assert batch.num_batched_tokens == sum(sequence.num_new_tokens for sequence in batch.sequences)
    assert batch.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert batch.num_seqs <= scheduler.max_num_seqs
    assert len({sequence.request.request_id for sequence in batch.sequences}) == batch.num_seqs
    page_size = scheduler.page_size
    for sequence in batch.sequences:
        start = sequence.kv_len - sequence.num_new_tokens
        assert sequence.positions == list(range(start, sequence.kv_len))
        assert sequence.token_ids == sequence.request.all_token_ids[start : sequence.kv_len]
        assert sequence.slots == [
            sequence.block_table[p // page_size] * page_size + p % page_size for p in sequence.positions
        ]
        assert sequence.completes_prompt == (sequence.kv_len == sequence.request.num_tokens)


def run_step(scheduler: ReplicaScheduler, model: FakeModel) -> tuple[ReplicaBatch, list[Request]]:
    """One checked engine step with the fake model."""
    batch = scheduler.schedule()
    check_batch(scheduler, batch)
    finished = scheduler.update(batch, model.step(batch, scheduler.page_size)).finished
    check_state(scheduler)
    return batch, finished


def run_alone(request_id, num_prompt_tokens, **sampling):
    """The output and finish reason of one request run alone in a big pool."""
    scheduler = make_scheduler(num_pages=256, max_model_len=1024)
    request = make_request(request_id, num_prompt_tokens, **sampling)
    scheduler.add_request(request)
    model = FakeModel()
    while scheduler.has_unfinished_requests():
        run_step(scheduler, model)
    return request.output_token_ids, request.finish_reason


def expected_output(request_id, num_prompt_tokens, params: SamplingParams):
    """The fake model's output computed directly: what the scheduler must produce however it batches."""
    output = []
    while True:
        token_id = fake_token(request_id, num_prompt_tokens + len(output))
        output.append(token_id)
        if len(output) >= params.min_tokens:
            if (token_id == EOS and not params.ignore_eos) or token_id in params.stop_token_ids:
                return output, "stop"
        if len(output) >= params.max_tokens:
            return output, "length"


# --- add_request ---


def test_rejects_an_empty_prompt():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="'a' has an empty prompt; give at least one prompt token"):
        scheduler.add_request(Request("a", []))


def test_rejects_a_request_over_max_model_len():
    scheduler = make_scheduler(max_model_len=20)
    with pytest.raises(ValueError, match=r"15 prompt tokens \+ max_tokens 6 = 21 tokens but max_model_len is 20; "):
        scheduler.add_request(make_request("a", 15, max_tokens=6))
    scheduler.add_request(make_request("b", 15, max_tokens=5))


def test_rejects_a_request_over_the_whole_pool():
    scheduler = make_scheduler(num_pages=5, page_size=4)  # 4 usable pages: 16 tokens
    with pytest.raises(ValueError, match="needs up to 5 pages of 4 tokens .* the pool has only 4; raise num_pages"):
        scheduler.add_request(make_request("a", 12, max_tokens=5))
    scheduler.add_request(make_request("b", 12, max_tokens=4))


def test_rejects_a_duplicate_request_id():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="'a' is already queued or running; use a unique id"):
        scheduler.add_request(make_request("a", 3))


def test_a_rejected_request_leaves_the_others_running():
    scheduler = make_scheduler(max_model_len=32)
    scheduler.add_request(make_request("ok1", 5, max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("bad", 40))
    scheduler.add_request(make_request("ok2", 5, max_tokens=3, ignore_eos=True))
    assert scheduler.num_waiting == 2
    model, finished = FakeModel(), []
    while scheduler.has_unfinished_requests():
        finished += run_step(scheduler, model)[1]
    assert [request.request_id for request in finished] == ["ok1", "ok2"]


def test_rejects_bad_budgets():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer, got 0"):
        make_scheduler(max_num_batched_tokens=0)


# --- schedule ---


def test_budgets_hold_every_step():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16)
    for index in range(6):
        scheduler.add_request(make_request(f"r{index}", 10, max_tokens=4, ignore_eos=True))
    model, num_steps = FakeModel(), 0
    while scheduler.has_unfinished_requests():
        batch, _ = run_step(scheduler, model)
        assert batch.num_batched_tokens <= 16 and batch.num_seqs <= 3
        num_steps += 1
    assert num_steps > 6


def test_a_long_prompt_is_chunked_with_contiguous_positions_and_slots():
    scheduler = make_scheduler(page_size=4, max_num_batched_tokens=8)
    request = make_request("long", 25, max_tokens=2, ignore_eos=True)
    scheduler.add_request(request)
    chunks = []
    for _ in range(4):
        batch = scheduler.schedule()
        (sequence,) = batch.sequences
        chunks.append(sequence)
        scheduler.update(batch, {"long": 7} if sequence.completes_prompt else {})
    assert [chunk.num_new_tokens for chunk in chunks] == [8, 8, 8, 1]
    assert [chunk.completes_prompt for chunk in chunks] == [False, False, False, True]
    assert sum((chunk.positions for chunk in chunks), []) == list(range(25))
    assert sum((chunk.token_ids for chunk in chunks), []) == request.prompt_token_ids
    assert request.block_table == [1, 2, 3, 4, 5, 6, 7]  # a fresh pool hands out 1, 2, 3, ...
    slots = sum((chunk.slots for chunk in chunks), [])
    assert slots == [request.block_table[p // 4] * 4 + p % 4 for p in range(25)] == list(range(4, 29))
    assert request.output_token_ids == [7] and request.num_computed_tokens == 25
    decode = scheduler.schedule().sequences[0]
    assert decode.token_ids == [7] and decode.positions == [25] and decode.slots == [7 * 4 + 1]


def test_decodes_and_prefill_chunks_share_a_batch():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("short", 4, max_tokens=8, ignore_eos=True))
    model = FakeModel()
    run_step(scheduler, model)  # "short" prefills and samples its first token.
    scheduler.add_request(make_request("long", 30, max_tokens=2))
    batch, _ = run_step(scheduler, model)
    assert [(s.request.request_id, s.num_new_tokens, s.completes_prompt) for s in batch.sequences] == [
        ("short", 1, True),
        ("long", 9, False),
    ]


def test_admits_in_arrival_order():
    scheduler = make_scheduler(max_num_seqs=1)
    for request_id in ["c", "a", "b"]:
        scheduler.add_request(make_request(request_id, 3, max_tokens=2, ignore_eos=True))
    model, order = FakeModel(), []
    while scheduler.has_unfinished_requests():
        batch, _ = run_step(scheduler, model)
        order += [s.request.request_id for s in batch.sequences if s.request.request_id not in order]
    assert order == ["c", "a", "b"]


def test_a_head_that_does_not_fit_blocks_later_requests():
    scheduler = make_scheduler(num_pages=7, page_size=4, max_num_batched_tokens=64)  # 6 usable pages
    scheduler.add_request(make_request("first", 12, max_tokens=4, ignore_eos=True))  # 3 pages now
    scheduler.add_request(make_request("big", 16, max_tokens=4))  # 4 pages: does not fit yet
    scheduler.add_request(make_request("small", 2, max_tokens=2))  # would fit, but must not overtake
    batch = scheduler.schedule()
    assert [s.request.request_id for s in batch.sequences] == ["first"]
    assert [request.request_id for request in scheduler.waiting] == ["big", "small"]


# --- update, finish, abort ---


def test_stops_on_eos_and_keeps_it():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10)
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(), {"a": 5})
    finished = scheduler.update(scheduler.schedule(), {"a": EOS}).finished
    assert finished == [request]
    assert request.finish_reason == "stop" and request.output_token_ids == [5, EOS]
    assert request.status is RequestStatus.FINISHED and not request.block_table
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_total_pages
    assert not scheduler.has_unfinished_requests()


def test_ignore_eos_runs_to_length():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=3, ignore_eos=True)
    scheduler.add_request(request)
    finished = []
    while not finished:
        finished = scheduler.update(scheduler.schedule(), {"a": EOS}).finished
    assert request.output_token_ids == [EOS] * 3 and request.finish_reason == "length"


def test_stops_on_a_stop_token_id():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10, stop_token_ids=[9])
    scheduler.add_request(request)
    for token_id in [5, 8, 9]:
        scheduler.update(scheduler.schedule(), {"a": token_id})
    assert request.output_token_ids == [5, 8, 9] and request.finish_reason == "stop"


def test_min_tokens_holds_back_stop():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    scheduler.add_request(request)
    for token_id in [EOS, 9, 4, EOS]:
        assert not request.is_finished
        scheduler.update(scheduler.schedule(), {"a": token_id})
    assert request.output_token_ids == [EOS, 9, 4, EOS] and request.finish_reason == "stop"


def test_length_at_max_tokens():
    output, finish_reason = run_alone("x", 5, max_tokens=4, ignore_eos=True)
    assert len(output) == 4 and finish_reason == "length"


def test_abort_a_running_and_a_waiting_request_frees_pages():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 9), make_request("wait", 3)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    batch = scheduler.schedule()
    assert running.block_table and scheduler.num_running == 1 and scheduler.num_waiting == 1
    assert scheduler.abort("run") is running and scheduler.abort("wait") is waiting
    assert (running.finish_reason, waiting.finish_reason) == ("abort", "abort")
    assert scheduler.abort("run") is None and scheduler.abort("unknown") is None
    assert scheduler.update(batch, {}).finished == []  # a batch built before the abort is ignored for aborted requests
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_total_pages
    assert not scheduler.has_unfinished_requests()
    check_state(scheduler)


def test_update_requires_a_token_for_each_completed_prompt():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        scheduler.update(scheduler.schedule(), {})


# --- preemption ---


def test_preemption_by_recompute_gives_the_outputs_of_isolated_runs(caplog):
    specs = [(f"r{index}", 6 + 5 * index, 12 + index) for index in range(6)]  # (id, prompt tokens, max_tokens)
    alone = {rid: run_alone(rid, num_prompt, max_tokens=max_tokens) for rid, num_prompt, max_tokens in specs}
    # 10 pages of 4 tokens: the largest request (31 + 17 tokens) fits alone, all six at once need about 40.
    scheduler = make_scheduler(num_pages=13, page_size=4, max_num_seqs=6, max_num_batched_tokens=16)
    requests = [make_request(rid, num_prompt, max_tokens=max_tokens) for rid, num_prompt, max_tokens in specs]
    for request in requests:
        scheduler.add_request(request)
    model, victims = FakeModel(), []
    with caplog.at_level(logging.INFO, logger="paxkv.scheduling.replica_scheduler"):
        for _ in range(1000):
            if not scheduler.has_unfinished_requests():
                break
            running_before = [request.request_id for request in scheduler.running]
            batch, _ = run_step(scheduler, model)
            for victim in batch.preempted_request_ids:
                # Victims are taken newest first from the requests running before the step.
                assert victim == running_before.pop()
                victims.append(victim)
    assert not scheduler.has_unfinished_requests()
    for request in requests:
        assert (request.output_token_ids, request.finish_reason) == alone[request.request_id]
    assert victims and scheduler.num_preemptions == len(victims)
    assert sum(request.num_preemptions for request in requests) == len(victims)
    assert requests[0].num_preemptions == 0  # the oldest request is never the victim
    assert sum("preempted request" in record.getMessage() for record in caplog.records) == len(victims)
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_total_pages


# --- property test ---

request_specs = st.lists(
    st.tuples(
        st.integers(1, 30),  # prompt tokens
        st.integers(1, 12),  # max_tokens
        st.integers(0, 3),  # min_tokens (capped at max_tokens)
        st.booleans(),  # ignore_eos
        st.integers(0, 6),  # arrival step
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=request_specs,
    page_size=st.integers(1, 6),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(1, 40),
    num_extra_pages=st.integers(0, 12),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=3),  # (step, request index)
    fit_step_sizes=st.booleans(),
)
def test_random_workloads_finish_with_consistent_pages(
    specs, page_size, max_num_seqs, max_num_batched_tokens, num_extra_pages, aborts, fit_step_sizes
):
    requests, params, arrivals = [], {}, collections.defaultdict(list)
    for index, (num_prompt, max_tokens, min_tokens, ignore_eos, arrival_step) in enumerate(specs):
        request_id = f"r{index}"
        params[request_id] = SamplingParams(
            max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos, stop_token_ids=[1]
        )
        requests.append(Request(request_id, [2 + (index + i) % 20 for i in range(num_prompt)], params[request_id]))
        arrivals[arrival_step].append(requests[-1])
    max_pages_alone = max(Request.num_pages_needed(page_size, r.num_prompt_tokens + 12) for r in requests)
    scheduler = make_scheduler(
        num_pages=1 + max_pages_alone + num_extra_pages,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
        step_sizes=power_of_two_buckets(max_num_batched_tokens) if fit_step_sizes else (),
    )
    abort_steps = collections.defaultdict(list)
    for step, index in aborts:
        abort_steps[step].append(requests[index % len(requests)].request_id)
    # The oldest unfinished request computes at least one token each step and recomputes at most once per output.
    max_num_steps = 7 + sum(r.num_prompt_tokens + 2 * r.sampling_params.max_tokens for r in requests)
    model, aborted = FakeModel(), set()
    # Steps this small are never trimmed at the shipped minimum size: fit them down to 2 tokens.
    with mock.patch.object(step_fitting, "MIN_FITTED_STEP_SIZE", 2):
        for step in range(max_num_steps + 1):
            for request in arrivals.get(step, []):
                scheduler.add_request(request)
            for request_id in abort_steps.get(step, []):
                if scheduler.abort(request_id) is not None:
                    aborted.add(request_id)
            check_state(scheduler)
            if step > 6 and not scheduler.has_unfinished_requests():
                break
            if scheduler.has_unfinished_requests():
                batch, _ = run_step(scheduler, model)
                assert not batch.is_empty  # progress every step: no deadlock
        else:
            pytest.fail(f"not finished after {max_num_steps} steps")
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_total_pages
    assert scheduler.num_preemptions == sum(request.num_preemptions for request in requests)
    for request in requests:
        assert request.status is RequestStatus.FINISHED and not request.block_table
        if request.request_id in aborted:
            assert request.finish_reason == "abort"
        else:
            expected = expected_output(request.request_id, request.num_prompt_tokens, params[request.request_id])
            assert (request.output_token_ids, request.finish_reason) == expected
