"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) as one Flax NNX model over a page pool."""

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import GatedMLP, PagedAttention, RMSNorm, init_param, project
from models.packed_weights import embedding_rows
from models.rope import rope_angles, rope_inverse_frequencies
from pallas_kernels import AttentionMetadata


class DecoderLayer(nnx.Module):
    """Pre-norm attention block followed by a pre-norm gated MLP block."""

    def __init__(self, config: ModelConfig, *, param_dtype, attention_impl: str, rngs: nnx.Rngs | None):
        norm = dict(eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.input_norm = RMSNorm(config.hidden_size, **norm)
        self.attention = PagedAttention(config, param_dtype=param_dtype, attention_impl=attention_impl, rngs=rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, **norm)
        self.mlp = GatedMLP(config, param_dtype=param_dtype, native_matmul=attention_impl == "cpu_native", rngs=rngs)

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        rope: tuple[jax.Array, jax.Array],  # (cos, sin), f32[T, head_dim // 2] each
        kv_pages: jax.Array,  # [num_pages, page_size, 2K * H]
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:  # ([T, D], kv_pages)
        """Attend (writing this step's K/V into the pages), then the MLP, each around a residual."""
        attended, kv_pages = self.attention(x, rope, kv_pages, metadata, norm=self.input_norm)
        x = x + attended
        x = x + self.mlp(x, norm=self.post_attention_norm)
        return x, kv_pages


class Llama(nnx.Module):
    """A decoder-only transformer whose attention reads and writes a paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        attention_impl: str = "xla",
        rngs: nnx.Rngs | None,
    ):
        """Build the model with random weights (use models.load for real ones).

        Args:
          config: the model's hyperparameters.
          param_dtype: storage dtype of the weights.
          compute_dtype: dtype of activations (f32 on CPU, bf16 on TPU/GPU).
          attention_impl: a resolved pallas_kernels implementation name.
          rngs: random streams for initialization; None for zeros (shapes only, under nnx.eval_shape).
        """
        self.config = config
        self.compute_dtype = compute_dtype
        self.native_matmul = attention_impl == "cpu_native"  # small-row matmuls by the native CPU kernel too
        self.embed = init_param(rngs, (config.vocab_size, config.hidden_size), param_dtype, ("vocab", "embed"))
        self.layers = nnx.List(
            [
                DecoderLayer(config, param_dtype=param_dtype, attention_impl=attention_impl, rngs=rngs)
                for _ in range(config.num_layers)
            ]
        )
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = init_param(rngs, (config.hidden_size, config.vocab_size), param_dtype, ("embed", "vocab"))

    def __call__(
        self,
        tokens: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_caches: list[jax.Array],  # num_layers x [num_pages, page_size, 2K * H]
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, list[jax.Array]]:  # ([T, D] final hidden states, kv_caches)
        """Run the ragged batch through every layer, writing its K/V into the pages."""
        x = embedding_rows(self.embed[...], tokens).astype(self.compute_dtype)  # [T, D]
        # The rotary angles once for every layer (their sines and cosines had been a tenth of the attention block's
        # time at 32 decode rows, evaluated per layer). inv_freq is a trace-time constant of the static config.
        config = self.config
        inv_freq = rope_inverse_frequencies(
            config.head_dim, config.rope_theta, config.rope_scaling, config.rope_freq_factors
        )
        rope = rope_angles(positions, jnp.asarray(inv_freq))
        new_caches = []
        for layer, kv_pages in zip(self.layers, kv_caches, strict=True):
            x, kv_pages = layer(x, rope, kv_pages, metadata)
            new_caches.append(kv_pages)
        return self.final_norm(x), new_caches

    def logits(self, hidden: jax.Array) -> jax.Array:  # [T, D] -> f32[T, vocab]
        """Project hidden states onto the vocabulary."""
        if self.lm_head is None:
            logits = project("TD,VD->TV", hidden, self.embed[...], native=self.native_matmul)
        else:
            logits = project("TD,DV->TV", hidden, self.lm_head[...], native=self.native_matmul)
        return logits.astype(jnp.float32)
