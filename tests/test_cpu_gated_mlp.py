"""The native gated MLP (pallas_kernels/cpu_gated_mlp.cc) against the exact gated MLP in float64, its rows against
themselves in other batches, with an RMS norm of its input rows, and the model's MLP through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.layers import GatedMLP, RMSNorm, _fuses_gated_mlp
from models.packed_weights import PanelWeight, pack_projections_in_place
from pallas_kernels import (
    gated_mlp_cpu,
    gated_mlp_reference,
    pack_panels,
    pack_panels_bf16,
    panel_matmul_cpu,
    panel_matmuls_cpu,
)
from pallas_kernels.native_library import native_kernel_error

pytestmark = pytest.mark.skipif(native_kernel_error() is not None, reason="the native CPU kernels do not build here")

EPS = float(np.finfo(np.float32).eps)
BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of it

# (hidden, mlp_width): SmolLM2's 576 -> 1536 -> 576; widths and hidden sizes that leave padded last panels, an odd
# width (a bf16 h padded with a zero to whole pairs), and a hidden size of 3.
SHAPES = [(576, 1536), (64, 100), (33, 47), (50, 97), (3, 20)]
# One row, a tile's rows minus and plus one, a decode batch, the most taken all at once (64), one more (chunks of 32
# rows), and a ragged last chunk.
ROWS = [1, 7, 9, 33, 64, 65, 100]
PACKS = {"float32": pack_panels, "bfloat16": pack_panels_bf16}
# A model config whose MLP is 64 -> 100 -> 64 (the model-level tests).
MLP_CONFIG = models.ModelConfig(
    model_type="llama",
    vocab_size=32,
    hidden_size=64,
    intermediate_size=100,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
)


def _silu(g):
    return g / (1.0 + np.exp(-g))


def _exact_with_bound(x, gate, up, down, dtype):
    """The gated MLP in float64 on the values the kernel reads (x rounded to bf16 for bf16 weights, which are bf16
    values), and the bound its f32 result stays within: the gate and up sums' f32 error (depth * eps * |x| @ |w|)
    carried through silu (|silu'| < 1.1) and the product, silu's own evaluation (4 roundings), h rounded to bf16 for
    bf16 weights, and the down projection's sums."""
    as64 = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    x64, g64, u64, d64 = as64(x), as64(gate), as64(up), as64(down)
    gate_sums, up_sums = x64 @ g64, x64 @ u64
    gate_error = x64.shape[1] * EPS * (np.abs(x64) @ np.abs(g64))
    up_error = x64.shape[1] * EPS * (np.abs(x64) @ np.abs(u64))
    h = _silu(gate_sums) * up_sums
    h_error = 1.1 * gate_error * np.abs(up_sums) + np.abs(_silu(gate_sums)) * up_error + 4 * EPS * np.abs(h)
    if dtype == "bfloat16":
        h_error += BF16_UNIT_ROUNDOFF * (np.abs(h) + h_error)
    bound = (h_error @ np.abs(d64)) + d64.shape[0] * EPS * ((np.abs(h) + h_error) @ np.abs(d64))
    return h @ d64, bound


def _case(seed, rows, hidden, width, dtype, scale=1.0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32) * scale)
    weights = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0]) for s in [(hidden, width)] * 2]
    weights.append(rng.standard_normal((width, hidden)).astype(np.float32) / np.sqrt(width))
    return x, [jnp.asarray(w, dtype) for w in weights]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_row_count_and_shape_is_within_f32_error_of_the_exact_gated_mlp(dtype):
    for index, (hidden, width) in enumerate(SHAPES):
        for rows in ROWS:
            x, (gate, up, down) = _case(100 * index + rows, rows, hidden, width, dtype)
            panels = [PACKS[dtype](w) for w in (gate, up, down)]
            out = np.asarray(gated_mlp_cpu(x, *panels, width, hidden))
            exact, bound = _exact_with_bound(x, gate, up, down, dtype)
            assert out.shape == (rows, hidden)
            assert np.all(np.abs(out - exact) <= bound), (hidden, width, rows)
        reference = np.asarray(gated_mlp_reference(x, *panels, width, hidden))
        assert np.all(np.abs(reference - exact) <= bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_silu_holds_its_error_far_out_on_both_sides(dtype):
    """Inputs 30x larger: gate sums of magnitude up to about 100, where silu is about 0 on one side (e^-|g| small) and
    g on the other."""
    x, (gate, up, down) = _case(7, 40, 64, 100, dtype, scale=30.0)
    panels = [PACKS[dtype](w) for w in (gate, up, down)]
    assert np.abs(np.asarray(panel_matmul_cpu(x, panels[0], 100))).max() > 60
    out = np.asarray(gated_mlp_cpu(x, *panels, 100, 64))
    exact, bound = _exact_with_bound(x, gate, up, down, dtype)
    assert np.all(np.isfinite(out)) and np.all(np.abs(out - exact) <= bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_is_the_same_bits_alone_in_a_few_rows_and_in_many(dtype):
    """300 rows (chunks of 32, every item's rows), 40 of them (all rows at once) and single rows: each row's output
    depends on its own input row alone (batch invariance)."""
    x, weights = _case(3, 300, 576, 1536, dtype)
    panels = [PACKS[dtype](w) for w in weights]
    together = np.asarray(gated_mlp_cpu(x, *panels, 1536, 576))
    np.testing.assert_array_equal(np.asarray(gated_mlp_cpu(x[250:290], *panels, 1536, 576)), together[250:290])
    for row in (0, 7, 8, 131, 299):
        alone = np.asarray(gated_mlp_cpu(x[row : row + 1], *panels, 1536, 576))
        np.testing.assert_array_equal(alone[0], together[row])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 9, 65, 300])
