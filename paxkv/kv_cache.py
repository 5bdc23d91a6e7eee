"""The KV page pool's storage: dtype names, bytes per token (8-bit scales included) and allocation."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import models
from pallas_kernels import QuantizedKVPages, empty_quantized_pages
from pallas_kernels.quantization import is_quantized
from paxkv.mesh import pool_sharding

# Config names of the 8-bit formats -> their jnp dtypes.
QUANTIZED_NAMES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}
# An 8-bit pool stores one bf16 scale per token, KV head and K/V.
SCALE_BYTES = 2


def kv_storage_dtype(kv_cache_dtype: str, param_dtype) -> np.dtype:
    """The dtype K/V are stored in: the parameters' dtype for "auto", else the named one.

    Args:
      kv_cache_dtype: auto | float32 | bfloat16 | fp8_e4m3 | fp8_e5m2 | int8.
      param_dtype: the model parameters' dtype.
    """
    if kv_cache_dtype == "auto":
        return np.dtype(param_dtype)
    return np.dtype(QUANTIZED_NAMES.get(kv_cache_dtype, kv_cache_dtype))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """KV bytes one token costs: 2 x KV heads x head_dim x dtype bytes x layers, plus 8-bit scales.

    Args:
      num_layers, num_kv_heads, head_dim: the model's attention shape.
      dtype: the storage dtype.
    """
    dtype = np.dtype(dtype)
    per_head = head_dim * dtype.itemsize + (SCALE_BYTES if is_quantized(dtype) else 0)
    return 2 * num_kv_heads * per_head * num_layers


def allocate_pool(
    model_config: models.ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh | None = None
) -> list[jax.Array | QuantizedKVPages]:
    """Zeroed page pools, one per layer: plain arrays, or 8-bit pages with unit scales.

    Args:
      model_config: the model whose layers and KV heads size the pools.
      num_pages: pages per layer, including the null page 0.
      page_size: tokens per page.
      dtype: the storage dtype (kv_storage_dtype).
      mesh: if given, each device allocates only its shard (KV heads on "model", see mesh.pool_sharding).
    """

    def allocate():
        if is_quantized(dtype):
            shape = (num_pages, page_size, model_config.num_kv_heads, model_config.head_dim)
            return [empty_quantized_pages(*shape, dtype) for _ in range(model_config.num_layers)]
        return models.allocate_kv_caches(model_config, num_pages, page_size, dtype)

    if mesh is None:
        return allocate()
    shardings = [pool_sharding(layer, model_config.num_kv_heads, mesh) for layer in jax.eval_shape(allocate)]
    return jax.jit(allocate, out_shardings=shardings)()
