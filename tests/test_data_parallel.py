"""Data parallelism on 8 fake CPU devices: the pool's pages split on "data", one replica per page partition,
and the same greedy tokens as one device."""

import collections
import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from mesh_cases import EXPECTED_SPECS, spec_of, step_collectives

import models
from paxkv import LLM
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.execution.swap import HostSwapSpace
from paxkv.parallel.mesh import make_mesh, parse_mesh_shape
from paxkv.scheduling.request import Request
from paxkv.scheduling.sampling_params import SamplingParams
from paxkv.scheduling.scheduler import Scheduler


@pytest.fixture(scope="module")
def four_kv_heads(tiny_llama_checkpoint):
    """A tiny Llama whose 4 KV heads (8 query heads) split over model = 2."""
    return tiny_llama_checkpoint(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        intermediate_size=256,
        initializer_range=0.1,
    )


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, int(n)).tolist() for n in rng.integers(3, 40, count)]


# Every step pads to its budgets: 4 rows and 32 tokens (smaller steps: test_engine).
FULL_STEPS = dict(
    page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32, min_padded_seqs=4, min_padded_tokens=32
)


def _run(loaded, prompts, *, params=None, **config) -> tuple[Engine, dict[str, list[list[int]]]]:
    """Every request to the end; request id -> the token ids of each of its samples."""
    engine = Engine(loaded, EngineConfig(**{**FULL_STEPS, **config}))
    for index, prompt in enumerate(prompts):
        sampling = (params or {}).get(index, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        engine.add_request(str(index), prompt, sampling)
    engine.placements = {r.request_id: getattr(r, "replica", 0) for r in engine.scheduler.waiting}
    finished = drain(engine, on_step=lambda _: engine.scheduler.check_page_invariants())
    outputs = {request_id: [c.token_ids for c in output.outputs] for request_id, output in finished.items()}
    engine.logprobs = {request_id: [c.logprobs for c in output.outputs] for request_id, output in finished.items()}
    assert engine.scheduler.num_used_pages == engine.metrics.kv_pages_cached_idle  # no page leaked
    return engine, outputs


def _on_mesh(path, mesh_shape: str, **load_kwargs):
    mesh = make_mesh(mesh_shape, jax.devices()[: math.prod(parse_mesh_shape(mesh_shape).values())])
    return models.load(path, mesh=mesh, require_tokenizer=False, **load_kwargs)


def test_data_2_model_2_gives_the_one_device_tokens_with_pages_split_on_data(four_kv_heads):
    prompts = _prompts(9)
    _, expected = _run(models.load(four_kv_heads, require_tokenizer=False), prompts)
    loaded = _on_mesh(four_kv_heads, "data=2,model=2")
    for path, variable in nnx.to_flat_state(loaded.state):
        array = variable.get_value()
        assert spec_of(array) == spec_of(EXPECTED_SPECS.get(path[-1], P())), (path, array.sharding.spec)
    engine, outputs = _run(loaded, prompts)
    assert outputs == expected
    for layer in engine.kv_caches:  # [pages, page_size, 2K * D]: pages on data, KV heads on model
        assert spec_of(layer) == ("data", None, "model")
        shard = layer.addressable_shards[0].data
        assert shard.shape[0] * 2 == layer.shape[0] == 64 and shard.shape[2] * 2 == layer.shape[2]
    assert engine.scheduler.num_replicas == 2 and sorted(set(engine.placements.values())) == [0, 1]
    assert engine.metrics.num_total_pages == 2 * 31  # each replica's page 0 is its null page


def test_both_replicas_work_within_their_own_partitions(four_kv_heads):
    """Routing spreads requests; block tables hold local pages, and each replica's pages stay on its devices."""
    prompts = _prompts(6, seed=3)
    loaded = _on_mesh(four_kv_heads, "data=2,model=1")
    engine = Engine(loaded, EngineConfig(**FULL_STEPS))
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    batch = engine.scheduler.schedule()
    by_replica = [[s.request.request_id for s in b.sequences] for b in batch.replica_batches]
    assert all(by_replica)  # each replica runs a batch of its own (within its 32-token budget)
    for replica, replica_batch in enumerate(batch.replica_batches):
        for sequence in replica_batch.sequences:
            assert sequence.request.replica == replica
            assert all(0 < page < 32 for page in sequence.block_table)  # local to the partition
    inputs = engine.runner.step_batch(batch, lambda request_id: 0)[0].inputs
    assert inputs.tokens.shape[0] == 2 and inputs.metadata.block_tables.shape[0] == 2  # [D, ...]


@pytest.mark.parametrize("attention_impl", ["interpret_gpu", "interpret_tpu"])
def test_pallas_kernels_run_per_replica(four_kv_heads, attention_impl):
    """A Pallas kernel inside the data-parallel step (and its nested shard_map over model) matches XLA."""
    prompts = _prompts(4, seed=5)
    _, expected = _run(_on_mesh(four_kv_heads, "data=2,model=2", attention_impl="xla"), prompts, kv_cache_dtype="int8")
    _, outputs = _run(
        _on_mesh(four_kv_heads, "data=2,model=2", attention_impl=attention_impl), prompts, kv_cache_dtype="int8"
    )
    assert outputs == expected


def test_prefix_caching_routes_shared_prompts_to_the_replica_that_holds_them(four_kv_heads):
    rng = np.random.default_rng(7)
    system = rng.integers(1, 256, 24).tolist()  # three full pages of 8
    prompts = [system + rng.integers(1, 256, 5).tolist() for _ in range(6)]
    prompts.insert(0, rng.integers(1, 256, 30).tolist())  # an unrelated first request takes replica 0
    _, expected = _run(models.load(four_kv_heads, require_tokenizer=False), prompts)
    loaded = _on_mesh(four_kv_heads, "data=2,model=1")
    engine = Engine(loaded, EngineConfig(**FULL_STEPS))
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("0", prompts[0], greedy)
    engine.add_request("1", prompts[1], greedy)
    assert [r.replica for r in engine.scheduler.waiting] == [0, 1]  # least loaded
    drain(engine)
    for index in range(2, len(prompts)):  # the shared prefix now lies cached on replica 1
        engine.add_request(str(index), prompts[index], greedy)
    assert {r.replica for r in engine.scheduler.waiting} == {1}
    outputs = {request_id: [c.token_ids for c in o.outputs] for request_id, o in drain(engine).items()}
    assert outputs == {str(i): expected[str(i)] for i in range(2, len(prompts))}
    assert engine.metrics.prefix_hit_tokens >= 4 * 24


def test_preemption_swap_and_forks_on_two_replicas(four_kv_heads, monkeypatch):
    """A tight pool per replica: swap and recompute, copy-on-write for n=2, and a penalty row on one replica
    only (the others get neutral vocabulary arrays) all give the one-device tokens and logprobs; every page
    swapped back in is bit-identical to the host copy taken at swap-out, in global page numbers."""
    swapped_in = []
    swap_in = HostSwapSpace.swap_in

    def checked_swap_in(self, kv_caches, slots, pages, **options):
        kv_caches = swap_in(self, kv_caches, slots, pages, **options)
        on_device = jax.device_get(jax.tree.leaves(jax.tree.map(lambda pool: pool[np.asarray(pages)], kv_caches)))
        for host, values in zip(self._host, on_device, strict=True):
            np.testing.assert_array_equal(values, host[slots])
        swapped_in.extend(pages)
        return kv_caches

    monkeypatch.setattr(HostSwapSpace, "swap_in", checked_swap_in)
    prompts = _prompts(6, seed=11)
    params = {i: SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) for i in range(len(prompts))}
    params[0] = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    params[3] = SamplingParams(
        temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, presence_penalty=0.5, logprobs=2
    )
    config = dict(num_pages=16, max_num_seqs=4, swap_space_bytes=1 << 20)
    single, expected = _run(models.load(four_kv_heads, require_tokenizer=False), prompts, params=params, **config)
    loaded = _on_mesh(four_kv_heads, "data=2,model=1")
    for mode in ("swap", "recompute"):  # 8 pages per replica
        swapped_in.clear()
        engine, outputs = _run(loaded, prompts, params=params, preemption_mode=mode, **config)
        assert outputs == expected, mode
        assert len(outputs["0"]) == 2
        kind = engine.metrics.num_preemptions_swap if mode == "swap" else engine.metrics.num_preemptions_recompute
        assert kind > 0, mode
        assert bool(swapped_in) == (mode == "swap") and any(page >= 8 for page in swapped_in) == (mode == "swap")
        for want, got in zip(single.logprobs["3"][0], engine.logprobs["3"][0], strict=True):
            assert want.keys() == got.keys()  # the same top tokens, at the same log-probabilities
            np.testing.assert_allclose([v.logprob for v in got.values()], [v.logprob for v in want.values()], atol=1e-5)


