"""The KV page pool's storage: dtype names, bytes per token (8-bit scales included) and allocation."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import models
from pallas_kernels import QuantizedKVPages, page_bytes
from paxkv.mesh import num_scale_groups, pool_sharding

# Config names of the 8-bit formats -> their jnp dtypes.
QUANTIZED_NAMES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}


def kv_storage_dtype(kv_cache_dtype: str, param_dtype) -> np.dtype:
    """The dtype K/V are stored in: the parameters' dtype for "auto", else the named one.

    Args:
      kv_cache_dtype: auto | float32 | bfloat16 | fp8_e4m3 | fp8_e5m2 | int8.
      param_dtype: the model parameters' dtype.
    """
    if kv_cache_dtype == "auto":
        return np.dtype(param_dtype)
    return np.dtype(QUANTIZED_NAMES.get(kv_cache_dtype, kv_cache_dtype))


def kv_bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype, page_size: int, num_groups: int = 1
) -> int:
    """KV bytes one page costs over all layers: 2 x KV heads x head_dim x dtype bytes per token, plus the
    8-bit scales' rows (pallas_kernels.page_bytes).

    Args:
      num_layers, num_kv_heads, head_dim: the model's attention shape.
      dtype: the storage dtype.
      page_size: tokens per page.
      num_groups: for 8-bit pools, the head groups of the scale layout (paxkv.mesh.num_scale_groups).
    """
    return num_layers * page_bytes(page_size, num_kv_heads, head_dim, dtype, num_groups)


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype, page_size: int = 16, num_groups: int = 1
) -> float:
    """KV bytes one token costs in full pages (kv_bytes_per_page / page_size); an int when it divides evenly."""
    per_page = kv_bytes_per_page(num_layers, num_kv_heads, head_dim, dtype, page_size, num_groups)
    return per_page // page_size if per_page % page_size == 0 else per_page / page_size


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
    num_groups = num_scale_groups(model_config.num_kv_heads, mesh)

    def allocate():
        return models.allocate_kv_caches(model_config, num_pages, page_size, dtype, num_groups)

    if mesh is None:
        return allocate()
    shardings = [pool_sharding(layer, model_config.num_kv_heads, mesh) for layer in jax.eval_shape(allocate)]
    return jax.jit(allocate, out_shardings=shardings)()


def abstract_pool(
    model_config: models.ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh
) -> list[jax.ShapeDtypeStruct | QuantizedKVPages]:
    """The pool allocate_pool(..., mesh) makes, as ShapeDtypeStructs carrying its shardings; nothing is allocated.

    Args:
      model_config, num_pages, page_size, dtype, mesh: as allocate_pool.
    """
    num_groups = num_scale_groups(model_config.num_kv_heads, mesh)
    shapes = jax.eval_shape(lambda: models.allocate_kv_caches(model_config, num_pages, page_size, dtype, num_groups))

    def with_sharding(shape, sharding):
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)

    return [
        jax.tree.map(with_sharding, layer, pool_sharding(layer, model_config.num_kv_heads, mesh)) for layer in shapes
    ]
