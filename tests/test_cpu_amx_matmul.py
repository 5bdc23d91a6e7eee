"""The native AMX matmul (pallas_kernels/cpu_amx_matmul.cc) against exact sums, and where models' project takes it.
Runs where the CPU has AMX; elsewhere only the refusal and the dispatch rules run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matmul_cases import check_within_summation_error, random_case

from models.layers import project
from pallas_kernels import MAX_AMX_ROWS, MIN_AMX_ROWS, amx_matmul_cpu, amx_matmul_reads, small_matmul_reference
from pallas_kernels.native_library import amx_available, native_kernel_error

needs_amx = pytest.mark.skipif(
    native_kernel_error() is not None or not amx_available(),
    reason="no AMX here (the CPU lacks amx_bf16, or the native kernels do not build)",
)

# (depth, columns): SmolLM2's 576 -> 192 and 1536 -> 576 (several 128-row packing blocks, a ragged last one); depths
# that leave part of a 32-value tile step; 16 columns (one tile, half a 32-column block) and 48 (a block and a half).
SHAPES = [(576, 192), (1536, 576), (200, 48), (37, 16), (3, 32), (64, 64)]
# One row, a tile's rows minus one, one tile, a block and a tile, a tile more than a block, a decode batch, a chunk.
ROWS = [1, 15, 16, 33, 48, 64, 100]


@needs_amx
@pytest.mark.parametrize("contraction_last", [False, True], ids=["KN", "NK"])
def test_every_row_count_and_shape_is_within_f32_summation_error_of_the_exact_product(contraction_last):
    check_within_summation_error(
        amx_matmul_cpu,
        small_matmul_reference,
        SHAPES,
        ROWS,
        "bfloat16",
        contraction_last,
        seed_stride=1000,
        # An [N, K] weight's rows load as whole tiles: the kernel refuses other depths (tested below).
        takes=lambda depth, columns: not contraction_last or depth % 32 == 0,
    )


@needs_amx
@pytest.mark.parametrize("contraction_last", [False, True], ids=["KN", "NK"])
def test_a_rows_result_does_not_depend_on_the_other_rows(contraction_last):
    """Bit for bit: each output sums over K in one order whatever else is in the batch (batch invariance)."""
    x, weight = random_case(7, 40, 1536, 576, "bfloat16", contraction_last)
    together = np.asarray(amx_matmul_cpu(x, weight, contraction_last=contraction_last))
    for row in (0, 15, 16, 31, 32, 39):  # each tile's first and last rows, the padded last tile's
        alone = np.asarray(amx_matmul_cpu(x[row : row + 1], weight, contraction_last=contraction_last))
        np.testing.assert_array_equal(alone[0], together[row])
    other = x.at[1:].set(-x[1:])
    np.testing.assert_array_equal(
        np.asarray(amx_matmul_cpu(other, weight, contraction_last=contraction_last))[0], together[0]
    )


@needs_amx
def test_empty_products_are_empty_or_zeros():
    x, weight = random_case(3, 12, 0, 32, "bfloat16", False)
    np.testing.assert_array_equal(np.asarray(amx_matmul_cpu(x, weight)), np.zeros((12, 32), np.float32))
    x, weight = random_case(3, 0, 64, 32, "bfloat16", False)
    assert amx_matmul_cpu(x, weight).shape == (0, 32)


@needs_amx
def test_what_the_kernel_does_not_take_is_refused_naming_the_fix():
    x, weight = random_case(0, 8, 64, 24, "bfloat16", False)
    with pytest.raises(ValueError, match="N a multiple of 16 .*layers.project gives other products"):
        amx_matmul_cpu(x, weight)
    x, weight = random_case(0, 8, 40, 32, "bfloat16", True)
    with pytest.raises(ValueError, match="K of 32 for an \\[N, K\\] weight"):
        amx_matmul_cpu(x, weight, contraction_last=True)
    x, weight = random_case(0, 8, 64, 32, "float32", False)
    with pytest.raises(ValueError, match="bf16 weights"):
        amx_matmul_cpu(x, weight)


def test_the_rows_shapes_and_dtypes_it_takes():
    """bf16 decode-sized products in whole tiles, and only where this process may use AMX."""
    here = amx_available()
    assert amx_matmul_reads(MIN_AMX_ROWS, jnp.bfloat16, 576, 1536) == here
    assert amx_matmul_reads(MAX_AMX_ROWS, jnp.bfloat16, 49152, 576, contraction_last=True) == here
    assert not amx_matmul_reads(MIN_AMX_ROWS - 1, jnp.bfloat16, 576, 1536)  # the small-row kernel's
    assert not amx_matmul_reads(MAX_AMX_ROWS + 1, jnp.bfloat16, 576, 1536)  # XLA's
    assert not amx_matmul_reads(32, jnp.float32, 576, 1536)
    assert not amx_matmul_reads(32, jnp.bfloat16, 100, 1536)
    assert not amx_matmul_reads(32, jnp.bfloat16, 4096, 100, contraction_last=True)


@needs_amx
@pytest.mark.parametrize(
    "spec,shape", [("TD,DKH->TKH", (576, 3, 64)), ("TF,FD->TD", (1536, 576)), ("TD,VD->TV", (4096, 576))]
)
def test_project_takes_it_for_bf16_decode_batches_and_agrees_with_xla(spec, shape):
    rng = np.random.default_rng(1)
    depth = shape[1] if spec.startswith("TD,VD") else shape[0]
    weight = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
    for rows, expect_amx in [(MIN_AMX_ROWS - 1, False), (MIN_AMX_ROWS, True), (32, True), (MAX_AMX_ROWS + 1, False)]:
        x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)
        native_text = jax.jit(lambda x, w: project(spec, x, w, native=True)).lower(x, weight).as_text()
        assert ("paxkv_cpu_amx_matmul" in native_text) == expect_amx, rows
        got = np.asarray(project(spec, x, weight, native=True))
        want = np.asarray(project(spec, x, weight, native=False))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(depth))
