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
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.quantization import QuantizedKVPages

# Smallest query tile: Triton's dot needs at least 16 rows.
_MIN_ROWS = 16


def _attention_kernel(
    first_rows_ref,  # i32[num_q_blocks]
    last_rows_ref,  # i32[num_q_blocks]
    block_tables_ref,  # i32[S * W]
    cu_q_lens_ref,  # i32[S + 1]
    kv_lens_ref,  # i32[S]
    q_ref,  # [rows, D] this KV head's query rows of this block
    kv_pages_ref,  # [num_pages, P, 2K, D]
    scales_ref,  # bf16[num_pages, 2K, P] or None
    out_ref,  # [rows, D]
    *,
    layout: KernelLayout,
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
            table_start = row * layout.pages_per_seq + kv_block * pages_per_block
            page_ids = block_tables_ref[pl.ds(table_start, pages_per_block)]  # i32[pages_per_block]
            visible, in_sequence = block_masks(row_tokens, q_start, q_end, kv_len, kv_block, layout)
            keys = kv_pages_ref[page_ids, :, 2 * head, :].reshape(block_tokens, head_dim)  # [B, D]
            values = kv_pages_ref[page_ids, :, 2 * head + 1, :].reshape(block_tokens, head_dim)  # [B, D]
            key_scales = value_scales = None
            if scales_ref is not None:
                key_scales = scales_ref[page_ids, 2 * head, :].reshape(1, block_tokens)
                value_scales = scales_ref[page_ids, 2 * head + 1, :].reshape(1, block_tokens)
            return fold_kv_block(carry, q, keys, values, key_scales, value_scales, visible, in_sequence, layout)

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
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K, D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    queries_per_block: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
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
      num_warps, num_stages: Triton launch parameters.
      interpret: run the kernel with Pallas' generic interpreter (CPU).
    """
    scales = None
    if isinstance(kv_pages, QuantizedKVPages):
        kv_pages, scales = kv_pages.values(), kv_pages.scale_values()
    layout = kernel_layout(
        q,
        kv_pages,
        metadata,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        queries_per_block=queries_per_block,
        pages_per_block=pages_per_block,
        min_rows=_MIN_ROWS,
        power_of_two_group=True,
        # One token per decode tile (dummy query heads fill it to 16 rows): one program per
        # (sequence, KV head) keeps every SM busy on a decode batch.
        decode_queries_per_block=1,
    )
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
    inputs = [first_rows, last_rows, block_tables.reshape(-1), metadata.cu_q_lens, metadata.kv_lens, q_rows, kv_pages]
    in_specs = [whole] * 5 + [row_block, whole]
    if scales is not None:
        inputs.append(scales)
        in_specs.append(whole)

    def kernel(*refs):
        scalars, q_ref, kv_ref = refs[:5], refs[5], refs[6]
        scales_ref = refs[7] if scales is not None else None
        _attention_kernel(*scalars, q_ref, kv_ref, scales_ref, refs[-1], layout=layout)

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
