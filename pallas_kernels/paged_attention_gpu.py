"""Ragged paged attention as a Pallas GPU (Triton) kernel: prefill chunks and decodes in one call.

Same tiling as the TPU kernel (see kernel_layout.py): grid (KV head, query block), a tile of
[queries_per_block * G, D] query rows per KV head, one online softmax per tile. Triton has
no explicit DMA: each KV block's pages are gathered straight from global memory through the
block table, inside two `fori_loop`s (sequences in the block, then KV blocks) that Triton
turns into `scf.for` loops it can software-pipeline (`num_stages`).

Triton tiles must have power-of-two sizes, so the query heads per KV head are padded to a
power of two (SmolLM2's 3 become 4) and page_size, head_dim and pages_per_block must be
powers of two; the wrapper checks and says so.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kernel_layout import (
    MASK_VALUE,
    KernelLayout,
    block_masks,
    fold_kv_block,
    kernel_layout,
    kv_block_range,
    query_blocks_rows,
    rows_to_tokens,
    tokens_to_rows,
)
from pallas_kernels.kv_pages import page_view
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.quantization import QuantizedKVPages, unpack_scale_words

# Smallest query tile: Triton's dot needs at least 16 rows.
_MIN_ROWS = 16
# Prefill-shaped tiles: 128 query rows against 64-token KV blocks keep the scores, the running output and the
# q tile in registers (ptxas for sm_90: 224 registers and no spills at head_dim 128; 128-token blocks spilled
# 2 KB a thread). head_dim 256 halves the rows. Decode tiles (16 rows) read 128-token blocks, 64 at head_dim
# 256 (where 128 spilled 8-40 bytes in FP8). Blocks smaller than a page read a slice of it. Both launch 8
# warps over 2 stages (4 warps, capped at 128 registers, spilled int8 decode tiles).
_PREFILL_ROWS = 128
_PREFILL_BLOCK_TOKENS = 64
_DECODE_BLOCK_TOKENS = 128
_NUM_WARPS, _NUM_STAGES = 8, 2


def _attention_kernel(
    first_rows_ref,  # i32[num_q_blocks]
    last_rows_ref,  # i32[num_q_blocks]
    block_tables_ref,  # i32[S * W]
    cu_q_lens_ref,  # i32[S + 1]
    kv_lens_ref,  # i32[S]
    q_ref,  # [rows, D] this KV head's query rows of this block
    kv_pages_ref,  # [num_pages, P, 2K, D] (the pool's [.., 2K * D] rows seen per head slot)
    scales_ref,  # u32[num_pages, 1, lanes] packed K and V scales, or None
    out_ref,  # [rows, D]
    *,
    layout: KernelLayout,
    value_dtype,
):
    head = pl.program_id(0)
    q_block = pl.program_id(1)
    rows, head_dim = q_ref.shape
    block_tokens, pages_per_block = layout.block_tokens, layout.pages_per_block
    block_first_token = q_block * layout.queries_per_block
    row_tokens = block_first_token + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // layout.group  # [rows, 1]
    q = q_ref[...]

    def attend_row(row, carry):
        q_start, q_end = cu_q_lens_ref[row], cu_q_lens_ref[row + 1]
        kv_len = kv_lens_ref[row]
        start, stop = kv_block_range(q_start, q_end, kv_len, block_first_token, layout)

        def attend_block(kv_block, carry):
            masks = block_masks(row_tokens, q_start, q_end, kv_len, kv_block, layout)
            if layout.blocks_per_page == 1:
                table_start = row * layout.pages_per_seq + kv_block * pages_per_block
                page_ids = block_tables_ref[pl.ds(table_start, pages_per_block)]  # i32[pages_per_block]
                tokens, scale_lanes = slice(None), pl.ds(head * layout.page_size, layout.page_size)
            else:  # the block is a slice of one page
                page_ids = block_tables_ref[row * layout.pages_per_seq + kv_block // layout.blocks_per_page]
                offset = (kv_block % layout.blocks_per_page) * block_tokens
                tokens, scale_lanes = pl.ds(offset, block_tokens), pl.ds(head * layout.page_size + offset, block_tokens)
            keys = kv_pages_ref[page_ids, tokens, 2 * head, :].reshape(block_tokens, head_dim)  # [B, D]
            values = kv_pages_ref[page_ids, tokens, 2 * head + 1, :].reshape(block_tokens, head_dim)  # [B, D]
            key_scales = value_scales = None
            if scales_ref is not None:
                words = scales_ref[page_ids, 0, scale_lanes]  # u32[pages_per_block, P] or u32[B]
                key_scales, value_scales = unpack_scale_words(words.reshape(1, block_tokens))
            if value_dtype is not None:
                keys = jax.lax.bitcast_convert_type(keys, value_dtype)
                values = jax.lax.bitcast_convert_type(values, value_dtype)
            return fold_kv_block(carry, q, keys, values, key_scales, value_scales, masks, layout)

        return jax.lax.fori_loop(start, stop, attend_block, carry)

    init = (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    # Rows between the first and last hold this block's tokens (or none, and read nothing).
    _, running_sum, acc = jax.lax.fori_loop(first_rows_ref[q_block], last_rows_ref[q_block] + 1, attend_row, init)
    out_ref[...] = (acc / jnp.maximum(running_sum, 1e-30)).astype(out_ref.dtype)


def _check_power_of_two(name: str, value: int):
    if value & (value - 1):
        raise ValueError(
            f"the Pallas GPU attention kernel needs {name} to be a power of two (Triton tiles), got {value}; "
            "use attention_impl='xla' for this model"
        )


def gpu_layout(q, kv_pages, metadata, **options) -> KernelLayout:
    """The GPU kernel's tiling of a batch of this shape (q [T, N, D], the pool's values [N, P, 2K * D]).

    Args:
      q, kv_pages, metadata: the call's inputs (shapes only).
      options: sm_scale, sliding_window, soft_cap, queries_per_block, pages_per_block (see kernel_layout).
    """
    head_dim = q.shape[-1]
    return kernel_layout(
        q,
        kv_pages,
        metadata,
        min_rows=_MIN_ROWS,
        pad_group=True,
        # One token per decode tile (dummy query heads fill it to 16 rows): one program per
        # (sequence, KV head) keeps every SM busy on a decode batch.
        decode_queries_per_block=1,
        prefill_rows=_PREFILL_ROWS * 128 // max(128, head_dim),
        prefill_block_tokens=_PREFILL_BLOCK_TOKENS,
        decode_block_tokens=_DECODE_BLOCK_TOKENS * 128 // max(128, head_dim),
        split_pages=True,
        **options,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "queries_per_block",
        "pages_per_block",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def paged_attention_gpu(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    queries_per_block: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, num_q_heads, D]
    """Causal attention of each new token over its sequence's pages, on a GPU (or interpreted).

    Args:
      q: queries of the new tokens, already rotated.
      kv_pages: one layer's page pool (K at even, V at odd head slots), plain or 8-bit (FP8 or int8) with scales.
      metadata: the ragged batch layout (see AttentionMetadata).
      sm_scale: multiplier applied to q.k.
      sliding_window: if set, a token sees only the last `sliding_window` positions.
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      queries_per_block, pages_per_block: overrides of the default tiling (powers of two).
      num_warps, num_stages: Triton launch parameters (default 8 and 2).
      interpret: run the kernel with Pallas' generic interpreter (CPU).
    """
    scales = value_dtype = None
    if isinstance(kv_pages, QuantizedKVPages):
        if kv_pages.num_groups != 1:
            raise ValueError(
                f"the GPU kernel reads one scale group, but the pool has {kv_pages.num_groups}; run it per "
                "model shard (models.sharding.attention_on_mesh does) so each shard sees its own group"
            )
        kv_pages, scales, value_dtype = kv_pages.pages, kv_pages.scales, kv_pages.dtype
    layout = gpu_layout(
        q,
        kv_pages,
        metadata,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        queries_per_block=queries_per_block,
        pages_per_block=pages_per_block,
    )
    num_warps, num_stages = num_warps or _NUM_WARPS, num_stages or _NUM_STAGES
    for name, value in (
        ("page_size", layout.page_size),
        ("head_dim", layout.head_dim),
        ("pages_per_block", layout.pages_per_block),
        ("queries_per_block", layout.queries_per_block),
    ):
        _check_power_of_two(name, value)
    num_tokens, _, head_dim = q.shape
    q_rows = tokens_to_rows(q, layout)  # [K, padded T * G, D]
    first_rows, last_rows, block_tables = query_blocks_rows(metadata, layout)
    rows = layout.queries_per_block * layout.group
    row_block = pl.BlockSpec((None, rows, head_dim), lambda head, q_block: (head, q_block, 0))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    kv_heads = page_view(kv_pages, head_dim)  # free on a GPU: the same bytes, row-major
    inputs = [first_rows, last_rows, block_tables.reshape(-1), metadata.cu_q_lens, metadata.kv_lens, q_rows, kv_heads]
    in_specs = [whole] * 5 + [row_block, whole]
    if scales is not None:
        inputs.append(scales)
        in_specs.append(whole)

    def kernel(*refs):
        scalars, q_ref, kv_ref = refs[:5], refs[5], refs[6]
        scales_ref = refs[7] if scales is not None else None
        _attention_kernel(*scalars, q_ref, kv_ref, scales_ref, refs[-1], layout=layout, value_dtype=value_dtype)

    out_rows = pl.pallas_call(
        kernel,
        grid=(layout.num_kv_heads, layout.num_q_blocks),
        in_specs=in_specs,
        out_specs=row_block,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_gpu",
    )(*inputs)
    return rows_to_tokens(out_rows, layout)[:num_tokens]
