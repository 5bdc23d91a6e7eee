"""How the Pallas attention kernels tile a ragged batch: block sizes, query rows, per-block sequence ranges."""

import dataclasses
import math
from typing import NamedTuple

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
    heads_per_block: int  # KV heads one program attends (a divisor of num_kv_heads)
    group: int  # query heads per KV head, as tiled (maybe padded)
    true_group: int  # query heads per KV head in the model
    head_dim: int
    page_size: int
    pages_per_block: int
    blocks_per_page: int  # > 1 when a KV block is a slice of one page (pages_per_block is then 1)
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
        return self.pages_per_block * self.page_size // self.blocks_per_page

    @property
    def num_head_blocks(self) -> int:
        """Programs along the KV-head axis of the grid."""
        return self.num_kv_heads // self.heads_per_block

    @property
    def rows(self) -> int:
        """Query rows of one tile: tokens per query block times query heads per KV head."""
        return self.queries_per_block * self.group

    @property
    def padded_tokens(self) -> int:
        """Tokens after padding to whole query blocks."""
        return self.queries_per_block * self.num_q_blocks


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_layout(
    q: jax.Array,
    kv_pages: jax.Array,
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    queries_per_block: int | None,
    pages_per_block: int | None,
    min_rows: int = 8,
    pad_group: bool = False,
    decode_queries_per_block: int | None = None,
    heads_per_block: int | None = None,
    prefill_rows: int = _PREFILL_ROWS,
    prefill_block_tokens: int = _DEFAULT_BLOCK_TOKENS,
    decode_block_tokens: int = _DEFAULT_BLOCK_TOKENS,
    split_pages: bool = False,
) -> KernelLayout:
    """Choose block sizes for a batch of this shape (all static: shapes, not values).

    Decode-shaped batches (no more tokens than sequence rows) get query blocks of a few tokens,
    since each token of a block is usually its own sequence and rows of other sequences are
    wasted work; prefill-shaped batches get blocks of about 128 query rows.

    Args:
      q: [T, num_q_heads, D] queries; kv_pages: [num_pages, P, 2K * D]; metadata: the batch (shapes only).
      sm_scale, sliding_window, soft_cap: attention options, carried into the kernel.
      queries_per_block, pages_per_block: overrides of the default block sizes.
      min_rows: a tile's rows must be a multiple of this (TPU sublanes: 8 for 32-bit q, 16 for 16-bit q;
        16 for a Triton dot).
      pad_group: pad the query heads per KV head to a power of two (Triton tiles), and further with dummy
        heads to `min_rows // queries_per_block` when the tile would be too small; without it, tiles
        reach a multiple of min_rows by holding more tokens.
      decode_queries_per_block: tokens per query block for decode-shaped batches (default: fill min_rows).
      heads_per_block: KV heads per program (default all of them).
      prefill_rows, prefill_block_tokens: the query tile's rows and KV block's tokens for prefill-shaped batches.
      decode_block_tokens: the KV block's tokens for decode-shaped batches.
      split_pages: let a KV block be a slice of one page when the block is smaller than a page (else a
        block is at least one page).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, row_width = kv_pages.shape
    if row_width % (2 * head_dim):
        raise ValueError(f"the pool's rows of {row_width} lanes do not hold whole K/V pairs of head_dim {head_dim}")
    num_kv_heads = row_width // (2 * head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    true_group = num_q_heads // num_kv_heads
    group = _power_of_two_at_least(true_group) if pad_group else true_group
    num_rows, width = metadata.block_tables.shape
    # Without padded heads, a power-of-two block of tokens fills whole tiles from this many tokens on.
    min_queries = 1 if pad_group else max(1, min_rows // math.gcd(group, min_rows))
    decode_shaped = num_tokens <= num_rows
    if queries_per_block is None:
        if decode_shaped:
            queries_per_block = decode_queries_per_block or max(min_queries, min_rows // group)
        else:
            queries_per_block = max(1, max(min_rows, prefill_rows) // group)
            queries_per_block = 1 << (queries_per_block.bit_length() - 1)  # a power of two at most that
        queries_per_block = max(min_queries, min(queries_per_block, _power_of_two_at_least(num_tokens)))
    if pad_group and queries_per_block * group < min_rows:
        group = max(group, min_rows // queries_per_block)
    if (queries_per_block * group) % min_rows:
        raise ValueError(
            f"queries_per_block={queries_per_block} x {group} query heads per KV head = "
            f"{queries_per_block * group} rows, not a multiple of {min_rows}"
        )
    blocks_per_page = 1
    if pages_per_block is None:
        block_tokens = decode_block_tokens if decode_shaped else prefill_block_tokens
        pages_per_block = max(1, min(block_tokens // page_size, _power_of_two_at_least(width)))
        if split_pages and block_tokens < page_size and page_size % block_tokens == 0:
            blocks_per_page = page_size // block_tokens
    if queries_per_block < 1 or pages_per_block < 1:
        raise ValueError(f"block sizes must be positive, got {queries_per_block=} {pages_per_block=}")
    heads_per_block = heads_per_block or num_kv_heads
    if num_kv_heads % heads_per_block:
        raise ValueError(f"heads_per_block={heads_per_block} does not divide {num_kv_heads} KV heads")
    return KernelLayout(
        num_kv_heads=num_kv_heads,
        heads_per_block=heads_per_block,
        group=group,
        true_group=true_group,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_block=pages_per_block,
        blocks_per_page=blocks_per_page,
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


class BlockMasks(NamedTuple):
    """Which scores of one KV block count, and which of its token slots hold the sequence's tokens."""

    visible: jax.Array  # bool[rows, B] causal (and windowed) and the row's own sequence
    in_sequence: jax.Array  # bool[1, B] slots before the sequence's end
    rows_in_sequence: jax.Array  # bool[B, 1] the same as a column


