"""How the Pallas attention kernels tile a ragged batch: block sizes, query rows, per-block sequence ranges."""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import AttentionMetadata

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# KV tokens per KV block (one DMA batch / one loaded tile) when the caller does not choose.
_DEFAULT_BLOCK_TOKENS = 128
# Query rows (tokens x query heads per KV head) per tile for prefill-shaped batches.
_PREFILL_ROWS = 128


@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """Static tiling of one kernel call; hashable, so it can parametrize a trace."""

    num_kv_heads: int
    group: int  # query heads per KV head, as tiled (maybe padded)
    true_group: int  # query heads per KV head in the model
    head_dim: int
    page_size: int
    pages_per_block: int
    pages_per_seq: int  # block-table width, padded to whole KV blocks
    num_rows: int  # S, sequence rows including padding
    queries_per_block: int
    num_q_blocks: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    precision: jax.lax.Precision | None

    @property
    def block_tokens(self) -> int:
        """KV tokens per KV block."""
        return self.pages_per_block * self.page_size

    @property
    def padded_tokens(self) -> int:
        """Tokens after padding to whole query blocks."""
        return self.queries_per_block * self.num_q_blocks


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_layout(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * K, D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    queries_per_block: int | None,
    pages_per_block: int | None,
    min_rows: int = 8,
    power_of_two_group: bool = False,
    decode_queries_per_block: int | None = None,
) -> KernelLayout:
    """Choose block sizes for a batch of this shape (all static: shapes, not values).

    Decode-shaped batches (no more tokens than sequence rows) get query blocks of a few tokens,
    since each token of a block is usually its own sequence and rows of other sequences are
    wasted work; prefill-shaped batches get blocks of about 128 query rows.

    Args:
      q, kv_pages, metadata: the call's inputs (only shapes and dtypes are read).
      sm_scale, sliding_window, soft_cap: attention options, carried into the kernel.
      queries_per_block, pages_per_block: overrides of the default block sizes.
      min_rows: smallest query tile in rows (8 sublanes on TPU, 16 for a GPU dot).
      power_of_two_group: pad the query heads per KV head to a power of two (Triton tiles), and
        further to `min_rows // queries_per_block` with dummy heads when the tile would be too small.
      decode_queries_per_block: tokens per query block for decode-shaped batches (default: fill min_rows).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, two_k, kv_head_dim = kv_pages.shape
    num_kv_heads = two_k // 2
    if kv_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the pages' head_dim {kv_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    true_group = num_q_heads // num_kv_heads
    group = _power_of_two_at_least(true_group) if power_of_two_group else true_group
    num_rows, width = metadata.block_tables.shape
    if queries_per_block is None:
        if num_tokens <= num_rows:
            queries_per_block = decode_queries_per_block or max(1, min_rows // group)
        else:
            queries_per_block = max(1, max(min_rows, _PREFILL_ROWS) // group)
        queries_per_block = min(queries_per_block, _power_of_two_at_least(num_tokens))
    if power_of_two_group and queries_per_block * group < min_rows:
        group = max(group, min_rows // queries_per_block)
    if pages_per_block is None:
        pages_per_block = max(1, min(_DEFAULT_BLOCK_TOKENS // page_size, _power_of_two_at_least(width)))
    if queries_per_block < 1 or pages_per_block < 1:
        raise ValueError(f"block sizes must be positive, got {queries_per_block=} {pages_per_block=}")
    return KernelLayout(
        num_kv_heads=num_kv_heads,
        group=group,
        true_group=true_group,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_block=pages_per_block,
        pages_per_seq=-(-width // pages_per_block) * pages_per_block,
        num_rows=num_rows,
        queries_per_block=queries_per_block,
        num_q_blocks=-(-num_tokens // queries_per_block),
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )


def tokens_to_rows(q: jax.Array, layout: KernelLayout) -> jax.Array:
    """[T, N, D] -> [K, padded T * G, D]: row t * G + g of KV head k is query head k * G + g of token t."""
    num_tokens, _, head_dim = q.shape
    q = q.reshape(num_tokens, layout.num_kv_heads, layout.true_group, head_dim)
    q = jnp.pad(q, ((0, layout.padded_tokens - num_tokens), (0, 0), (0, layout.group - layout.true_group), (0, 0)))
    return q.transpose(1, 0, 2, 3).reshape(layout.num_kv_heads, layout.padded_tokens * layout.group, head_dim)


def rows_to_tokens(rows: jax.Array, layout: KernelLayout) -> jax.Array:
    """[K, padded T * G, D] -> [padded T, N, D], dropping padded query heads."""
    out = rows.reshape(layout.num_kv_heads, layout.padded_tokens, layout.group, layout.head_dim)
    out = out[:, :, : layout.true_group].transpose(1, 0, 2, 3)
    return out.reshape(layout.padded_tokens, layout.num_kv_heads * layout.true_group, layout.head_dim)


def query_blocks_rows(metadata: AttentionMetadata, layout: KernelLayout) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query block, its first and last live sequence rows; and block tables padded to whole KV blocks.

    Returns:
      first_rows: i32[num_q_blocks] the row of each block's first token (clamped to S - 1).
      last_rows: i32[num_q_blocks] the row of each block's last live token, -1 if it has none.
      block_tables: i32[S, pages_per_seq], padded with the null page 0.
    """
    cu_q_lens = metadata.cu_q_lens
    token_index = jnp.arange(layout.padded_tokens, dtype=jnp.int32)
    # i32[padded T]: number of sequence ends at or before each token = its row.
    token_rows = jnp.searchsorted(cu_q_lens[1:], token_index, side="right").astype(jnp.int32)
    live_tokens = cu_q_lens[jnp.minimum(metadata.num_seqs[0], layout.num_rows)]
    live = token_index < live_tokens
    blocked_rows = token_rows.reshape(layout.num_q_blocks, layout.queries_per_block)
    blocked_live = live.reshape(layout.num_q_blocks, layout.queries_per_block)
    first_rows = jnp.minimum(blocked_rows[:, 0], layout.num_rows - 1)
    last_rows = jnp.max(jnp.where(blocked_live, blocked_rows, -1), axis=1)
    width = metadata.block_tables.shape[1]
    block_tables = jnp.pad(metadata.block_tables, ((0, 0), (0, layout.pages_per_seq - width)))
    return first_rows, last_rows.astype(jnp.int32), block_tables.astype(jnp.int32)


