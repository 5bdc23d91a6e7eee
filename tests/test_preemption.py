"""Memory pressure: swap round trips, recompute vs swap vs auto, priorities, the watermark, an overload soak."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from pallas_kernels import QuantizedKVPages
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.execution.swap import HostSwapSpace
from paxkv.scheduling.preemption import PreemptionPolicy
from paxkv.scheduling.sampling_params import SamplingParams

PAGE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(engine_llama_checkpoint):
    return models.load(engine_llama_checkpoint, require_tokenizer=False)


def _pool(dtype: str, num_pages=12):
    key = jax.random.key(0)
    shape = (num_pages, PAGE, 4, 16)
    if dtype.startswith("float8") or dtype == "int8":
        pages = (30 * jax.random.normal(key, shape)).astype(jnp.dtype(dtype))
        scales = jax.random.uniform(key, (num_pages, PAGE, 4))
        layer = QuantizedKVPages.from_values(pages, scales)
    else:
        layer = jax.random.normal(key, shape).astype(jnp.dtype(dtype)).reshape(num_pages, PAGE, -1)
    return [layer, jax.tree.map(lambda x: x + 1 if not jnp.issubdtype(x.dtype, jnp.integer) else x ^ 1, layer)]


@pytest.mark.parametrize("native", [False, True], ids=["xla_scatter", "native_writes"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int8"])
def test_swap_round_trip_is_bit_exact(dtype, native):
    """Pages out and back in, bit for bit; with `native` (one CPU device, cpu_native), a bf16 pool's swap-in goes
    through the native in-place write, every other pool's through XLA's scatter still."""
    pool = _pool(dtype)
    before = jax.device_get(jax.tree.leaves(pool))
    space = HostSwapSpace(pool, num_slots=6)
    slots = space.slots.allocate(3)
    space.swap_out(pool, [3, 5, 1], slots)
    pool = space.swap_in(pool, slots, [7, 2, 4], native=native)
    after = jax.device_get(jax.tree.leaves(pool))
    for old, new in zip(before, after, strict=True):
        for source, destination in ((3, 7), (5, 2), (1, 4)):
            assert old[source].tobytes() == new[destination].tobytes()
        untouched = [p for p in range(1, 12) if p not in (7, 2, 4)]
        assert old[untouched].tobytes() == new[untouched].tobytes()
    assert space.bytes_moved == 6 * space.bytes_per_page and space.bytes_per_second > 0


def test_policy_picks_the_cheaper_kind():
    policy = PreemptionPolicy("auto", bytes_per_page=1000, num_host_slots=10)
    policy.prefill_tokens_per_s, policy.transfer_bytes_per_s, policy.swap_latency_s = 1000.0, 1e6, 0.0
    assert policy.choose(num_tokens_to_recompute=64, num_pages=4, num_free_host_slots=10) == "swap"  # 8 ms < 64 ms
    assert policy.choose(num_tokens_to_recompute=4, num_pages=4, num_free_host_slots=10) == "recompute"
    assert policy.choose(num_tokens_to_recompute=64, num_pages=4, num_free_host_slots=3) == "recompute"  # no room
    assert PreemptionPolicy("swap", 1000, 10).choose(0, 4, 10) == "swap"
    assert PreemptionPolicy("recompute", 1000, 10).choose(10**6, 4, 10) == "recompute"
    policy.observe_prefill(500, 0.25)
    policy.observe_prefill(500, 0.25)
    assert policy.prefill_tokens_per_s == pytest.approx(2000.0)  # the first measurement replaces the guess


def _prompts(rng, lengths):
    return {f"r{i}": rng.integers(1, 256, n).tolist() for i, n in enumerate(lengths)}


def _run(engine, prompts, params=GREEDY, aborts=None):
    """Add all prompts, step to the end (aborting {step: [ids]}); return finished tokens and abort outputs."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    results, aborted, step = {}, {}, 0
    while engine.has_unfinished_requests():
        for request_id in (aborts or {}).get(step, []):
            output = engine.abort(request_id)
            if output is not None:
                aborted[request_id] = output
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        engine.scheduler.check_page_invariants()
        step += 1
    return results, aborted


def _engine(loaded, **config):
    # Steps pad to 8 rows and 64 tokens, for fewer programs to compile (smaller steps: test_engine).
    defaults = dict(page_size=PAGE, num_pages=400, max_num_seqs=8, max_num_batched_tokens=64, watermark=0.0)
    return Engine(loaded, EngineConfig(**{**defaults, "min_padded_seqs": 8, "min_padded_tokens": 64, **config}))


