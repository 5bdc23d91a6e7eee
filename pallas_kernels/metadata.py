"""The ragged-batch description every attention implementation reads."""

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token lives in the page pool and which pages each sequence reads.

    Tokens of one sequence are contiguous in the batch; sequence `s` owns tokens
    `cu_q_lens[s]:cu_q_lens[s + 1]`, which are the last `q_len` of its `kv_lens[s]`
    tokens. Rows `s >= num_seqs[0]` are padding and must have q_len 0.
    """

    slots: jax.Array  # i32[T] page * page_size + offset; padded tokens point into page 0
    block_tables: jax.Array  # i32[S, pages_per_seq] page ids; padded entries are 0
    cu_q_lens: jax.Array  # i32[S + 1] cumulative new-token counts
    kv_lens: jax.Array  # i32[S] tokens in the cache after this step's writes
    num_seqs: jax.Array  # i32[1] live sequence rows
