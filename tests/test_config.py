"""ModelConfig from HF config.json dicts (transformers 4 and 5 layouts) and GGUF metadata; rope frequencies."""

import numpy as np
import pytest

from models import CheckpointError, ModelConfig
from models.config import RopeScaling
from models.rope import rope_inverse_frequencies

LLAMA_31_STYLE = {  # transformers-4 layout, as Llama 3.1 checkpoints ship it
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def test_llama31_transformers4_layout():
    config = ModelConfig.from_hf_config(LLAMA_31_STYLE)
    assert (config.model_type, config.num_kv_heads, config.head_dim) == ("llama", 8, 128)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert not config.qkv_bias and not config.qk_norm and not config.tie_word_embeddings


def test_transformers5_rope_parameters_layout():
    hf = {k: v for k, v in LLAMA_31_STYLE.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 1234.0
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 2.0


def test_qwen_flags_and_sliding_window():
    base = dict(LLAMA_31_STYLE, rope_scaling=None, sliding_window=4096, use_sliding_window=False)
    qwen2 = ModelConfig.from_hf_config(dict(base, architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf_config(dict(base, architectures=["Qwen3ForCausalLM"], head_dim=64))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 64
    mistral = ModelConfig.from_hf_config(dict(base, architectures=["MistralForCausalLM"]))
    assert mistral.sliding_window == 4096


def test_unsupported_rope_type_names_supported_ones():
    hf = dict(LLAMA_31_STYLE, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="yarn.*supported"):
        ModelConfig.from_hf_config(hf)


def test_gguf_metadata():
    meta = {
        "general.architecture": "llama",
        "llama.block_count": 30,
        "llama.context_length": 8192,
        "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.rope.freq_base": 100000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    config = ModelConfig.from_gguf_metadata(meta, vocab_size=49152, tie_word_embeddings=True)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.rope_theta == 100000.0 and config.tie_word_embeddings
    with pytest.raises(CheckpointError, match="block_count"):
        ModelConfig.from_gguf_metadata(
            {k: v for k, v in meta.items() if k != "llama.block_count"}, vocab_size=1, tie_word_embeddings=True
        )


def test_config_round_trips_through_dict():
    config = ModelConfig.from_hf_config(LLAMA_31_STYLE)
    assert ModelConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "scaling",
    [
        RopeScaling(),
        RopeScaling("linear", factor=4.0),
        RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        RopeScaling("llama3", 32.0, 1.0, 4.0, 64),
    ],
)
def test_rope_frequencies_match_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 128, 500000.0
    hf_config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": scaling.rope_type,
            "rope_theta": theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
    )
    if scaling.rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling.rope_type](hf_config, "cpu")
    ours = rope_inverse_frequencies(head_dim, theta, scaling)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)
