"""Prefix caching and parallel sampling in the engine: the same greedy tokens with the cache on and off."""

import numpy as np
import pytest

import models
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.scheduling.sampling_params import SamplingParams

PAGE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_llama_checkpoint):
    """A tiny random Llama (saved by transformers) with a 2,048-token context."""
    path = tiny_llama_checkpoint(max_position_embeddings=2048, initializer_range=0.1)
    return models.load(path, require_tokenizer=False)


def _engine(loaded, caching: bool, **config) -> Engine:
    # min_padded_seqs: TPU's row floor, for fewer programs to compile (steps of fewer rows: test_engine).
    defaults = dict(num_pages=600, page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1200)
    defaults["min_padded_seqs"] = 8
    return Engine(loaded, EngineConfig(enable_prefix_caching=caching, **{**defaults, **config}))


def _run(engine: Engine, prompts: dict[str, list[int]], params=GREEDY, salts=None) -> dict[str, list]:
    """Add every prompt, step to the end; return each request's completions' token ids."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params, cache_salt=(salts or {}).get(request_id))
    finished = drain(engine, on_step=lambda _: engine.scheduler.check_page_invariants())
    return {request_id: [c.token_ids for c in output.outputs] for request_id, output in finished.items()}


def _tokens(rng, n):
    return rng.integers(1, 256, n).tolist()


def test_shared_system_prompt(loaded):
    """One 1,000-token system prompt and 16 different questions: one copy of the prompt's KV, same tokens."""
    rng = np.random.default_rng(0)
    system = _tokens(rng, 1000)
    prompts = {f"q{i}": system + _tokens(rng, int(rng.integers(5, 40))) for i in range(16)}
    on, off = _engine(loaded, True), _engine(loaded, False)
    assert _run(on, prompts) == _run(off, prompts)
    full_pages = 1000 // PAGE * PAGE  # 992 tokens of the system prompt fill whole pages
    metrics = on.metrics
    assert metrics.prefix_query_tokens == sum(map(len, prompts.values()))
    # Every question after the first finds the system prompt's full pages; the second, admitted while the
    # first was mid-prefill, finds at least the first chunk's.
    assert metrics.prefix_hit_tokens >= 14 * full_pages + 512
    assert metrics.peak_kv_pages_used < off.metrics.peak_kv_pages_used / 3
    assert off.metrics.prefix_hit_tokens == 0 and off.metrics.kv_pages_cached == 0


def test_multi_turn_chat_reuses_the_earlier_answer(loaded):
    rng = np.random.default_rng(1)
    turn1, follow_up = _tokens(rng, 50), _tokens(rng, 30)
    for caching in (True, False):
        engine = _engine(loaded, caching)
        answer = _run(engine, {"t1": turn1})["t1"][0]
        hits_before = engine.metrics.prefix_hit_tokens
        turn2 = turn1 + answer + follow_up
        second = _run(engine, {"t2": turn2})["t2"]
        if caching:
            # Turn 1 computed its 50 prompt tokens and 7 of its 8 answer tokens (the last one's KV never is):
            # 57 tokens, so 3 full pages, one of them holding answer tokens.
            assert engine.metrics.prefix_hit_tokens - hits_before == 3 * PAGE
            cached_second = second
        else:
            assert second == cached_second


@pytest.mark.parametrize(
    "divergence,expected_hit",
    [
        (20, PAGE),  # inside the second page: only the first page is shared
        (32, 2 * PAGE),  # exactly at a page boundary
        (33, 2 * PAGE),  # one token after it
        (None, 2 * PAGE),  # the second prompt is a strict prefix (40 of the first's 60 tokens)
    ],
)
def test_prompts_diverging_around_page_boundaries(loaded, divergence, expected_hit):
    rng = np.random.default_rng(2)
    first = _tokens(rng, 60)
    if divergence is None:
        second = first[:40]
    else:
        second = first[:divergence] + [(t % 255) + 1 for t in first[divergence:]]
    results = {}
    for caching in (True, False):
        engine = _engine(loaded, caching)
        results[caching] = (_run(engine, {"a": first}), _run(engine, {"b": second}))
        if caching:
            assert engine.metrics.prefix_hit_tokens == expected_hit
    assert results[True] == results[False]


