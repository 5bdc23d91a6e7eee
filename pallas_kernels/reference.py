"""Pure-jnp ragged paged attention: the reference every kernel is checked against."""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.kv_pages import num_kv_heads_of, page_view
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.quantization import QuantizedKVPages

# Letters in einsum strings:
#   T new tokens, K kv heads, G query heads per kv head, D head_dim, P tokens in one page.

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _gather_pages(kv_pages: jax.Array | QuantizedKVPages, page_ids: jax.Array, head_dim: int) -> jax.Array:
    """f32 K/V of the given pages: [*page_ids.shape, page_size, 2K, D], dequantized for 8-bit pools."""
    if isinstance(kv_pages, QuantizedKVPages):
        return kv_pages.gather(page_ids)
    return page_view(kv_pages[page_ids], head_dim).astype(jnp.float32)


def token_sequence_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """The sequence row each token belongs to; padded tokens get the row after the last.

    Args:
      cu_q_lens: i32[S + 1] cumulative new-token counts.
      num_tokens: T, the padded token count.
    """
    token_index = jnp.arange(num_tokens, dtype=jnp.int32)
    # i32[T]: number of sequence ends at or before each token.
    return jnp.searchsorted(cu_q_lens[1:], token_index, side="right").astype(jnp.int32)


KV_READS = ("auto", "per_token", "per_sequence", "per_block")
# Tokens of KV read per loop step, and query tokens per block, on the blocked paths.
_KV_BLOCK_TOKENS = 128
_Q_BLOCK_TOKENS = 128
# KV tokens per loop step when each token reads its own pages: small, since short sequences would waste the rest.
_PER_TOKEN_KV_BLOCK_TOKENS = 32
# On the per_block path, a query block spanning more sequence rows than this reads pages per token instead.
_MAX_ROWS_PER_BLOCK = 4


def _online_softmax_step(carry, scores, visible, weighted_values, soft_cap):
    """Fold one block of scores (block on the last axis) into the running max, sum and output."""
    running_max, running_sum, acc = carry
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, _MASK_VALUE)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    correction = jnp.exp(running_max - new_max)
    probs = jnp.exp(scores - new_max[..., None]) * visible
    running_sum = running_sum * correction + probs.sum(axis=-1)
    acc = acc * correction[..., None] + weighted_values(probs)
    return new_max, running_sum, acc


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_read"))
def ragged_paged_attention_reference(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_read: str = "auto",
) -> jax.Array:  # [T, num_q_heads, D]
    """Causal attention of each new token over its sequence's pages, with an online softmax.

    Three ways to read the pages give the same result at different costs:
    `per_token` gathers each token's own pages (memory O(T * block), best for decode
    batches); `per_sequence` reads each sequence's pages once and scores every token
    against them as one matmul, masking other sequences (O(T * S) work); `per_block`
    (what `auto` runs for more than 4 tokens; it reads fewer per token) splits the tokens
    into query blocks and, in each, loops over only the sequences present, one matmul per
    KV block, or reads per token when a block spans many sequences (decode tokens). Prefill
    chunks of many sequences then cost about their causal FLOPs.

    Args:
      q: queries of the new tokens, already rotated.
      kv_pages: one layer's page pool, K and V interleaved per head in each token row; 8-bit pools
        (QuantizedKVPages) are dequantized block by block as they are read.
      metadata: the ragged batch layout (see AttentionMetadata).
      sm_scale: multiplier applied to q.k, usually head_dim ** -0.5.
      sliding_window: if set, a token sees only the last `sliding_window` positions.
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      kv_read: auto (= per_block) | per_token | per_sequence | per_block.
    """
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, kv_read=kv_read)
    return ragged_attention_with_reader(q, kv_pages, metadata, token_reader=attend_per_token, **options)