def _collectives(loaded) -> collections.Counter:
    """Collective ops in the compiled step, as it ran on `loaded`'s mesh."""
    return step_collectives(lambda: _run(loaded, _prompts(2)), loaded.mesh)


def test_nothing_crosses_replicas_in_the_step(four_kv_heads):
    counts = _collectives(_on_mesh(four_kv_heads, "data=2,model=1"))
    assert sum(counts.values()) == 0, counts  # each replica computes alone
    loaded = _on_mesh(four_kv_heads, "data=2,model=2")
    counts = _collectives(loaded)
    # Tensor parallelism within each replica only: as on a model=2 mesh, two all-reduces per layer plus one.
    assert counts["all-reduce"] == 2 * loaded.config.num_layers + 1, counts


def test_llm_takes_a_data_parallel_mesh_and_budgets_are_per_replica(four_kv_heads):
    llm = LLM(
        four_kv_heads, skip_tokenizer_init=True, mesh_shape="data=4,model=2", num_pages=64, page_size=8, max_num_seqs=2
    )
    outputs = llm.generate(
        _prompts(8, seed=2), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3] * 8
    with pytest.raises(ValueError, match=r"leaves 7 usable pages per data replica \(of 4\).*max_num_seqs=8"):
        Engine(llm.loaded, EngineConfig(mesh_shape="data=4,model=2", num_pages=32, page_size=8, max_num_seqs=8))


