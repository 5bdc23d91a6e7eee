"""Speculative steps at the scheduler, with stand-in drafters and a fake model: rollback, the prefix cache, stops
inside accepted drafts, and 10k random operations with every page accounted for."""

import numpy as np
import pytest

from paxkv.config import SpeculativeConfig
from paxkv.execution.step_inputs import power_of_two_buckets
from paxkv.scheduling import step_fitting
from paxkv.scheduling.page_allocator import PageAllocator
from paxkv.scheduling.prefix_trie import PrefixTrie
from paxkv.scheduling.replica_scheduler import ReplicaScheduler
from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams


class FixedDrafter:
    """Proposes the same drafts for every decoding sequence, and records the verdicts (a stand-in for Drafter)."""

    config = SpeculativeConfig(method="ngram")

    def __init__(self, drafts):
        self.drafts, self.verdicts = drafts, []

    def choose(self, sequences, num_tokens, token_budget, max_model_len, nothing_waiting=False):
        return [(i, list(self.drafts)) for i, s in enumerate(sequences) if s.num_new_tokens == 1 and s.completes_prompt]

    def observe_verified(self, request, num_drafts, num_accepted):
        self.verdicts.append((num_drafts, num_accepted))

    def forget(self, request_id):
        pass


def _speculating_scheduler(drafts):
    allocator = PageAllocator(16)
    trie = PrefixTrie(allocator, 4)
    scheduler = ReplicaScheduler(
        allocator,
        page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        eos_token_ids=[0],
        prefix_trie=trie,
        drafter=FixedDrafter(drafts),
    )
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=20))
    scheduler.add_request(request)
    batch = scheduler.schedule()
    scheduler.update(batch, {"r": 4})  # prompt done, first output token 4
    return scheduler, allocator, trie, request


def test_rejected_drafts_give_their_pages_back_and_never_reach_the_prefix_cache():
    scheduler, allocator, trie, request = _speculating_scheduler([5, 6, 7, 8, 9, 10])
    free_before = allocator.num_free_pages
    batch = scheduler.schedule()
    (sequence,) = batch.sequences
    assert sequence.token_ids == [4, 5, 6, 7, 8, 9, 10] and sequence.num_draft_tokens == 6
    assert allocator.num_free_pages == free_before - 2  # positions 4..9 need two more pages
    outcome = scheduler.update(batch, {"r": [5, 11]})  # draft 5 stands, 6 does not: 11 comes instead
    assert request.output_token_ids == [4, 5, 11] and outcome.num_taken == {"r": 2}
    assert request.num_computed_tokens == 5 and len(request.block_table) == 2  # the page of 6..9 went back
    assert allocator.num_free_pages == free_before - 1
    assert trie.num_cached_pages == 1  # only [1, 2, 3, 4]: the second page holds one verified token
    assert scheduler.drafter.verdicts == [(6, 1)]
    scheduler.check_page_invariants()
    with pytest.raises(ValueError, match="give its accepted drafts"):
        scheduler.update(scheduler.schedule(), {"r": [9, 9]})  # 9 was never drafted there


def test_a_stop_among_accepted_drafts_drops_the_tokens_after_it():
    scheduler, allocator, trie, request = _speculating_scheduler([5, 0, 7])
    batch = scheduler.schedule()
    outcome = scheduler.update(batch, {"r": [5, 0, 7, 8]})  # every draft stands, but 0 is EOS
    assert request.output_token_ids == [4, 5, 0] and request.finish_reason == "stop"
    assert outcome.num_taken == {"r": 2} and outcome.finished == [request]  # 5 and the EOS
    assert trie.num_cached_pages == 1 and allocator.num_free_pages == allocator.num_total_pages - 1
    scheduler.check_page_invariants()


