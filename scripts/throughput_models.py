"""The models scripts/bench_throughput.py measures, written as HF folders: the seeded random Llama, and SmolLM2 for
vllm (which cannot read the embedded GGUF). scripts/bench_memory.py's overload part uses the random Llama too."""

import os

# The random Llama: the sizes named in the issue (hidden 256, 4 layers, vocab 32000) plus choices of ours: an MLP of
# 4x hidden, 4 query heads of 64 dims sharing 2 KV heads (grouped-query attention, as in SmolLM2) and an untied
# lm_head; the rest are LlamaConfig's defaults (initializer_range 0.02, rope_theta 10000, rms_norm_eps 1e-6).
RANDOM_LLAMA = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
RANDOM_LLAMA_SEED = 0


def save_random_llama(folder: str) -> None:
    """Build the seeded random Llama (RANDOM_LLAMA) and save it as an HF folder with safetensors, no tokenizer."""
    import torch
    import transformers

    torch.manual_seed(RANDOM_LLAMA_SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**RANDOM_LLAMA)).eval()
    model.save_pretrained(folder)


def save_smollm2_hf(gguf_path: str, folder: str) -> None:
    """Convert the SmolLM2 GGUF to an f32 HF folder with its tokenizer, for vllm (which cannot read this GGUF)."""
    import torch
    import transformers

    directory, name = os.path.split(gguf_path)
    source = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = source.config.to_dict()
    config.pop("quantization_config", None)  # it names the GGUF, which vllm refuses; the saved weights are plain f32
    config["architectures"] = ["LlamaForCausalLM"]
    # A fresh model holding the same tensors: save_pretrained refuses the one loaded from a GGUF.
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config))
    target.load_state_dict(source.state_dict())
    target.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(folder)
