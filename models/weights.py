"""Map HF-named checkpoint tensors onto the NNX Llama state, checking every name and shape."""

from collections.abc import Callable

import numpy as np

from models.config import ModelConfig
from models.errors import CheckpointError

# HF tensors that carry no weights we need (buffers older exporters saved).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_weight_map(config: ModelConfig) -> dict[tuple, tuple[str, tuple[int, ...], Callable]]:
    """Our state path -> (HF tensor name, its HF shape, HF array -> our layout).

    Args:
      config: the model's config, which decides the names and shapes expected.
    """
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    identity = lambda w: w  # noqa: E731

    def columns(*out_shape):  # HF Linear [out, in] -> ours [in, *out]
        return lambda w: np.ascontiguousarray(w.T).reshape(w.shape[1], *out_shape)

    def rows(*in_shape):  # HF Linear [out, in] -> ours [*in, out]
        return lambda w: np.ascontiguousarray(w.T).reshape(*(in_shape or (w.shape[1],)), w.shape[0])

    mapping = {
        ("embed",): ("model.embed_tokens.weight", (v, d), identity),
        ("final_norm", "weight"): ("model.norm.weight", (d,), identity),
    }
    if not config.tie_word_embeddings:
        mapping[("lm_head",)] = ("lm_head.weight", (v, d), rows())
    for i in range(config.num_layers):
        hf = f"model.layers.{i}."
        ours = ("layers", i)
        mapping[ours + ("input_norm", "weight")] = (hf + "input_layernorm.weight", (d,), identity)
        mapping[ours + ("post_attention_norm", "weight")] = (hf + "post_attention_layernorm.weight", (d,), identity)
        mapping[ours + ("attention", "q_proj")] = (hf + "self_attn.q_proj.weight", (n * h, d), columns(n, h))
        mapping[ours + ("attention", "k_proj")] = (hf + "self_attn.k_proj.weight", (k * h, d), columns(k, h))
        mapping[ours + ("attention", "v_proj")] = (hf + "self_attn.v_proj.weight", (k * h, d), columns(k, h))
        mapping[ours + ("attention", "o_proj")] = (hf + "self_attn.o_proj.weight", (d, n * h), rows(n, h))
        mapping[ours + ("mlp", "gate")] = (hf + "mlp.gate_proj.weight", (f, d), rows())
        mapping[ours + ("mlp", "up")] = (hf + "mlp.up_proj.weight", (f, d), rows())
        mapping[ours + ("mlp", "down")] = (hf + "mlp.down_proj.weight", (d, f), rows())
        if config.qkv_bias:
            for name, heads in (("q", n), ("k", k), ("v", k)):
                mapping[ours + ("attention", f"{name}_bias")] = (
                    hf + f"self_attn.{name}_proj.bias",
                    (heads * h,),
                    lambda w, heads=heads: w.reshape(heads, h),
                )
        if config.o_bias:
            mapping[ours + ("attention", "o_bias")] = (hf + "self_attn.o_proj.bias", (d,), identity)
        if config.qk_norm:
            mapping[ours + ("attention", "q_norm", "weight")] = (hf + "self_attn.q_norm.weight", (h,), identity)
            mapping[ours + ("attention", "k_norm", "weight")] = (hf + "self_attn.k_norm.weight", (h,), identity)
    return mapping


def params_from_hf_tensors(
    config: ModelConfig,
    tensor_names: set[str],
    read_tensor: Callable[[str], np.ndarray],
    *,
    source: str,
) -> dict[tuple, np.ndarray]:
    """Read and convert every tensor the model needs.

    Args:
      config: the model's config (decides the expected names and shapes).
      tensor_names: names present in the checkpoint.
      read_tensor: returns one tensor as a numpy array (f32 or bf16).
      source: the checkpoint path, for error messages.
    Returns:
      our state path -> array in our layout.
    """
    mapping = hf_weight_map(config)
    needed = {hf_name for hf_name, _, _ in mapping.values()}
    missing = sorted(needed - tensor_names)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"{source} lacks {len(missing)} tensors the config implies ({shown}); "
            "the checkpoint is incomplete or does not match its config.json"
        )
    ignorable = _IGNORED_SUFFIXES + (("lm_head.weight",) if config.tie_word_embeddings else ())
    unexpected = sorted(n for n in tensor_names - needed if not n.endswith(ignorable))
    if unexpected:
        # A tensor we would drop is a part of the architecture we do not implement: refuse
        # rather than run a different model.
        raise CheckpointError(
            f"{source} has {len(unexpected)} tensors paxkv's {config.model_type} model does not use "
            f"(e.g. {unexpected[:3]}); the checkpoint has features paxkv does not implement or its "
            "config.json does not describe it"
        )
    params = {}
    for path, (hf_name, hf_shape, convert) in mapping.items():
        array = read_tensor(hf_name)
        if tuple(array.shape) != hf_shape:
            raise CheckpointError(
                f"{source}: tensor {hf_name} has shape {tuple(array.shape)} but the config implies {hf_shape}; "
                "the weights do not match config.json (wrong file or edited config)"
            )
        params[path] = convert(array)
    return params
