"""Run a model over a page pool outside any engine: one jitted forward, and one sequence at a time."""

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from pallas_kernels import AttentionMetadata, QuantizedKVPages, allocate_pages, pages_for


def allocate_kv_caches(
    config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, num_groups: int = 1
) -> list[jax.Array | QuantizedKVPages]:
    """Zeroed page pools, one per layer, each [num_pages, page_size, 2 * num_kv_heads * head_dim] (8-bit dtypes
    with their scales; see pallas_kernels.kv_pages).

    Args:
      config: the model whose layers and KV heads size the pools.
      num_pages: pages per layer, including the null page 0.
      page_size: tokens per page.
      dtype: storage dtype of K/V (f32, bf16, or an 8-bit format).
      num_groups: for 8-bit pools, the head groups of the scale layout (the pool's shards over KV heads).
    """
    return [
        allocate_pages(num_pages, page_size, config.num_kv_heads, config.head_dim, dtype, num_groups)
        for _ in range(config.num_layers)
    ]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def forward_over_pages(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,  # i32[T]
    kv_caches: list[jax.Array],  # num_layers x [num_pages, page_size, 2K * H]
    positions: jax.Array,  # i32[T]
    metadata: AttentionMetadata,
    logits_indices: jax.Array,  # i32[R] rows of the batch whose logits are wanted
) -> tuple[jax.Array, list[jax.Array]]:  # (f32[R, vocab], kv_caches)
    """One ragged forward pass: write the new K/V, attend, and return logits of chosen rows.

    A plain jax.jit over (graphdef, state): nnx.jit costs ~20 ms a call in dispatch.

    Args:
      graphdef, state: the split NNX model (graphdef is static).
      tokens, positions: the new tokens of every sequence, padded to a bucket.
      kv_caches: the page pools, donated and returned updated.
      metadata: slots, block tables and lengths of the ragged batch.
      logits_indices: which rows' logits to compute.
    """
    return logits_over_pages(nnx.merge(graphdef, state), tokens, positions, kv_caches, metadata, logits_indices)