@pytest.mark.parametrize("mode,kv_cache_dtype", [("recompute", "auto"), ("swap", "auto"), ("swap", "bfloat16")])
def test_preempted_requests_give_the_unpreempted_tokens(loaded, mode, kv_cache_dtype):
    """A bf16 pool too: on CPU its rows and swapped-in pages go through the native in-place write."""
    prompts = _prompts(np.random.default_rng(0), [30, 5, 44, 17, 60, 9, 25, 38])
    expected, _ = _run(_engine(loaded, kv_cache_dtype=kv_cache_dtype), prompts)
    tight = _engine(
        loaded, num_pages=20, preemption_mode=mode, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype
    )
    got, _ = _run(tight, prompts)
    assert got == expected
    other = "swap" if mode == "recompute" else "recompute"
    assert getattr(tight.metrics, f"num_preemptions_{mode}") > 0
    assert getattr(tight.metrics, f"num_preemptions_{other}") == 0
    assert (
        tight.pool.swap_space is None
        or tight.pool.swap_space.slots.num_free_slots == tight.pool.swap_space.slots.num_slots
    )


def test_auto_swaps_unique_requests_and_recomputes_cached_ones(loaded):
    """A page moves in the time of 2 prefill tokens (4 out and back, for 8 tokens of KV): a unique request swaps,
    one whose prefix other running requests keep cached recomputes."""
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 256, 48).tolist()
    engine = _engine(loaded, num_pages=22, preemption_mode="auto", max_num_seqs=4)
    engine.preemption.observe_prefill = engine.preemption.observe_transfer = lambda *args: None  # fixed rates
    engine.preemption.prefill_tokens_per_s = 1000.0
    engine.preemption.transfer_bytes_per_s = engine.preemption.bytes_per_page * 1000.0 / 2
    engine.preemption.swap_latency_s = 0.0
    _run(engine, {"warm": shared + [7]})  # the shared prefix is now cached
    # The newest running request is the victim: cached2 first (recompute: its prefix comes back from the
    # cache), then unique (swap: all its tokens would have to be recomputed).
    prompts = {f"cached{i}": shared + [i + 1] for i in range(2)}
    prompts["unique"] = rng.integers(1, 256, 50).tolist()
    prompts["cached2"] = shared + [3]
    got, _ = _run(engine, prompts, params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    expected, _ = _run(_engine(loaded), prompts, params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == expected
    assert engine.metrics.num_preemptions_swap > 0 and engine.metrics.num_preemptions_recompute > 0


def test_lowest_priority_is_preempted_first(loaded, caplog):
    prompts = _prompts(np.random.default_rng(2), [40, 40, 40])
    engine = _engine(loaded, num_pages=16, preemption_mode="recompute", max_num_seqs=3, enable_prefix_caching=False)
    for priority, (request_id, prompt) in zip((5, 0, 1), prompts.items(), strict=True):
        engine.add_request(
            request_id, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), priority=priority
        )
    with caplog.at_level("INFO", logger="paxkv.scheduling.replica_scheduler"):
        drain(engine)
    victims = [r.getMessage().split("'")[1] for r in caplog.records if "preempted request" in r.getMessage()]
    assert victims and victims[0] == "r0"  # the oldest, but the lowest priority (5)


def test_watermark_holds_admissions_back(loaded):
    """With 40% of the pool (8 of 20 pages) kept free at admission, a second request waits for room."""
    rng = np.random.default_rng(3)
    prompts = {"a": rng.integers(1, 256, 60).tolist(), "b": rng.integers(1, 256, 40).tolist()}
    admitted = {}
    for watermark in (0.0, 0.4):
        engine = _engine(loaded, num_pages=21, watermark=watermark, max_num_seqs=4, max_num_batched_tokens=128)
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, GREEDY)
        engine.step()
        admitted[watermark] = [r.request_id for r in engine.scheduler.running]
        drain(engine)
        assert engine.metrics.num_finished_requests == 2
    # a takes 8 pages, leaving 12; b needs 5, which would leave 7 < 8.
    assert admitted == {0.0: ["a", "b"], 0.4: ["a"]}


