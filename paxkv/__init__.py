"""paxkv: a JAX/Pallas LLM inference runtime built around a paged KV cache."""

from paxkv.compilation_cache import enable_compilation_cache

__all__ = ["enable_compilation_cache"]
