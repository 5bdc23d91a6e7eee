"""The native blocked CPU matmul (pallas_kernels/cpu_blocked_matmul.cc) against exact sums."""

import os
import platform

import jax.numpy as jnp
import numpy as np
import pytest
from matmul_cases import check_within_summation_error, random_case

from pallas_kernels import (
    MIN_BLOCKED_ROWS,
    blocked_matmul_cpu,
    blocked_matmul_reads,
    small_matmul_cpu,
    small_matmul_reference,
)
from pallas_kernels.native_library import cpu_feature_flags, native_kernel_error

pytestmark = pytest.mark.skipif(native_kernel_error() is not None, reason=f"no native kernels: {native_kernel_error()}")

# (depth, columns): SmolLM2's 576 -> 192 and 1536 -> 576; depths past one packed block (96 rows on AVX2) with a
# ragged last block and columns that leave part of a panel or of an 8 x 8 transposed block; tiny ones.
SHAPES = [(576, 192), (1536, 576), (200, 100), (37, 70), (16, 17), (3, 5)]
# One row, a tile's height minus one, whole 6-row tiles plus every remainder, a decode batch, a prefill chunk.
ROWS = [1, 5, 9, 13, 32, 64, 130]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("contraction_last", [False, True], ids=["KN", "NK"])
def test_every_row_count_and_shape_is_within_f32_summation_error_of_the_exact_product(dtype, contraction_last):
    check_within_summation_error(
        blocked_matmul_cpu, small_matmul_reference, SHAPES, ROWS, dtype, contraction_last, seed_stride=1000
    )


@pytest.mark.parametrize("contraction_last", [False, True], ids=["KN", "NK"])
def test_a_rows_result_does_not_depend_on_the_other_rows(contraction_last):
    """Bit for bit: each output sums over K in one order whatever else is in the batch (batch invariance)."""
    x, weight = random_case(7, 32, 1536, 200, "bfloat16", contraction_last)
    together = np.asarray(blocked_matmul_cpu(x, weight, contraction_last=contraction_last))
    for row in (0, 5, 6, 31):  # first and last of a full tile, first of the next, the remainder tile's
        alone = np.asarray(blocked_matmul_cpu(x[row : row + 1], weight, contraction_last=contraction_last))
        np.testing.assert_array_equal(alone[0], together[row])
    other = x.at[1:].set(-x[1:])
    np.testing.assert_array_equal(
        np.asarray(blocked_matmul_cpu(other, weight, contraction_last=contraction_last))[0], together[0]
    )


@pytest.mark.parametrize("contraction_last", [False, True], ids=["KN", "NK"])
def test_empty_products_are_empty_or_zeros(contraction_last):
    for kernel, rows in ((blocked_matmul_cpu, 12), (small_matmul_cpu, 3)):
        x, weight = random_case(3, rows, 0, 20, "float32", contraction_last)  # no contraction: zeros
        np.testing.assert_array_equal(np.asarray(kernel(x, weight, contraction_last=contraction_last)), 0.0)
    x, weight = random_case(3, 0, 16, 20, "float32", contraction_last)  # no rows
    assert blocked_matmul_cpu(x, weight, contraction_last=contraction_last).shape == (0, 20)


def test_what_the_kernel_does_not_take_is_refused_naming_the_fix():
    x, weight = random_case(0, 16, 16, 16, "float32", False)
    with pytest.raises(ValueError, match="the weight is"):
        blocked_matmul_cpu(x, weight[:8])
    with pytest.raises(ValueError, match="f32 or bf16 weights, not int8"):
        blocked_matmul_cpu(x, weight.astype(jnp.int8))


AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw"}
AVX512_BF16 = AVX512 | {"avx512_bf16", "amx_bf16"}


def test_the_row_counts_it_is_given_are_where_it_beats_xla():
    # AVX2: f32 from 9 to 64 rows, bf16 from 9, in both layouts.
    for contraction_last in (False, True):
        assert not blocked_matmul_reads(MIN_BLOCKED_ROWS - 1, jnp.float32, contraction_last, AVX2)  # small-row's
        assert blocked_matmul_reads(MIN_BLOCKED_ROWS, jnp.float32, contraction_last, AVX2)
        assert blocked_matmul_reads(64, jnp.float32, contraction_last, AVX2)
        assert not blocked_matmul_reads(65, jnp.float32, contraction_last, AVX2)  # XLA's as fast or faster
        assert blocked_matmul_reads(4096, jnp.bfloat16, contraction_last, AVX2)  # XLA's bf16 ones never are
        assert not blocked_matmul_reads(32, jnp.int8, contraction_last, AVX2)
    # No flags known (no /proc/cpuinfo): as on an AVX2 machine.
    assert blocked_matmul_reads(64, jnp.float32, False, frozenset())
    # AVX-512: f32 [K, N] weights from 9 to 32 rows; XLA's transposing lm_head is faster.
    assert blocked_matmul_reads(MIN_BLOCKED_ROWS, jnp.float32, False, AVX512)
    assert blocked_matmul_reads(32, jnp.float32, False, AVX512)
    assert not blocked_matmul_reads(33, jnp.float32, False, AVX512)
    assert not blocked_matmul_reads(16, jnp.float32, True, AVX512)
    # bf16 is XLA's where the CPU has bf16 instructions for it, else the kernel's.
    assert blocked_matmul_reads(32, jnp.bfloat16, False, AVX512)
    assert not any(blocked_matmul_reads(rows, jnp.bfloat16, False, AVX512_BF16) for rows in (9, 32, 256))
    assert not blocked_matmul_reads(32, jnp.bfloat16, True, AVX512_BF16)


def test_this_machines_flags_are_read():
    flags = cpu_feature_flags()
    assert isinstance(flags, frozenset)
    if os.path.exists("/proc/cpuinfo") and platform.machine() == "x86_64":
        assert "sse2" in flags  # every x86-64 CPU has it
    assert blocked_matmul_reads(32, jnp.float32) == blocked_matmul_reads(32, jnp.float32, False, flags)
