"""Rotary position embeddings with default, linear and llama3 frequency scaling."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeScaling


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling, freq_factors: tuple[float, ...] | None = None
) -> np.ndarray:
    """Per-pair rotation frequencies, f32[head_dim // 2], as HF computes them.

    Args:
      head_dim: size of one attention head (rotated in full).
      theta: the rope base.
      scaling: the frequency scaling of the checkpoint.
      freq_factors: optional per-pair divisors (llama.cpp's rope_freqs), applied after scaling.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    if freq_factors is not None:
        if len(freq_factors) != len(inv_freq):
            raise ValueError(f"{len(freq_factors)} rope frequency factors for {len(inv_freq)} frequencies")
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3.1's scaling: long wavelengths slowed by `factor`, short kept, a smooth ramp between."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def rope_angles(
    positions: jax.Array,  # i32[T]
    inv_freq: jax.Array,  # f32[D // 2]
) -> tuple[jax.Array, jax.Array]:  # (cos, sin), each f32[T, D // 2]
    """The cosines and sines of every position's rotation angles, computed once for all the heads that use them.

    They leave here materialized, so that XLA cannot fuse the sines and cosines into each layer's rotation and evaluate
    them there again, once per head and layer. Elsewhere an optimization barrier does that. XLA:CPU removes barriers
    before fusing, and it had put both into all 60 of SmolLM2's q and k rotations, each element evaluating them anew
    (30 layers' rotations at 2048 tokens 116 ms, at 32 rows 2.6 ms, against 15 and 0.15 once). There, a conditional
    does it, since its results are buffers: both of its branches evaluate the same thing, so the predicate (a value
    the compiler cannot know) changes nothing.

    Args:
      positions: each token's position in its sequence.
      inv_freq: the rotary frequencies (rope_inverse_frequencies).
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]

    def evaluate(angles):
        return jnp.cos(angles), jnp.sin(angles)

    def behind_barrier(angles):
        return jax.lax.optimization_barrier(evaluate(angles))

    def in_conditional(angles):
        if angles.shape[0] == 0:
            return evaluate(angles)
        return jax.lax.cond(positions[0] >= 0, evaluate, evaluate, angles)

    return jax.lax.platform_dependent(angles, cpu=in_conditional, default=behind_barrier)


def rotate(
    x: jax.Array,  # [T, H, D]
    cos: jax.Array,  # f32[T, D // 2]
    sin: jax.Array,  # f32[T, D // 2]
) -> jax.Array:  # [T, H, D]
    """Rotate the two halves of each head by the given angles (HF's rotate_half convention)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
