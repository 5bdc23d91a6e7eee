"""Paged attention on CPU through a native XLA FFI kernel (cpu_paged_attention.cc): every token of a plain f32 or
bf16 pool (decode tokens with or without speculative drafts, and prefill chunks), and of an int8 pool of head_dim 32,
64 or 128; FP8 pools (and int8 ones of other head_dims) keep the XLA reference's blocked path and its per-token
reader.

XLA:CPU's version of the per-token read gathers every token's KV block into a fresh array first, at about 4 GB/s;
the native kernel walks the pages in place (12-15 GB/s on 2 cores, 3x less time at batch 32). Prefill chunks take
its tiled path, a matrix-product-shaped loop over each page: SmolLM2's 2048-token prompt attends in about 40 ms a
layer there, against about 107 ms by the reference's 128 x 128 blocks (BUILD.md). Over a bf16 pool the tiled path,
and the short-run path of head_dim 32, 64 and 128, multiply bf16 pairs (queries and softmax weights rounded to bf16,
exact products, f32 sums), within 2^-8 of the reference; every other token matches the reference's f32 arithmetic
but for the order of its sums. Over an int8 pool the short runs multiply the stored integers in f32, each key's dot
product times its K scale and each softmax weight times its V scale (where the reference multiplies the dequantized
values: the same products, rounded in another order), and the tiled path multiplies bf16 pairs as over a bf16 pool
(the integers are exact in bf16; scores times K scales, weights times V scales before their rounding).

The kernel is part of the native library (pallas_kernels/native_library.py), built on first use; where it cannot be
built, `native_kernel_error()` says why and `auto` keeps the pure-jnp reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_pages import num_kv_heads_of
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.native_library import ATTENTION_TARGETS, native_kernel_error
from pallas_kernels.quantization import QuantizedKVPages
from pallas_kernels.reference import attend_per_token, ragged_attention_with_reader

# When the blocked path runs (kv_read="per_block", or an 8-bit pool under "auto"): query blocks whose rows average
# at most this many tokens (a decode token and its drafts) go to the per-token reader, longer chunks to the
# reference's matmuls.
NATIVE_RUN_TOKENS = 8
# The head_dims whose int8 pools the kernel reads (its lanes path's; cpu_paged_attention_lanes.h).
INT8_HEAD_DIMS = (32, 64, 128)


def _native_reads(kv_pages) -> bool:
    """Whether the kernel reads this pool: plain f32 or bf16 pages, and int8 ones (with their scales) of head_dim 32,
    64 or 128; FP8 pools, and int8 ones of other head_dims, keep the jnp reader."""
    if isinstance(kv_pages, QuantizedKVPages):
        return kv_pages.dtype == jnp.int8 and kv_pages.head_dim in INT8_HEAD_DIMS
    return jnp.dtype(kv_pages.dtype) in ATTENTION_TARGETS and jnp.dtype(kv_pages.dtype) != jnp.int8


def _native_reader(q, kv_pages, block_tables, tokens, sliding_window, soft_cap):
    """attend_per_token's contract through the native kernel, for the pools it reads (_native_reads)."""
    if not _native_reads(kv_pages):
        return attend_per_token(q, kv_pages, block_tables, tokens, sliding_window, soft_cap)
    num_kv_heads_of(kv_pages, q.shape[-1])  # checks the pool's width against head_dim
    target, _ = ATTENTION_TARGETS[jnp.dtype(kv_pages.dtype)]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    # An int8 pool passes its values' bits and its scale words (the kernel applies the scales as it reads).
    pool = (kv_pages.pages, kv_pages.scales) if isinstance(kv_pages, QuantizedKVPages) else (kv_pages,)
    return call(
        q.astype(jnp.float32),
        *pool,
        block_tables.astype(jnp.int32),
        tokens.row.astype(jnp.int32),
        tokens.query_positions.astype(jnp.int32),
        tokens.kv_lens.astype(jnp.int32),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_read"))
def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_read: str = "auto",
) -> jax.Array:  # [T, num_q_heads, D]
    """ragged_paged_attention_reference through the native kernel: under kv_read="auto" it takes every token of a
    pool it reads (_native_reads); FP8 pools, and the other kv_read modes, keep the reference's paths around it.

    Args:
      q: queries of the new tokens, already rotated.
      kv_pages: one layer's page pool.
      metadata: the ragged batch layout.
      sm_scale, sliding_window, soft_cap, kv_read: as ragged_paged_attention_reference.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"attention_impl='cpu_native' cannot run: {error}; use attention_impl='xla'")
    if kv_read == "auto" and _native_reads(kv_pages):
        kv_read = "per_token"  # the kernel takes every token: decode runs and prefill chunks alike
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, kv_read=kv_read)
    return ragged_attention_with_reader(
        q, kv_pages, metadata, token_reader=_native_reader, reader_run_tokens=NATIVE_RUN_TOKENS, **options
    )
