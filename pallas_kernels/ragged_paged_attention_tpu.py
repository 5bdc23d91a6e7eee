"""Ragged paged attention as a Pallas Mosaic TPU kernel: prefill chunks and decodes in one call.

Grid: (KV head, query block). A query block holds `queries_per_block` consecutive tokens of the
ragged batch times the G query heads that share one KV head, as rows of one [rows, D] tile,
so each KV page is read once for all its query heads. The block walks the sequences its
tokens belong to and, for each, the KV blocks (`pages_per_block` pages) its tokens can see:
pages are copied HBM -> VMEM by DMA into two buffers, the next block's copy in flight while
the current one is scored. One online softmax (running max, sum, output) serves every row;
a row only ever sees its own sequence's keys, so other sequences leave it untouched.

8-bit (FP8 or int8) pages carry one scale per token and KV head ([num_pages, 2K, page_size]); the kernel
multiplies the scores by the key scales and the probabilities by the value scales, both
row vectors over the block's tokens, instead of dequantizing K/V tiles.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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


def _kv_block_range(row, cu_q_lens_ref, kv_lens_ref, block_first_token, layout: KernelLayout):
    """KV blocks [start, stop) that this query block's tokens of sequence `row` can see (0, 0 if none)."""
    row = jnp.minimum(row, layout.num_rows - 1)  # a row past the last is never attended; keep reads in range
    return kv_block_range(cu_q_lens_ref[row], cu_q_lens_ref[row + 1], kv_lens_ref[row], block_first_token, layout)


