"""Engine outputs beyond tokens: top-k logprobs against transformers, metrics, compilation bounds, bad configs."""

import numpy as np
import pytest
import torch
import transformers

import models
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.scheduling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(engine_llama_checkpoint):
    """A tiny random Llama saved by transformers, and the same model loaded by paxkv."""
    torch_model = transformers.LlamaForCausalLM.from_pretrained(engine_llama_checkpoint).eval()
    return torch_model, models.load(engine_llama_checkpoint, require_tokenizer=False)


def test_top_logprobs_match_transformers(tiny):
    torch_model, loaded = tiny
    prompt = np.random.default_rng(1).integers(0, 256, 37).tolist()
    engine = Engine(loaded, EngineConfig(num_pages=64, max_num_seqs=4))
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5))
    completion = drain(engine)["a"].outputs[0]
    with torch.no_grad():
        logits = torch_model(torch.tensor([prompt + completion.token_ids])).logits[0]
    reference = torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1 : -1]  # [6, vocab]
    assert len(completion.logprobs) == 6
    for position, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        top_values, top_ids = reference[position].topk(5)
        assert list(entry)[:5] == top_ids.tolist()
        assert [entry[t].rank for t in top_ids.tolist()] == [1, 2, 3, 4, 5]
        np.testing.assert_allclose([entry[t].logprob for t in top_ids.tolist()], top_values.numpy(), atol=2e-5)
        assert entry[token_id].rank == 1  # greedy picks the most likely token
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    expected_cumulative = sum(entry[t].logprob for t, entry in pairs)
    assert completion.cumulative_logprob == pytest.approx(expected_cumulative)


def test_logprobs_zero_gives_the_sampled_token_only_with_its_rank(tiny):
    torch_model, loaded = tiny
    prompt = [5, 6, 7, 8]
    engine = Engine(loaded, EngineConfig(num_pages=64, max_num_seqs=4))
    params = SamplingParams(temperature=5.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)
    engine.add_request("a", prompt, params)
    completion = drain(engine)["a"].outputs[0]
    with torch.no_grad():
        logits = torch_model(torch.tensor([prompt + completion.token_ids])).logits[0].double()
    reference = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    for position, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert list(entry) == [token_id]
        expected_rank = int((reference[position] >= reference[position, token_id]).sum())  # as vLLM counts
        assert entry[token_id].rank == expected_rank
        assert entry[token_id].logprob == pytest.approx(float(reference[position, token_id]), abs=2e-5)
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    assert any(entry[t].rank > 1 for t, entry in pairs)  # a hot temperature samples below the top


def test_metrics_count_tokens_pages_and_waste(tiny):
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(num_pages=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=64))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", list(range(1, 21)), params)  # 20 + 10 tokens: 2 pages
    engine.add_request("b", list(range(1, 4)), params)  # 3 + 10 tokens: 1 page
    finished = drain(engine)
    metrics = engine.metrics
    assert metrics.num_requests == metrics.num_finished_requests == 2
    assert metrics.num_prompt_tokens == 23 and metrics.num_generated_tokens == 20
    assert metrics.num_computed_tokens == 23 + 2 * 9  # the last sampled token's KV is never computed
    assert metrics.peak_kv_pages_used == 3 and metrics.kv_pages_used == 0
    # a computed 29 tokens, so its first page is full and stays in the prefix cache, idle, after it finished.
    assert metrics.kv_pages_cached_idle == metrics.kv_pages_cached == 1 and metrics.kv_pages_free == 62
    # Allocated vs filled slots after each step: step 1 prefills both (a: 2 pages for 20 tokens, b: 1 page for 3);
    # decode steps 2..9 hold the same 3 pages while a fills 21..28 and b 4..11 slots; at step 10 both finish.
    allocated = 48 + 8 * 48
    filled = 23 + sum((19 + k) + (2 + k) for k in range(2, 10))
    assert metrics.kv_waste_fraction == pytest.approx((allocated - filled) / allocated)
    assert metrics.num_preemptions == 0 and metrics.num_compilations >= 1
    assert metrics.generated_tokens_per_s > 0
    for output in finished.values():
        request_metrics = output.metrics
        assert request_metrics.num_generated_tokens == 10
        assert 0 <= request_metrics.queue_time <= request_metrics.time_to_first_token
        assert request_metrics.decode_tokens_per_s > 0


def test_compilations_stay_within_the_buckets_over_100_mixed_requests(tiny):
    _, loaded = tiny
    rng = np.random.default_rng(7)
    config = EngineConfig(num_pages=96, max_num_seqs=8, max_num_batched_tokens=64)
    engine = Engine(loaded, config)
    before = engine.num_compilations
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=10, top_p=0.9),
        dict(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5),
        dict(temperature=0.0, min_tokens=3),
        dict(temperature=1.0, logprobs=3),
    ]
    pending = []
    for index in range(100):
        prompt = rng.integers(0, 256, int(rng.integers(1, 150))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(3, 12)), seed=index, **kinds[index % len(kinds)])
        pending.append((str(index), prompt, params))
    finished = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                engine.add_request(*pending.pop(0))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert len(finished) == 100
    new_programs = engine.num_compilations - before
    # Each step shape is a forward (T, S, R) and a sampling (S, R, optional parts); shapes share both.
    shapes = engine.runner.step_shapes
    forwards, samplings = {(t, s, r) for t, s, *_, r in shapes}, {shape[1:] for shape in shapes}
    assert new_programs <= len(forwards) + len(samplings) <= engine.max_step_programs
    assert len(forwards) < len(shapes) and len(samplings) < len(shapes)
    assert engine.metrics.num_steps > 3 * len(engine.runner.step_shapes)  # most steps reuse a compiled program


