"""The panel layout (pack_panels, models.packed_weights) and the native panel matmul (pallas_kernels/
cpu_panel_matmul.cc) against exact sums, and a model whose projections are stored as panels against the same model
unpacked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matmul_cases import check_within_summation_error, random_case

import models
from models.layers import project
from models.packed_weights import PanelWeight, num_parameters, pack_projections, panels_pay_here, unpacked_state
from pallas_kernels import PANEL_WIDTH, pack_panels, panel_matmul_cpu, panel_matmul_reference, unpack_panels
from pallas_kernels.native_library import native_kernel_error

needs_native = pytest.mark.skipif(native_kernel_error() is not None, reason="the native CPU kernels do not build here")

# (depth, columns): SmolLM2's 576 -> 192, 576 -> 1536 and 1536 -> 576; columns that leave a padded last panel (50,
# 20); a depth past one deep block (700 > 576) and one of 3.
SHAPES = [(576, 192), (576, 1536), (1536, 576), (200, 50), (700, 96), (3, 20), (37, 48)]
# One row, a tile's rows minus one and plus one, a decode batch, the most taken all at once (64), one more (chunks of
# 32 rows, deep blocks), and a ragged last chunk.
ROWS = [1, 7, 9, 33, 64, 65, 100]


def _panel_matmul(x, weight, contraction_last=False):
    assert not contraction_last
    return panel_matmul_cpu(x, pack_panels(weight), weight.shape[1])


def _panel_reference(x, weight, contraction_last=False):
    assert not contraction_last
    return panel_matmul_reference(x, pack_panels(weight), weight.shape[1])


def test_packing_lays_each_48_columns_out_as_one_panel_and_unpacks_exactly():
    weight = np.arange(5 * 100, dtype=np.float32).reshape(5, 100)
    panels = np.asarray(pack_panels(jnp.asarray(weight)))
    assert panels.shape == (3, 5, PANEL_WIDTH)
    for p in range(3):
        width = min(PANEL_WIDTH, 100 - p * PANEL_WIDTH)
        np.testing.assert_array_equal(panels[p, :, :width], weight[:, p * PANEL_WIDTH : p * PANEL_WIDTH + width])
        np.testing.assert_array_equal(panels[p, :, width:], 0.0)  # the padding columns
    np.testing.assert_array_equal(np.asarray(unpack_panels(jnp.asarray(panels), 100)), weight)


@needs_native
def test_every_row_count_and_shape_is_within_f32_summation_error_of_the_exact_product():
    check_within_summation_error(
        _panel_matmul, _panel_reference, SHAPES, ROWS, "float32", contraction_last=False, seed_stride=1000
    )


@needs_native
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Bit for bit, alone and among up to 100 rows (the few-row path's blocks and the chunked deep blocks alike):
    each output sums over K in one order whatever else is in the batch (batch invariance)."""
    x, weight = random_case(11, 100, 1536, 576, "float32", False)
    panels = pack_panels(weight)
    together = np.asarray(panel_matmul_cpu(x, panels, 576))
    few = np.asarray(panel_matmul_cpu(x[:40], panels, 576))
    np.testing.assert_array_equal(few, together[:40])
    for row in (0, 7, 8, 31, 32, 39, 99):  # tiles' first and last rows, a chunk's, the ragged last tile's
        alone = np.asarray(panel_matmul_cpu(x[row : row + 1], panels, 576))
        np.testing.assert_array_equal(alone[0], together[row])


@needs_native
def test_empty_products_are_empty_or_zeros():
    x, weight = random_case(3, 12, 0, 96, "float32", False)
    np.testing.assert_array_equal(np.asarray(_panel_matmul(x, weight)), np.zeros((12, 96), np.float32))
    x, weight = random_case(3, 0, 64, 96, "float32", False)
    assert np.asarray(_panel_matmul(x, weight)).shape == (0, 96)


@needs_native
def test_operands_that_are_not_f32_panels_are_refused_naming_the_layout():
    x, weight = random_case(5, 4, 64, 96, "float32", False)
    with pytest.raises(ValueError, match="panels"):
        panel_matmul_cpu(x, weight, 96)  # [K, N], not packed
    with pytest.raises(ValueError, match="panels"):
        panel_matmul_cpu(x, pack_panels(weight).astype(jnp.bfloat16), 96)
    with pytest.raises(ValueError, match="does not fit"):
        panel_matmul_cpu(x, pack_panels(weight), 97)