class RandomDrafter:
    """Drafts up to k tokens for every decoding sequence, each the fake model's own next token with probability
    `hit`, so acceptance is random; a stand-in for Drafter in the scheduler's state machine, as a draft model's (the
    scheduler keeps how far the draft's KV reaches)."""

    config = SpeculativeConfig(method="draft_model", model="draft")

    def __init__(self, rng, k: int, hit: float):
        self.rng, self.k, self.hit = rng, k, hit
        self.num_drafts = self.num_accepted = 0

    def choose(self, sequences, num_tokens, token_budget, max_model_len, nothing_waiting=False):
        from test_replica_scheduler import fake_token

        chosen = []
        for index, sequence in enumerate(sequences):
            request = sequence.request
            room = min(
                request.sampling_params.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens
            )
            count = min(int(self.rng.integers(0, self.k + 1)), room - 1, token_budget)
            if sequence.num_new_tokens != 1 or not sequence.completes_prompt or count <= 0:
                continue
            drafts = [
                fake_token(request.request_id, request.num_tokens + j) if self.rng.random() < self.hit else 1000 + j
                for j in range(count)
            ]
            chosen.append((index, drafts))
            token_budget -= count
        return chosen

    def observe_verified(self, request, num_drafts, num_accepted):
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted

    def forget(self, request_id):
        pass


