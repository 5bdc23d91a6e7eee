"""The configs, validated once: EngineConfig (page pool, budgets, context, KV dtype, preemption, mesh) and
LoadConfig (how the model is loaded) and SpeculativeConfig (drafting tokens to verify in one step). Their fields
are the command line's flags."""

import dataclasses
import operator

from paxkv.parallel.mesh import parse_mesh_shape

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")
PREEMPTION_MODES = ("auto", "recompute", "swap")
SPECULATIVE_METHODS = ("none", "ngram", "draft_model")


def option(default, help: str, *, flag: str | None = None, kind: str | None = None, choices=None):
    """A config field that is also a command-line flag (paxkv.entrypoints.config_flags defines and reads them).

    Args:
      default: the field's default.
      help: the flag's help (and the field's documentation).
      flag: the flag's name when it is not the field's.
      kind: "memory" for byte counts written as sizes (2GiB), "negated" for a bool the flag turns off.
      choices: the values a string field may take (an enum flag).
    """
    metadata = {"help": help, "flag": flag, "kind": kind, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: draft up to num_speculative_tokens tokens per decoding request and verify them all in
    the next step, as vLLM's speculative_config names them. Every field is a flag of the `paxkv` command line.

    Output is unchanged by it: greedy and seeded sampling give the same tokens as without (each position samples
    with its own key, and a draft stands only where it equals that sample).
    """

    method: str = option(
        "none",
        "Speculative decoding: ngram (prompt lookup: drafts copied from earlier in the prompt and output), "
        "draft_model (a smaller model with the same vocabulary drafts greedily; --speculative_model), or none.",
        flag="speculative_method",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = option(4, "Most draft tokens per request and step.")
    prompt_lookup_max: int = option(4, "ngram: the longest suffix matched against earlier tokens.")
    prompt_lookup_min: int = option(1, "ngram: the shortest suffix matched.")
    model: str | None = option(
        None,
        "draft_model: the draft model's checkpoint (an HF folder, .gguf file or orbax folder), loaded like the target.",
        flag="speculative_model",
    )
    adaptive: bool = option(
        True,
        "Draft every proposed token even where the measured acceptance and step costs say it slows the batch.",
        flag="no_adaptive_speculation",
        kind="negated",
    )

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                "speculative method 'draft_model' needs the draft's checkpoint: give model=PATH (--speculative_model)"
            )
        if self.method != "draft_model" and self.model:
            raise ValueError(
                f"a speculative model ({self.model!r}) is only used by method='draft_model', not {self.method!r}; "
                "set method='draft_model' or drop model"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max={self.prompt_lookup_max}; "
                "make the minimum at most the maximum"
            )

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig from a dict of its fields (vLLM's names), or None where speculation is off.

        Args:
          value: None, a SpeculativeConfig, or a dict such as {"method": "ngram", "num_speculative_tokens": 4}.
        """
        if isinstance(value, dict):
            unknown = sorted(set(value) - {field.name for field in dataclasses.fields(cls)})
            if unknown:
                known = ", ".join(field.name for field in dataclasses.fields(cls))
                raise ValueError(f"speculative_config has unknown keys {unknown}; the keys are {known}")
            value = cls(**value)
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, not {type(value).__name__}")
        return None if value is None or value.method == "none" else value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its page pool and its batches, and what it does when pages run out.

    Every field is a flag of the `paxkv` command line with the help given here.
    """

    page_size: int = option(16, "Tokens per KV page.")
    num_pages: int | None = option(None, "Pages in the whole pool (split over data replicas); overrides the memory.")
    kv_cache_memory_bytes: int = option(
        1 << 30, "KV page pool budget, e.g. 512MiB, 2GiB or a byte count.", flag="kv_cache_memory", kind="memory"
    )
    max_num_seqs: int = option(32, "Most sequences in one step (per data replica).")
    max_num_batched_tokens: int = option(512, "Most tokens in one step (per data replica).")
    min_padded_seqs: int | None = option(
        None,
        "Steps of fewer sequences (or draft rows) pad to this many rows (rounded up to a power of two): fewer "
        "programs to compile, more padding in small steps (default: 8 on TPU, where 8 rows cost what 1 does; 1 "
        "elsewhere).",
    )
    min_padded_tokens: int = option(
        1,
        "Steps of fewer tokens pad to this many (rounded up to a power of two, at most max_num_batched_tokens): "
        "fewer programs to compile, more padding in small steps. At max_num_batched_tokens every step has one "
        "token bucket.",
    )
    max_model_len: int | None = option(None, "Longest prompt plus output (default: min(model context, 4096)).")
    num_scheduler_steps: int = option(
        8,
        "Decode passes one step may chain on the device, each pass's token the next one's input (vLLM's multi-step "
        "scheduling): the host then schedules and reads back once per that many tokens. Only while every request "
        "decodes, wants only its final output (LLM.generate, the batch runner), samples without penalties, logprobs "
        "or min_tokens, and none waits, and never with speculative decoding; the tokens are the same. 1 turns it off.",
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV pool dtype; auto is the activations' (f32 on CPU, bf16 on TPU/GPU); fp8 and int8 store a bf16 scale "
        "per token and KV head, rotated.",
        choices=KV_CACHE_DTYPES,
    )
    seed: int = option(0, "Draws the seeds of requests that give none.", flag="engine_seed")
    enable_prefix_caching: bool = option(
        True,
        "Turn off prefix caching (sharing full prompt pages between requests).",
        flag="no_prefix_caching",
        kind="negated",
    )
    preemption_mode: str = option(
        "auto",
        "When pages run out: recompute (free the pages), swap (to a host pool and back), or auto (the cheaper).",
        choices=PREEMPTION_MODES,
    )
    swap_space_bytes: int = option(
        1 << 30,
        "Host memory for swapped-out pages, e.g. 4GiB; 0 turns swapping off.",
        flag="swap_space",
        kind="memory",
    )
    watermark: float = option(0.01, "Fraction of the pool admission keeps free, in [0, 1).")
    mesh_shape: str | dict | None = option(
        None,
        "Device mesh, e.g. data=1,model=4 (default: every device on model; one device on CPU); data > 1 runs "
        "data-parallel replicas, each with its own share of the pool.",
        flag="mesh",
    )
    # Its own flags (config_flags defines a nested config's fields as flags of their own).
    speculative_config: SpeculativeConfig | dict | None = dataclasses.field(
        default=None, metadata={"nested": SpeculativeConfig}
    )

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        parse_mesh_shape(self.mesh_shape)  # raises on an unknown axis or a bad size
        # Integral values of other types (numpy integers) become ints; anything else is left for the checks below.
        for name in (
            "page_size",
            "num_pages",
            "kv_cache_memory_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "min_padded_seqs",
            "min_padded_tokens",
            "max_model_len",
            "num_scheduler_steps",
            "seed",
            "swap_space_bytes",
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (bool, int)) and hasattr(value, "__index__"):
                object.__setattr__(self, name, operator.index(value))
        positive = (
            "page_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "min_padded_tokens",
            "kv_cache_memory_bytes",
            "num_scheduler_steps",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ValueError(
                f"num_pages={self.num_pages!r} cannot hold even one page besides the null page 0; use at least 2"
            )
        if self.min_padded_seqs is not None and (not isinstance(self.min_padded_seqs, int) or self.min_padded_seqs < 1):
            raise ValueError(
                f"min_padded_seqs must be a positive integer (or None for the default), got {self.min_padded_seqs!r}"
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
        speculative = self.speculative_config
        if speculative is not None and speculative.num_speculative_tokens + 1 > self.max_num_batched_tokens:
            raise ValueError(
                f"num_speculative_tokens={speculative.num_speculative_tokens} drafts and their request's token do not "
                f"fit one step of max_num_batched_tokens={self.max_num_batched_tokens}; lower num_speculative_tokens "
                "or raise max_num_batched_tokens"
            )
        if not isinstance(self.watermark, (int, float)) or not 0 <= self.watermark < 1:
            raise ValueError(
                f"watermark is the fraction of pages admission keeps free, in [0, 1); got {self.watermark!r}"
            )

    def context_length(self, model_context: int) -> int:
        """The longest prompt plus output: max_model_len, by default min(model_context, 4096); raises past the model's.

        Args:
          model_context: the model's max_position_embeddings.
        """
        max_model_len = self.max_model_len or min(model_context, 4096)
        if max_model_len > model_context:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context of {model_context}; lower max_model_len"
            )
        return max_model_len


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """How the command line loads the model (models.load's options, which validates them). Every field is a flag of
    the `paxkv` command line; LLM takes the same names as keyword arguments."""

    dtype: str = option("float32", "Parameter storage dtype.", choices=("float32", "bfloat16"))
    quantization: str = option(
        "none",
        "Weight quantization: none, or int8 (weight-only: every projection and the tied embedding as int8 with an "
        "f32 scale and min per 32 contraction rows and output column, f32 activations and sums; the native CPU "
        "matmul on one device, f32 dtype). 31% of f32's weight bytes per decode step; "
        "scripts/eval_weight_quality.py measures its quality.",
        choices=("none", "int8"),
    )
    attention_impl: str = option(
        "auto",
        "Attention implementation: the backend's kernel (on CPU the native one where it builds), a Pallas kernel, "
        "the Pallas interpreter, the native CPU kernel, or the pure-jnp XLA reference.",
        choices=("auto", "pallas", "interpret", "cpu_native", "xla"),
    )
    skip_tokenizer_init: bool = option(
        False, "Load the weights only, without a tokenizer (as vLLM's flag); prompts must then be token ids."
    )
    allow_nonfinite_weights: bool = option(
        False,
        "Load weights that hold NaN or Inf instead of refusing them (they generate garbage; for debugging only).",
    )
