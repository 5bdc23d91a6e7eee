"""Paged-attention kernels and their pure-jnp references; depends on jax only."""

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ops import ATTENTION_IMPLS, paged_attention, resolve_attention_impl
from pallas_kernels.reference import ragged_paged_attention_reference, write_kv_reference

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionMetadata",
    "paged_attention",
    "ragged_paged_attention_reference",
    "resolve_attention_impl",
    "write_kv_reference",
]
