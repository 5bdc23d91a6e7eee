"""ModelConfig: the static shape of a Llama-family model, from an HF config.json or GGUF metadata."""

import dataclasses
import json
from typing import Any

from models.errors import CheckpointError

# HF `architectures` / `model_type` values this implementation covers, and the flags they imply.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Mistral GGUFs from llama.cpp carry architecture "llama".
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF `rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyperparameters of one Llama-family model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or attention_bias
    o_bias: bool = False  # attention_bias on Llama, Mistral and Qwen3 (Qwen2 has none on o_proj)
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None  # Mistral
    # Per-frequency divisors, as llama.cpp stores Llama 3.1+ rope scaling (GGUF tensor rope_freqs).
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix the config.json"
            )
        if self.rope_scaling.rope_type not in ROPE_TYPES:
            raise CheckpointError(
                f"rope type {self.rope_scaling.rope_type!r} is not supported; supported: {ROPE_TYPES}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form, used by orbax checkpoints."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """Inverse of to_dict."""
        values = dict(values)
        values["rope_scaling"] = RopeScaling(**values.get("rope_scaling", {}))
        if values.get("rope_freq_factors") is not None:
            values["rope_freq_factors"] = tuple(values["rope_freq_factors"])
        return cls(**values)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of an HF config.json.

        Args:
          hf: the parsed config.json of a Llama, Mistral, Qwen2 or Qwen3 checkpoint.
        """
        model_type = _hf_model_type(hf)
        missing = [key for key in _REQUIRED_HF_KEYS if hf.get(key) is None]
        if missing:
            raise CheckpointError(
                f"config.json lacks {missing}; it is incomplete, re-download it from the model's repository"
            )
        if hf.get("mlp_bias"):
            raise CheckpointError("mlp_bias=true is not supported by paxkv's Llama implementation")
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        rope_theta, rope_scaling = _hf_rope(hf)
        sliding_window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3"):
            sliding_window = _qwen_sliding_window(hf, num_layers)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding_window) if sliding_window else None,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, vocab_size: int, tie_word_embeddings: bool) -> "ModelConfig":
        """Build from GGUF key/values (`{key: field.contents()}`).

        Args:
          meta: the GGUF metadata.
          vocab_size: rows of the token-embedding tensor.
          tie_word_embeddings: True when the file has no separate output tensor.
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise CheckpointError(
                f"GGUF architecture {arch!r} is not supported; paxkv loads {SUPPORTED_GGUF_ARCHITECTURES}: "
                "use a GGUF of one of those, or the model's HF safetensors folder"
            )

        def get(key, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise CheckpointError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
            return value

        hidden_size = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden_size // num_heads)
        scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor")))
        elif scaling_type in ("none", None):
            rope_scaling = RopeScaling()
        else:
            raise CheckpointError(f"GGUF rope scaling {scaling_type!r} is not supported; supported: linear")
        window = meta.get(f"{arch}.attention.sliding_window")
        return cls(
            model_type=arch,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=tie_word_embeddings,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            sliding_window=int(window) if window else None,
        )


def load_hf_config(path) -> dict[str, Any]:
    """Read and parse config.json, with errors that name the fix."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} not found: an HF model folder needs config.json beside its *.safetensors"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download or re-save the checkpoint") from None


_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _qwen_sliding_window(hf: dict[str, Any], num_layers: int) -> int | None:
    """Qwen's window applies only when use_sliding_window is set, and only to layers >= max_window_layers."""
    if not hf.get("use_sliding_window") or not hf.get("sliding_window"):
        return None
    if int(hf.get("max_window_layers", num_layers)) >= num_layers:
        return None  # no layer reaches the windowed range
    raise CheckpointError(
        "use_sliding_window=true with max_window_layers below num_hidden_layers gives some layers a window "
        "and others none, which paxkv does not support; set use_sliding_window=false (the Qwen default)"
    )


def _hf_model_type(hf: dict[str, Any]) -> str:
    for architecture in hf.get("architectures") or []:
        if architecture in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[architecture]
    model_type = hf.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    raise CheckpointError(
        f"architecture {hf.get('architectures')} (model_type={model_type!r}) is not supported; "
        f"paxkv loads {sorted(SUPPORTED_ARCHITECTURES)}; use a checkpoint of one of those"
    )


def _hf_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Read rope theta and scaling from either the transformers-4 or transformers-5 layout."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
    return theta, scaling