def test_a_prompt_that_is_all_cached_still_computes_its_last_token(loaded):
    rng = np.random.default_rng(3)
    prompt = _tokens(rng, 3 * PAGE)  # exactly three pages
    engine = _engine(loaded, True)
    first = _run(engine, {"a": prompt})
    again = _run(engine, {"b": prompt})
    assert again["b"] == first["a"]
    assert engine.metrics.prefix_hit_tokens == 2 * PAGE  # the third page holds the last token: recomputed


def test_eviction_under_pressure_keeps_serving(loaded):
    """A pool too small to keep every prompt cached evicts least recently used pages and gives the same tokens."""
    rng = np.random.default_rng(4)
    shared = _tokens(rng, 64)
    prompts = {f"p{i}": (shared if i % 2 else []) + _tokens(rng, 90) for i in range(12)}
    small = dict(num_pages=30, max_num_seqs=2)
    on, off = _engine(loaded, True, **small), _engine(loaded, False, **small)
    assert _run(on, prompts) == _run(off, prompts)
    assert on.metrics.prefix_evictions > 0 and on.metrics.prefix_hit_tokens > 0
    assert on.metrics.kv_pages_used == 0 and on.metrics.kv_pages_free + on.metrics.kv_pages_cached_idle == 29


def test_different_salts_share_no_page(loaded):
    rng = np.random.default_rng(5)
    prompt = _tokens(rng, 70)
    engine = _engine(loaded, True)
    tokens_a = _run(engine, {"a": prompt}, salts={"a": "tenant-a"})
    pages_a = set(engine.scheduler.prefix_tries[0].cached_pages())
    tokens_b = _run(engine, {"b": prompt}, salts={"b": "tenant-b"})
    assert engine.metrics.prefix_hit_tokens == 0
    assert not pages_a & (set(engine.scheduler.prefix_tries[0].cached_pages()) - pages_a)  # b cached its own copies
    assert len(engine.scheduler.prefix_tries[0].cached_pages()) == 2 * len(pages_a)
    assert tokens_a["a"] == tokens_b["b"]
    _run(engine, {"c": prompt}, salts={"c": "tenant-a"})
    assert engine.metrics.prefix_hit_tokens == 4 * PAGE  # the same tenant shares


@pytest.mark.parametrize("caching", [True, False])
def test_parallel_samples_share_the_prompt_pages(loaded, caching):
    """n = 4 samples of a 100-token prompt: 6 shared full pages plus 4 copies of the partial one, not 4 x 7."""
    rng = np.random.default_rng(6)
    prompt = _tokens(rng, 100)
    engine = _engine(loaded, caching)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7, n=4)
    (completions,) = _run(engine, {"r": prompt}, params=params).values()
    assert len(completions) == 4 and len({tuple(c) for c in completions}) > 1  # different seeds diverge
    # 108 tokens per sample fit in 7 pages: positions 96..107 in the seventh, the one copied on write.
    assert engine.metrics.peak_kv_pages_used == 6 + 4


def test_greedy_samples_equal_the_single_sample(loaded):
    rng = np.random.default_rng(7)
    prompts = {"short": _tokens(rng, 1), "page": _tokens(rng, 17), "long": _tokens(rng, 45)}
    engine = _engine(loaded, True)
    single = _run(engine, prompts)
    many = _run(_engine(loaded, True), prompts, params=SamplingParams(temperature=0.0, max_tokens=8, n=3))
    for request_id, (tokens,) in single.items():
        assert many[request_id] == [tokens] * 3