def test_overload_soak(loaded):
    """200 requests against a pool of 25% of their demand, 10% aborted at random steps: nothing lost or leaked."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(3, 60, 200)
    prompts = _prompts(rng, lengths)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    demand = sum(-(-(n + 10) // PAGE) for n in lengths)
    # Every request may run at once, so running them all needs `demand` pages; the pool has a quarter. The
    # reference runs 16 at a time in the same pool, never preempted (16 requests of at most 9 pages fit), so
    # both runs share one pool shape and the programs compiled for it.
    num_pages = demand // 4
    assert 16 * -(-(max(lengths) + 10) // PAGE) < num_pages
    reference = _engine(loaded, num_pages=num_pages, max_num_seqs=16, max_num_batched_tokens=256)
    expected, _ = _run(reference, prompts, params)
    assert reference.metrics.num_preemptions == 0
    engine = _engine(loaded, num_pages=num_pages, watermark=0.01, max_num_seqs=256, max_num_batched_tokens=256)
    abort_ids = rng.choice(sorted(prompts), 20, replace=False)
    aborts = {}
    for step, request_id in zip(rng.integers(0, 40, 20), abort_ids, strict=True):
        aborts.setdefault(int(step), []).append(str(request_id))
    got, aborted = _run(engine, prompts, params, aborts)
    assert set(got) | set(aborted) == set(prompts) and not set(got) & set(aborted)
    for output in aborted.values():
        assert output.finished and output.outputs[0].finish_reason == "abort"
    for request_id, tokens in got.items():
        assert tokens == expected[request_id], request_id
    metrics = engine.metrics
    assert metrics.num_preemptions > 0 and len(aborted) >= 15
    assert metrics.kv_pages_used == 0 and metrics.kv_pages_free + metrics.kv_pages_cached_idle == num_pages - 1
    if engine.pool.swap_space is not None:
        assert engine.pool.swap_space.slots.num_free_slots == engine.pool.swap_space.slots.num_slots


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_8_bit_pool_runs_on_the_xla_and_interpreted_paths(engine_llama_checkpoint, kv_cache_dtype):
    path = engine_llama_checkpoint
    prompts = _prompts(np.random.default_rng(5), [20, 7, 33])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(attention_impl, kv_dtype):
        engine = Engine(
            models.load(path, require_tokenizer=False, attention_impl=attention_impl),
            EngineConfig(
                page_size=PAGE,
                num_pages=40,
                max_num_seqs=4,
                min_padded_seqs=8,
                min_padded_tokens=64,
                kv_cache_dtype=kv_dtype,
            ),
        )
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, params)
        return engine, {request_id: output.outputs[0] for request_id, output in drain(engine).items()}

    engine, xla = run("xla", kv_cache_dtype)
    assert isinstance(engine.kv_caches[0], QuantizedKVPages)
    # 2 layers x (2 KV heads x K and V x 16 one-byte values + a page's row of scale words, 2 heads x 8
    # tokens padded to 128 four-byte lanes, over its 8 tokens).
    assert engine.pool.bytes_per_token == 2 * (2 * 2 * 16 + 128 * 4 // 8)
    _, interpreted = run("interpret", kv_cache_dtype)
    assert {k: o.token_ids for k, o in xla.items()} == {k: o.token_ids for k, o in interpreted.items()}
    # Against an f32 pool: the first token (the prompt's own logits, the same inputs) and its log-probability
    # barely move. Later tokens may differ: this random model's next-token distribution is nearly flat, so
    # greedy paths split at near ties (a bf16 pool splits them too); the quality report measures SmolLM2.
    _, full = run("xla", "auto")
    for request_id in prompts:
        token = full[request_id].token_ids[0]
        assert xla[request_id].token_ids[0] == token
        drift = abs(xla[request_id].logprobs[0][token].logprob - full[request_id].logprobs[0][token].logprob)
        # Measured here: up to ~0.05 nats for e4m3. The bound catches broken dequantization (a scale lost or
        # applied to the wrong token moves it by whole nats), not quality, which eval_kv_quality.py reports.
        assert drift < 0.25


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("kv_cache_dtype", "int4", "kv_cache_dtype must be one of"),
        ("swap_space_bytes", -1, "swap_space_bytes must be a non-negative integer"),
        ("watermark", 1.0, r"watermark .* in \[0, 1\)"),
        ("watermark", -0.1, r"watermark .* in \[0, 1\)"),
        ("preemption_mode", "evict", "preemption_mode must be one of"),
    ],
)
def test_bad_config_names_the_problem(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_swap_without_swap_space_is_refused(loaded):
    with pytest.raises(ValueError, match="preemption_mode='swap' needs a host pool"):
        _engine(loaded, preemption_mode="swap", swap_space_bytes=0)
