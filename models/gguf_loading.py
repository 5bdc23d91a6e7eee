"""Read a GGUF file: metadata, dequantized tensors under HF names, q/k permutation undone."""

import dataclasses
import re
from typing import Any

import numpy as np

from models.config import ModelConfig
from models.errors import CheckpointError

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for tensors we do not use (e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs back to HF's split halves).

    llama.cpp's converter reorders each head's rows from [first half, second half] to
    pairs (0, h/2), (1, h/2 + 1), ...; this is the inverse.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# The head of the file the metadata is parsed from in memory (a 128k-token vocabulary and its merges take ~10 MiB).
HEADER_READ_BYTES = 32 << 20


def open_gguf(path: str):
    """A gguf.GGUFReader of `path` whose metadata is parsed from an in-memory copy of the file's head.

    The stock reader slices its memmap once per value, three times per vocabulary string: 250k slices and
    about 2 s for SmolLM2's 49k-token vocabulary, on every load. Reading the same values from a bytes copy of
    the head gives the same fields in about a third of the time; values past the head, the tensor data among
    them, still come from the memmap.

    Args:
      path: the .gguf file.
    """
    import gguf

    class HeadInMemoryReader(gguf.GGUFReader):
        def __init__(self, path):
            with open(path, "rb") as f:
                self._head = f.read(HEADER_READ_BYTES)
            super().__init__(path)

        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            if offset + np.dtype(dtype).itemsize * count > len(self._head):
                return super()._get(offset, dtype, count, override_order)
            array = np.frombuffer(self._head, dtype=dtype, count=count, offset=offset)
            return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return HeadInMemoryReader(path)


class GGUFCheckpoint:
    """A GGUF file opened for loading: metadata, config, and HF-named dequantized tensors."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.reader = open_gguf(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"GGUF file {path} does not exist; check the path, or pass None for the embedded SmolLM2"
            ) from None
        except Exception as e:  # the gguf package raises bare ValueError/struct errors on bad files
            raise CheckpointError(f"{path} is not a readable GGUF file ({e}); re-download it") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            self.metadata[key] = field.contents()
        self.tensors = {}
        rope_freqs = None
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self.tensors[name] = tensor
            elif tensor.name == "rope_freqs.weight":
                rope_freqs = tensor
            else:
                raise CheckpointError(
                    f"{path} holds tensor {tensor.name}, which paxkv's Llama-family model does not use; "
                    "the file has features paxkv does not implement"
                )
        arch = self.metadata.get("general.architecture")
        if self.metadata.get(f"{arch}.expert_count"):
            raise CheckpointError(
                f"{path} is a mixture-of-experts model ({self.metadata[f'{arch}.expert_count']} experts), "
                "which paxkv does not support; use a dense Llama, Qwen2 or Qwen3 model"
            )
        embedding = self.tensors.get("model.embed_tokens.weight")
        if embedding is None:
            raise CheckpointError(f"{path} has no token_embd.weight tensor; it is not a complete model file")
        self.config = ModelConfig.from_gguf_metadata(
            self.metadata,
            vocab_size=int(embedding.shape[-1]),  # GGUF shapes are innermost-first
            tie_word_embeddings="lm_head.weight" not in self.tensors,
        )
        if rope_freqs is not None:  # Llama 3.1+ rope scaling, as llama.cpp's converter stores it
            factors = np.asarray(rope_freqs.data, np.float32).reshape(-1)
            self.config = dataclasses.replace(self.config, rope_freq_factors=tuple(float(f) for f in factors))

    @property
    def architecture(self) -> str:
        """general.architecture, e.g. llama."""
        return self.metadata["general.architecture"]

    def read_tensor(self, name: str) -> np.ndarray:
        """One tensor by HF name, dequantized to f32 in HF layout (q/k rows un-permuted for llama).

        Args:
          name: an HF tensor name, e.g. model.layers.0.self_attn.q_proj.weight.
        """
        from gguf import quants

        tensor = self.tensors[name]
        # A plain in-memory copy of the (small, quantized) bytes: dequantizing straight from the
        # memmap pays numpy's memmap bookkeeping on every row slice, several seconds per model.
        raw = np.array(tensor.data, copy=True, subok=False)
        try:
            array = quants.dequantize(raw, tensor.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {tensor.name} is quantized as {tensor.tensor_type.name}, which the gguf "
                "package cannot dequantize; use a GGUF quantized as F16, Q8_0 or Q4_K, or the HF safetensors"
            ) from None
        array = np.asarray(array, np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if self.architecture == "llama":
            if name.endswith("self_attn.q_proj.weight"):
                array = unpermute_rotary_rows(array, self.config.num_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                array = unpermute_rotary_rows(array, self.config.num_kv_heads)
        return array