def _attention_kernel(
    # Scalar prefetch (SMEM).
    first_rows_ref,  # i32[num_q_blocks] first sequence row in each query block
    last_rows_ref,  # i32[num_q_blocks] last live sequence row in each query block (-1: none)
    block_tables_ref,  # i32[S * W] flattened, W a multiple of pages_per_block
    cu_q_lens_ref,  # i32[S + 1]
    kv_lens_ref,  # i32[S]
    # Inputs.
    q_ref,  # [rows, D] this KV head's query rows of this block (VMEM)
    kv_pages_hbm_ref,  # [num_pages, P, 2K, D] (HBM)
    scales_hbm_ref,  # bf16[num_pages, 2K, P] (HBM) or None
    # Output.
    out_ref,  # [rows, D]
    # Scratch.
    k_buffer,  # [2, pages_per_block, P, D]
    v_buffer,  # [2, pages_per_block, P, D]
    scale_buffer,  # bf16[2, pages_per_block, 2, P] or None
    semaphores,  # DMA[2]
    *,
    layout: KernelLayout,
):
    head = pl.program_id(0)
    q_block = pl.program_id(1)
    rows, head_dim = q_ref.shape
    pages_per_block = layout.pages_per_block
    block_tokens = layout.block_tokens
    block_first_token = q_block * layout.queries_per_block
    last_row = last_rows_ref[q_block]

    def copies(row, kv_block, slot):
        """The DMAs that bring KV block `kv_block` of sequence `row` into buffer `slot`."""
        descriptors = []
        for j in range(pages_per_block):
            page = block_tables_ref[row * layout.pages_per_seq + kv_block * pages_per_block + j]
            descriptors.append(
                pltpu.make_async_copy(
                    kv_pages_hbm_ref.at[page, :, 2 * head, :], k_buffer.at[slot, j], semaphores.at[slot]
                )
            )
            descriptors.append(
                pltpu.make_async_copy(
                    kv_pages_hbm_ref.at[page, :, 2 * head + 1, :], v_buffer.at[slot, j], semaphores.at[slot]
                )
            )
            if scales_hbm_ref is not None:
                descriptors.append(
                    pltpu.make_async_copy(
                        scales_hbm_ref.at[page, pl.ds(2 * head, 2), :], scale_buffer.at[slot, j], semaphores.at[slot]
                    )
                )
        return descriptors

    def next_row_with_blocks(row):
        """The first row >= `row` (up to last_row + 1) with KV blocks to read, and its block range."""

        def has_none(state):
            row, start, stop = state
            return (row <= last_row) & (start >= stop)

        def advance(state):
            row = state[0] + 1
            start, stop = _kv_block_range(row, cu_q_lens_ref, kv_lens_ref, block_first_token, layout)
            return row, start, stop

        start, stop = _kv_block_range(row, cu_q_lens_ref, kv_lens_ref, block_first_token, layout)
        return jax.lax.while_loop(has_none, advance, (row, start, stop))

    # Per row of the tile: its token index in the batch.
    row_tokens = block_first_token + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // layout.group  # [rows, 1]
    q = q_ref[...]

    def attend_block(row, kv_block, slot, carry):
        """Fold KV block `kv_block` of sequence `row` (in buffer `slot`) into the running softmax."""
        visible, in_sequence = block_masks(
            row_tokens, cu_q_lens_ref[row], cu_q_lens_ref[row + 1], kv_lens_ref[row], kv_block, layout
        )
        keys = k_buffer[slot].reshape(block_tokens, head_dim)  # [B, D]
        values = v_buffer[slot].reshape(block_tokens, head_dim)  # [B, D]
        key_scales = value_scales = None
        if scale_buffer is not None:
            block_scales = scale_buffer[slot]  # [pages_per_block, 2, P]
            key_scales = block_scales[:, 0, :].reshape(1, block_tokens)
            value_scales = block_scales[:, 1, :].reshape(1, block_tokens)
        return fold_kv_block(carry, q, keys, values, key_scales, value_scales, visible, in_sequence, layout)

    def body(state):
        row, kv_block, stop, slot, carry = state
        # Next block: the same sequence's, or the next sequence's first.
        next_row, next_block, next_stop = jax.lax.cond(
            kv_block + 1 < stop,
            lambda: (row, kv_block + 1, stop),
            lambda: next_row_with_blocks(row + 1),
        )

        @pl.when(next_row <= last_row)
        def _prefetch_next():
            for copy in copies(next_row, next_block, 1 - slot):
                copy.start()

        for copy in copies(row, kv_block, slot):
            copy.wait()
        carry = attend_block(row, kv_block, slot, carry)
        return next_row, next_block, next_stop, 1 - slot, carry

    init_carry = (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    first_row, first_block, first_stop = next_row_with_blocks(first_rows_ref[q_block])

    @pl.when(first_row <= last_row)
    def _fetch_first():
        for copy in copies(first_row, first_block, 0):
            copy.start()

    _, _, _, _, (_, running_sum, acc) = jax.lax.while_loop(
        lambda state: state[0] <= last_row,
        body,
        (first_row, first_block, first_stop, jnp.int32(0), init_carry),
    )
    # Rows of padded tokens saw nothing and stay 0.
    out_ref[...] = (acc / jnp.maximum(running_sum, 1e-30)).astype(out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "queries_per_block",
        "pages_per_block",
        "interpret",
    ),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K, D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    queries_per_block: int | None = None,
    pages_per_block: int | None = None,
    interpret=False,
) -> jax.Array:  # [T, num_q_heads, D]
    """Causal attention of each new token over its sequence's pages, on TPU (or interpreted).

    Args:
      q: queries of the new tokens, already rotated.
      kv_pages: one layer's page pool (K at even, V at odd head slots), plain or 8-bit (FP8 or int8) with scales.
      metadata: the ragged batch layout (see AttentionMetadata).
      sm_scale: multiplier applied to q.k.
      sliding_window: if set, a token sees only the last `sliding_window` positions.
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      queries_per_block: tokens per query block; by default chosen from the batch's shape.
      pages_per_block: pages per KV block (one DMA batch); by default about 128 tokens' worth.
      interpret: False on TPU; True (generic interpreter) or a pltpu.InterpretParams on CPU.
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
    )
    num_tokens, num_q_heads, head_dim = q.shape
    q_rows = tokens_to_rows(q, layout)  # [K, padded T * G, D]
    first_rows, last_rows, block_tables = query_blocks_rows(metadata, layout)
    rows = layout.queries_per_block * layout.group
    row_block = pl.BlockSpec((None, rows, head_dim), lambda head, q_block, *_: (head, q_block, 0))
    kv_dtype = kv_pages.dtype
    scratch = [
        pltpu.VMEM((2, layout.pages_per_block, layout.page_size, head_dim), kv_dtype),
        pltpu.VMEM((2, layout.pages_per_block, layout.page_size, head_dim), kv_dtype),
        pltpu.VMEM((2, layout.pages_per_block, 2, layout.page_size), scales.dtype) if scales is not None else None,
        pltpu.SemaphoreType.DMA((2,)),
    ]
    in_specs = [row_block, pl.BlockSpec(memory_space=pl.ANY)]
    inputs = [q_rows, kv_pages]
    if scales is not None:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        inputs.append(scales)

    def kernel(*refs):
        scalars, rest = refs[:5], refs[5:]
        q_ref, kv_ref = rest[0], rest[1]
        scales_ref = rest[2] if scales is not None else None
        rest = rest[3:] if scales is not None else rest[2:]
        out_ref, k_buffer, v_buffer = rest[0], rest[1], rest[2]
        scale_buffer = rest[3] if scales is not None else None
        semaphores = rest[-1]
        _attention_kernel(
            *scalars, q_ref, kv_ref, scales_ref, out_ref, k_buffer, v_buffer, scale_buffer, semaphores, layout=layout
        )

    out_rows = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(layout.num_kv_heads, layout.num_q_blocks),
            in_specs=in_specs,
            out_specs=row_block,
            scratch_shapes=[s for s in scratch if s is not None],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(first_rows, last_rows, block_tables.reshape(-1), metadata.cu_q_lens, metadata.kv_lens, *inputs)
    return rows_to_tokens(out_rows, layout)[:num_tokens]
