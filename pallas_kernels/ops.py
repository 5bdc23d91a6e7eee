"""The one attention entry point models call, and the choice of implementation behind it."""

import jax

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import ragged_paged_attention_reference, write_kv_reference

ATTENTION_IMPLS = ("auto", "pallas", "interpret", "xla")
# Implementations that exist in this version; the Pallas kernels land with their own tests.
_AVAILABLE_IMPLS = ("xla",)


def resolve_attention_impl(attention_impl: str = "auto") -> str:
    """Turn a configured implementation name into the one that will run.

    In this version only the XLA reference path exists, so `auto` resolves to it on
    every backend, and asking for the Pallas kernels is a clear error rather than a
    silent fallback. (With the kernels, `auto` will pick TPU/GPU Pallas from the backend.)

    Args:
      attention_impl: one of auto, pallas, interpret, xla.
    """
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(
            f"attention_impl={attention_impl!r} is not one of {ATTENTION_IMPLS}; use 'auto' to pick from the backend"
        )
    if attention_impl == "auto":
        return "xla"
    if attention_impl not in _AVAILABLE_IMPLS:
        raise ValueError(
            f"attention_impl={attention_impl!r} is not available in this version of pallas_kernels; "
            "use attention_impl='xla' (or 'auto')"
        )
    return attention_impl


def paged_attention(
    q: jax.Array,  # [T, num_q_heads, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * K, D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    attention_impl: str = "xla",
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:  # ([T, num_q_heads, D], kv_pages)
    """Write this step's K/V into the pool, then attend each token over its sequence's pages.

    Args:
      q, k, v: projections of the new tokens (q and k already rotated).
      kv_pages: one layer's page pool; returned updated.
      metadata: the ragged batch layout.
      sm_scale: multiplier applied to q.k.
      attention_impl: a resolved implementation name (see resolve_attention_impl).
      sliding_window: optional local-attention window, in tokens.
      soft_cap: optional logit soft-cap.
    """
    if attention_impl != "xla":
        attention_impl = resolve_attention_impl(attention_impl)
    kv_pages = write_kv_reference(kv_pages, k, v, metadata.slots)
    out = ragged_paged_attention_reference(
        q, kv_pages, metadata, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
    return out, kv_pages