def _fake_speculative_step(batch, page_size: int, kv: dict, draft_kv: dict | None = None) -> dict:
    """The fake model of test_replica_scheduler with drafts: the token at position p is fake_token(id, p); a draft
    stands while it equals that token. Checks every read through the block tables, drafts' slots included (a slot
    holds (position, token): a prefix-cache page shared by two requests holds the same tokens for both). With
    `draft_kv`, a draft model's KV too, as DraftModelProposer writes it: each drafting row reads what
    Request.num_draft_computed says its pages hold, and writes the rest through its last token and its drafts."""
    from test_replica_scheduler import fake_token

    def slot_of(sequence, position):
        return sequence.block_table[position // page_size] * page_size + position % page_size

    for sequence in batch.sequences if draft_kv is not None else ():
        if sequence.num_draft_tokens:
            request, last = sequence.request, sequence.positions[0]
            known = request.all_token_ids
            for position in range(request.num_draft_computed):
                assert draft_kv[slot_of(sequence, position)] == (position, known[position]), request.request_id
            for position in range(request.num_draft_computed, last + 1):
                draft_kv[slot_of(sequence, position)] = (position, known[position])
            for j, token_id in enumerate(sequence.draft_token_ids):
                draft_kv[slot_of(sequence, last + 1 + j)] = (last + 1 + j, token_id)
    for sequence in batch.sequences:
        for slot, position, token_id in zip(sequence.slots, sequence.positions, sequence.token_ids, strict=True):
            kv[slot] = (position, token_id)
    given = {}
    for sequence in batch.sequences:
        request = sequence.request
        known, first = request.all_token_ids, sequence.kv_len - sequence.num_new_tokens
        for position in range(sequence.kv_len):
            slot = sequence.block_table[position // page_size] * page_size + position % page_size
            token_id = known[position] if position < len(known) else sequence.token_ids[position - first]
            assert kv[slot] == (position, token_id), request.request_id
        if not sequence.completes_prompt:
            continue
        tokens = []
        for j, draft in enumerate(sequence.draft_token_ids):
            tokens.append(fake_token(request.request_id, request.num_tokens + j))
            if tokens[-1] != draft:
                break
        else:
            tokens.append(fake_token(request.request_id, sequence.kv_len))
        given[request.request_id] = tokens
    return given


@pytest.mark.parametrize("fit_step_sizes", [False, True])
def test_random_speculative_steps_keep_every_page_accounted_for_and_the_output_exact(fit_step_sizes, monkeypatch):
    """10k scheduler operations (arrivals, aborts, speculative steps with random acceptance) on a tight pool with
    prefix caching, with steps fitted to power-of-two sizes or not: after every step each page's ref count equals
    its holders, every read of the target's and the draft model's KV finds its tokens, and at the end no page leaks
    and every request's output is the one plain decoding gives."""
    from test_replica_scheduler import EOS, check_state, fake_token

    monkeypatch.setattr(step_fitting, "MIN_FITTED_STEP_SIZE", 2)  # these steps are far below the shipped 64

    rng = np.random.default_rng(0)
    page_size, max_model_len = 4, 48
    allocator = PageAllocator(40)
    scheduler = ReplicaScheduler(
        allocator,
        page_size=page_size,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
        prefix_trie=PrefixTrie(allocator, page_size),
        drafter=RandomDrafter(rng, k=5, hit=0.6),
        step_sizes=power_of_two_buckets(24) if fit_step_sizes else (),
    )
    match, draft_reuse = scheduler.prefix_sharing.match, []

    def noting_draft_reuse(request):  # how far a prefix hit's pages hold the draft's KV
        num_tokens = match(request)
        draft_reuse.append(request.num_draft_computed)
        return num_tokens

    scheduler.prefix_sharing.match = noting_draft_reuse
    requests, kv, draft_kv, operations = [], {}, {}, 0
    while operations < 10_000:
        if rng.random() < 0.4:
            prompt = [2 + int(t) for t in rng.integers(0, 6, int(rng.integers(1, 20)))]  # shared prefixes are common
            params = SamplingParams(max_tokens=int(rng.integers(1, 24)), stop_token_ids=[1])
            requests.append(Request(f"r{len(requests)}", prompt, params))
            scheduler.add_request(requests[-1])
            operations += 1
        if requests and rng.random() < 0.03:
            scheduler.abort(requests[int(rng.integers(len(requests)))].request_id)
            operations += 1
        if scheduler.has_unfinished_requests():
            batch = scheduler.schedule()
            scheduler.update(batch, _fake_speculative_step(batch, page_size, kv, draft_kv))
            check_state(scheduler)
            operations += 2
    while scheduler.has_unfinished_requests():
        batch = scheduler.schedule()
        scheduler.update(batch, _fake_speculative_step(batch, page_size, kv, draft_kv))
        check_state(scheduler)
    assert len(requests) > 1000 and scheduler.prefix_trie.num_cached_pages > 0
    scheduler.prefix_trie.evict(allocator.num_total_pages)
    assert allocator.num_free_pages == allocator.num_total_pages  # nothing leaked
    drafter = scheduler.drafter
    assert 0 < drafter.num_accepted < drafter.num_drafts
    assert any(draft_reuse)  # some prefix hits reused the draft's KV in cached pages (checked at every read)
    for request in requests:
        if request.finish_reason == "abort":
            continue
        expected = []
        while True:
            expected.append(fake_token(request.request_id, request.num_prompt_tokens + len(expected)))
            if expected[-1] in (EOS, 1):
                reason = "stop"
                break
            if (
                len(expected) >= request.sampling_params.max_tokens
                or request.num_prompt_tokens + len(expected) >= max_model_len
            ):
                reason = "length"
                break
        assert (request.output_token_ids, request.finish_reason) == (expected, reason), request.request_id


def test_a_step_is_fitted_to_its_size_around_its_drafts():
    """A decode with two drafts beside 299 prompt tokens (302) runs at 256: the prompt gives up 46 tokens, the
    drafts stay; the next step (the drafts again and the prompt's last 46 tokens, 49) is too small to fit."""
    scheduler = ReplicaScheduler(
        PageAllocator(128),
        page_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        max_model_len=1024,
        eos_token_ids=[0],
        drafter=FixedDrafter([5, 6]),
        step_sizes=power_of_two_buckets(512),
    )
    scheduler.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=20)))
    scheduler.update(scheduler.schedule(), {"r": 4})
    scheduler.add_request(Request("long", list(range(1, 300)), SamplingParams(max_tokens=1)))
    batch = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.num_draft_tokens) for s in batch.sequences] == [
        ("r", 3, 2), ("long", 253, 0)
    ]  # fmt: skip
    assert batch.num_batched_tokens == 256
    scheduler.update(batch, {"r": [5, 8]})  # draft 5 stands, 6 does not
    batch = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.num_draft_tokens) for s in batch.sequences] == [
        ("r", 3, 2), ("long", 46, 0)
    ]  # fmt: skip
