"""Several panel products over one x in one native call (pallas_kernels.panel_matmuls_cpu, an attention block's q, k
and v) against one panel_matmul_cpu call each, its RMS norm of x's rows against the exact norm in float64, and
models.layers.project_together, which takes it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matmul_cases import random_case

from models.layers import RMSNorm, project, project_together
from models.packed_weights import PanelWeight
from pallas_kernels import (
    pack_panels,
    pack_panels_bf16,
    panel_matmul_cpu,
    panel_matmuls_cpu,
    quantize_panels_int8,
)
from pallas_kernels.native_library import native_kernel_error

needs_native = pytest.mark.skipif(native_kernel_error() is not None, reason="the native CPU kernels do not build here")


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 9, 65, 2050])
def test_products_sharing_x_in_one_call_are_each_the_bits_of_its_own_call(dtype, rows):
    """panel_matmuls_cpu (an attention block's q, k and v at once) against one panel_matmul_cpu per weight: 576, 192
    and a padded 50 columns; at 2050 rows the first output (4.5 MiB) streams past the cache."""
    pack = pack_panels if dtype == "float32" else pack_panels_bf16
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)
    weights = [jnp.asarray(rng.standard_normal((576, n)) * 0.05, dtype) for n in (576, 192, 50)]
    panels = [pack(w) for w in weights]
    together = jax.jit(lambda x, *p: panel_matmuls_cpu(x, list(p), [576, 192, 50]))(x, *panels)
    for out, p, w in zip(together, panels, weights, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(panel_matmul_cpu(x, p, w.shape[1])))


@needs_native
def test_products_sharing_x_refuse_mixed_kinds_and_depths_naming_the_layout():
    x, weight = random_case(5, 4, 64, 96, "float32", False)
    with pytest.raises(ValueError, match="one dtype"):
        panel_matmuls_cpu(x, [pack_panels(weight), pack_panels_bf16(weight)], [96, 96])
    with pytest.raises(ValueError, match="one dtype"):
        panel_matmuls_cpu(x, [quantize_panels_int8(weight)[0]], [96])
    with pytest.raises(ValueError, match="ceil"):
        panel_matmuls_cpu(x[:, :62], [pack_panels_bf16(weight)], [96])
    with pytest.raises(ValueError, match="does not fit"):
        panel_matmuls_cpu(x, [pack_panels(weight)], [97])


@needs_native
@pytest.mark.parametrize("packed", [True, False], ids=["panel_weights", "arrays"])
def test_project_together_is_one_call_over_panel_weights_and_each_projects_result(packed):
    """An attention block's q, k and v projections: one native call over PanelWeights (the same bits as three
    project() calls), and project() itself for arrays."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((33, 64)), jnp.float32)
    shapes = {"TD,DNH->TNH": (64, 4, 16), "TD,DKH->TKH": (64, 2, 16)}
    products = []
    for spec in ("TD,DNH->TNH", "TD,DKH->TKH", "TD,DKH->TKH"):
        weight = jnp.asarray(rng.standard_normal(shapes[spec]) * 0.1, jnp.float32)
        products.append((spec, PanelWeight(pack_panels(weight.reshape(64, -1)), weight.shape) if packed else weight))
    together = project_together(x, products, native=True)
    for out, (spec, weight) in zip(together, products, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(project(spec, x, weight, native=True)))
    jaxpr = str(jax.make_jaxpr(lambda x: project_together(x, products, native=True))(x))
    assert jaxpr.count("paxkv_cpu_panel_matmuls_f32") == (1 if packed else 0)


EPS = float(np.finfo(np.float32).eps)
NORM_EPS = 1e-5


def _normed_by_kernel(x, norm_weight):
    """x's rows as the kernel norms them while packing: its product with an f32 identity, which is exact (each output
    sums one value and zeros)."""
    depth = x.shape[1]
    return panel_matmuls_cpu(x, [pack_panels(jnp.eye(depth, dtype=jnp.float32))], [depth], norm_weight, NORM_EPS)[0]


def _norm_case(seed, rows, depth):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, depth)) * rng.uniform(0.1, 30.0, (rows, 1)), jnp.float32)
    return x, jnp.asarray(1.0 + 0.5 * rng.standard_normal(depth), jnp.float32)


