"""The memory planner against the seed's worked example (Llama-70B at 128K), and `paxkv --plan` from a config.json."""

import json
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env

from models.config import ModelConfig
from paxkv.entrypoints.planner import parameter_count, plan

# Llama 3 70B's config.json, as its model card gives it.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
GIB = 2**30


def _plan(hf_config, **kwargs):
    config = ModelConfig.from_hf_config(hf_config)
    options = dict(kv_cache_memory_bytes=80 * GIB, max_model_len=131072, page_size=16)
    rows, num_params = plan(config, **{**options, **kwargs})
    return {row.kv_cache_dtype: row for row in rows}, num_params


def test_llama_70b_at_128k_matches_the_seed():
    rows, num_params = _plan(LLAMA_70B)
    assert 70.0e9 < num_params < 71.0e9  # 70.6 B
    bf16 = rows["bfloat16"]
    assert bf16.bytes_per_token == 2 * 8 * 128 * 2 * 80  # 320 KiB
    assert bf16.bytes_per_sequence == 40 * GIB
    assert bf16.bytes_per_sequence / (2 * num_params) == pytest.approx(0.30, abs=0.01)  # about 30% of the weights
    assert bf16.max_sequences_at_full_context == 1  # an 80 GiB budget holds one full-context sequence
    assert rows["float32"].bytes_per_sequence == 80 * GIB
    # FP8 and int8: a byte per value plus, per page, a row of one 4-byte word (K and V scales) per KV head and
    # token, 8 x 16 = 128 words (no lane padding): 32 bytes per token.
    assert rows["fp8_e4m3"].bytes_per_token == rows["int8"].bytes_per_token == 2 * 8 * (128 + 2) * 80


def test_without_gqa_the_kv_outgrows_the_weights():
    rows, num_params = _plan({**LLAMA_70B, "num_key_value_heads": 64})
    assert rows["bfloat16"].bytes_per_sequence == 320 * GIB
    assert rows["bfloat16"].bytes_per_sequence > 2 * num_params
    assert rows["bfloat16"].max_sequences_at_full_context == 0


def test_parameter_count_matches_a_real_small_model(make_tiny_llama):
    model = make_tiny_llama()
    config = ModelConfig.from_hf_config(model.config.to_dict())
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_cli_plans_from_a_config_json_alone(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    env = subprocess_env()
    result = subprocess.run(
        [sys.executable, "-m", "paxkv.entrypoints.run", "--plan", f"--model={path}", "--kv_cache_memory=80GiB"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "40.00 GiB of bf16 KV: 30% of the bf16 weights, less than the weights" in result.stdout
    assert "Without grouped-query attention (64 KV heads) it would be 320.00 GiB" in result.stdout
    assert "fp8_e4m3" in result.stdout and "327,680" in result.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "paxkv.entrypoints.run", "--plan", f"--model={tmp_path / 'nope.json'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode != 0 and "not found" in missing.stderr
