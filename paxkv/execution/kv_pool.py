"""An engine's KV page pool: its storage dtype, its size in bytes (8-bit scales included), its allocation on the
mesh, its split into data replicas, and the host swap space beside it. The planner sizes pools with the same
arithmetic."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import models
from pallas_kernels import QuantizedKVPages, page_bytes
from paxkv.config import EngineConfig
from paxkv.execution.swap import HostSwapSpace
from paxkv.parallel.distributed import agree_across_processes
from paxkv.parallel.mesh import num_scale_groups, pool_sharding

logger = logging.getLogger(__name__)

# Config names of the 8-bit formats -> their jnp dtypes.
QUANTIZED_NAMES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}


def kv_storage_dtype(kv_cache_dtype: str, activation_dtype) -> np.dtype:
    """The dtype K/V are stored in: for "auto" the activations' dtype, which K and V are computed in (so bf16
    weights under f32 activations on CPU keep an f32 pool), else the named one.

    Args:
      kv_cache_dtype: auto | float32 | bfloat16 | fp8_e4m3 | fp8_e5m2 | int8.
      activation_dtype: the model's compute dtype.
    """
    if kv_cache_dtype == "auto":
        return np.dtype(activation_dtype)
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
      num_groups: for 8-bit pools, the head groups of the scale layout (paxkv.parallel.mesh.num_scale_groups).
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
        # Committed to the device they were made on (the same buffers, not copies), as the pools a step program
        # compiled ahead of use returns are: a jitted step's cache keys on its arguments' commitment, so a pool that
        # went uncommitted into the jitted steps, then came back committed from a speculating step compiled ahead,
        # recompiled every step shape seen before (2-3 s each on a 2-core CPU, inside the timed runs of
        # bench_speculative).
        return jax.tree.map(lambda array: jax.device_put(array, array.sharding), allocate())
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


class KVPool:
    """The device page pool of an engine, sized from its config: D >= 1 equal partitions (one per data replica, each
    with its null page), allocated on the mesh, and the host swap space for preemption by swap.

    `kv_caches` is replaced after every step (the step donates it). With a speculative draft model, its layers
    follow the target's in `kv_caches`: a page holds both models' KV of the same tokens, so one block table, one
    allocation and every page move (swap, copy-on-write) serve both.
    """

    def __init__(
        self,
        model_config: models.ModelConfig,
        config: EngineConfig,
        activation_dtype,
        mesh: Mesh | None,
        draft_config: models.ModelConfig | None = None,
    ):
        """Size and allocate the pool; raise ValueError naming the fix when it cannot hold the budgets.

        Args:
          model_config: the model whose layers and KV heads size the pages.
          config: page size, pool size (num_pages or kv_cache_memory_bytes), max_num_seqs, KV dtype, swap space.
          activation_dtype: the model's compute dtype (the KV dtype of kv_cache_dtype="auto").
          mesh: the engine's mesh, or None for one device.
          draft_config: a speculative draft model whose KV the pages hold too, or None.
        """
        self.page_size = config.page_size
        self.dtype = kv_storage_dtype(config.kv_cache_dtype, activation_dtype)
        self.num_target_layers = model_config.num_layers
        models_in_pool = [model_config] + ([draft_config] if draft_config is not None else [])
        self.bytes_per_page = 0
        for pooled in models_in_pool:
            shape = (pooled.num_layers, pooled.num_kv_heads, pooled.head_dim, self.dtype, self.page_size)
            self.bytes_per_page += kv_bytes_per_page(*shape, num_scale_groups(pooled.num_kv_heads, mesh))
        per_token = self.bytes_per_page / self.page_size
        self.bytes_per_token = int(per_token) if per_token.is_integer() else per_token
        num_pages = config.num_pages or config.kv_cache_memory_bytes // self.bytes_per_page
        self.preemption_mode = config.preemption_mode
        if jax.process_count() > 1:
            num_pages, self.preemption_mode = agree_across_processes(num_pages, self.preemption_mode)
        self.num_replicas = mesh.shape["data"] if mesh is not None else 1
        self.pages_per_replica = num_pages // self.num_replicas
        self.num_pages = self.pages_per_replica * self.num_replicas
        if self.pages_per_replica - 1 < config.max_num_seqs:
            source = (
                f"num_pages={config.num_pages}"
                if config.num_pages
                else f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} ({self.num_pages} pages)"
            )
            per_replica = f" per data replica (of {self.num_replicas})" if self.num_replicas > 1 else ""
            draft = " (each page holds the draft model's KV too)" if draft_config is not None else ""
            raise ValueError(
                f"{source} leaves {max(self.pages_per_replica - 1, 0)} usable pages{per_replica}{draft} (page 0 is "
                f"reserved), too few to hold even one page for each of max_num_seqs={config.max_num_seqs} "
                "sequences; raise num_pages or kv_cache_memory_bytes, or lower max_num_seqs"
            )
        try:
            self.kv_caches = [
                layer
                for pooled in models_in_pool
                for layer in allocate_pool(pooled, self.num_pages, self.page_size, self.dtype, mesh)
            ]
        except (RuntimeError, MemoryError) as e:  # XLA reports a failed allocation as a RuntimeError
            raise ValueError(
                f"cannot allocate the KV page pool ({self.num_pages} pages, {self.total_bytes / 2**30:.2f} GiB): "
                f"{str(e)[:200]}; lower kv_cache_memory_bytes or num_pages"
            ) from None
        self.num_host_slots = 0
        if self.preemption_mode != "recompute":
            self.num_host_slots = config.swap_space_bytes // self.bytes_per_page
        if self.preemption_mode == "swap" and self.num_host_slots == 0:
            raise ValueError(
                f"preemption_mode='swap' needs a host pool of at least one page ({self.bytes_per_page} bytes), but "
                f"swap_space_bytes={config.swap_space_bytes}; raise swap_space_bytes or use 'auto' or 'recompute'"
            )
        self.swap_space = HostSwapSpace(self.kv_caches, self.num_host_slots) if self.num_host_slots else None

    @property
    def total_bytes(self) -> int:
        """The pool's device bytes over all devices' shards (as sized; replicated shards count once)."""
        return self.num_pages * self.bytes_per_page

    @property
    def num_usable_tokens(self) -> int:
        """Token slots in the pool, each partition's null page left out."""
        return (self.num_pages - self.num_replicas) * self.page_size

    def log(self) -> None:
        """One log line: pages, tokens, dtype, bytes."""
        logger.info(
            "page pool: %d pages of %d tokens (page 0 of each of %d partitions reserved) = %d tokens of KV, %s, "
            "%s bytes per token, %.1f MiB",
            self.num_pages,
            self.page_size,
            self.num_replicas,
            self.num_usable_tokens,
            self.dtype.name,
            self.bytes_per_token,
            self.total_bytes / 2**20,
        )