@needs_native
@pytest.mark.parametrize("depth", [576, 33])
@pytest.mark.parametrize("rows", [1, 7, 9, 65, 300])
def test_rows_normed_as_they_are_packed_are_within_f32_rounding_of_the_exact_rms_norm(rows, depth):
    """The kernel's RMS norm (x * r * weight, r = 1 / sqrt(mean(x^2) + eps)) against float64: r's error is at most the
    sum of squares' (depth * eps), halved by the square root, plus one rounding each for the mean, the eps, the square
    root and the reciprocal, and the two products add one each. A ragged 33 leaves a tail past the vectors."""
    x, norm_weight = _norm_case(rows + depth, rows, depth)
    x64, w64 = np.asarray(x, np.float64), np.asarray(norm_weight, np.float64)
    exact = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + NORM_EPS) * w64
    bound = (depth / 2 + 6) * EPS * np.abs(exact)
    got = np.asarray(_normed_by_kernel(x, norm_weight), np.float64)
    assert np.all(np.abs(got - exact) <= bound), float(np.max(np.abs(got - exact) / (bound + 1e-30)))


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 9, 65, 2050])
def test_normed_products_are_the_bits_of_the_products_of_the_normed_rows(dtype, rows):
    """With a norm, each product is panel_matmul_cpu's of the rows as the kernel normed them, bit for bit (bf16
    panels round the normed rows to bf16 as any x)."""
    pack = pack_panels if dtype == "float32" else pack_panels_bf16
    x, norm_weight = _norm_case(rows, rows, 576)
    rng = np.random.default_rng(rows + 1)
    weights = [jnp.asarray(rng.standard_normal((576, n)) * 0.05, dtype) for n in (576, 192, 50)]
    panels = [pack(w) for w in weights]
    normed = _normed_by_kernel(x, norm_weight)
    together = jax.jit(lambda x, w, *p: panel_matmuls_cpu(x, list(p), [576, 192, 50], w, NORM_EPS))(
        x, norm_weight, *panels
    )
    for out, p, w in zip(together, panels, weights, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(panel_matmul_cpu(normed, p, w.shape[1])))


@needs_native
def test_a_norm_weight_over_other_columns_is_refused_naming_its_shape():
    x, weight = random_case(5, 4, 64, 96, "float32", False)
    with pytest.raises(ValueError, match=r"\[K\] = \[64\]"):
        panel_matmuls_cpu(x, [pack_panels(weight)], [96], jnp.ones((63,), jnp.float32), NORM_EPS)


@needs_native
def test_project_together_norms_x_inside_the_one_call_over_panel_weights():
    """A norm given to project_together: over PanelWeights it runs inside the native call (no rsqrt left in the
    program), within f32 rounding of projecting the norm's own output; over arrays it is the norm's output projected."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((33, 64)) * 4, jnp.float32)
    norm = RMSNorm(64, eps=NORM_EPS, param_dtype=jnp.float32)
    norm.weight[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(64), jnp.float32)
    weights = [jnp.asarray(rng.standard_normal((64, n)) * 0.1, jnp.float32) for n in (64, 32)]
    panels = [("TD,DN->TN", PanelWeight(pack_panels(w), w.shape)) for w in weights]
    fused = project_together(x, panels, native=True, norm=norm)
    normed = norm(x)
    normed64 = np.abs(np.asarray(normed, np.float64))
    for out, w in zip(fused, weights, strict=True):
        w64 = np.abs(np.asarray(w, np.float64))
        # The normed rows' difference carried through the sums, and both sums' own f32 error.
        bound = (64 / 2 + 6) * EPS * (normed64 @ w64) + 2 * 64 * EPS * (normed64 @ w64)
        diff = np.abs(np.asarray(out, np.float64) - np.asarray(project("TD,DN->TN", normed, w), np.float64))
        assert np.all(diff <= bound)
    jaxpr = str(jax.make_jaxpr(lambda x: project_together(x, panels, native=True, norm=norm))(x))
    assert jaxpr.count("paxkv_cpu_panel_matmuls_f32") == 1 and "rsqrt" not in jaxpr
    arrays = [("TD,DN->TN", w) for w in weights]
    for out, w in zip(project_together(x, arrays, native=True, norm=norm), weights, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(project("TD,DN->TN", normed, w, native=True)))
