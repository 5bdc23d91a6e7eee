"""Several panel products over one x in one native call (pallas_kernels.panel_matmuls_cpu, an attention block's q, k
and v) against one panel_matmul_cpu call each, and models.layers.project_together, which takes it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matmul_cases import random_case

from models.layers import project, project_together
from models.packed_weights import PanelWeight
from pallas_kernels import pack_panels, pack_panels_bf16, panel_matmul_cpu, panel_matmuls_cpu, quantize_panels_int8
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
