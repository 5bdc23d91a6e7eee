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
NORMS = ("input_layernorm", "post_attention_layernorm")


def save_random_llama(folder: str) -> None:
    """Write the seeded random Llama (RANDOM_LLAMA) as an HF folder (config.json and safetensors), no tokenizer.

    Drawn with numpy as transformers initializes a LlamaForCausalLM (every matrix from N(0, 0.02), the RMSNorm
    weights ones), without importing torch and transformers for it: that import was 8 of the 13 CPU seconds a
    small bench_throughput run spends outside its workers.
    """
    import json

    import numpy as np
    from safetensors.numpy import save_file

    c = RANDOM_LLAMA
    hidden, mlp, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = hidden // c["num_attention_heads"]
    q_width, kv_width = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (q_width, hidden),
            layer + "self_attn.k_proj.weight": (kv_width, hidden),
            layer + "self_attn.v_proj.weight": (kv_width, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_width),
            layer + "mlp.gate_proj.weight": (mlp, hidden),
            layer + "mlp.up_proj.weight": (mlp, hidden),
            layer + "mlp.down_proj.weight": (hidden, mlp),
        }
    rng = np.random.default_rng(RANDOM_LLAMA_SEED)
    tensors = {name: rng.normal(0.0, 0.02, shape).astype(np.float32) for name, shape in shapes.items()}
    norms = [f"model.layers.{i}.{n}.weight" for i in range(c["num_hidden_layers"]) for n in NORMS]
    norms.append("model.norm.weight")
    tensors |= {name: np.ones(hidden, np.float32) for name in norms}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        **c,
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


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
