"""8-bit pages: per-row quantization error within the format's bound, the quantizing KV write, the rotation."""

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import one_prompt_metadata

from pallas_kernels import (
    QuantizedKVPages,
    empty_quantized_pages,
    paged_attention,
    quantize_per_row,
    ragged_paged_attention_reference,
    rotation_matrix,
    write_kv,
)
from pallas_kernels.quantization import dequantize_pages

# (mantissa bits, exponent of the smallest subnormal) of each format.
FORMATS = {"float8_e4m3fn": (3, -9), "float8_e5m2": (2, -16)}


def _inputs(kind: str, rng) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal((64, 128)).astype(np.float32)
    # Outlier-heavy: heavy tails, a few huge entries per row, and rows of wildly different scales.
    x = rng.standard_t(df=2, size=(64, 128)).astype(np.float32)
    x[:, rng.integers(0, 128, 3)] *= 1e3
    return x * np.exp(rng.uniform(-8, 8, size=(64, 1))).astype(np.float32)


@pytest.mark.parametrize("dtype", sorted(FORMATS))
@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_fp8_quantization_error_within_format_bound(dtype, kind):
    mantissa_bits, min_subnormal_exp = FORMATS[dtype]
    x = _inputs(kind, np.random.default_rng(0))
    quantized, scale = quantize_per_row(jnp.asarray(x), jnp.dtype(dtype))
    assert quantized.dtype == jnp.dtype(dtype) and scale.shape == (64,) and scale.dtype == jnp.bfloat16
    scale = np.asarray(scale.astype(jnp.float32))
    restored = np.asarray(quantized.astype(jnp.float32)) * scale[:, None]
    error = np.abs(restored - x)
    # Round to nearest: half a unit in the last place for normals (relative), half the subnormal
    # spacing below the normal range (absolute, in units of the row's scale). Nothing saturates.
    bound = np.maximum(np.abs(x) * 2.0 ** -(mantissa_bits + 1), scale[:, None] * 2.0 ** (min_subnormal_exp - 1))
    assert (error <= bound * (1 + 1e-6)).all()
    # The bf16 scale is rounded up, so each row's largest magnitude lands within one bf16 step
    # (2^-8) below the format's largest finite value, never above it.
    largest = float(jnp.finfo(jnp.dtype(dtype)).max)
    row_max = np.abs(np.asarray(quantized.astype(jnp.float32))).max(axis=1)
    assert (row_max <= largest).all() and (row_max >= largest * (1 - 2**-7)).all()


@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_int8_quantization_error_within_half_a_step(kind):
    x = _inputs(kind, np.random.default_rng(0))
    quantized, scale = quantize_per_row(jnp.asarray(x), jnp.int8)
    assert quantized.dtype == jnp.int8
    scale = np.asarray(scale.astype(jnp.float32))
    values = np.asarray(quantized, np.int32)
    assert (np.abs(values) <= 127).all() and (np.abs(values).max(axis=1) >= 126).all()
    error = np.abs(values * scale[:, None] - x)
    assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all()
    # The step is the row's largest magnitude over 127, give or take the bf16 rounding up.
    amax = np.abs(x).max(axis=1)
    assert (scale >= amax / 127).all() and (scale <= amax / 127 * (1 + 2**-7)).all()


def test_zero_rows_get_unit_scale():
    quantized, scale = quantize_per_row(jnp.zeros((3, 8)), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(scale), 1.0)
    np.testing.assert_array_equal(np.asarray(quantized.astype(jnp.float32)), 0.0)


