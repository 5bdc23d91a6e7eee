"""Tensor parallelism on 8 fake CPU devices: same greedy tokens as one device, every array where the rules say."""

import collections
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from mesh_cases import EXPECTED_SPECS, spec_of, step_collectives

import models
from models.sharding import attention_on_mesh
from pallas_kernels import AttentionMetadata
from paxkv import LLM
from paxkv.config import EngineConfig
from paxkv.core.engine import Engine
from paxkv.entrypoints.batch_runner import drain
from paxkv.parallel.mesh import make_mesh, parse_mesh_shape
from paxkv.scheduling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def eight_kv_heads(tiny_llama_checkpoint):
    """A tiny Llama whose 8 KV heads (16 query heads) split over model = 1, 2, 4 or 8."""
    return tiny_llama_checkpoint(
        hidden_size=128,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=16,
        intermediate_size=256,
        initializer_range=0.1,
    )


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab_size, n).tolist() for n in (5, 17, 33, 9)]


def _greedy(loaded, prompts, **config) -> tuple[Engine, list[list[int]]]:
    # Steps pad to 8 rows and 64 tokens (the prompts' sum), for fewer programs to compile (smaller steps: test_engine).
    config = dict(page_size=8, num_pages=64, max_num_seqs=4, min_padded_seqs=8, min_padded_tokens=64, **config)
    engine = Engine(loaded, EngineConfig(**config))
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    outputs = drain(engine)
    return engine, [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _on_mesh(path, model_size: int, **load_kwargs):
    mesh = make_mesh(f"data=1,model={model_size}", jax.devices()[:model_size])
    return models.load(path, mesh=mesh, require_tokenizer=False, **load_kwargs)


def test_greedy_tokens_match_one_device_for_every_model_size(eight_kv_heads):
    single = models.load(eight_kv_heads, require_tokenizer=False)
    prompts = _prompts(single.config.vocab_size)
    _, expected = _greedy(single, prompts)
    for model_size in (1, 2, 4, 8):
        loaded = _on_mesh(eight_kv_heads, model_size)
        for path, variable in nnx.to_flat_state(loaded.state):
            array = variable.get_value()
            spec = EXPECTED_SPECS.get(path[-1], P())  # norms are replicated
            assert spec_of(array) == spec_of(spec), (model_size, path, array.sharding.spec)
            if spec != P():
                split = spec.index("model")
                assert array.addressable_shards[0].data.shape[split] * model_size == array.shape[split]
        engine, tokens = _greedy(loaded, prompts)
        assert tokens == expected, model_size
        if model_size == 1:
            continue  # a one-device mesh runs the plain single-device engine
        for layer in engine.kv_caches:  # KV heads (whole K/V pairs of the rows of [pages, page_size, 2K * D])
            assert spec_of(layer) == spec_of(P(None, None, "model"))
            assert layer.addressable_shards[0].data.shape[2] * model_size == layer.shape[2]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_pool_shards_its_scales_with_its_heads(eight_kv_heads, kv_cache_dtype):
    single = models.load(eight_kv_heads, require_tokenizer=False)
    prompts = _prompts(single.config.vocab_size)
    _, expected = _greedy(single, prompts, kv_cache_dtype=kv_cache_dtype)
    engine, tokens = _greedy(_on_mesh(eight_kv_heads, 4), prompts, kv_cache_dtype=kv_cache_dtype)
    assert tokens == expected
    layer = engine.kv_caches[0]
    assert spec_of(layer.pages) == spec_of(P(None, None, "model"))
    assert spec_of(layer.scales) == spec_of(P(None, "model", None))  # [pages, G, lanes]: a scale group per shard
    assert layer.num_groups == 4 and layer.scales.addressable_shards[0].data.shape[1] == 1


def test_int8_pool_read_by_the_native_cpu_kernel_shards_with_its_heads(tiny_llama_checkpoint):
    """An int8 pool of head_dim 32, which the native CPU kernel reads (scores and weights scaled per slot), split
    over model = 2: each shard's kernel reads its own heads' scale group, and the greedy tokens are one device's."""
    path = tiny_llama_checkpoint(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=256,
        initializer_range=0.1,
    )
    single = models.load(path, require_tokenizer=False)
    assert single.model.native_matmul  # auto resolved to cpu_native: the kernel reads the int8 pool
    prompts = _prompts(single.config.vocab_size)
    _, expected = _greedy(single, prompts, kv_cache_dtype="int8")
    engine, tokens = _greedy(_on_mesh(path, 2), prompts, kv_cache_dtype="int8")
    assert tokens == expected
    assert engine.kv_caches[0].num_groups == 2


@pytest.mark.parametrize("attention_impl", ["interpret_gpu", "interpret_tpu"])
def test_pallas_kernels_run_per_shard_under_the_mesh(eight_kv_heads, attention_impl):
    """The Pallas path runs inside shard_map (models.sharding.attention_on_mesh) and matches the XLA path."""
    prompts = _prompts(256)[:2]
    _, expected = _greedy(_on_mesh(eight_kv_heads, 2, attention_impl="xla"), prompts, kv_cache_dtype="int8")
    _, tokens = _greedy(_on_mesh(eight_kv_heads, 2, attention_impl=attention_impl), prompts, kv_cache_dtype="int8")
    assert tokens == expected
    # The kernel call itself sits inside a shard_map under the mesh; the XLA path is left to the partitioner.
    q, kv = jnp.zeros((4, 16, 16)), jnp.zeros((4, 8, 16))
    pool = jnp.zeros((3, 8, 16 * 16))
    metadata = AttentionMetadata(
        slots=jnp.arange(8, 12, dtype=jnp.int32),
        block_tables=jnp.asarray([[1, 2]], jnp.int32),
        cu_q_lens=jnp.asarray([0, 4], jnp.int32),
        kv_lens=jnp.asarray([4], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )
    with jax.set_mesh(make_mesh("model=2", jax.devices()[:2])):
        for impl, wrapped in ((attention_impl, True), ("xla", False)):
            jaxpr = jax.make_jaxpr(
                lambda q, k, v, pool, md, impl=impl: attention_on_mesh(
                    q, k, v, pool, md, attention_impl=impl, sm_scale=0.25
                )
            )(q, kv, kv, pool, metadata)
            assert ("shard_map" in str(jaxpr)) == wrapped, impl


def test_swap_preemption_and_forks_on_the_mesh(eight_kv_heads):
    """Swapping sharded pages to the host and back, and copy-on-write for n=2, give the one-device tokens."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (21, 37, 45, 29, 50, 33)]

    def run(loaded):
        config = EngineConfig(
            page_size=8,
            num_pages=20,
            max_num_seqs=6,
            min_padded_seqs=8,
            min_padded_tokens=64,
            preemption_mode="swap",
            kv_cache_dtype="int8",
        )
        engine = Engine(loaded, config)
        for index, prompt in enumerate(prompts):
            n = 2 if index == 0 else 1
            engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=n))
        return engine, {i: [c.token_ids for c in o.outputs] for i, o in drain(engine).items()}

    _, expected = run(models.load(eight_kv_heads, require_tokenizer=False))
    engine, outputs = run(_on_mesh(eight_kv_heads, 4))
    assert outputs == expected
    assert engine.metrics.num_preemptions_swap > 0 and len(outputs["0"]) == 2


def _collectives(loaded) -> collections.Counter:
    """Collective ops in the compiled step, as it ran on `loaded`'s mesh."""
    return step_collectives(lambda: _greedy(loaded, [[1, 2, 3, 4, 5]]), loaded.mesh)


def test_step_holds_two_all_reduces_per_layer(eight_kv_heads):
    loaded = _on_mesh(eight_kv_heads, 2)
    counts = _collectives(loaded)
    # One after the attention's output projection and one after the MLP's down projection in each layer,
    # plus one for the vocab-split embedding lookup; the logits are gathered for sampling.
    assert counts["all-reduce"] == 2 * loaded.config.num_layers + 1, counts
    assert counts["all-gather"] >= 1 and counts["all-to-all"] == 0, counts


def test_smollm2_replicates_its_three_kv_heads_on_model_2(caplog):
    """SmolLM2's 3 KV heads do not divide model=2: its pool and K/V are replicated, loudly, and the MLP split."""
    loaded = _on_mesh(None, 2)
    with caplog.at_level(logging.WARNING, logger="paxkv.parallel.mesh"):
        engine = Engine(loaded, EngineConfig(page_size=8, num_pages=64, max_num_seqs=4, min_padded_seqs=8))
    assert "REPLICATED" in caplog.text and "3 KV heads" in caplog.text
    assert spec_of(engine.kv_caches[0]) == ()
    state = {path[-1]: variable.get_value() for path, variable in nnx.to_flat_state(loaded.state)}
    assert spec_of(state["k_proj"]) == ()  # 3 heads: replicated
    assert spec_of(state["gate"]) == (None, "model")  # the MLP is still split


def test_replicated_attention_matches_one_device_with_one_all_reduce_per_layer(tiny_llama_checkpoint):
    """SmolLM2's shape in small (9 query and 3 KV heads) on model=2: replicated K/V give the one-device greedy
    tokens, and only the MLP's all-reduce per layer remains."""
    path = tiny_llama_checkpoint(
        hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16, initializer_range=0.1
    )
    prompts = _prompts(256)
    _, expected = _greedy(models.load(path, require_tokenizer=False), prompts)
    loaded = _on_mesh(path, 2)
    engine, tokens = _greedy(loaded, prompts)
    assert tokens == expected
    assert spec_of(engine.kv_caches[0]) == ()
    counts = _collectives(loaded)
    assert counts["all-reduce"] == loaded.config.num_layers + 1, counts  # the MLP's, and the embedding's


def test_llm_and_config_take_a_mesh_shape(eight_kv_heads):
    llm = LLM(eight_kv_heads, skip_tokenizer_init=True, mesh_shape="data=1,model=8", num_pages=64, page_size=8)
    assert dict(llm.loaded.mesh.shape) == {"data": 1, "model": 8}
    outputs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="but the model was loaded on data=1,model=1"):
        Engine(models.load(eight_kv_heads, require_tokenizer=False), EngineConfig(mesh_shape="model=8"))


@pytest.mark.parametrize(
    "mesh_shape,message",
    [
        ("data=2,model=8", r"needs 16 devices, but only 8 are available"),
        ("data=1,pipeline=8", r"unknown axis 'pipeline'"),
        ("model:8", r"is not axis=size"),
        ("model=0", r"sizes are positive integers"),
    ],
)
def test_bad_meshes_name_the_problem(mesh_shape, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(mesh_shape)


def test_a_mesh_smaller_than_the_machine_takes_the_first_devices(caplog):
    """As vLLM's tensor_parallel_size=2 on an 8-GPU host: 2 of the 8 devices, and the log says so."""
    with caplog.at_level(logging.INFO, logger="paxkv.parallel.mesh"):
        mesh = make_mesh("data=1,model=2")
    assert list(mesh.devices.flat) == jax.devices()[:2]
    assert "mesh data=1,model=2 uses the first 2 of 8 cpu devices" in caplog.text
    assert make_mesh("model=3").devices.size == 3


def test_bad_mesh_in_config():
    with pytest.raises(ValueError, match="unknown axis 'tensor'"):
        EngineConfig(mesh_shape="tensor=2")
    assert parse_mesh_shape({"model": 4}) == {"data": 1, "model": 4}
