"""Flax NNX Llama-family models over a paged KV cache, and checkpoint loading."""

from models.config import ModelConfig, RopeScaling
from models.errors import CheckpointError
from models.generation_config import GenerationConfig
from models.llama import Llama
from models.loading import LoadedModel, embedded_model_path, load
from models.paged_forward import (
    PagedSequence,
    allocate_kv_caches,
    forward_over_pages,
    greedy_generate,
    greedy_tokens,
)

__all__ = [
    "CheckpointError",
    "GenerationConfig",
    "LoadedModel",
    "Llama",
    "ModelConfig",
    "PagedSequence",
    "RopeScaling",
    "allocate_kv_caches",
    "embedded_model_path",
    "greedy_generate",
    "greedy_tokens",
    "load",
    "forward_over_pages",
]