@needs_native
@pytest.mark.parametrize("native", [True, False], ids=["panel_kernel", "xla_unpacked"])
def test_project_multiplies_a_panel_weight_as_the_array_it_packed(native):
    """Both paths of project(): the kernel, and XLA over the unpacked matrix where the native kernels may not run;
    a 3-axis weight keeps its output axes, and o_proj's two contracted axes (as_matrix) too."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((64, 3, 20)), jnp.float32)
    packed = PanelWeight(pack_panels(weight.reshape(64, 60)), (64, 3, 20), 1)
    expected = np.einsum("td,dnh->tnh", np.asarray(x, np.float64), np.asarray(weight, np.float64))
    out = np.asarray(jax.jit(lambda x, w: project("TD,DNH->TNH", x, w, native=native))(x, packed))
    assert out.shape == (9, 3, 20)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(packed.unpack()), np.asarray(weight))
    with pytest.raises(ValueError, match="leading axes"):
        project("TD,ND->TN", x, PanelWeight(pack_panels(weight.reshape(64, 60).T), (60, 64), 1), native=native)


@needs_native
@pytest.mark.parametrize("tied", [False, True], ids=["own_lm_head", "tied_embedding"])
def test_a_model_packed_for_the_native_matmul_scores_and_generates_as_unpacked(tiny_llama_checkpoint, tied):
    """The tiny Llama (its 64 and 128 columns padded to whole panels) with every projection as panels, and its lm_head:
    its own, or the tied embedding's transpose, whose panels the token lookup reads too. The same greedy tokens, and
    logits within f32 rounding, as the same weights unpacked; unpacking gives the original arrays back bit for bit;
    the weights count the same."""
    checkpoint = tiny_llama_checkpoint(max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=tied)
    loaded = models.load(checkpoint, attention_impl="cpu_native", require_tokenizer=False)
    original = {path: np.asarray(variable.get_value()) for path, variable in nnx.to_flat_state(loaded.state)}
    ids = [5, 17, 99, 3, 42, 7, 255, 0]  # the first and last tokens of the vocabulary too
    logits = loaded.score(ids)
    tokens = loaded.greedy_generate(ids, 8, stop_at_eos=False)
    packed = models.LoadedModel(**{**loaded.__dict__, "state": pack_projections(loaded.state)})
    assert all(isinstance(v.get_value(), jax.Array) for _, v in nnx.to_flat_state(loaded.state))  # left as it was
    flat = dict(nnx.to_flat_state(packed.state))
    gate, embed = (flat[path].get_value() for path in [("layers", 0, "mlp", "gate"), ("embed",)])
    assert isinstance(gate, PanelWeight) and gate.shape == (64, 128) and not gate.transposed
    if tied:
        assert isinstance(embed, PanelWeight) and embed.transposed and embed.shape == (256, 64)
    else:
        assert isinstance(flat[("lm_head",)].get_value(), PanelWeight)
        assert isinstance(embed, jax.Array)  # only a lookup table: stays as it is
    np.testing.assert_allclose(packed.score(ids), logits, rtol=0, atol=1e-4)
    assert packed.greedy_generate(ids, 8, stop_at_eos=False) == tokens
    assert num_parameters(packed.state) == num_parameters(loaded.state)
    # What an engine does at start: the same packing, into the model's own variables.
    assert loaded.pack_for_native_matmul() == panels_pay_here(True, None)
    if panels_pay_here(True, None):
        assert isinstance(dict(nnx.to_flat_state(loaded.state))[("layers", 0, "mlp", "gate")].get_value(), PanelWeight)
    for state in (packed.state, loaded.state if panels_pay_here(True, None) else packed.state):
        for path, restored in nnx.to_flat_state(unpacked_state(state)):
            np.testing.assert_array_equal(np.asarray(restored.get_value()), original[path], str(path))


def test_only_native_f32_models_on_one_device_are_packed():
    assert not panels_pay_here(False, None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    assert panels_pay_here(True, mesh) == panels_pay_here(True, None)
    bf16 = models.load(None, dtype="bfloat16", attention_impl="cpu_native", require_tokenizer=False)
    before = jax.tree.leaves(bf16.state)
    bf16.pack_for_native_matmul()  # nothing f32 to pack: the state keeps its arrays
    assert all(a is b for a, b in zip(before, jax.tree.leaves(bf16.state), strict=True))
