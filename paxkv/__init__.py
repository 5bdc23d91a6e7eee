"""paxkv: a JAX/Pallas LLM inference runtime built around a paged KV cache."""

from paxkv.compilation_cache import enable_compilation_cache
from paxkv.page_allocator import OutOfPagesError, PageAllocator
from paxkv.sampling_params import SamplingParams

__all__ = ["OutOfPagesError", "PageAllocator", "SamplingParams", "enable_compilation_cache"]
