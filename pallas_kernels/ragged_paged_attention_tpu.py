"""Ragged paged attention as a Pallas Mosaic TPU kernel: prefill chunks and decodes in one call.

Grid: (KV-head block, query block). A query block holds `queries_per_block` consecutive tokens of the
ragged batch times the G query heads that share one KV head, as rows of one [rows, D] tile per KV
head. The block walks the sequences its tokens belong to and, for each, the KV blocks
(`pages_per_block` pages) its tokens can see: each page's token rows for all the program's KV heads
are one HBM -> VMEM DMA (kv_pages.py explains why the pool is laid out so that they are), into two
buffers, the next block's copies in flight while the current one is scored. Per KV head, one online
softmax (running max, sum and output in VMEM scratch) serves every row; a row only ever sees its
own sequence's keys, so other sequences leave it untouched.

8-bit (FP8 or int8) pages bring one scale row per page, a u32 word per (KV head, token) packing the
K and V scales; the kernel multiplies the scores by the key scales and the probabilities by the
value scales, both row vectors over the block's tokens, instead of dequantizing K/V tiles.
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
from pallas_kernels.quantization import QuantizedKVPages, unpack_scale_words

# Lanes of a TPU vector register; the running max and sum are kept replicated across them.
_LANES = 128
# KV heads one program attends at most (each is one unrolled step over the block), unless K has no
# divisor that keeps the DMA windows lane-aligned.
_MAX_HEADS_PER_BLOCK = 8


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
    q_ref,  # [H, rows, D] this block's query rows for its H KV heads (VMEM)
    kv_pages_hbm_ref,  # [num_pages, P, 2K * D] (HBM)
    scales_hbm_ref,  # u32[num_pages, 1, lanes] (HBM) or None
    # Output.
    out_ref,  # [H, rows, D]
    # Scratch.
    kv_buffer,  # [2, pages_per_block, P, 2H * D]
    scale_buffer,  # u32[2, pages_per_block, 1, scale lanes of H heads] or None
    semaphores,  # DMA[2]
    max_ref,  # f32[H, rows, 128] running max, replicated over lanes
    sum_ref,  # f32[H, rows, 128] running sum, replicated over lanes
    acc_ref,  # f32[H, rows, D] running output
    *,
    layout: KernelLayout,
    value_dtype,
):
    head_block = pl.program_id(0)
    q_block = pl.program_id(1)
    num_heads, rows, head_dim = q_ref.shape
    page_size, pages_per_block = layout.page_size, layout.pages_per_block
    block_tokens = layout.block_tokens
    block_first_token = q_block * layout.queries_per_block
    last_row = last_rows_ref[q_block]
    window = 2 * num_heads * head_dim  # lanes of this program's heads in a token row
    scale_window = scale_buffer.shape[-1] if scale_buffer is not None else 0

    def page_source(page):
        if layout.num_head_blocks == 1:
            return kv_pages_hbm_ref.at[page]
        return kv_pages_hbm_ref.at[page, :, pl.ds(pl.multiple_of(head_block * window, _LANES), window)]

    def scale_source(page):
        if layout.num_head_blocks == 1:
            return scales_hbm_ref.at[page]
        start = pl.multiple_of(head_block * num_heads * page_size, _LANES)
        return scales_hbm_ref.at[page, :, pl.ds(start, scale_window)]

    def copies(row, kv_block, slot):
        """The DMAs that bring KV block `kv_block` of sequence `row` into buffer `slot`, with how many of its
        pages hold tokens (only those are copied)."""
        live_pages = jnp.minimum(pl.cdiv(kv_lens_ref[row], page_size) - kv_block * pages_per_block, pages_per_block)
        descriptors = []
        for j in range(pages_per_block):
            page = block_tables_ref[row * layout.pages_per_seq + kv_block * pages_per_block + j]
            descriptors.append(pltpu.make_async_copy(page_source(page), kv_buffer.at[slot, j], semaphores.at[slot]))
            if scale_buffer is not None:
                descriptors.append(
                    pltpu.make_async_copy(scale_source(page), scale_buffer.at[slot, j], semaphores.at[slot])
                )
        copies_per_page = 2 if scale_buffer is not None else 1
        return descriptors, live_pages, copies_per_page

    def run(descriptors_and_count, method):
        descriptors, live_pages, copies_per_page = descriptors_and_count
        for index, descriptor in enumerate(descriptors):
            # Pages past the sequence's end stay uncopied: their stale slots are masked like any other.
            pl.when(index // copies_per_page < live_pages)(getattr(descriptor, method))

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

    def attend_block(row, kv_block, slot):
        """Fold KV block `kv_block` of sequence `row` (in buffer `slot`) into every head's running softmax."""
        masks = block_masks(row_tokens, cu_q_lens_ref[row], cu_q_lens_ref[row + 1], kv_lens_ref[row], kv_block, layout)
        block = kv_buffer[slot]  # [pages_per_block, P, 2H * D]
        if value_dtype is not None:
            block = jax.lax.bitcast_convert_type(block, value_dtype)
        block = block.astype(q_ref.dtype).reshape(block_tokens, window)  # [B, 2H * D]
        page_words = [scale_buffer[slot, j] for j in range(pages_per_block)] if scale_buffer is not None else []
        for head in range(num_heads):
            keys = block[:, 2 * head * head_dim : (2 * head + 1) * head_dim]  # [B, D]
            values = block[:, (2 * head + 1) * head_dim : (2 * head + 2) * head_dim]  # [B, D]
            key_scales = value_scales = None
            if page_words:
                lanes = slice(head * page_size, (head + 1) * page_size)
                words = jnp.concatenate([w[:, lanes] for w in page_words], axis=1)  # u32[1, B]
                key_scales, value_scales = unpack_scale_words(words)
            carry = (max_ref[head][:, :1], sum_ref[head][:, :1], acc_ref[head])
            new_max, new_sum, new_acc = fold_kv_block(
                carry, q_ref[head], keys, values, key_scales, value_scales, masks, layout
            )
            max_ref[head] = jnp.broadcast_to(new_max, (rows, _LANES))
            sum_ref[head] = jnp.broadcast_to(new_sum, (rows, _LANES))
            acc_ref[head] = new_acc

    def body(state):
        row, kv_block, stop, slot = state
        # Next block: the same sequence's, or the next sequence's first.
        next_row, next_block, next_stop = jax.lax.cond(
            kv_block + 1 < stop,
            lambda: (row, kv_block + 1, stop),
            lambda: next_row_with_blocks(row + 1),
        )

        @pl.when(next_row <= last_row)
        def _prefetch_next():
            run(copies(next_row, next_block, 1 - slot), "start")

        run(copies(row, kv_block, slot), "wait")
        attend_block(row, kv_block, slot)
        return next_row, next_block, next_stop, 1 - slot

    max_ref[...] = jnp.full(max_ref.shape, MASK_VALUE, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    first_row, first_block, first_stop = next_row_with_blocks(first_rows_ref[q_block])

    @pl.when(first_row <= last_row)
    def _fetch_first():
        run(copies(first_row, first_block, 0), "start")

    jax.lax.while_loop(lambda state: state[0] <= last_row, body, (first_row, first_block, first_stop, jnp.int32(0)))
    # Rows of padded tokens saw nothing and stay 0.
    for head in range(num_heads):
        out_ref[head] = (acc_ref[head] / jnp.maximum(sum_ref[head][:, :1], 1e-30)).astype(out_ref.dtype)


def _heads_per_block(num_kv_heads: int, head_dim: int, page_size: int, quantized: bool) -> int:
    """KV heads per program: all of them, or (for many heads) the largest divisor up to 8 whose DMA windows
    stay lane-aligned."""
    if num_kv_heads <= _MAX_HEADS_PER_BLOCK:
        return num_kv_heads
    for heads in range(_MAX_HEADS_PER_BLOCK, 0, -1):
        aligned = (2 * heads * head_dim) % _LANES == 0 and (not quantized or (heads * page_size) % _LANES == 0)
        if num_kv_heads % heads == 0 and aligned:
            return heads
    return num_kv_heads


def tpu_layout(q, kv_pages, metadata, *, quantized: bool, heads_per_block: int | None = None, **options):
    """The TPU kernel's tiling of a batch of this shape (q [T, N, D], the pool's values [N, P, 2K * D]).

    Args:
      q, kv_pages, metadata: the call's inputs (shapes only).
      quantized: whether the pool has 8-bit pages with scales.
      heads_per_block: KV heads per program; by default all of them (up to 8).
      options: sm_scale, sliding_window, soft_cap, queries_per_block, pages_per_block (see kernel_layout).
    """
    head_dim = q.shape[-1]
    num_kv_heads = kv_pages.shape[2] // (2 * head_dim)
    return kernel_layout(
        q,
        kv_pages,
        metadata,
        min_rows=_sublane_rows(q.dtype),
        heads_per_block=heads_per_block or _heads_per_block(num_kv_heads, head_dim, kv_pages.shape[1], quantized),
        **options,
    )


def _sublane_rows(dtype) -> int:
    """Rows of one TPU vector register for this dtype: 8 for 32-bit values, 16 for 16-bit ones."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "queries_per_block",
        "pages_per_block",
        "heads_per_block",
        "vmem_limit_bytes",
        "interpret",
    ),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    queries_per_block: int | None = None,
    pages_per_block: int | None = None,
    heads_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret=False,
) -> jax.Array:  # [T, num_q_heads, D]
    """Causal attention of each new token over its sequence's pages, on TPU (or interpreted).

    Args:
      q: queries of the new tokens, already rotated.
      kv_pages: one layer's page pool (kv_pages.py), plain or 8-bit (FP8 or int8) with scales in one group.
      metadata: the ragged batch layout (see AttentionMetadata).
      sm_scale: multiplier applied to q.k.
      sliding_window: if set, a token sees only the last `sliding_window` positions.
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      queries_per_block: tokens per query block; by default chosen from the batch's shape.
      pages_per_block: pages per KV block (one DMA batch); by default about 128 tokens' worth.
      heads_per_block: KV heads per program; by default all of them (up to 8).
      vmem_limit_bytes: the kernel's VMEM budget; by default twice its estimated need, at least 32 MiB.
      interpret: False on TPU; True (generic interpreter) or a pltpu.InterpretParams on CPU.
    """
    scales = value_dtype = None
    if isinstance(kv_pages, QuantizedKVPages):
        if kv_pages.num_groups != 1:
            raise ValueError(
                f"the TPU kernel reads one scale group, but the pool has {kv_pages.num_groups}; run it per "
                "model shard (models.sharding.attention_on_mesh does) so each shard sees its own group"
            )
        kv_pages, scales, value_dtype = kv_pages.pages, kv_pages.scales, kv_pages.dtype
    num_tokens, num_q_heads, head_dim = q.shape
    layout = tpu_layout(
        q,
        kv_pages,
        metadata,
        quantized=scales is not None,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        queries_per_block=queries_per_block,
        pages_per_block=pages_per_block,
        heads_per_block=heads_per_block,
    )
    heads = layout.heads_per_block
    q_rows = tokens_to_rows(q, layout)  # [K, padded T * G, D]
    first_rows, last_rows, block_tables = query_blocks_rows(metadata, layout)
    rows = layout.rows
    row_block = pl.BlockSpec((heads, rows, head_dim), lambda head_block, q_block, *_: (head_block, q_block, 0))
    window = 2 * heads * head_dim
    scale_window = scales.shape[-1] // layout.num_head_blocks if scales is not None else 0
    scratch = [
        pltpu.VMEM((2, layout.pages_per_block, layout.page_size, window), kv_pages.dtype),
        pltpu.VMEM((2, layout.pages_per_block, 1, scale_window), jnp.uint32) if scales is not None else None,
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((heads, rows, _LANES), jnp.float32),
        pltpu.VMEM((heads, rows, _LANES), jnp.float32),
        pltpu.VMEM((heads, rows, head_dim), jnp.float32),
    ]
    in_specs = [row_block, pl.BlockSpec(memory_space=pl.ANY)]
    inputs = [q_rows, kv_pages]
    if scales is not None:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        inputs.append(scales)
    if vmem_limit_bytes is None:
        vmem_limit_bytes = max(32 * 2**20, 2 * _vmem_estimate(layout, q.dtype, kv_pages.dtype, scale_window))

    def kernel(*refs):
        scalars, rest = refs[:5], refs[5:]
        q_ref, kv_ref = rest[0], rest[1]
        scales_ref = rest[2] if scales is not None else None
        out_ref, *buffers = rest[3:] if scales is not None else rest[2:]
        if scales is None:
            buffers.insert(1, None)
        _attention_kernel(
            *scalars, q_ref, kv_ref, scales_ref, out_ref, *buffers, layout=layout, value_dtype=value_dtype
        )

    out_rows = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(layout.num_head_blocks, layout.num_q_blocks),
            in_specs=in_specs,
            out_specs=row_block,
            scratch_shapes=[s for s in scratch if s is not None],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(first_rows, last_rows, block_tables.reshape(-1), metadata.cu_q_lens, metadata.kv_lens, *inputs)
    return rows_to_tokens(out_rows, layout)[:num_tokens]


def _vmem_estimate(layout: KernelLayout, q_dtype, kv_dtype, scale_window: int) -> int:
    """Bytes of VMEM the kernel's buffers take: double-buffered KV blocks and q/out tiles, the softmax state,
    and the f32 scores and probabilities of one head."""
    heads, rows, head_dim = layout.heads_per_block, layout.rows, layout.head_dim
    q_bytes = jnp.dtype(q_dtype).itemsize
    kv_block = layout.block_tokens * 2 * heads * head_dim
    total = 2 * kv_block * jnp.dtype(kv_dtype).itemsize + kv_block * q_bytes  # buffers + the block as q's dtype
    total += 2 * layout.pages_per_block * scale_window * 4
    total += 2 * 2 * heads * rows * head_dim * q_bytes  # q and out tiles, double-buffered
    total += heads * rows * (2 * _LANES + head_dim) * 4  # max, sum, acc
    total += 3 * rows * layout.block_tokens * 4  # scores, probabilities, mask
    return total
