"""The native rotation of 8-bit KV (pallas_kernels/cpu_hadamard.cc) against x @ rotation_matrix in f64, and its use
by paged_attention under cpu_native."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import one_prompt_metadata

from pallas_kernels import empty_quantized_pages, native_library, paged_attention
from pallas_kernels.cpu_hadamard import MAX_WIDTH, hadamard_rows_cpu, turns_natively
from pallas_kernels.quantization import dequantize_pages, rotate, rotation_matrix, unrotate

HADAMARD_TARGET = native_library.HADAMARD_TARGET[0]
# An f32 butterfly rounds once per stage: log2(D) roundings of sums no larger than the row's norm.
TOLERANCE = 1e-6


@pytest.fixture(autouse=True, scope="module")
def _kernel_builds():
    """The suite's machines have a compiler: the kernel must build there, not skip."""
    assert native_library.native_kernel_error() is None, native_library.native_kernel_error()


def _exact(x: np.ndarray) -> np.ndarray:
    """x @ rotation_matrix(D) in f64: the normalized Sylvester-Hadamard matrix, for a power-of-two D."""
    return x.astype(np.float64) @ rotation_matrix(x.shape[-1]).astype(np.float64)


# Widths of a vector and more (the vector butterflies: 32, 64 and 128 compiled for their width, 256 and 512 not),
# below a vector (lane by lane), and row counts of one work item, several (over the thread pool) and none.
@pytest.mark.parametrize("width", [1, 2, 8, 16, 32, 64, 128, 256, MAX_WIDTH])
@pytest.mark.parametrize("leading", [(3,), (600, 3), (0, 2)])
def test_rows_equal_the_dot_with_the_rotation_matrix(width, leading):
    x = np.random.default_rng(width).standard_normal((*leading, width)).astype(np.float32)
    x[..., -1] += 20.0  # an outlier channel, which every output channel shares
    turned = np.asarray(jax.jit(hadamard_rows_cpu)(jnp.asarray(x)))
    assert turned.shape == x.shape and turned.dtype == np.float32
    scale = max(1.0, float(np.abs(x).max(initial=0.0)))
    np.testing.assert_allclose(turned, _exact(x), rtol=0, atol=TOLERANCE * scale * np.log2(2 * width))


def test_a_row_turned_twice_comes_back():
    """The normalized Hadamard matrix is symmetric and orthonormal: it is its own inverse."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 4, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(hadamard_rows_cpu(hadamard_rows_cpu(x))), np.asarray(x), atol=2e-6)


def test_bf16_rows_come_back_in_bf16():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 64)), jnp.bfloat16)
    turned = hadamard_rows_cpu(x)
    assert turned.dtype == jnp.bfloat16
    expected = _exact(np.asarray(x.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(turned.astype(jnp.float32)), expected, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("width", [80, 48, 3, 2 * MAX_WIDTH])
def test_widths_other_than_a_power_of_two_up_to_the_limit_are_refused(width):
    assert not turns_natively(width)
    with pytest.raises(ValueError, match="power-of-two width"):
        hadamard_rows_cpu(jnp.ones((2, width), jnp.float32))


@pytest.mark.parametrize("width", [64, 80])
def test_rotate_takes_the_kernel_only_where_asked_and_the_width_allows(width):
    """rotate and unrotate with native=True: the kernel at 64 (one call, no dot), the dot at 80 (a random orthogonal
    matrix, which the butterflies cannot compute), whose bits then equal native=False's."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((7, 2, width)), jnp.float32)
    for turn in (rotate, unrotate):
        program = str(jax.make_jaxpr(lambda x, turn=turn: turn(x, native=True))(x))
        assert program.count(HADAMARD_TARGET) == (width == 64)
        assert ("dot_general" in program) == (width != 64)
        natively, by_dot = np.asarray(turn(x, native=True)), np.asarray(turn(x))
        if width == 64:
            np.testing.assert_allclose(natively, by_dot, rtol=0, atol=1e-5)
        else:
            np.testing.assert_array_equal(natively, by_dot)


def test_paged_attention_under_cpu_native_turns_with_the_kernel_and_stores_rotated_keys():
    """An int8 pool under cpu_native: q, k, v and the output turned by the kernel (four calls, no dot), the pool
    holding K @ R as the reference stores it, and the output that of the jnp reader's path (turns by dot, the
    reference attention) up to the int8 rounding the two pools may make differently."""
    rng = np.random.default_rng(3)
    num_kv_heads, group, head_dim, page_size, length = 2, 2, 64, 8, 5
    q, k, v = (
        jnp.asarray(rng.standard_normal((length, heads, head_dim)), jnp.float32)
        for heads in (num_kv_heads * group, num_kv_heads, num_kv_heads)
    )
    metadata = one_prompt_metadata(page_size, length)

    def attend(impl):
        pool = empty_quantized_pages(4, page_size, num_kv_heads, head_dim, jnp.int8)
        return paged_attention(q, k, v, pool, metadata, sm_scale=head_dim**-0.5, attention_impl=impl)

    program = str(jax.make_jaxpr(lambda: attend("cpu_native"))())
    assert program.count(HADAMARD_TARGET) == 4 and "dot_general" not in program
    out, pool = jax.jit(attend, static_argnums=0)("cpu_native")
    expected_out, expected_pool = jax.jit(attend, static_argnums=0)("xla")
    stored = np.asarray(dequantize_pages(pool))[1, :length]  # [T, 2K, D]: K of head h at slot 2h, V at 2h + 1
    step = np.asarray(pool.token_scales())[1, :length, :, None]  # [T, 2K, 1]: each row's int8 step
    half_step = np.broadcast_to(step / 2 + 1e-6, stored.shape)  # the rounding's bound, beside the turn's f32 noise
    np.testing.assert_array_less(np.abs(stored[:, 0::2] - _exact(np.asarray(k))), half_step[:, 0::2])
    np.testing.assert_array_less(np.abs(stored[:, 1::2] - _exact(np.asarray(v))), half_step[:, 1::2])
    np.testing.assert_allclose(
        np.asarray(dequantize_pages(pool)), np.asarray(dequantize_pages(expected_pool)), rtol=0, atol=step.max()
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected_out), rtol=0, atol=step.max())
