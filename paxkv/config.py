"""EngineConfig: page pool, budgets, context length, KV dtype and preemption, validated once."""

import dataclasses
import operator

from paxkv.parallel.mesh import parse_mesh_shape

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")
PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its page pool and its batches, and what it does when pages run out."""

    page_size: int = 16
    # The whole pool (split evenly over data replicas): set directly, or derived from kv_cache_memory_bytes.
    num_pages: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    # Per step and per data replica (with data=D, D batches of this size run side by side).
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: min(the model's context, 4096)
    # "auto" (the parameters' dtype), "float32", "bfloat16", or 8-bit (FP8 or int8) with a
    # bf16 scale per token and KV head, stored rotated (pallas_kernels/quantization.py).
    kv_cache_dtype: str = "auto"
    seed: int = 0  # draws seeds for requests that give none
    enable_prefix_caching: bool = True  # share full prompt pages between requests (paxkv/scheduling/prefix_trie.py)
    # Preemption: "recompute" frees a victim's pages, "swap" copies them to a host pool and back, "auto"
    # picks the cheaper by measured prefill and transfer rates (swapping only when the host pool has room).
    preemption_mode: str = "auto"
    swap_space_bytes: int = 1 << 30  # the host pool for swapped pages; 0 turns swapping off
    # Admission keeps this fraction of the pool free, so a new request does not at once force preemptions.
    watermark: float = 0.01
    # The device mesh, "data=D,model=M" or a dict; None puts every device on "model" (one device on CPU).
    # data > 1 runs data-parallel replicas, each with its own share of the pool (paxkv/scheduling/scheduler.py).
    # LLM and the CLI load the model onto it (paxkv.parallel.mesh.load_on_mesh).
    mesh_shape: str | dict | None = None

    def __post_init__(self):
        parse_mesh_shape(self.mesh_shape)  # raises on an unknown axis or a bad size
        # Integral values of other types (numpy integers) become ints; anything else is left for the checks below.
        for name in (
            "page_size",
            "num_pages",
            "kv_cache_memory_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "seed",
            "swap_space_bytes",
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (bool, int)) and hasattr(value, "__index__"):
                object.__setattr__(self, name, operator.index(value))
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
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(
                f"swap_space_bytes must be a non-negative integer (0 = no swapping), got {self.swap_space_bytes!r}"
            )
        if not isinstance(self.watermark, (int, float)) or not 0 <= self.watermark < 1:
            raise ValueError(
                f"watermark is the fraction of pages admission keeps free, in [0, 1); got {self.watermark!r}"
            )