def test_a_normed_mlp_is_the_bits_of_the_mlp_of_its_rows_as_the_kernel_norms_them(dtype, rows):
    """With a norm weight, the MLP takes x's rows RMS-normed as they are packed: the same bits as the MLP of those
    normed rows (read back as their product with an f32 identity, which is exact; panel_matmuls_cpu's tests check the
    norm itself against float64)."""
    x, weights = _case(rows, rows, 576, 1536, dtype, scale=5.0)
    panels = [PACKS[dtype](w) for w in weights]
    norm_weight = jnp.asarray(1.0 + 0.3 * np.random.default_rng(rows).standard_normal(576), jnp.float32)
    identity = pack_panels(jnp.eye(576, dtype=jnp.float32))
    normed = panel_matmuls_cpu(x, [identity], [576], norm_weight, 1e-5)[0]
    fused = np.asarray(gated_mlp_cpu(x, *panels, 1536, 576, norm_weight, 1e-5))
    np.testing.assert_array_equal(fused, np.asarray(gated_mlp_cpu(normed, *panels, 1536, 576)))


def test_the_products_are_the_panel_matmuls_and_silu_is_within_two_roundings_of_xlas():
    """Against the unfused native path (three panel matmuls, XLA's silu between): gate's and up's sums and the down
    projection are the same kernel's, so in f32 only silu's evaluation differs."""
    x, weights = _case(11, 65, 576, 1536, "float32")
    gate, up, down = [pack_panels(w) for w in weights]
    h = jax.nn.silu(panel_matmul_cpu(x, gate, 1536)) * panel_matmul_cpu(x, up, 1536)
    unfused = np.asarray(panel_matmul_cpu(h, down, 576), np.float64)
    fused = np.asarray(gated_mlp_cpu(x, gate, up, down, 1536, 576), np.float64)
    h64, d64 = np.abs(np.asarray(h, np.float64)), np.abs(np.asarray(weights[2], np.float64))
    # Two roundings of h each way, carried through the down projection, and its sums' f32 error on both sides.
    bound = 4 * EPS * (h64 @ d64) + 2 * 1536 * EPS * (h64 @ d64)
    assert np.all(np.abs(fused - unfused) <= bound)
    assert np.mean(fused == unfused) > 0.3  # most elements are the same bits: the silu values mostly agree


