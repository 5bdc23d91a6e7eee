"""paxkv: a JAX/Pallas LLM inference runtime built around a paged KV cache."""

from paxkv.config import EngineConfig, SpeculativeConfig
from paxkv.core.engine import Engine
from paxkv.core.outputs import CompletionOutput, RequestOutput
from paxkv.entrypoints.compilation_cache import enable_compilation_cache
from paxkv.entrypoints.llm import LLM
from paxkv.scheduling.page_allocator import OutOfPagesError, PageAllocator
from paxkv.scheduling.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "OutOfPagesError",
    "PageAllocator",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "enable_compilation_cache",
]