def ragged_attention_with_reader(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    kv_read: str,
    token_reader: Callable,
    reader_run_tokens: int = 0,
) -> jax.Array:  # [T, num_q_heads, D]
    """The reference's attention with another per-token page reader (`token_reader`, attend_per_token's
    signature) wherever tokens read their own pages: how a native kernel reuses the blocked prefill path.

    Args:
      reader_run_tokens: on the per_block path, query blocks whose rows average at most this many tokens (a
        decode token with its speculative drafts) go to the reader too; for a reader that reads a row's pages once
        for its consecutive tokens. 0: only blocks spanning many rows do.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = num_kv_heads_of(kv_pages, head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if kv_read not in KV_READS:
        raise ValueError(f"kv_read={kv_read!r} is not one of {KV_READS}")
    num_rows = metadata.kv_lens.shape[0]
    if kv_read == "auto":
        # A handful of tokens (batch-1 to batch-4 decodes) is quickest read per token: the blocked path's
        # loops over rows and 128-token KV blocks cost twice as much there (0.21 vs 0.10 ms a layer at one
        # token over 160 positions, on 2 CPU cores).
        kv_read = "per_token" if num_tokens <= _MAX_ROWS_PER_BLOCK else "per_block"

    seq_ids = token_sequence_ids(metadata.cu_q_lens, num_tokens)  # i32[T]
    live = seq_ids < jnp.minimum(metadata.num_seqs[0], num_rows)  # bool[T]
    row = jnp.minimum(seq_ids, num_rows - 1)
    q_lens = metadata.cu_q_lens[1:] - metadata.cu_q_lens[:-1]  # i32[S]
    # Absolute position of each query: kv_len - q_len + index within the chunk.
    first_query_position = metadata.kv_lens - q_lens  # i32[S]
    query_positions = first_query_position[row] + jnp.arange(num_tokens) - metadata.cu_q_lens[row]
    token_kv_lens = jnp.where(live, metadata.kv_lens[row], 0)  # i32[T]

    tokens = TokenLayout(row, query_positions, token_kv_lens)
    scaled_q = q.astype(jnp.float32) * sm_scale
    if kv_read == "per_token":
        out = token_reader(scaled_q, kv_pages, metadata.block_tables, tokens, sliding_window, soft_cap)
    elif kv_read == "per_block":
        out = _attend_per_block(
            scaled_q, kv_pages, metadata.block_tables, tokens, sliding_window, soft_cap, token_reader, reader_run_tokens
        )
    else:
        seq_kv_lens = jnp.where(jnp.arange(num_rows) < metadata.num_seqs[0], metadata.kv_lens, 0)  # i32[S]
        out = _attend_per_sequence(
            scaled_q, kv_pages, metadata.block_tables, seq_kv_lens, tokens, sliding_window, soft_cap
        )
    return out.astype(q.dtype)


class TokenLayout(NamedTuple):
    """Per-token facts every page reader needs."""

    row: jax.Array  # i32[T] sequence row of each token (clamped for padding)
    query_positions: jax.Array  # i32[T] absolute position of each token
    kv_lens: jax.Array  # i32[T] its sequence's kv length; 0 for padded tokens


def _visibility(kv_positions, query_positions, kv_lens, sliding_window):  # -> bool[T, B]
    """Causal (and optionally windowed) mask of tokens [T] over kv positions [B]."""
    visible = (kv_positions[None, :] <= query_positions[:, None]) & (kv_positions[None, :] < kv_lens[:, None])
    if sliding_window is not None:
        visible &= kv_positions[None, :] > query_positions[:, None] - sliding_window
    return visible


def _pad_block_tables(
    block_tables: jax.Array, page_size: int, block_tokens: int = _KV_BLOCK_TOKENS
) -> tuple[jax.Array, int]:
    """Pad block tables (with the null page) to whole KV blocks of about `block_tokens`; return them and the
    pages per block."""
    pages_per_seq = block_tables.shape[1]
    pages_per_block = max(1, min(block_tokens // page_size, pages_per_seq))
    pad = -pages_per_seq % pages_per_block
    return jnp.pad(block_tables, ((0, 0), (0, pad))), pages_per_block


def _gather_heads_first(kv_pages, page_ids: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """f32 keys and values of the given pages, heads first: [T, K, n * P, D] each, for page_ids i32[T, n].

    A plain pool is gathered straight into that order, K and V apart: gathering whole pages and then
    transposing them wrote the block twice more (on 2 CPU cores a batch-32 decode over 160 positions took
    2.2 ms a layer that way and 1.6 ms so). 8-bit pools dequantize whole pages, then turn them.
    """
    num_tokens, num_pages = page_ids.shape
    page_size = kv_pages.shape[1]
    num_kv_heads = num_kv_heads_of(kv_pages, head_dim)
    if isinstance(kv_pages, QuantizedKVPages):
        block = kv_pages.gather(page_ids).reshape(num_tokens, num_pages * page_size, num_kv_heads, 2, head_dim)
        return block[:, :, :, 0].transpose(0, 2, 1, 3), block[:, :, :, 1].transpose(0, 2, 1, 3)
    heads = page_view(kv_pages, head_dim)  # [pages, P, 2K, D]
    key_slots = 2 * jnp.arange(num_kv_heads)[None, :, None]  # K of head h sits in slot 2h, V in 2h + 1
    rows = page_ids[:, None, :]  # [T, 1, n]
    shape = (num_tokens, num_kv_heads, num_pages * page_size, head_dim)
    keys = heads[rows, :, key_slots].reshape(shape)  # [T, K, n, P, D] -> [T, K, B, D]
    values = heads[rows, :, key_slots + 1].reshape(shape)
    return keys.astype(jnp.float32), values.astype(jnp.float32)


def attend_per_token(q, kv_pages, block_tables, tokens, sliding_window, soft_cap):
    """Each token gathers its own sequence's next KV block at every step: [T, B] scores per step.

    Args:
      q: f32[T, N, D] queries, already scaled by sm_scale.
      kv_pages: one layer's pool; block_tables: i32[S, W]; tokens: their TokenLayout.
      sliding_window, soft_cap: as ragged_paged_attention_reference.
    Returns:
      f32[T, N, D]; padded tokens (kv length 0) are 0.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_pages.shape[1], num_kv_heads_of(kv_pages, head_dim)
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    block_tables, pages_per_block = _pad_block_tables(block_tables, page_size, _PER_TOKEN_KV_BLOCK_TOKENS)
    block_size = pages_per_block * page_size
    token_block_tables = block_tables[tokens.row]  # i32[T, padded pages_per_seq]

    def attend_block(step, carry):
        page_ids = jax.lax.dynamic_slice_in_dim(token_block_tables, step * pages_per_block, pages_per_block, 1)
        # [T, K, B, D] each: (token, kv head) lead, so both products are plain batched matmuls.
        keys, values = _gather_heads_first(kv_pages, page_ids, head_dim)
        kv_positions = step * block_size + jnp.arange(block_size)
        # Slots past a sequence's length (stale or null-page data, possibly NaN) must not reach
        # the output: a zero probability times NaN is still NaN.
        in_sequence = kv_positions[None, :] < tokens.kv_lens[:, None]  # [T, B]
        values = jnp.where(in_sequence[:, None, :, None], values, 0.0)
        scores = jnp.einsum("tkgd,tkbd->tkgb", qg, keys)  # [T, K, G, B]
        visible = _visibility(kv_positions, tokens.query_positions, tokens.kv_lens, sliding_window)
        visible = visible[:, None, None, :]
        return _online_softmax_step(
            carry, scores, visible, lambda probs: jnp.einsum("tkgb,tkbd->tkgd", probs, values), soft_cap
        )

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    start = 0
    if sliding_window is not None:
        live = tokens.kv_lens > 0
        first_position = jnp.min(jnp.where(live, tokens.query_positions, jnp.iinfo(jnp.int32).max))
        start = jnp.maximum(first_position - sliding_window + 1, 0) // block_size
    num_steps = (jnp.max(tokens.kv_lens) + block_size - 1) // block_size
    _, running_sum, acc = jax.lax.fori_loop(jnp.minimum(start, num_steps), num_steps, attend_block, init)
    out = acc / jnp.maximum(running_sum, 1e-30)[..., None]  # padded tokens stay 0
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _attend_rows_of_block(q_heads, kv_pages, block_tables, pages_per_block, block_tokens, sliding_window, soft_cap):
    """One query block against each sequence row present in it, one KV block per matmul.

    Args:
      q_heads: [K, Q * G, D] the block's queries, head-major (row t * G + g).
      block_tables: [S, W] padded to whole KV blocks.
      block_tokens: TokenLayout of the block's Q tokens.
    Returns:
      [K, Q * G, D] attention output; padded tokens are 0.
    """
    num_kv_heads, rows, head_dim = q_heads.shape
    q_block = block_tokens.row.shape[0]
    group = rows // q_block
    page_size = kv_pages.shape[1]
    block_size = pages_per_block * page_size
    live = block_tokens.kv_lens > 0  # bool[Q]
    first_row = block_tokens.row[0]
    last_row = jnp.max(jnp.where(live, block_tokens.row, -1))

    def attend_row(row, carry):
        own = live & (block_tokens.row == row)  # bool[Q]
        kv_len = jnp.max(jnp.where(own, block_tokens.kv_lens, 0))
        last_position = jnp.max(jnp.where(own, block_tokens.query_positions, -1))
        stop = (last_position + block_size) // block_size
        start = 0
        if sliding_window is not None:
            first_position = jnp.min(jnp.where(own, block_tokens.query_positions, jnp.iinfo(jnp.int32).max))
            start = jnp.clip((first_position - sliding_window + 1) // block_size, 0, stop)
        row_pages = block_tables[row]  # i32[W]

        def attend_kv_block(step, carry):
            page_ids = jax.lax.dynamic_slice_in_dim(row_pages, step * pages_per_block, pages_per_block)
            block = _gather_pages(kv_pages, page_ids, head_dim)  # [pages_per_block, P, 2K, D]
            block = block.reshape(block_size, num_kv_heads, 2, head_dim)
            kv_positions = step * block_size + jnp.arange(block_size)
            keys = block[:, :, 0].transpose(1, 2, 0)  # [K, D, B]
            # Zero slots past the sequence's length: stale or null-page data (maybe NaN) would
            # otherwise leak through zero probabilities.
            values = jnp.where((kv_positions < kv_len)[None, :, None], block[:, :, 1].transpose(1, 0, 2), 0.0)
            scores = jnp.matmul(q_heads, keys)  # [K, Q * G, B]
            visible = own[:, None] & _visibility(
                kv_positions, block_tokens.query_positions, block_tokens.kv_lens, sliding_window
            )  # [Q, B]
            visible = jnp.repeat(visible, group, axis=0)[None]  # [1, Q * G, B]
            return _online_softmax_step(carry, scores, visible, lambda probs: jnp.matmul(probs, values), soft_cap)

        return jax.lax.fori_loop(start, stop, attend_kv_block, carry)

    init = (
        jnp.full((num_kv_heads, rows), _MASK_VALUE, jnp.float32),
        jnp.zeros((num_kv_heads, rows), jnp.float32),
        jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32),
    )
    _, running_sum, acc = jax.lax.fori_loop(first_row, last_row + 1, attend_row, init)
    return acc / jnp.maximum(running_sum, 1e-30)[..., None]


