"""models.rope: the angles' cosines and sines are right, and a compiled step evaluates them once, not per layer."""

import jax
import jax.numpy as jnp
import numpy as np

from models.config import RopeScaling
from models.rope import rope_angles, rope_inverse_frequencies, rotate

HEAD_DIM = 16
LAYERS = 4


def _inverse_frequencies() -> jax.Array:
    """Default-scaled frequencies of a 16-dim head."""
    return jnp.asarray(rope_inverse_frequencies(HEAD_DIM, 10000.0, RopeScaling("default")))


def _rotated_through_layers(positions, q, k):
    """What a model does with the angles: one rope_angles, then q and k rotated in every layer."""
    cos, sin = rope_angles(positions, _inverse_frequencies())
    for _ in range(LAYERS):
        q = rotate(q, cos, sin) * 1.5
        k = rotate(k, cos, sin) * 0.5
    return q, k


def test_angles_match_numpy():
    """cos and sin of position times frequency, for positions up to a long context's."""
    positions = np.array([0, 1, 7, 300, 4095, 32767], np.int32)
    cos, sin = jax.jit(rope_angles)(jnp.asarray(positions), _inverse_frequencies())
    angles = positions[:, None].astype(np.float32) * np.asarray(_inverse_frequencies())[None, :]
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles.astype(np.float64)), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles.astype(np.float64)), atol=2e-5)


def test_a_step_evaluates_the_angles_once():
    """The compiled program holds one cosine per branch of rope_angles' conditional, not one per rotation.

    XLA:CPU drops optimization barriers before fusing; with one, each layer's q and k rotations evaluated the
    cosines again for every element (8 cosines here).
    """
    positions = jnp.arange(5, dtype=jnp.int32)
    q, k = jnp.ones((5, 3, HEAD_DIM)), jnp.ones((5, 1, HEAD_DIM))
    compiled = jax.jit(_rotated_through_layers).lower(positions, q, k).compile().as_text()
    assert compiled.count("cosine(") == 2 and compiled.count("sine(") == 4  # "sine(" also matches "cosine("
    q_out, k_out = jax.jit(_rotated_through_layers)(positions, q, k)
    # Each rotation turns every (first half, second half) pair by its angle: (1, 1) turned LAYERS times.
    turned = LAYERS * np.arange(5, dtype=np.float64)[:, None] * np.asarray(_inverse_frequencies(), np.float64)
    expected = np.concatenate([np.cos(turned) - np.sin(turned), np.cos(turned) + np.sin(turned)], axis=-1)[:, None]
    np.testing.assert_allclose(np.asarray(q_out), 1.5**LAYERS * np.broadcast_to(expected, q.shape), atol=1e-4)
    np.testing.assert_allclose(np.asarray(k_out), 0.5**LAYERS * np.broadcast_to(expected, k.shape), atol=1e-5)


def test_an_empty_step_has_no_angles():
    """Zero tokens give empty tables rather than a conditional on a missing first position."""
    cos, sin = jax.jit(rope_angles)(jnp.zeros((0,), jnp.int32), _inverse_frequencies())
    assert cos.shape == sin.shape == (0, HEAD_DIM // 2)