@pytest.mark.parametrize("dtype,relative", [(jnp.float8_e4m3fn, 2**-4), (jnp.int8, 2**-6)])
def test_quantizing_write_stores_pages_and_scales_at_their_slots(dtype, relative):
    rng = np.random.default_rng(1)
    pool = empty_quantized_pages(num_pages=5, page_size=4, num_kv_heads=2, head_dim=16, dtype=dtype)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32) * np.array([1.0, 50.0])[None, :, None]
    v = rng.standard_normal((3, 2, 16)).astype(np.float32) * 0.01
    slots = jnp.asarray([2 * 4 + 1, 3 * 4 + 3, 4 * 4 + 0])
    written = write_kv(pool, jnp.asarray(k), jnp.asarray(v), slots)
    assert isinstance(written, QuantizedKVPages)
    dense = np.asarray(dequantize_pages(written))  # [pages, P, 2K, D]
    for token, slot in enumerate(np.asarray(slots)):
        page, offset = divmod(int(slot), 4)
        # Per head: an error relative to the head's largest magnitude (FP8 does better, per element).
        for head in range(2):
            for got, want in (
                (dense[page, offset, 2 * head], k[token, head]),
                (dense[page, offset, 2 * head + 1], v[token, head]),
            ):
                assert np.abs(got - want).max() <= relative * np.abs(want).max()
    untouched = np.ones(dense.shape[:2], bool)
    for slot in np.asarray(slots):
        untouched[divmod(int(slot), 4)] = False
    assert (dense[untouched] == 0).all()
    scales = np.asarray(written.token_scales())  # [pages, P, 2K]
    np.testing.assert_array_equal(scales[untouched], 1.0)


def test_empty_quantized_pages_refuses_a_non_8_bit_dtype():
    with pytest.raises(ValueError, match="need an 8-bit dtype"):
        empty_quantized_pages(4, 16, 2, 64, jnp.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_rotation_matrix_is_orthonormal_and_spreads_an_outlier(head_dim):
    matrix = rotation_matrix(head_dim).astype(np.float64)
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(head_dim), atol=1e-6)
    # One channel carrying everything comes out spread: no channel keeps more than a small share.
    spike = np.zeros(head_dim)
    spike[3] = 1.0
    assert np.abs(spike @ matrix).max() < 0.5


# Bounds on ||out - exact|| / ||exact|| for keys with a +30 outlier channel. FP8 keeps each element's
# relative precision, so the rotation, which spreads the outlier over every channel, costs it here
# (0.07 rotated, 0.03 not); on the real model's keys it helps (scripts/eval_kv_quality.py).
# int8's step is set by the row's largest magnitude, so there the rotation is what keeps it accurate.
@pytest.mark.parametrize("dtype,bound", [(jnp.float8_e4m3fn, 0.1), (jnp.int8, 0.02)])
def test_rotated_quantized_attention_matches_plain_attention(dtype, bound):
    """paged_attention turns q, k, v into the stored basis and the output back: the result is unrotated."""
    rng = np.random.default_rng(2)
    num_kv_heads, group, head_dim, page_size, length = 2, 2, 64, 8, 20
    q = rng.standard_normal((length, num_kv_heads * group, head_dim)).astype(np.float32)
    k = rng.standard_normal((length, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((length, num_kv_heads, head_dim)).astype(np.float32)
    k[..., 5] += 30.0  # an outlier channel, as real keys have
    metadata = one_prompt_metadata(page_size, length)
    options = dict(sm_scale=head_dim**-0.5, attention_impl="xla")
    exact, _ = paged_attention(
        *map(jnp.asarray, (q, k, v)), jnp.zeros((4, page_size, 4 * head_dim)), metadata, **options
    )
    pool = empty_quantized_pages(4, page_size, num_kv_heads, head_dim, dtype)
    out, pool = paged_attention(*map(jnp.asarray, (q, k, v)), pool, metadata, **options)
    error = np.linalg.norm(np.asarray(out) - np.asarray(exact)) / np.linalg.norm(np.asarray(exact))
    assert error < bound
    # What the pool holds is K turned by the rotation, not K itself.
    stored = np.asarray(dequantize_pages(pool))[1, 0, 0]  # token 0, K of head 0
    np.testing.assert_allclose(stored, k[0, 0] @ rotation_matrix(head_dim), rtol=0.1, atol=0.5)
    if dtype != jnp.int8:
        return
    # For int8, unrotated storage of the same outlier-heavy keys is much worse.
    plain = write_kv(
        empty_quantized_pages(4, page_size, num_kv_heads, head_dim, dtype),
        jnp.asarray(k),
        jnp.asarray(v),
        metadata.slots,
    )
    unrotated = ragged_paged_attention_reference(jnp.asarray(q), plain, metadata, sm_scale=head_dim**-0.5)
    worse = np.linalg.norm(np.asarray(unrotated) - np.asarray(exact)) / np.linalg.norm(np.asarray(exact))
    assert worse > 3 * error