def _attend_per_block(q, kv_pages, block_tables, tokens, sliding_window, soft_cap, token_reader, reader_run_tokens):
    """Query blocks of Q tokens: loop over the rows present, or read per token when a block spans many rows (or
    its rows average at most reader_run_tokens tokens)."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_pages.shape[1], num_kv_heads_of(kv_pages, head_dim)
    group = num_q_heads // num_kv_heads
    padded_tables, pages_per_block = _pad_block_tables(block_tables, page_size)
    q_block = _Q_BLOCK_TOKENS if num_tokens % _Q_BLOCK_TOKENS == 0 else num_tokens
    num_q_blocks = num_tokens // q_block
    blocked_q = q.reshape(num_q_blocks, q_block, num_q_heads, head_dim)
    blocked = jax.tree.map(lambda a: a.reshape(num_q_blocks, q_block), tokens)

    def attend_query_block(inputs):
        q_blk, block_tokens = inputs  # [Q, N, D], TokenLayout of [Q]
        live = block_tokens.kv_lens > 0
        num_block_rows = jnp.max(jnp.where(live, block_tokens.row, -1)) - block_tokens.row[0] + 1

        def by_rows():
            # [K, Q * G, D], row index t * G + g
            q_heads = q_blk.reshape(q_block, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
            q_heads = q_heads.reshape(num_kv_heads, q_block * group, head_dim)
            out = _attend_rows_of_block(
                q_heads, kv_pages, padded_tables, pages_per_block, block_tokens, sliding_window, soft_cap
            )
            out = out.reshape(num_kv_heads, q_block, group, head_dim).transpose(1, 0, 2, 3)
            return out.reshape(q_block, num_q_heads, head_dim)

        def by_tokens():
            return token_reader(q_blk, kv_pages, block_tables, block_tokens, sliding_window, soft_cap)

        to_reader = num_block_rows > _MAX_ROWS_PER_BLOCK
        if reader_run_tokens:  # and live rows short enough for a reader that reads each row's pages once
            to_reader |= (num_block_rows > 0) & (jnp.sum(live) <= reader_run_tokens * num_block_rows)
        return jax.lax.cond(to_reader, by_tokens, by_rows)

    out = jax.lax.map(attend_query_block, (blocked_q, blocked))  # [num_q_blocks, Q, N, D]
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _attend_per_sequence(q, kv_pages, block_tables, kv_lens, tokens, sliding_window, soft_cap):
    """Blocks of tokens score blocks of every sequence's pages as one matmul per KV head.

    Head-major layout ([K, tokens * G, ...]) keeps both matmuls plain batched GEMMs on CPU.
    Each query block reads only the KV blocks its positions can see, which skips the
    upper triangle of a causal prefill.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_pages.shape[1], num_kv_heads_of(kv_pages, head_dim)
    group = num_q_heads // num_kv_heads
    num_rows = block_tables.shape[0]
    block_tables, pages_per_block = _pad_block_tables(block_tables, page_size)
    block_size = pages_per_block * page_size
    q_block = _Q_BLOCK_TOKENS if num_tokens % _Q_BLOCK_TOKENS == 0 else num_tokens
    num_q_blocks = num_tokens // q_block
    # [num_q_blocks, K, q_block * G, D], row index t * G + g within a block
    q_heads = q.reshape(num_q_blocks, q_block, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_heads = q_heads.reshape(num_q_blocks, num_kv_heads, q_block * group, head_dim)
    blocked = jax.tree.map(lambda a: a.reshape(num_q_blocks, q_block), tokens)

    def attend_query_block(inputs):
        q_blk, block_tokens = inputs  # [K, q_block * G, D], TokenLayout of [q_block]
        own_row = block_tokens.row[:, None] == jnp.arange(num_rows)[None, :]  # bool[q_block, S]
        live = block_tokens.kv_lens > 0

        def attend_kv_block(step, carry):
            page_ids = jax.lax.dynamic_slice_in_dim(block_tables, step * pages_per_block, pages_per_block, 1)
            block = _gather_pages(kv_pages, page_ids, head_dim)  # [S, pages_per_block, P, 2K, D]
            block = block.reshape(num_rows * block_size, num_kv_heads, 2, head_dim)
            keys = block[:, :, 0].transpose(1, 2, 0)  # [K, D, S * B]
            values = block[:, :, 1].transpose(1, 0, 2)  # [K, S * B, D]
            # Zero slots past each sequence's length: stale or null-page data (maybe NaN) would
            # otherwise leak through zero probabilities into every token's output.
            kv_positions = step * block_size + jnp.arange(block_size)
            in_sequence = (kv_positions[None, :] < kv_lens[:, None]).reshape(1, num_rows * block_size, 1)
            values = jnp.where(in_sequence, values, 0.0)
            scores = jnp.matmul(q_blk, keys)  # [K, q_block * G, S * B]
            visible = _visibility(kv_positions, block_tokens.query_positions, block_tokens.kv_lens, sliding_window)
            visible = own_row[:, :, None] & visible[:, None, :]  # [q_block, S, B]
            visible = jnp.broadcast_to(
                visible.reshape(q_block, 1, num_rows * block_size), (q_block, group, num_rows * block_size)
            ).reshape(1, q_block * group, num_rows * block_size)
            return _online_softmax_step(carry, scores, visible, lambda probs: jnp.matmul(probs, values), soft_cap)

        init = (
            jnp.full((num_kv_heads, q_block * group), _MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, q_block * group), jnp.float32),
            jnp.zeros((num_kv_heads, q_block * group, head_dim), jnp.float32),
        )
        # KV blocks from the first one a live token's window reaches to the last one it sees.
        last_position = jnp.max(jnp.where(live, block_tokens.query_positions, -1))
        stop = (last_position + block_size) // block_size
        start = 0
        if sliding_window is not None:
            first_position = jnp.min(jnp.where(live, block_tokens.query_positions, jnp.iinfo(jnp.int32).max))
            start = jnp.clip((first_position - sliding_window + 1) // block_size, 0, stop)
        _, running_sum, acc = jax.lax.fori_loop(start, stop, attend_kv_block, init)
        return acc / jnp.maximum(running_sum, 1e-30)[..., None]  # padded tokens stay 0

    out = jax.lax.map(attend_query_block, (q_heads, blocked))  # [num_q_blocks, K, q_block * G, D]
    # -> [T, K * G, D]
    out = out.reshape(num_q_blocks, num_kv_heads, q_block, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, num_q_heads, head_dim)
