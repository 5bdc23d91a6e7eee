"""The panel layout (pack_panels, models.packed_weights) and the native panel matmul (pallas_kernels/
cpu_panel_matmul.cc) against exact sums, and a model whose projections are stored as panels against the same model
unpacked."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matmul_cases import check_within_summation_error, exact_product, random_case

import models
from models.layers import project
from models.packed_weights import (
    PROJECTION_CONTRACTED_AXES,
    PanelWeight,
    num_parameters,
    pack_projections,
    panels_pay_here,
    unpacked_state,
)
from pallas_kernels import (
    INT8_GROUP_ROWS,
    PANEL_WIDTH,
    bf16_panels_pay,
    dequantized_matrix,
    pack_panels,
    pack_panels_bf16,
    panel_matmul_cpu,
    panel_matmul_reference,
    quantize_panels_int8,
    unpack_panels,
)
from pallas_kernels.native_library import native_kernel_error

needs_native = pytest.mark.skipif(native_kernel_error() is not None, reason="the native CPU kernels do not build here")

# (depth, columns): SmolLM2's 576 -> 192, 576 -> 1536 and 1536 -> 576; columns that leave a padded last panel (50,
# 20); a depth past one deep block of 768 steps in f32 and in bf16 pairs (1700 > 2 * 768), one of 3, and odd ones: 37,
# and 301, whose bf16 pairs x's packing rounds in two pieces (128 pairs, then 23 with a zero in the last).
SHAPES = [(576, 192), (576, 1536), (1536, 576), (200, 50), (1700, 96), (3, 20), (37, 48), (301, 20)]
# One row, a tile's rows minus one and plus one, a decode batch, the most taken all at once (64), one more (chunks of
# 32 rows, deep blocks), and a ragged last chunk.
ROWS = [1, 7, 9, 33, 64, 65, 100]


def _packed(product, pack):
    """product(x, pack(weight), N), called as check_within_summation_error calls a matmul."""

    def call(x, weight, contraction_last=False):
        assert not contraction_last
        return product(x, pack(weight), weight.shape[1])

    return call


_panel_matmul, _panel_reference = _packed(panel_matmul_cpu, pack_panels), _packed(panel_matmul_reference, pack_panels)


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
def test_many_rows_of_a_narrow_weight_split_into_row_ranges_give_each_row_its_own_result():
    """600 rows times 128 columns (3 panels, too few items for the threads) run as row ranges of whole chunks: every
    row bit for bit what it is alone and among a few rows, and within summation error of the exact product."""
    x, weight = random_case(12, 600, 256, 128, "float32", False)
    panels = pack_panels(weight)
    together = np.asarray(panel_matmul_cpu(x, panels, 128))
    np.testing.assert_array_equal(np.asarray(panel_matmul_cpu(x[300:340], panels, 128)), together[300:340])
    for row in (0, 319, 320, 352, 599):  # ranges of 320 rows: the first's first and last, the second's first, ...
        np.testing.assert_array_equal(np.asarray(panel_matmul_cpu(x[row : row + 1], panels, 128))[0], together[row])
    x64, weight64 = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    exact = x64 @ weight64
    bound = 256 * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(weight64))
    assert (np.abs(together - exact) <= bound).all()


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_output_over_4_mib_stored_without_the_cache_is_each_rows_own_result(dtype):
    """2050 x 576 f32 outputs (4.5 MiB: cpu_panel_tiles.h's kStreamOutBytes) store their last block's sums by
    non-temporal stores: 1700 deep (two deep blocks in bf16 pairs, three in f32), with a ragged last chunk. Every row
    is bit for bit what it is in a product of a few rows (stored as usual), and the whole within summation error of the
    exact product."""
    x, weight = random_case(16, 2050, 1700, 576, dtype, False)
    pack = pack_panels if dtype == "float32" else pack_panels_bf16
    panels = pack(weight)
    together = np.asarray(panel_matmul_cpu(x, panels, 576))
    for first in (0, 1000, 2040):
        np.testing.assert_array_equal(
            np.asarray(panel_matmul_cpu(x[first : first + 10], panels, 576)), together[first : first + 10]
        )
    exact, bound = exact_product(x, weight, False)
    assert np.all(np.abs(together - exact) <= bound)


@needs_native
def test_empty_products_are_empty_or_zeros():
    x, weight = random_case(3, 12, 0, 96, "float32", False)
    np.testing.assert_array_equal(np.asarray(_panel_matmul(x, weight)), np.zeros((12, 96), np.float32))
    x, weight = random_case(3, 0, 64, 96, "float32", False)
    assert np.asarray(_panel_matmul(x, weight)).shape == (0, 96)


@needs_native
@pytest.mark.parametrize("rows", [32, 100])
def test_a_partial_last_panel_is_written_by_the_kernel_with_no_slice_after_it(rows):
    """32000 columns (a Llama 2 vocabulary) leave the last of 667 panels a third full: the kernel writes the [T, 32000]
    output itself, so no XLA slice (a copy of the whole output) follows the call, and every column, the partial panel's
    too, is the product's."""
    x, weight = random_case(11, rows, 64, 32000, "float32", False)
    panels = pack_panels(weight)
    assert panels.shape[0] * PANEL_WIDTH == 32016
    program = jax.make_jaxpr(lambda x, p: panel_matmul_cpu(x, p, 32000))(x, panels)
    assert [eqn.primitive.name for eqn in program.eqns] == ["ffi_call"]
    out = np.asarray(panel_matmul_cpu(x, panels, 32000))
    exact, bound = exact_product(x, weight, False)
    assert out.shape == (rows, 32000)
    assert np.all(np.abs(out - exact) <= bound)


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


def test_only_native_models_on_one_device_are_packed_and_bf16_ones_where_the_cpu_has_avx512_bf16_alone():
    assert not panels_pay_here(False, None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    assert panels_pay_here(True, mesh) == panels_pay_here(True, None)
    bf16 = models.load(None, dtype="bfloat16", attention_impl="cpu_native", require_tokenizer=False)
    before = jax.tree.leaves(bf16.state)
    bf16.pack_for_native_matmul()
    after = jax.tree.leaves(bf16.state, is_leaf=lambda leaf: isinstance(leaf, PanelWeight))
    gate = dict(nnx.to_flat_state(bf16.state))[("layers", 0, "mlp", "gate")].get_value()
    if panels_pay_here(True, None) and bf16_panels_pay():
        assert isinstance(gate, PanelWeight) and gate.dtype == jnp.bfloat16
    else:  # nothing to pack here: the state keeps its arrays
        assert all(a is b for a, b in zip(before, after, strict=True))
    avx512 = frozenset({"avx512f"})
    assert bf16_panels_pay(avx512 | {"avx512_bf16"}) == (native_kernel_error() is None)
    assert not bf16_panels_pay(avx512 | {"avx512_bf16", "amx_bf16"})  # AMX's kernel and XLA's AMX matmuls instead
    assert not bf16_panels_pay(avx512)


def test_bf16_packing_pairs_contraction_rows_and_unpacks_exactly():
    """Element [p, k, c, j] is w[2k + j, 48p + c]: an odd depth gets a zero row, and columns pad to whole panels."""
    weight = jnp.asarray(np.arange(5 * 100).reshape(5, 100), jnp.bfloat16)  # integers below 256: exact in bf16
    panels = np.asarray(pack_panels_bf16(weight).astype(jnp.float32))
    assert panels.shape == (3, 3, PANEL_WIDTH, 2)
    w = np.asarray(weight.astype(jnp.float32))
    assert panels[1, 2, 5, 0] == w[4, 53] and panels[0, 1, 7, 1] == w[3, 7] and panels[2, 0, 3, 1] == w[1, 99]
    np.testing.assert_array_equal(panels[:, 2, :, 1], 0)  # the padding row
    np.testing.assert_array_equal(panels[2, :, 100 - 2 * PANEL_WIDTH :], 0)  # the padding columns
    np.testing.assert_array_equal(np.asarray(unpack_panels(pack_panels_bf16(weight), 100, depth=5)), weight)


@needs_native
def test_bf16_panels_are_within_f32_summation_error_of_the_exact_product_of_x_rounded_to_bf16():
    """Every shape (odd depths 3 and 37 among them) and row count, and the jnp reference, against x rounded to bf16
    times the bf16 weight in float64."""
    matmul, reference = _packed(panel_matmul_cpu, pack_panels_bf16), _packed(panel_matmul_reference, pack_panels_bf16)
    check_within_summation_error(matmul, reference, SHAPES, ROWS, "bfloat16", contraction_last=False, seed_stride=1000)


@needs_native
def test_a_bf16_rows_result_does_not_depend_on_the_other_rows():
    """Batch invariance with bf16 panels, bit for bit: one row, a few-row block, the chunked deep blocks."""
    x, weight = random_case(14, 100, 1536, 576, "bfloat16", False)
    panels = pack_panels_bf16(weight)
    together = np.asarray(panel_matmul_cpu(x, panels, 576))
    np.testing.assert_array_equal(np.asarray(panel_matmul_cpu(x[:40], panels, 576)), together[:40])
    for row in (0, 7, 8, 31, 32, 39, 99):
        alone = np.asarray(panel_matmul_cpu(x[row : row + 1], panels, 576))
        np.testing.assert_array_equal(alone[0], together[row])


@needs_native
def test_bf16_panels_of_the_wrong_depth_are_refused():
    x, weight = random_case(15, 4, 64, 96, "bfloat16", False)
    with pytest.raises(ValueError, match="ceil"):
        panel_matmul_cpu(x[:, :62], pack_panels_bf16(weight), 96)  # 31 pairs of x against 32 of the panels
    with pytest.raises(ValueError, match="ceil"):
        panel_matmul_cpu(x, pack_panels_bf16(weight).reshape(2, 32, 96), 96)  # unpaired


def _int8_case(seed: int, rows: int, depth: int, columns: int):
    """x f32[rows, depth], a weight's int8 panels, scales and mins, the exact product with the dequantized weight (in
    float64), and the f32 error bound (depth + 3) * eps * (|x| @ (|q| * scale + |min|)): a group's two sums (at most
    32 terms each), the two multiply-adds that take it into the total, and the sum over groups."""
    x, weight = random_case(seed, rows, depth, columns, "float32", False)
    panels, scales, mins = quantize_panels_int8(weight)
    levels = np.asarray(unpack_panels(panels, columns), np.float64)  # the int8 values, [K, N]
    row_scales, row_mins = (
        np.repeat(np.asarray(unpack_panels(a, columns), np.float64), INT8_GROUP_ROWS, axis=0)[:depth]
        for a in (scales, mins)
    )
    x64 = np.asarray(x, np.float64)
    magnitude = np.abs(x64) @ (np.abs(levels) * row_scales + np.abs(row_mins))
    bound = (depth + 3) * np.finfo(np.float32).eps * magnitude
    return x, (panels, scales, mins), x64 @ (levels * row_scales + row_mins), bound


def test_int8_quantization_spans_each_group_in_256_levels():
    """A scale and min per group of 32 contraction rows and column (70 rows: groups of 32, 32 and 6): level -128 is the
    group's min and 127 its max, every value within half a step of its level; a constant group has scale 0 and comes
    back exactly; an outlier widens only its own group; padding columns are zeros. A weight already on a 4-bit grid per
    32-row block (GGUF Q4_1's d * q + m) comes back within f32 rounding."""
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((70, 100)).astype(np.float32) * np.linspace(0.01, 3.0, 100, dtype=np.float32)
    weight[:, 17] = 0.25
    weight[5, 40] = 50.0
    panels, scales, mins = quantize_panels_int8(jnp.asarray(weight))
    assert panels.dtype == jnp.int8 and panels.shape == (3, 70, PANEL_WIDTH)
    assert scales.shape == mins.shape == (3, 3, PANEL_WIDTH)  # laid out as the panels: [P, G, 48]
    scales, mins = (np.asarray(unpack_panels(a, 3 * PANEL_WIDTH)) for a in (scales, mins))  # [G, N']
    levels = np.asarray(unpack_panels(panels, 100)).astype(np.float64)
    for g, rows in enumerate((slice(0, 32), slice(32, 64), slice(64, 70))):
        group = weight[rows].astype(np.float64)
        np.testing.assert_allclose(scales[g, :100], (group.max(axis=0) - group.min(axis=0)) / 255, rtol=1e-5)
        spanned = scales[g, :100] > 0
        assert np.all(levels[rows].min(axis=0)[spanned] == -128) and np.all(levels[rows].max(axis=0)[spanned] == 127)
    assert np.all(scales[:, 17] == 0) and np.all(levels[:, 17] == -128) and np.all(mins[:, 17] == np.float32(0.25))
    assert scales[0, 40] > 50.0 / 255 and scales[1, 40] < 3.0 * 8 / 255
    assert np.all(scales[:, 100:] == 0) and np.all(mins[:, 100:] == 0)
    row_scales, row_mins = (np.repeat(a[:, :100], INT8_GROUP_ROWS, axis=0)[:70] for a in (scales, mins))
    assert np.all(np.abs(levels * row_scales + row_mins - weight) <= row_scales / 2 * (1 + 1e-4) + 1e-6)
    np.testing.assert_array_equal(np.asarray(panels)[2, :, 100 - 2 * PANEL_WIDTH :], 0)  # padding columns
    # A Q4_1-like weight: each 32-row block of a column is d * q + m for q in 0..15 (all 16 levels used).
    step = rng.uniform(0.01, 0.1, (2, 1, 50))
    low = rng.uniform(-1, 0, (2, 1, 50))
    grid = np.stack([rng.permutation(np.tile(np.arange(16), 2)) for _ in range(100)], axis=1).T.reshape(2, 50, 32)
    q4 = (low + step * grid.transpose(0, 2, 1)).reshape(64, 50).astype(np.float32)
    q4_panels, q4_scales, q4_mins = quantize_panels_int8(jnp.asarray(q4))
    back = np.asarray(dequantized_matrix(q4_panels, 50, q4_scales, q4_mins))
    np.testing.assert_allclose(back, q4, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(q4).max())


@needs_native
def test_int8_rows_of_a_narrow_weight_split_into_row_ranges_give_each_row_its_own_result():
    """The row ranges of test_many_rows_of_a_narrow_weight_... with int8 panels: rows across a range boundary bit for
    bit as alone, and the whole product within the int8 bound."""
    x, (panels, scales, mins), exact, bound = _int8_case(13, 600, 256, 128)
    together = np.asarray(panel_matmul_cpu(x, panels, 128, scales, mins))
    assert np.all(np.abs(together - exact) <= bound)
    for row in (0, 319, 320, 599):
        alone = np.asarray(panel_matmul_cpu(x[row : row + 1], panels, 128, scales, mins))
        np.testing.assert_array_equal(alone[0], together[row])


@needs_native
def test_int8_panels_are_within_f32_error_of_the_exact_product_with_the_dequantized_weight():
    """Every shape and row count (the few-row path's register groups, the chunked path's group blocks), and the jnp
    reference, against x @ (levels * scales + mins) in float64."""
    for index, (depth, columns) in enumerate(SHAPES):
        for rows in ROWS:
            x, (panels, scales, mins), exact, bound = _int8_case(index * 1000 + rows, rows, depth, columns)
            out = np.asarray(panel_matmul_cpu(x, panels, columns, scales, mins))
            assert out.shape == (rows, columns)
            assert np.all(np.abs(out - exact) <= bound), (depth, columns, rows)
        expected = np.asarray(panel_matmul_reference(x, panels, columns, scales, mins))
        assert np.all(np.abs(expected - exact) <= bound), (depth, columns)


@needs_native
def test_an_int8_rows_result_does_not_depend_on_the_other_rows():
    """Batch invariance with int8 panels, bit for bit, as for f32 ones: under 8 rows (register groups, 4-row tiles and
    the rest) and from 8 rows on (a block per group, 8-row tiles, chunked past 64 rows) do the same operations in the
    same order."""
    x, (panels, scales, mins), _, _ = _int8_case(12, 100, 1536, 576)
    together = np.asarray(panel_matmul_cpu(x, panels, 576, scales, mins))
    np.testing.assert_array_equal(np.asarray(panel_matmul_cpu(x[:40], panels, 576, scales, mins)), together[:40])
    np.testing.assert_array_equal(np.asarray(panel_matmul_cpu(x[:5], panels, 576, scales, mins)), together[:5])
    for row in (0, 3, 4, 7, 8, 39, 99):
        alone = np.asarray(panel_matmul_cpu(x[row : row + 1], panels, 576, scales, mins))
        np.testing.assert_array_equal(alone[0], together[row])


@needs_native
def test_int8_panels_without_their_scales_or_f32_panels_with_scales_are_refused():
    x, (panels, scales, mins), _, _ = _int8_case(13, 4, 64, 96)
    with pytest.raises(ValueError, match="scales and mins"):
        panel_matmul_cpu(x, panels, 96)
    with pytest.raises(ValueError, match="scales and mins"):
        panel_matmul_cpu(x, panels, 96, scales)
    with pytest.raises(ValueError, match="scales and mins"):
        panel_matmul_cpu(x, panels, 96, scales[:1], mins[:1])
    with pytest.raises(ValueError, match="scales and mins"):
        panel_matmul_cpu(x, pack_panels(jnp.ones((64, 96))), 96, scales, mins)


def _as_matrix(path, value: np.ndarray) -> np.ndarray:
    """A packed parameter as the [K, N] matrix its panels hold (a tied embedding's transpose: a column per token)."""
    name = str(path[-1])
    if name == "embed":
        return value.T
    contracted = PROJECTION_CONTRACTED_AXES[name]
    return value.reshape(math.prod(value.shape[:contracted]), -1)


@needs_native
@pytest.mark.parametrize("tied", [False, True], ids=["own_lm_head", "tied_embedding"])
def test_an_int8_model_computes_exactly_its_dequantized_weights(tiny_llama_checkpoint, tied):
    """models.load(quantization="int8"): every projection (and the tied embedding, whose token rows are scaled too)
    is int8 panels. Its logits equal, within f32 rounding, those of the f32 model whose weights are the dequantized
    ones (the same values, multiplied by XLA), and its greedy tokens are the same; those dequantized weights lie
    within half a step of the originals. The engine's greedy tokens equal the model's own paged decoding."""
    checkpoint = tiny_llama_checkpoint(max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=tied)
    original = models.load(checkpoint, attention_impl="cpu_native", require_tokenizer=False)
    quantized = models.load(checkpoint, attention_impl="cpu_native", require_tokenizer=False, quantization="int8")
    assert quantized.quantization == "int8"
    flat = dict(nnx.to_flat_state(quantized.state))
    gate, embed = (flat[path].get_value() for path in [("layers", 0, "mlp", "gate"), ("embed",)])
    assert isinstance(gate, PanelWeight) and gate.dtype == jnp.int8 and gate.scales is not None
    assert isinstance(embed, PanelWeight) == tied
    dequantized = models.LoadedModel(**{**quantized.__dict__, "state": unpacked_state(quantized.state)})
    originals = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(original.state)}
    for path, variable in nnx.to_flat_state(dequantized.state):
        value, before = np.asarray(variable.get_value()), originals[path]
        if not isinstance(flat[path].get_value(), PanelWeight):
            np.testing.assert_array_equal(value, before)
            continue
        value, before = _as_matrix(path, value), _as_matrix(path, before)  # [K, N]: levels per group and column
        groups = np.arange(before.shape[0]) // INT8_GROUP_ROWS
        spans = [np.ptp(before[groups == g], axis=0) for g in groups]  # each row's group's range
        step = np.stack(spans) / 255
        assert np.all(np.abs(value - before) <= step / 2 * (1 + 1e-4) + 1e-6), path
    ids = [5, 17, 99, 3, 42, 7, 255, 0]
    np.testing.assert_allclose(quantized.score(ids), dequantized.score(ids), rtol=0, atol=1e-4)
    tokens = quantized.greedy_generate(ids, 8, stop_at_eos=False)
    assert dequantized.greedy_generate(ids, 8, stop_at_eos=False) == tokens
    from paxkv import LLM, SamplingParams

    llm = LLM(
        checkpoint,
        attention_impl="cpu_native",
        quantization="int8",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 22,
    )
    output = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert list(output[0].outputs[0].token_ids) == tokens


def test_quantization_that_cannot_run_here_is_refused_naming_the_fix(tiny_llama_checkpoint):
    checkpoint = tiny_llama_checkpoint()
    with pytest.raises(ValueError, match="dtype='float32'"):
        models.load(checkpoint, dtype="bfloat16", quantization="int8", require_tokenizer=False)
    with pytest.raises(ValueError, match="native CPU matmul.*Drop the quantization"):
        models.load(checkpoint, attention_impl="xla", quantization="int8", require_tokenizer=False)
    with pytest.raises(ValueError, match="'none' or 'int8'"):
        models.load(checkpoint, quantization="int4", require_tokenizer=False)


@needs_native
@pytest.mark.parametrize("tied", [False, True], ids=["own_lm_head", "tied_embedding"])
def test_a_bf16_model_packed_as_bf16_panels_follows_the_same_model_unpacked(tiny_llama_checkpoint, tied):
    """bf16 weights as bf16 panels (every projection, and the tied embedding, whose token rows the lookup reads from
    the pairs): the same greedy tokens as the unpacked bf16 model, logits within the summation-order differences
    that bf16 rounding of the next layer's activations can amplify, and the original arrays back on unpacking."""
    checkpoint = tiny_llama_checkpoint(max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=tied)
    loaded = models.load(checkpoint, dtype="bfloat16", attention_impl="cpu_native", require_tokenizer=False)
    ids = [5, 17, 99, 3, 42, 7, 255, 0]
    logits = loaded.score(ids)
    tokens = loaded.greedy_generate(ids, 8, stop_at_eos=False)
    packed = models.LoadedModel(**{**loaded.__dict__, "state": pack_projections(loaded.state, bf16=True)})
    flat = dict(nnx.to_flat_state(packed.state))
    gate, embed = (flat[path].get_value() for path in [("layers", 0, "mlp", "gate"), ("embed",)])
    assert isinstance(gate, PanelWeight) and gate.dtype == jnp.bfloat16 and gate.panels.shape == (3, 32, 48, 2)
    assert isinstance(embed, PanelWeight) == tied
    packed_logits = packed.score(ids)
    relative = np.linalg.norm(packed_logits - logits) / np.linalg.norm(logits)
    assert relative < 2**-9, relative
    assert packed.greedy_generate(ids, 8, stop_at_eos=False) == tokens
    originals = dict(nnx.to_flat_state(loaded.state))
    for path, restored in nnx.to_flat_state(unpacked_state(packed.state)):
        restored, original = restored.get_value(), originals[path].get_value()
        assert restored.dtype == original.dtype
        np.testing.assert_array_equal(np.asarray(restored, np.float32), np.asarray(original, np.float32), str(path))
