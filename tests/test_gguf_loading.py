"""GGUF loading on a file written here: llama.cpp's q/k permutation, tensor names and rope_freqs."""

import math

import gguf
import numpy as np
import pytest
import tokenizers
import torch

import models

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [first half, second half] become interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama_cpp_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for Llama 3.1 scaling: a divisor per frequency."""
    factors = []
    old_context = rope["original_max_position_embeddings"]
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < old_context / rope["high_freq_factor"]:
            factors.append(1.0)
        elif wavelength > old_context / rope["low_freq_factor"]:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelength - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1.0 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, np.float32)


@pytest.fixture(scope="module")
def hf_llama3(make_tiny_llama):
    """A tiny random Llama with llama3 rope scaling, as transformers builds it."""
    return make_tiny_llama(max_position_embeddings=256, initializer_range=0.1, rope_parameters=LLAMA3_ROPE)


def _write_gguf(model, path, *, with_rope_freqs: bool) -> str:
    """Write `model` the way llama.cpp's converter would: F32 tensors, permuted q/k, optional rope_freqs."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(LLAMA3_ROPE["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    # A byte-level vocabulary of the model's size: 255 single characters and one merge of two.
    writer.add_token_list(alphabet[: config.vocab_size - 1] + [alphabet[0] + alphabet[1]])
    writer.add_token_merges([f"{alphabet[0]} {alphabet[1]}"])
    writer.add_token_types([1] * config.vocab_size)
    state = {name: tensor.detach().numpy().astype(np.float32) for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    if with_rope_freqs:
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(head_dim, LLAMA3_ROPE))
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(config.num_hidden_layers):
        hf = f"model.layers.{i}."
        for ours, theirs in names.items():
            writer.add_tensor(f"blk.{i}.{ours}.weight", state[hf + theirs + ".weight"])
        q = _llama_cpp_permute(state[hf + "self_attn.q_proj.weight"], config.num_attention_heads)
        k = _llama_cpp_permute(state[hf + "self_attn.k_proj.weight"], config.num_key_value_heads)
        writer.add_tensor(f"blk.{i}.attn_q.weight", q)
        writer.add_tensor(f"blk.{i}.attn_k.weight", k)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_with_rope_freqs_matches_transformers(hf_llama3, tmp_path):
    loaded = models.load(_write_gguf(hf_llama3, tmp_path / "m.gguf", with_rope_freqs=True))
    assert loaded.config.rope_freq_factors is not None
    ids = np.random.default_rng(1).integers(0, 256, 48)
    with torch.no_grad():
        reference = hf_llama3(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(loaded.score(ids), reference, rtol=1e-4, atol=1e-5)


def test_gguf_without_rope_freqs_runs_unscaled_rope(hf_llama3, tmp_path):
    """The same file without rope_freqs is a different model: the factors are what carries the scaling."""
    loaded = models.load(_write_gguf(hf_llama3, tmp_path / "m.gguf", with_rope_freqs=False))
    assert loaded.config.rope_freq_factors is None
    ids = np.random.default_rng(1).integers(0, 256, 48)
    with torch.no_grad():
        reference = hf_llama3(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(loaded.score(ids) - reference).max() > 1e-2


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)  # 8 heads of head_dim 16
    from models.gguf_loading import unpermute_rotary_rows

    np.testing.assert_array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, 8), 8), weight)