def test_wrong_operands_are_refused_with_the_expected_layout():
    x, (gate, up, down) = _case(1, 4, 64, 100, "float32")
    f32 = [pack_panels(w) for w in (gate, up, down)]
    with pytest.raises(ValueError, match="all three of one dtype"):
        gated_mlp_cpu(x, f32[0], pack_panels_bf16(up), f32[2], 100, 64)
    with pytest.raises(ValueError, match="mlp_width = 96"):
        gated_mlp_cpu(x, *f32, 96, 64)  # 3 panels hold at most 144 columns, but down is [100, 64]
    with pytest.raises(ValueError, match="expected shapes"):
        gated_mlp_cpu(x[:, :60], *f32, 100, 64)


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8")])
def test_the_models_mlp_is_one_native_call_when_its_weights_are_f32_or_bf16_panels(monkeypatch, dtype, quantization):
    """GatedMLP with its three weights packed as an engine packs them on this CPU calls gated_mlp_cpu once and returns
    its result; with [K, N] weights, or int8 panels, it keeps the three projections."""
    mlp = GatedMLP(MLP_CONFIG, param_dtype=jnp.dtype(dtype), native_matmul=True, rngs=None)
    rng = np.random.default_rng(5)
    for name, shape in (("gate", (64, 100)), ("up", (64, 100)), ("down", (100, 64))):
        getattr(mlp, name).set_value(jnp.asarray(rng.standard_normal(shape) * 0.1, dtype))
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.float32)
    assert not _fuses_gated_mlp(x, (mlp.gate[...], mlp.up[...], mlp.down[...]))
    pack_projections_in_place(nnx.state(mlp), quantization, bf16=dtype == "bfloat16")
    packed = (mlp.gate[...], mlp.up[...], mlp.down[...])
    assert all(isinstance(w, PanelWeight) for w in packed)
    calls = []

    def counted(*args):
        calls.append(args)
        return gated_mlp_cpu(*args)

    monkeypatch.setattr("models.layers.gated_mlp_cpu", counted)
    out = np.asarray(mlp(x))
    if quantization is not None:
        assert not _fuses_gated_mlp(x, packed) and not calls
        return
    assert _fuses_gated_mlp(x, packed) and len(calls) == 1
    np.testing.assert_array_equal(out, np.asarray(gated_mlp_cpu(x, *(w.panels for w in packed), 100, 64)))


def test_the_models_mlp_takes_its_norm_into_the_native_call():
    """GatedMLP(x, norm) over f32 panels passes the norm's weight and eps to the one native call (no rsqrt left in the
    program); over [K, N] weights it is the MLP of the norm's output."""
    mlp = GatedMLP(MLP_CONFIG, param_dtype=jnp.float32, native_matmul=True, rngs=None)
    rng = np.random.default_rng(8)
    for name, shape in (("gate", (64, 100)), ("up", (64, 100)), ("down", (100, 64))):
        getattr(mlp, name).set_value(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32))
    norm = RMSNorm(64, eps=1e-6, param_dtype=jnp.float32)
    norm.weight[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(64), jnp.float32)
    x = jnp.asarray(rng.standard_normal((9, 64)) * 3, jnp.float32)
    np.testing.assert_array_equal(np.asarray(mlp(x, norm=norm)), np.asarray(mlp(norm(x))))
    pack_projections_in_place(nnx.state(mlp), None, bf16=False)
    panels = [w.panels for w in (mlp.gate[...], mlp.up[...], mlp.down[...])]
    fused = np.asarray(mlp(x, norm=norm))
    np.testing.assert_array_equal(fused, np.asarray(gated_mlp_cpu(x, *panels, 100, 64, norm.weight[...], 1e-6)))
    jaxpr = str(jax.make_jaxpr(lambda x: mlp(x, norm=norm))(x))
    assert jaxpr.count("paxkv_cpu_gated_mlp_f32") == 1 and "rsqrt" not in jaxpr
