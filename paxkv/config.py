"""EngineConfig: page pool, budgets and context length, validated once."""

import dataclasses

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its page pool and its batches."""

    page_size: int = 16
    num_pages: int | None = None  # set directly, or derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: min(the model's context, 4096)
    kv_cache_dtype: str = "auto"  # "auto" (the parameters' dtype), "float32" or "bfloat16"
    seed: int = 0  # draws seeds for requests that give none
    enable_prefix_caching: bool = True  # share full prompt pages between requests (paxkv/prefix_trie.py)

    def __post_init__(self):
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ValueError(
                f"num_pages={self.num_pages!r} cannot hold even one page besides the null page 0; use at least 2"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
