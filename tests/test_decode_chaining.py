"""Chained decode steps in the scheduler (paxkv.scheduling.decode_chaining), against a fake model that runs each
chained sequence's passes one by one: the outputs of isolated runs, consistent pages, and when a step may chain."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_replica_scheduler import (
    EOS,
    VOCAB_SIZE,
    FakeModel,
    check_state,
    expected_output,
    fake_token,
    make_request,
    make_scheduler,
)

from paxkv.config import EngineConfig
from paxkv.scheduling.decode_chaining import PLACEHOLDER_TOKEN, can_chain, most_passes
from paxkv.scheduling.replica_scheduler import ReplicaScheduler
from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduled_batch import ReplicaBatch


def stops_the_row(params: SamplingParams, token_id: int) -> bool:
    """Whether the device stops a chained row after it samples token_id (its stop tokens; min_tokens never chains)."""
    return (token_id == EOS and not params.ignore_eos) or token_id in params.stop_token_ids


def run_chained(model: FakeModel, batch: ReplicaBatch, page_size: int) -> tuple[ReplicaBatch, dict[str, list[int]]]:
    """Runs a chained batch as the device does, pass by pass: pass j writes the KV of the row's token j (its last
    known token, then its own samples) and samples the next, until a sample stops the row: its later passes write
    nothing and sample 0. Returns the batch with its placeholders filled in, as the model runner returns it, and
    each sequence's samples."""
    filled, samples = [], {}
    for sequence in batch.sequences:
        request = sequence.request
        known = request.all_token_ids
        own, stopped = [], False
        for j, (slot, position) in enumerate(zip(sequence.slots, sequence.positions, strict=True)):
            stopped = stopped or bool(own) and stops_the_row(request.sampling_params, own[-1])
            if stopped:
                own.append(0)
                continue
            token = sequence.token_ids[0] if j == 0 else own[-1]
            model.kv[slot] = (request.request_id, position, token)
            for read in range(position + 1):  # the pages it reads hold its tokens so far
                page_slot = sequence.block_table[read // page_size] * page_size + read % page_size
                expected = known[read] if read < len(known) else own[read - len(known)]
                model.check_read(page_slot, request.request_id, read, expected)
            own.append(fake_token(request.request_id, position + 1))
        assert sequence.token_ids[1:] == [PLACEHOLDER_TOKEN] * sequence.num_draft_tokens
        filled.append(dataclasses.replace(sequence, token_ids=sequence.token_ids[:1] + own[:-1]))
        samples[request.request_id] = own
    return dataclasses.replace(batch, sequences=filled), samples


def chained_step(scheduler: ReplicaScheduler, model: FakeModel, max_steps: int) -> ReplicaBatch:
    """One engine step as Scheduler.schedule plans it for one replica: chained where can_chain allows."""
    batch = scheduler.schedule()
    if can_chain(batch, scheduler.num_waiting) and batch.sequences:
        batch = scheduler.chain_decodes(batch, max_steps)
    if batch.decode_steps > 1:
        assert batch.num_batched_tokens == sum(s.num_new_tokens for s in batch.sequences)
        assert all(1 <= s.num_new_tokens <= max_steps for s in batch.sequences)
        batch, sampled = run_chained(model, batch, scheduler.page_size)
    else:
        sampled = model.step(batch, scheduler.page_size)
    scheduler.update(batch, sampled)
    check_state(scheduler)
    return batch


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 40),  # prompt tokens
            st.integers(1, 30),  # max_tokens
            st.booleans(),  # ignore_eos
            st.integers(0, 4),  # min_tokens
            st.integers(0, 3),  # arrival step
        ),
        min_size=1,
        max_size=8,
    ),
    num_pages=st.integers(24, 80),
    max_steps=st.integers(2, 6),
)
def test_chained_steps_give_the_outputs_of_isolated_runs(requests, num_pages, max_steps):
    scheduler = make_scheduler(num_pages=num_pages, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    model = FakeModel()
    pending = []
    for index, (num_prompt, max_tokens, ignore_eos, min_tokens, arrival) in enumerate(requests):
        params = dict(max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min(min_tokens, max_tokens))
        request = make_request(f"r{index}", num_prompt, **params)
        pending.append((arrival, request, expected_output(request.request_id, num_prompt, request.sampling_params)))
    step, num_chained = 0, 0
    while any(arrival >= step for arrival, _, _ in pending) or scheduler.has_unfinished_requests():
        for arrival, request, _ in pending:
            if arrival == step:
                scheduler.add_request(request)
        num_chained += chained_step(scheduler, model, max_steps).decode_steps > 1
        step += 1
        assert step < 500
    for _, request, (output, finish_reason) in pending:
        assert (request.output_token_ids, request.finish_reason) == (output, finish_reason)
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_total_pages
    (_, max_tokens, ignore_eos, min_tokens, _), *others = requests
    if not others and ignore_eos and min_tokens <= 1 and max_tokens >= 3 and num_pages >= 60:
        # A lone request with two plain tokens left after its first, in a pool that holds it, chains. (With
        # others, every decode may fall while another waits, or before min_tokens.)
        assert num_chained


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.lists(
        st.tuples(
            st.integers(1, 9),  # new prompt tokens
            st.integers(1, 24),  # max_tokens
            st.integers(1, VOCAB_SIZE - 1),  # a stop token
        ),
        min_size=2,
        max_size=4,
    ),
    max_steps=st.integers(2, 8),
)
def test_a_conversation_over_chained_steps_reads_only_kv_that_was_written(turns, max_steps):
    """Turns of one conversation under a prefix cache, each prompt the last turn's tokens and output and some new
    tokens: every slot a step reads holds its own token's KV, though a chain that stopped early wrote none for its
    stop token; and each turn's output is the fake model's."""
    scheduler = make_scheduler(num_pages=64, page_size=4, max_num_batched_tokens=16, prefix_caching=True)
    model = FakeModel(shared_prefixes=True)
    tokens = []
    for index, (num_new, max_tokens, stop) in enumerate(turns):
        tokens = tokens + [1 + (index + i) % (VOCAB_SIZE - 1) for i in range(num_new)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[stop])
        request = Request(f"t{index}", list(tokens), params)
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            chained_step(scheduler, model, max_steps)
        output, finish_reason = expected_output(request.request_id, len(tokens), params)
        assert (request.output_token_ids, request.finish_reason) == (output, finish_reason)
        tokens = request.all_token_ids  # the next turn extends this one, its stop token included
    if len(tokens) > 5:  # its KV filled a page at least
        assert scheduler.prefix_trie.num_cached_pages


