"""FP8 pages: per-row quantization error within the format's bound, and the quantizing KV write."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import QuantizedKVPages, empty_quantized_pages, quantize_per_row, write_kv_reference
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
def test_quantization_error_within_format_bound(dtype, kind):
    mantissa_bits, min_subnormal_exp = FORMATS[dtype]
    x = _inputs(kind, np.random.default_rng(0))
    quantized, scale = quantize_per_row(jnp.asarray(x), jnp.dtype(dtype))
    assert quantized.dtype == jnp.dtype(dtype) and scale.shape == (64,)
    restored = np.asarray(quantized.astype(jnp.float32)) * np.asarray(scale)[:, None]
    error = np.abs(restored - x)
    # Round to nearest: half a unit in the last place for normals (relative), half the subnormal
    # spacing below the normal range (absolute, in units of the row's scale). Nothing saturates.
    bound = np.maximum(
        np.abs(x) * 2.0 ** -(mantissa_bits + 1), np.asarray(scale)[:, None] * 2.0 ** (min_subnormal_exp - 1)
    )
    assert (error <= bound * (1 + 1e-6)).all()
    # Each row's largest magnitude lands on the format's largest finite value.
    largest = float(jnp.finfo(jnp.dtype(dtype)).max)
    np.testing.assert_allclose(np.abs(np.asarray(quantized.astype(jnp.float32))).max(axis=1), largest)


def test_zero_rows_get_unit_scale():
    quantized, scale = quantize_per_row(jnp.zeros((3, 8)), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(scale), 1.0)
    np.testing.assert_array_equal(np.asarray(quantized.astype(jnp.float32)), 0.0)


def test_quantizing_write_stores_pages_and_scales_at_their_slots():
    rng = np.random.default_rng(1)
    pool = empty_quantized_pages(num_pages=5, page_size=4, num_kv_heads=2, head_dim=16, dtype=jnp.float8_e4m3fn)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32) * np.array([1.0, 50.0])[None, :, None]
    v = rng.standard_normal((3, 2, 16)).astype(np.float32) * 0.01
    slots = jnp.asarray([2 * 4 + 1, 3 * 4 + 3, 4 * 4 + 0])
    written = write_kv_reference(pool, jnp.asarray(k), jnp.asarray(v), slots)
    assert isinstance(written, QuantizedKVPages)
    dense = np.asarray(dequantize_pages(written))  # [pages, P, 2K, D]
    for token, slot in enumerate(np.asarray(slots)):
        page, offset = divmod(int(slot), 4)
        np.testing.assert_allclose(dense[page, offset, 0::2], k[token], rtol=2**-4, atol=1e-6)
        np.testing.assert_allclose(dense[page, offset, 1::2], v[token], rtol=2**-4, atol=1e-8)
    untouched = np.ones(dense.shape[:2], bool)
    for slot in np.asarray(slots):
        untouched[divmod(int(slot), 4)] = False
    assert (dense[untouched] == 0).all()
    np.testing.assert_array_equal(np.asarray(written.scales)[untouched.nonzero()[0], :, untouched.nonzero()[1]], 1.0)


def test_empty_quantized_pages_refuses_a_non_fp8_dtype():
    with pytest.raises(ValueError, match="need an FP8 dtype"):
        empty_quantized_pages(4, 16, 2, 64, jnp.bfloat16)