def kv_block_range(q_start, q_end, kv_len, block_first_token, layout: KernelLayout):
    """KV blocks [start, stop) that a query block's tokens of one sequence can see; (0, 0) if it has none.

    Args:
      q_start, q_end, kv_len: the sequence's new-token range in the batch and its kv length (scalars).
      block_first_token: the query block's first batch token.
    """
    first_token = jnp.maximum(q_start, block_first_token)
    end_token = jnp.minimum(q_end, block_first_token + layout.queries_per_block)
    first_position = kv_len - (q_end - q_start) + (first_token - q_start)
    last_position = first_position + (end_token - first_token) - 1
    stop = jnp.where(end_token > first_token, last_position // layout.block_tokens + 1, 0)
    start = jnp.zeros_like(stop)
    if layout.sliding_window is not None:
        start = jnp.clip((first_position - layout.sliding_window + 1) // layout.block_tokens, 0, stop)
    return start, stop


def block_masks(row_tokens, q_start, q_end, kv_len, kv_block, layout: KernelLayout):
    """(visible [rows, B], in_sequence [1, B]) of one KV block for the tile's rows of one sequence.

    Args:
      row_tokens: i32[rows, 1] batch token of each tile row.
      q_start, q_end, kv_len: the sequence's new-token range and its kv length (scalars).
      kv_block: which KV block of the sequence.
    """
    own = (row_tokens >= q_start) & (row_tokens < q_end)  # [rows, 1]
    query_positions = kv_len - q_end + row_tokens  # [rows, 1]
    kv_positions = kv_block * layout.block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, layout.block_tokens), 1)
    in_sequence = kv_positions < kv_len  # [1, B]
    visible = own & in_sequence & (kv_positions <= query_positions)  # [rows, B]
    if layout.sliding_window is not None:
        visible &= kv_positions > query_positions - layout.sliding_window
    return visible, in_sequence


def fold_kv_block(carry, q, keys, values, key_scales, value_scales, visible, in_sequence, layout: KernelLayout):
    """One online-softmax step inside a kernel: fold a KV block into (running max, running sum, output).

    Args:
      carry: (f32[rows, 1], f32[rows, 1], f32[rows, D]).
      q: [rows, D] query tile.
      keys, values: [B, D] the block's K and V as stored.
      key_scales, value_scales: [1, B] scales of 8-bit pages (bf16), or None for plain pages.
      visible, in_sequence: from block_masks.
    """
    running_max, running_sum, acc = carry
    scores = jax.lax.dot_general(
        q,
        keys.astype(q.dtype),
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=layout.precision,
    )  # [rows, B]
    scores = scores * layout.sm_scale
    if key_scales is not None:
        scores = scores * key_scales.astype(jnp.float32)
    if layout.soft_cap is not None:
        scores = layout.soft_cap * jnp.tanh(scores / layout.soft_cap)
    scores = jnp.where(visible, scores, MASK_VALUE)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))  # [rows, 1]
    correction = jnp.exp(running_max - new_max)
    probs = jnp.where(visible, jnp.exp(scores - new_max), 0.0)  # [rows, B]
    running_sum = running_sum * correction + jnp.sum(probs, axis=1, keepdims=True)
    if value_scales is not None:
        probs = probs * jnp.where(in_sequence, value_scales.astype(jnp.float32), 0.0)
    # Slots past the sequence's end hold stale or null-page data, maybe NaN: zero them, since a zero
    # probability times NaN is still NaN.
    values = jnp.where(in_sequence.reshape(-1, 1), values.astype(q.dtype), 0.0).astype(q.dtype)
    update = jax.lax.dot_general(
        probs.astype(q.dtype),
        values,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=layout.precision,
    )  # [rows, D]
    return new_max, running_sum, acc * correction + update