def logits_over_pages(
    model,
    tokens: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    kv_caches: list,
    metadata: AttentionMetadata,
    logits_indices: jax.Array,  # i32[R]
) -> tuple[jax.Array, list]:  # (f32[R, vocab], kv_caches)
    """Run a ragged batch through `model` (writing its K/V into the pages) and return the logits of chosen rows.

    Args:
      model: a merged Llama.
      tokens, positions, kv_caches, metadata: as forward_over_pages.
      logits_indices: which rows' logits to compute.
    """
    hidden, kv_caches = model(tokens, positions, kv_caches, metadata)
    return model.logits(hidden[logits_indices]).astype(jnp.float32), kv_caches


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two at or above n (at least `minimum`), so shapes compile a bounded number of times.

    Single-token decodes stay unpadded: on CPU an 8-row matmul repacks the whole weight
    matrix and costs ~1.6x a 1-row one (measured on SmolLM2: 86 vs 53 ms a step).
    """
    return max(minimum, 1 << max(0, n - 1).bit_length())


class PagedSequence:
    """One sequence in a private page pool, fed prefill chunks or single decode tokens.

    Used by LoadedModel.score, the models-level greedy completion, and tests that
    check the paged path against dense references.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        config: ModelConfig,
        *,
        max_tokens: int,
        page_size: int = 16,
        block_table: list[int] | None = None,
        kv_dtype=jnp.float32,
    ):
        """Reserve pages for up to `max_tokens` tokens.

        Args:
          graphdef, state: the split NNX model.
          config: its ModelConfig.
          max_tokens: the most tokens this sequence will hold.
          page_size: tokens per page.
          block_table: the pages to use, in order (any order, never page 0);
            default pages 1, 2, 3, ...
          kv_dtype: storage dtype of the pool.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}; a sequence must hold at least one token")
        num_needed = pages_for(max_tokens, page_size)
        if block_table is None:
            block_table = list(range(1, num_needed + 1))
        if len(block_table) < num_needed:
            raise ValueError(f"block_table has {len(block_table)} pages; {max_tokens} tokens need {num_needed}")
        if 0 in block_table:
            raise ValueError("page 0 is the reserved null page and cannot be in a block table")
        self.graphdef, self.state, self.page_size = graphdef, state, page_size
        self.max_tokens = max_tokens
        self.block_table = np.asarray(block_table, np.int32)
        self.kv_caches = allocate_kv_caches(config, int(self.block_table.max()) + 1, page_size, kv_dtype)
        self.num_tokens = 0

    def feed(self, token_ids, *, all_logits: bool = True) -> np.ndarray:  # f32[n or 1, vocab]
        """Append tokens to the sequence; return the logits at each of them, or only at the last.

        Args:
          token_ids: one or more new tokens (a prefill chunk or a decode token).
          all_logits: return logits for every fed token, else only the last.
        """
        token_ids = np.asarray(token_ids, np.int32).reshape(-1)
        n = len(token_ids)
        if n == 0:
            raise ValueError("feed() needs at least one token")
        if self.num_tokens + n > self.max_tokens:
            raise ValueError(f"sequence would hold {self.num_tokens + n} tokens; it was sized for {self.max_tokens}")
        padded = bucket(n)
        positions = np.zeros(padded, np.int32)
        positions[:n] = np.arange(self.num_tokens, self.num_tokens + n)
        slots = np.zeros(padded, np.int32)  # padding writes into the null page
        slots[:n] = self.block_table[positions[:n] // self.page_size] * self.page_size + positions[:n] % self.page_size
        tokens = np.zeros(padded, np.int32)
        tokens[:n] = token_ids
        metadata = AttentionMetadata(
            slots=jnp.asarray(slots),
            block_tables=jnp.asarray(self.block_table[None, :]),
            cu_q_lens=jnp.asarray([0, n], jnp.int32),
            kv_lens=jnp.asarray([self.num_tokens + n], jnp.int32),
            num_seqs=jnp.asarray([1], jnp.int32),
        )
        logits, self.kv_caches = forward_over_pages(
            self.graphdef,
            self.state,
            jnp.asarray(tokens),
            self.kv_caches,
            jnp.asarray(positions),
            metadata,
            jnp.arange(padded, dtype=jnp.int32) if all_logits else jnp.asarray([n - 1], jnp.int32),
        )
        self.num_tokens += n
        return np.asarray(logits[:n] if all_logits else logits)


def greedy_tokens(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    config: ModelConfig,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    stop_token_ids=(),
    page_size: int = 16,
) -> Iterator[int]:
    """Yield a greedy completion of one prompt token by token: the models-level path, before any engine.

    Args:
      graphdef, state: the split NNX model.
      config: its ModelConfig.
      prompt_ids: the prompt's token ids.
      max_new_tokens: the most tokens to generate.
      stop_token_ids: generation ends after yielding one of these.
      page_size: tokens per page of the private pool.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt_ids) + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new tokens exceeds the model's "
            f"context of {config.max_position_embeddings}; shorten the prompt or lower max_new_tokens"
        )
    sequence = PagedSequence(graphdef, state, config, max_tokens=len(prompt_ids) + max_new_tokens, page_size=page_size)
    logits = sequence.feed(prompt_ids, all_logits=False)
    for step in range(max_new_tokens):
        next_token = int(np.argmax(logits[-1]))
        yield next_token
        if next_token in stop_token_ids or step + 1 == max_new_tokens:
            return
        logits = sequence.feed([next_token], all_logits=False)


def greedy_generate(
    graphdef, state, config, prompt_ids, max_new_tokens, *, stop_token_ids=(), page_size=16
) -> list[int]:
    """The whole greedy completion as a list (see greedy_tokens)."""
    return list(
        greedy_tokens(
            graphdef, state, config, prompt_ids, max_new_tokens, stop_token_ids=stop_token_ids, page_size=page_size
        )
    )