def _scheduler(num_replicas: int, pages: int, prefix_caching: bool = False) -> Scheduler:
    return Scheduler(
        num_replicas=num_replicas,
        pages_per_replica=pages,
        page_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_prefix_caching=prefix_caching,
    )


def test_routing_is_deterministic_and_balances_load():
    def placements():
        scheduler = _scheduler(3, 32)
        for index, length in enumerate([20, 4, 4, 4, 12, 8]):
            scheduler.add_request(Request(str(index), list(range(1, length + 1)), SamplingParams(max_tokens=4)))
        return {r.request_id: r.replica for r in scheduler.waiting}, scheduler

    first, scheduler = placements()
    assert first == placements()[0]
    # Each goes to the replica with the fewest pages demanded (prompt + max_tokens, 4 tokens a page) so far:
    # 6 pages to 0, then 2 to 1, 2 to 2, 2 to 1 (loads 6, 2, 2), 4 to 2 (6, 4, 2), 3 to 1 (6, 4, 6).
    assert first == {"0": 0, "1": 1, "2": 2, "3": 1, "4": 2, "5": 1}
    batch = scheduler.schedule()
    assert [len(b.sequences) for b in batch.replica_batches] == [1, 3, 2]
    assert scheduler.abort("0").finish_reason == "abort" and scheduler.abort("0") is None


def test_request_pages_count_a_shared_page_once_and_each_replica_apart():
    scheduler = _scheduler(2, 8)
    scheduler.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
    scheduler.add_request(Request("b", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2, n=2, temperature=1.0)))
    batch = scheduler.schedule()
    # Both replicas number their pages from 1: a holds replica 0's pages 1 and 2, b replica 1's pages 1 and 2.
    assert [(r.replica, r.block_table) for r in scheduler.running] == [(0, [1, 2]), (1, [1, 2])]
    assert scheduler.num_request_pages == 4
    scheduler.update(batch, {"a": 7})
    scheduler.schedule()  # b's sibling b#1 shares b's full page 1; b takes page 3 for its partial page
    assert [r.block_table for r in scheduler.running] == [[1, 2], [1, 3], [1, 2]]
    assert scheduler.num_request_pages == 2 + 3


def test_page_moves_are_reported_in_global_pages():
    scheduler = _scheduler(2, 8)
    scheduler.add_request(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
    scheduler.add_request(Request("b", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2, n=2, temperature=1.0)))
    assert [r.replica for r in scheduler.waiting] == [0, 1]
    batch = scheduler.schedule()  # b computes its prompt but the last token (a page and a bit), then forks
    assert [r.request_id for r in scheduler.update(batch, {"a": 7}).forked] == ["b#1"]
    batch = scheduler.schedule()
    # b's siblings share b's partial page 2 on replica 1: the copy is in global pages (replica 1 = 8..15).
    assert batch.page_copies and all(8 <= page < 16 for pair in batch.page_copies for page in pair)
    assert batch.replica_batches[1].page_copies == [(s - 8, d - 8) for s, d in batch.page_copies]
