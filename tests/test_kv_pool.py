"""KVPool on its own: sizing from a byte budget, replica partitions, 8-bit bytes per token, and its refusals."""

import jax
import jax.numpy as jnp
import pytest

from models.config import ModelConfig
from pallas_kernels import QuantizedKVPages
from paxkv.config import EngineConfig
from paxkv.execution.kv_pool import KVPool
from paxkv.parallel.mesh import make_mesh

# 2 layers, 2 KV heads of 16: a token's K and V take 2 x 2 x 16 = 64 values per layer.
CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


def test_a_byte_budget_becomes_pages_and_the_pool_is_allocated_as_the_layout_says():
    pool = KVPool(CONFIG, EngineConfig(page_size=8, kv_cache_memory_bytes=64 * 1024, max_num_seqs=4), jnp.float32, None)
    assert pool.bytes_per_token == 2 * 64 * 4  # 2 layers x 64 f32 values
    assert pool.bytes_per_page == 8 * pool.bytes_per_token
    assert pool.num_pages == 64 * 1024 // pool.bytes_per_page == 16
    assert pool.num_usable_tokens == 15 * 8  # the null page held back
    assert [layer.shape for layer in pool.kv_caches] == [(16, 8, 64)] * 2  # [pages, P, 2K * D]
    assert pool.swap_space is not None  # auto preemption keeps a host pool


def test_8_bit_pages_count_their_scale_rows():
    config = EngineConfig(page_size=8, num_pages=10, kv_cache_dtype="int8", max_num_seqs=4)
    pool = KVPool(CONFIG, config, jnp.float32, None)
    assert isinstance(pool.kv_caches[0], QuantizedKVPages)
    # Per layer and page: 8 tokens x 64 one-byte values, and a row of 2 heads x 8 tokens words padded to 128 lanes.
    assert pool.bytes_per_page == 2 * (8 * 64 + 128 * 4)
    assert pool.total_bytes == 10 * pool.bytes_per_page


def test_data_replicas_split_the_pool_evenly():
    mesh = make_mesh("data=2,model=1", jax.devices()[:2])
    pool = KVPool(CONFIG, EngineConfig(page_size=8, num_pages=33, max_num_seqs=4), jnp.float32, mesh)
    assert (pool.num_replicas, pool.pages_per_replica, pool.num_pages) == (2, 16, 32)
    assert pool.kv_caches[0].sharding.spec[0] == "data"


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="leaves 3 usable pages.*max_num_seqs=8.*raise num_pages"):
        KVPool(CONFIG, EngineConfig(page_size=8, num_pages=4, max_num_seqs=8), jnp.float32, None)
    with pytest.raises(ValueError, match="preemption_mode='swap' needs a host pool.*raise swap_space_bytes"):
        config = EngineConfig(page_size=8, num_pages=16, max_num_seqs=4, preemption_mode="swap", swap_space_bytes=0)
        KVPool(CONFIG, config, jnp.float32, None)
