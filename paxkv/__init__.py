"""paxkv: a JAX/Pallas LLM inference runtime built around a paged KV cache."""

from paxkv.compilation_cache import enable_compilation_cache
from paxkv.config import EngineConfig
from paxkv.engine import Engine
from paxkv.llm import LLM
from paxkv.outputs import CompletionOutput, RequestOutput
from paxkv.page_allocator import OutOfPagesError, PageAllocator
from paxkv.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "OutOfPagesError",
    "PageAllocator",
    "RequestOutput",
    "SamplingParams",
    "enable_compilation_cache",
]