def test_a_pool_without_one_page_per_sequence_is_refused(tiny):
    _, loaded = tiny
    with pytest.raises(ValueError, match="num_pages=5 leaves 4 usable pages.*max_num_seqs=8"):
        Engine(loaded, EngineConfig(num_pages=5, max_num_seqs=8))
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000 .*raise num_pages or kv_cache_memory_bytes"):
        Engine(loaded, EngineConfig(kv_cache_memory_bytes=1000, max_num_seqs=8))


def test_malformed_requests_name_the_problem(tiny):
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(num_pages=32, max_num_seqs=4))
    with pytest.raises(ValueError, match="n=5 samples but at most max_num_seqs=4"):
        engine.add_request("n", [1, 2], SamplingParams(n=5))
    with pytest.raises(ValueError, match="contains '#'"):
        engine.add_request("a#1", [1, 2])
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        engine.add_request("salt", [1, 2], cache_salt=3)
    with pytest.raises(ValueError, match="priority must be an int"):
        engine.add_request("p", [1, 2], priority="high")
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        engine.add_request("d", [1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match=r"request 's': token id 0 is 'a' \(str\); token ids must be integers"):
        engine.add_request("s", ["a", "b"])
    with pytest.raises(ValueError, match=r"request 'f': token id 1 is 2\.5 \(float\); token ids must be integers"):
        engine.add_request("f", [1, 2.5])
    with pytest.raises(ValueError, match=r"request 'i': token ids must be a list of integers, not int"):
        engine.add_request("i", 7)
    with pytest.raises(ValueError, match="stop_token_ids outside the vocabulary"):
        engine.add_request("t", [1, 2], SamplingParams(stop_token_ids=[5, 10_000], min_tokens=2))
    with pytest.raises(ValueError, match="logprobs must be None or in \\[0, 20\\]"):
        SamplingParams(logprobs=21)
    assert not engine.has_unfinished_requests() and engine.metrics.num_requests == 0


def test_peak_pages_count_requests_that_finish_in_their_first_step(tiny):
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(num_pages=32, page_size=16, max_num_seqs=4, max_num_batched_tokens=64))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("a", list(range(1, 21)), params)  # 2 pages
    engine.add_request("b", list(range(1, 4)), params)  # 1 page
    drain(engine)
    assert engine.metrics.num_steps == 1 and engine.metrics.peak_kv_pages_used == 3
    assert engine.metrics.kv_pages_used == 0


def test_stop_token_sets_stop_reason_without_a_tokenizer(tiny):
    _, loaded = tiny
    assert loaded.tokenizer is None
    engine = Engine(loaded, EngineConfig(num_pages=32, max_num_seqs=4))
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("free", [3, 1, 4, 1, 5], greedy)
    first_token = drain(engine)["free"].outputs[0].token_ids[0]
    stopping = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, stop_token_ids=[first_token])
    engine.add_request("stopped", [3, 1, 4, 1, 5], stopping)
    completion = drain(engine)["stopped"].outputs[0]
    assert completion.token_ids == [first_token]
    assert completion.finish_reason == "stop" and completion.stop_reason == first_token


def test_a_final_only_request_has_one_output_the_step_it_finishes_and_the_same_completion(tiny):
    """final_only (as LLM.generate adds its requests): no output before the request finishes, then the same
    RequestOutput a request without it ends with; n = 2 samples report once both finished; others still stream."""
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(num_pages=64, max_num_seqs=8))
    prompt = [7, 3, 9, 1, 4, 4, 2]
    seeded = dict(temperature=0.8, seed=5, ignore_eos=True)
    engine.add_request("streamed", prompt, SamplingParams(max_tokens=5, **seeded))
    engine.add_request("final", prompt, SamplingParams(max_tokens=5, **seeded), final_only=True)
    engine.add_request("pair", prompt, SamplingParams(n=2, max_tokens=3, **seeded), final_only=True)
    seen: dict[str, list] = {"streamed": [], "final": [], "pair": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["streamed"]) == 5 and [o.finished for o in seen["streamed"]] == [False] * 4 + [True]
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert len(seen["pair"]) == 1 and seen["pair"][0].finished and len(seen["pair"][0].outputs) == 2
    final, streamed = seen["final"][0].outputs[0], seen["streamed"][-1].outputs[0]
    assert final.token_ids == streamed.token_ids and len(final.token_ids) == 5
    assert final.finish_reason == streamed.finish_reason == "length"
    assert seen["final"][0].metrics.first_token_time is not None