def test_a_chain_stops_at_max_tokens():
    scheduler = make_scheduler(num_pages=64, page_size=4, max_num_batched_tokens=64, max_model_len=40)
    short = make_request("short", 5, max_tokens=6, ignore_eos=True)
    near_end = make_request("near_end", 35, max_tokens=5, ignore_eos=True)  # reaches the whole context
    for request in (short, near_end):
        scheduler.add_request(request)
    model = FakeModel()
    chained_step(scheduler, model, 4)  # both prompts, one token each
    assert most_passes(short, 4, 40) == 4 and most_passes(near_end, 4, 40) == 4
    batch = chained_step(scheduler, model, 4)
    assert batch.decode_steps == 4 and [s.num_new_tokens for s in batch.sequences] == [4, 4]
    assert short.num_output_tokens == 5 and near_end.num_output_tokens == 5 and near_end.num_tokens == 40
    assert near_end.is_finished and near_end.finish_reason == "length"
    batch = chained_step(scheduler, model, 4)  # one token left: a plain step
    assert batch.decode_steps == 1
    assert short.output_token_ids == expected_output("short", 5, short.sampling_params)[0]
    assert not scheduler.has_unfinished_requests()


def test_a_stop_token_inside_a_chain_drops_the_later_samples_and_frees_the_pages():
    # The fake model's samples for this request, found ahead: stop at the third token of a 4-pass chain.
    request_id, num_prompt = "s", 6
    samples = [fake_token(request_id, num_prompt + i) for i in range(6)]
    stop = samples[3]
    assert stop not in samples[:3]
    scheduler = make_scheduler(num_pages=32, page_size=4)
    request = make_request(request_id, num_prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    scheduler.add_request(request)
    model = FakeModel()
    chained_step(scheduler, model, 4)
    batch = chained_step(scheduler, model, 4)
    assert batch.decode_steps == 4
    assert request.output_token_ids == samples[:4] and request.finish_reason == "stop"
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_total_pages


def test_a_row_that_stops_inside_a_chain_caches_only_the_kv_its_passes_wrote():
    # A prompt of 4 and a stop at the fourth sample, drawn by the third of 4 passes: the stop token lies on the last
    # slot of page 1, which only the skipped fourth pass would have written. Page 0 alone holds computed KV.
    num_prompt = 4

    def fourth_sample_is_new(request_id):
        samples = [fake_token(request_id, num_prompt + i) for i in range(4)]
        return samples[3] not in samples[:3]

    request_id = next(f"s{i}" for i in range(100) if fourth_sample_is_new(f"s{i}"))
    stop = fake_token(request_id, num_prompt + 3)
    scheduler = make_scheduler(num_pages=32, page_size=4, prefix_caching=True)
    request = make_request(request_id, num_prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    scheduler.add_request(request)
    model = FakeModel()
    chained_step(scheduler, model, 4)
    batch = chained_step(scheduler, model, 4)
    assert batch.decode_steps == 4 and request.finish_reason == "stop" and request.num_tokens == 8
    assert scheduler.prefix_trie.num_cached_pages == 1
    (page,) = scheduler.prefix_trie.match(request.all_token_ids + [1], touch=False)
    assert [model.kv[page * 4 + i] for i in range(4)] == [(request_id, i, i + 1) for i in range(4)]


# Watermark 3: the one free page is below it, yet each chain still runs to the end of the page it holds.
@pytest.mark.parametrize("watermark, passes, free", [(1, [4, 4], 1), (0, [8, 4], 0), (3, [4, 4], 1)])
def test_a_chain_takes_only_pages_above_the_watermark_and_never_preempts(watermark, passes, free):
    scheduler = make_scheduler(num_pages=9, page_size=4)  # 8 usable pages
    scheduler.watermark_pages = watermark
    for request_id, num_prompt in (("a", 12), ("b", 8)):
        scheduler.add_request(make_request(request_id, num_prompt, max_tokens=16, ignore_eos=True))
    model = FakeModel()
    chained_step(scheduler, model, 8)  # both prompts: 5 pages
    # Their next tokens take a page each (7 used); 8 passes of "a" need one page more, and of "b" too.
    batch = chained_step(scheduler, model, 8)
    assert batch.decode_steps == 8 and not batch.preempted_request_ids
    assert [s.num_new_tokens for s in batch.sequences] == passes
    assert scheduler.allocator.num_free_pages == free


@pytest.mark.parametrize(
    "sampling, chains",
    [
        ({}, True),
        ({"presence_penalty": 0.5}, False),
        ({"logprobs": 2}, False),
        ({"min_tokens": 5, "ignore_eos": False}, False),
    ],
)
def test_only_plain_decodes_chain(sampling, chains):
    scheduler = make_scheduler()
    request = make_request("a", 5, max_tokens=20, **sampling)
    scheduler.add_request(request)
    model = FakeModel()
    chained_step(scheduler, model, 4)  # the prompt never chains
    assert chained_step(scheduler, model, 4).decode_steps == (4 if chains else 1)


def test_nothing_chains_while_a_request_waits():
    scheduler = make_scheduler(max_num_seqs=1)
    for request_id in ("a", "b"):
        scheduler.add_request(make_request(request_id, 5, max_tokens=6, ignore_eos=True))
    model = FakeModel()
    steps = [chained_step(scheduler, model, 4) for _ in range(6)]
    assert [s.decode_steps for s in steps] == [1] * 6  # "a" decodes alone while "b" waits
    while scheduler.has_unfinished_requests():
        steps.append(chained_step(scheduler, model, 4))
    assert max(s.decode_steps for s in steps) == 4  # "b" chains once nothing waits
    assert scheduler.running == []


def test_a_chain_evicts_idle_cached_pages_as_a_decode_would():
    scheduler = make_scheduler(num_pages=9, page_size=4, max_model_len=64, prefix_caching=True)  # 8 usable pages
    allocator = scheduler.allocator
    model = FakeModel()
    scheduler.add_request(make_request("old", 16, max_tokens=1, ignore_eos=True))
    chained_step(scheduler, model, 16)  # its 4 full prompt pages stay cached, idle
    assert scheduler.prefix_trie.num_cached_pages == 4 and allocator.num_free_pages == 4
    new = Request("new", list(range(100, 106)), SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add_request(new)
    chained_step(scheduler, model, 16)  # its prompt: 2 pages
    batch = chained_step(scheduler, model, 16)  # 16 passes reach position 21: 4 more pages, 2 of them cached ones
    assert [s.num_new_tokens for s in batch.sequences] == [16]
    assert scheduler.prefix_trie.num_evictions == 2
    assert new.output_token_ids == expected_output("new", 6, new.sampling_params)[0][:17]


def test_num_scheduler_steps_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="num_scheduler_steps must be a positive integer, got 0"):
        EngineConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps must be a positive integer, got 2.5"):
        EngineConfig(num_scheduler_steps=2.5)
    steps = EngineConfig(num_scheduler_steps=np.int64(4)).num_scheduler_steps
    assert steps == 4 and type(steps) is int
