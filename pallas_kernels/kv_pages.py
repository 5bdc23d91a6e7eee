"""The KV page pool: its layout, allocation, the KV write, its size in bytes and its partition specs.

Layout. One array per layer, [num_pages, page_size, 2 * K * D]: a page is page_size token rows, and a
row holds K_0 | V_0 | K_1 | V_1 | ... (D lanes each), i.e. JAX's [.., 2K, D] head-interleaved layout
with its last two axes merged. An 8-bit pool (QuantizedKVPages) stores the same rows as u8 bits plus
packed scales, u32[num_pages, G, lanes] (quantization.py).

Why this layout (measured with libtpu's compiler, BUILD.md): XLA tiles the last two axes of a TPU array
into (8, 128) tiles. A [.., 2K, D] pool pads 2K up to 8 or 16 rows and D = 64 up to 128 lanes, so
XLA gives it a pages-minor layout instead, which the kernel cannot DMA page by page; and a page's one
head is a sub-tile slice, which Mosaic refuses to DMA. As [.., P, 2K * D] every page is whole tiles
(P a multiple of 8, 2K * D of 128 for D in 64, 128, 256), the default row-major layout has no padding,
and a page is one contiguous DMA. Scales follow the same rule: 32-bit words with one row per page
get XLA's (1, 128) tiling, so a page's scales are one aligned DMA too. On CPU and GPU the reshape
between the two views is free.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from pallas_kernels.cpu_kv_write import write_kv_rows_cpu
from pallas_kernels.quantization import (
    QuantizedKVPages,
    empty_quantized_pages,
    is_quantized,
    pack_scale_words,
    quantize_per_row,
    scale_lanes,
)


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens (ceil(num_tokens / page_size))."""
    return -(-num_tokens // page_size)


def heads_split(num_kv_heads: int, num_shards: int) -> bool:
    """Whether a pool's KV heads split over `num_shards` (whole heads per shard); if not, every shard holds all of
    them. The one rule the pool's shardings, its scale groups and attention under a mesh follow."""
    return num_kv_heads % num_shards == 0


def num_kv_heads_of(kv_pages: jax.Array | QuantizedKVPages, head_dim: int) -> int:
    """K, the KV heads one token row of the pool holds."""
    width = kv_pages.shape[2]
    if width % (2 * head_dim):
        raise ValueError(f"a pool row of {width} lanes is not a whole number of K/V pairs of head_dim {head_dim}")
    return width // (2 * head_dim)


def page_view(pages: jax.Array, head_dim: int) -> jax.Array:  # [..., P, 2K * D] -> [..., P, 2K, D]
    """Pages with their head slots as an axis: K of head h at slot 2h, V at 2h + 1."""
    return pages.reshape(*pages.shape[:-1], pages.shape[-1] // head_dim, head_dim)


def allocate_pages(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, num_groups: int = 1
) -> jax.Array | QuantizedKVPages:
    """One layer's zeroed pool: a plain array, or 8-bit pages with unit scales.

    Args:
      num_pages: pages, including the null page 0.
      page_size: tokens per page.
      num_kv_heads, head_dim: K and D.
      dtype: the storage dtype (f32, bf16, or an 8-bit format).
      num_groups: for 8-bit pools, the head groups of the scale layout (the pool's shards over KV heads).
    """
    if is_quantized(dtype):
        return empty_quantized_pages(num_pages, page_size, num_kv_heads, head_dim, dtype, num_groups)
    return jnp.zeros((num_pages, page_size, 2 * num_kv_heads * head_dim), dtype)


def page_bytes(page_size: int, num_kv_heads: int, head_dim: int, dtype, num_groups: int = 1) -> int:
    """Bytes one page of one layer takes, 8-bit scales (with their lane padding) included.

    Args:
      page_size, num_kv_heads, head_dim: the pool's shape.
      dtype: the storage dtype.
      num_groups: for 8-bit pools, the head groups of the scale layout.
    """
    dtype = np.dtype(dtype)
    values = page_size * 2 * num_kv_heads * head_dim * dtype.itemsize
    if not is_quantized(dtype):
        return values
    return values + num_groups * scale_lanes(num_kv_heads // num_groups, page_size) * 4


def write_kv(
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    slots: jax.Array,  # i32[T]
    *,
    native: bool = False,
) -> jax.Array | QuantizedKVPages:
    """Scatter new K/V into their slots (one XLA scatter into the donated pool, in place).

    8-bit pools (QuantizedKVPages) are quantized on the way in, one scale per token and KV head. With `native`, a
    bf16 pool's rows go in through the native CPU kernel instead (cpu_kv_write: XLA:CPU's bf16 scatter copies the
    whole pool).

    Args:
      kv_pages: one layer's page pool, plain or 8-bit (FP8 or int8) with scales.
      k, v: the new tokens' keys and values.
      slots: page * page_size + offset for each token; padding points into the null page 0.
      native: the model runs the native CPU kernels (attention_impl resolved to cpu_native).
    """
    num_pages, page_size, width = kv_pages.shape
    num_tokens, num_kv_heads, head_dim = k.shape
    if width != 2 * num_kv_heads * head_dim:
        raise ValueError(
            f"the pool's rows hold {width} lanes, but {num_kv_heads} K/V heads of {head_dim} need "
            f"{2 * num_kv_heads * head_dim}"
        )
    kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)  # k0, v0, k1, v1, ...
    if not isinstance(kv_pages, QuantizedKVPages):
        rows = kv.reshape(num_tokens, width).astype(kv_pages.dtype)
        if native and kv_pages.dtype == jnp.bfloat16:
            return write_kv_rows_cpu(kv_pages, rows, slots)
        return _scatter_rows(kv_pages, rows, slots)
    quantized, scales = quantize_per_row(kv, kv_pages.dtype)  # [T, 2K, D], bf16[T, 2K]
    bits = jax.lax.bitcast_convert_type(quantized, jnp.uint8).reshape(num_tokens, width)
    pages = _scatter_rows(kv_pages.pages, bits, slots)
    words = pack_scale_words(scales[:, 0::2], scales[:, 1::2])  # u32[T, K]
    heads_per_group = num_kv_heads // kv_pages.num_groups
    heads = np.arange(num_kv_heads)
    page, offset = slots // page_size, slots % page_size  # i32[T]
    lane = (heads % heads_per_group)[None, :] * page_size + offset[:, None]  # i32[T, K]
    new_scales = kv_pages.scales.at[page[:, None], (heads // heads_per_group)[None, :], lane].set(words)
    return QuantizedKVPages(pages, new_scales, kv_pages.value_dtype, kv_pages.head_dim)


def write_pages(
    pool: jax.Array,  # [num_pages, page_size, W], or any array with the page on axis 0 (an 8-bit pool's leaves)
    page_ids: jax.Array,  # i32[C]
    values: jax.Array,  # [C, *pool.shape[1:]]
    *,
    native: bool = False,
) -> jax.Array:
    """pool with whole pages replaced, values[i] at page page_ids[i] (copy-on-write and swap-in): an XLA scatter, or
    with `native` a bf16 pool's pages through the native in-place write, as runs of slots (XLA:CPU's bf16 scatter
    copies the pool). Repeated pages (padding copies onto the null page) keep the last.

    Args:
      pool: one leaf of a layer's pool.
      page_ids: the pages written.
      values: their new contents.
      native: the pool is on one CPU device whose model runs the native kernels.
    """
    if native and pool.ndim == 3 and pool.dtype == jnp.bfloat16:
        page_size, width = pool.shape[1:]
        slots = (page_ids[:, None] * page_size + jnp.arange(page_size, dtype=page_ids.dtype)).reshape(-1)
        return write_kv_rows_cpu(pool, values.reshape(-1, width), slots)
    return pool.at[page_ids].set(values)


def _scatter_rows(pages: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """pages [num_pages, P, W] with rows [T, W] written at flat token slots.

    Indexed by (page, offset), not through a flat [num_pages * P, W] view: XLA:CPU's elemental emitters copy the
    whole pool to write one row through the view (24 ms for 256 MiB, where this takes 0.014 ms).
    """
    page_size = pages.shape[1]
    return pages.at[slots // page_size, slots % page_size].set(rows)


def pool_partition_spec(pool, *, page_axis: str | None, head_axis: str | None):
    """The PartitionSpec pytree of one layer's pool: pages on `page_axis`, KV heads (and scale groups) on
    `head_axis`; None replicates that axis.

    Args:
      pool: one layer's pool (array, QuantizedKVPages, or their ShapeDtypeStructs).
      page_axis, head_axis: mesh axis names or None.
    """
    pages = PartitionSpec(page_axis, None, head_axis)  # [num_pages, P, 2K * D]: whole heads per shard
    if isinstance(pool, QuantizedKVPages):
        scales = PartitionSpec(page_axis, head_axis, None)  # [num_pages, G, lanes]: one group per shard
        return QuantizedKVPages(pages, scales, pool.value_dtype, pool.head_dim)
    return pages