def block_masks(row_tokens, q_start, q_end, kv_len, kv_block, layout: KernelLayout) -> BlockMasks:
    """The masks of one KV block for the tile's rows of one sequence.

    Args:
      row_tokens: i32[rows, 1] batch token of each tile row.
      q_start, q_end, kv_len: the sequence's new-token range and its kv length (scalars).
      kv_block: which KV block of the sequence.
    """
    own = (row_tokens >= q_start) & (row_tokens < q_end)  # [rows, 1]
    query_positions = kv_len - q_end + row_tokens  # [rows, 1]
    first_position = kv_block * layout.block_tokens
    kv_positions = first_position + jax.lax.broadcasted_iota(jnp.int32, (1, layout.block_tokens), 1)
    in_sequence = kv_positions < kv_len  # [1, B]
    visible = own & in_sequence & (kv_positions <= query_positions)  # [rows, B]
    if layout.sliding_window is not None:
        visible &= kv_positions > query_positions - layout.sliding_window
    # The same as a column, built from its own iota: Mosaic cannot move a mask from lanes to sublanes.
    rows_in_sequence = first_position + jax.lax.broadcasted_iota(jnp.int32, (layout.block_tokens, 1), 0) < kv_len
    return BlockMasks(visible, in_sequence, rows_in_sequence)


def fold_kv_block(carry, q, keys, values, key_scales, value_scales, masks: BlockMasks, layout: KernelLayout):
    """One online-softmax step inside a kernel: fold a KV block into (running max, running sum, output).

    Args:
      carry: (f32[rows, 1], f32[rows, 1], f32[rows, D]).
      q: [rows, D] query tile.
      keys, values: [B, D] the block's K and V as stored.
      key_scales, value_scales: [1, B] scales of 8-bit pages (bf16), or None for plain pages.
      masks: from block_masks.
    """
    visible = masks.visible
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
        probs = probs * jnp.where(masks.in_sequence, value_scales.astype(jnp.float32), 0.0)
    # Slots past the sequence's end hold stale or null-page data, maybe NaN: zero them, since a zero
    # probability times NaN is still NaN.
    values = jnp.where(masks.rows_in_sequence, values.astype(q.dtype), 0.0).astype(q.dtype)
    update = jax.lax.dot_general(
        probs.astype(q.dtype),
        values,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=layout.precision,
    )  # [rows, D]
    return new_max, running_sum, acc * correction + update
