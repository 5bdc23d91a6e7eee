"""The native small-row CPU matmul (pallas_kernels/cpu_small_matmul.cc) against exact sums, and models' use of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matmul_cases import check_within_summation_error, random_case

from models.layers import project
from pallas_kernels import MAX_NATIVE_ROWS, small_matmul_cpu, small_matmul_reference
from pallas_kernels.cpu_blocked_matmul import blocked_matmul_reads
from pallas_kernels.native_library import amx_available, native_kernel_error

pytestmark = pytest.mark.skipif(native_kernel_error() is not None, reason=f"no native kernels: {native_kernel_error()}")

# Shapes: SmolLM2's (576 -> 192, 1536 -> 576), ones that leave vector and K-step tails, and tiny ones.
SHAPES = [(576, 192), (1536, 576), (37, 100), (16, 17), (3, 5), (64, 200)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("contraction_last", [False, True], ids=["KN", "NK"])
def test_every_row_count_and_shape_is_within_f32_summation_error_of_the_exact_product(dtype, contraction_last):
    # one row, a ragged tile (4-row groups plus rest), every row
    rows = (1, 3, MAX_NATIVE_ROWS)
    check_within_summation_error(small_matmul_cpu, small_matmul_reference, SHAPES, rows, dtype, contraction_last, 10)


@pytest.mark.parametrize("contraction_last", [False, True], ids=["KN", "NK"])
def test_a_rows_result_does_not_depend_on_the_other_rows(contraction_last):
    """Bit for bit: each output sums over K in one order whatever else is in the batch (batch invariance)."""
    x, weight = random_case(7, MAX_NATIVE_ROWS, 1536, 576, "bfloat16", contraction_last)
    together = np.asarray(small_matmul_cpu(x, weight, contraction_last=contraction_last))
    for row in range(MAX_NATIVE_ROWS):
        alone = np.asarray(small_matmul_cpu(x[row : row + 1], weight, contraction_last=contraction_last))
        np.testing.assert_array_equal(alone[0], together[row])
    other = x.at[1:].set(-x[1:])
    np.testing.assert_array_equal(
        np.asarray(small_matmul_cpu(other, weight, contraction_last=contraction_last))[0], together[0]
    )


def test_what_the_kernel_does_not_take_is_refused_naming_the_fix():
    x, weight = random_case(0, MAX_NATIVE_ROWS + 1, 16, 16, "float32", False)
    with pytest.raises(ValueError, match="1 to 8 rows .* larger products go to the blocked kernel or XLA"):
        small_matmul_cpu(x, weight)
    with pytest.raises(ValueError, match="the weight is"):
        small_matmul_cpu(x[:2], weight[:8])
    with pytest.raises(ValueError, match="int8"):
        small_matmul_cpu(x[:2], weight.astype(jnp.int8))


def _native_kernel_used(function, *args) -> str | None:
    """Which native matmul (small, blocked or amx) the function's program calls, or None."""
    text = jax.jit(function).lower(*args).as_text()
    used = [kernel for kernel in ("small", "blocked", "amx") if f"paxkv_cpu_{kernel}_matmul" in text]
    assert len(used) <= 1
    return used[0] if used else None


# (spec, weight shape): every product the Llama model makes, at SmolLM2's sizes.
MODEL_PRODUCTS = [
    ("TD,DNH->TNH", (576, 9, 64)),
    ("TD,DKH->TKH", (576, 3, 64)),
    ("TI,ID->TD", (576, 576)),
    ("TD,DF->TF", (576, 1536)),
    ("TF,FD->TD", (1536, 576)),
    ("TD,VD->TV", (4096, 576)),
]


@pytest.mark.parametrize("spec,shape", MODEL_PRODUCTS, ids=[spec for spec, _ in MODEL_PRODUCTS])
def test_project_takes_the_native_kernels_where_they_beat_xla_and_agrees_with_xla(spec, shape):
    rng = np.random.default_rng(1)
    depth = shape[1] if spec.startswith("TD,VD") else shape[0]

    def blocked(rows, dtype):  # this machine's choice (test_cpu_blocked_matmul tests it on every kind of CPU)
        return "blocked" if blocked_matmul_reads(rows, dtype, spec.startswith("TD,VD")) else None

    amx_here = "amx" if amx_available() else None  # test_cpu_amx_matmul tests its rules

    for dtype, rows, expect_native in [
        ("bfloat16", 1, "small"),
        ("bfloat16", 7, "small"),
        ("bfloat16", 8, amx_here or "small"),
        ("float32", 1, None),  # XLA reads f32 fastest at one row
        ("float32", 4, "small"),
        ("float32", 16, blocked(16, jnp.float32)),
        ("bfloat16", 16, amx_here or blocked(16, jnp.bfloat16)),
        ("float32", 64, blocked(64, jnp.float32)),
        ("float32", 128, None),  # XLA's f32 matmuls as fast from 64 rows on
        ("bfloat16", 128, blocked(128, jnp.bfloat16)),
    ]:
        x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)
        weight = jnp.asarray(rng.standard_normal(shape) * 0.05, dtype)

        def native(x, weight):
            return project(spec, x, weight, native=True)

        def xla(x, weight):
            return project(spec, x, weight, native=False)

        assert _native_kernel_used(native, x, weight) == expect_native, (dtype, rows)
        assert _native_kernel_used(xla, x, weight) is None
        got, want = np.asarray(native(x, weight)), np.asarray(xla(x, weight))
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(depth))


def test_a_mesh_axis_that_could_split_the_weight_keeps_xla():
    """Under an automatic mesh axis of more than one device the weight may be partitioned, which one opaque call
    would gather whole: the product stays XLA's there (a data-parallel step's manual axis does not count)."""
    x = jnp.ones((1, 64), jnp.float32)
    weight = jnp.ones((64, 32), jnp.bfloat16)

    def native(x, weight):
        return project("TD,DF->TF", x, weight, native=True)

    mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        assert _native_kernel_used(native, x, weight) is None
    single = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    with jax.set_mesh(single):
        assert _native_kernel_used(native, x, weight) == "small"
