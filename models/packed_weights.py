"""Projection weights laid out once for the native CPU matmul: PanelWeight, and the state transforms to and from it.

On CPU with the native kernels, an f32 projection weight is stored as pallas_kernels' column panels (one contiguous
run per 48 output columns) instead of [K, N]: every product with it, from one decode row to a 2048-token prefill
chunk, then runs through cpu_panel_matmul, whose reads of the weight overlap its arithmetic (pallas_kernels/
cpu_panel_matmul.py has the measurements). The weight is packed in place of the [K, N] array, never beside it. A tied
embedding [V, D] is stored as the panels of its transpose: the lm_head multiplies them, and a token's vector is read
from them (column t % 48 of panel t // 48), so the table is not kept twice.

With weight quantization "int8" (weight-only, as llama.cpp's Q8_0 or vLLM's W8A16), the panels hold int8 levels and
an f32 scale and min per output column and group of 32 contraction rows (pallas_kernels.quantize_panels_int8; a tied
embedding's columns are tokens, so a token's vector has a scale and min per 32 of its values): 31% of the bytes that
a decode step streams, with f32 activations and sums.

bf16 weights (a model loaded with dtype bfloat16, f32 activations) are stored as bf16 panels where the CPU has
AVX-512 BF16 and no AMX (pallas_kernels.bf16_panels_pay): contraction rows in pairs, which VDPBF16PS multiplies by x
rounded to bf16, the numerics project() gives bf16 weights anyway.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.cpu_panel_matmul import (
    INT8_GROUP_ROWS,
    PANEL_WIDTH,
    dequantized_matrix,
    pack_panels,
    pack_panels_bf16,
    panel_layout_pays,
    quantize_panels_int8,
)

WEIGHT_QUANTIZATIONS = (None, "int8")  # what pack_projections can store the projections as (None: f32 as they are)

# The projections a Llama-family model multiplies as x[T, K] @ weight, by parameter name: how many of the weight's
# leading axes are K (o_proj's [N, H, D] contracts heads and head_dim together).
PROJECTION_CONTRACTED_AXES = {
    "q_proj": 1,
    "k_proj": 1,
    "v_proj": 1,
    "o_proj": 2,
    "gate": 1,
    "up": 1,
    "down": 1,
    "lm_head": 1,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelWeight:
    """A projection weight of `shape` stored as column panels of its [K, N] matrix (K = the product of its first
    `contracted` axes; with `transposed`, the weight is [N, K], a tied embedding whose rows are tokens' vectors): f32,
    int8 with an f32 scale and min per group of 32 contraction rows and column, or bf16 with contraction rows in
    pairs; models.layers.project multiplies it without unpacking on the native CPU path."""

    panels: jax.Array  # f32 or s8[ceil(N / 48), K, 48], or bf16[ceil(N / 48), ceil(K / 2), 48, 2]
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    contracted: int = dataclasses.field(default=1, metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    scales: jax.Array | None = None  # f32[ceil(N / 48), ceil(K / 32), 48] per group and column, int8 panels only
    mins: jax.Array | None = None  # f32[ceil(N / 48), ceil(K / 32), 48] the value of level 0, int8 panels only

    @property
    def dtype(self):
        """The panels' storage dtype (float32, int8 for a quantized weight, or bfloat16)."""
        return self.panels.dtype

    @property
    def depth(self) -> int:
        """K: the product of the contracted axes (a transposed weight's last axis)."""
        return self.shape[1] if self.transposed else math.prod(self.shape[: self.contracted])

    @property
    def columns(self) -> int:
        """N: the product of the weight's axes after the contracted ones (a transposed weight's first axis)."""
        return self.shape[0] if self.transposed else math.prod(self.shape[self.contracted :])

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The axes a product with it gives each row (the weight's own shape after the contracted axes)."""
        return (self.shape[0],) if self.transposed else self.shape[self.contracted :]

    def __getitem__(self, key):
        """`param[...]` (how modules read a parameter) gives the weight itself."""
        if key is not Ellipsis:
            raise TypeError("a PanelWeight is read whole (param[...]); unpack() it to index it")
        return self

    def matrix(self) -> jax.Array:  # [K, N]
        """The weight as the [K, N] matrix that was packed (an int8 weight's dequantized to f32; bf16 stays bf16)."""
        return dequantized_matrix(self.panels, self.columns, self.scales, self.mins, depth=self.depth)

    def unpack(self) -> jax.Array:  # shape
        """The weight in its own shape."""
        return self.matrix().T if self.transposed else self.matrix().reshape(self.shape)


def embedding_rows(embed, tokens: jax.Array) -> jax.Array:  # [T, D]
    """Rows `tokens` of an embedding table stored as an array, or as the PanelWeight of a tied embedding (token t's
    vector is column t % 48 of panel t // 48)."""
    if isinstance(embed, PanelWeight):
        panel, column = tokens // PANEL_WIDTH, tokens % PANEL_WIDTH
        rows = embed.panels[panel, :, column]  # [T, D], or bf16 pairs [T, ceil(D / 2), 2]
        if rows.ndim == 3:
            return rows.reshape(rows.shape[0], -1)[:, : embed.depth]
        if embed.scales is None:
            return rows
        depth = rows.shape[1]
        # f32[T, D] each: token t's group values are column t % 48 of panel t // 48, repeated over each group's rows
        # (gathered before they are repeated: repeating the whole table first cost a one-token step 0.1 ms)
        scales, mins = (
            jnp.repeat(a[panel, :, column], INT8_GROUP_ROWS, axis=1)[:, :depth] for a in (embed.scales, embed.mins)
        )
        return rows.astype(jnp.float32) * scales + mins
    return jnp.take(embed, tokens, axis=0)


def as_matrix(weight, contracted: int):
    """`weight` as a [K, N] matrix for project(), K its first `contracted` axes: a PanelWeight is one already."""
    if isinstance(weight, PanelWeight):
        return weight
    return weight.reshape(math.prod(weight.shape[:contracted]), -1)


@functools.partial(jax.jit, static_argnames=("contracted", "transposed", "quantization"))
def _pack(value: jax.Array, contracted: int, transposed: bool, quantization: str | None):
    """(panels, scales, mins; None for f32 and bf16) of value's [K, N] matrix (of its transpose's: a tied embedding),
    in one program: no intermediate copy of the weight. bf16 values become bf16 panels, in pairs."""
    matrix = value.T if transposed else value.reshape(math.prod(value.shape[:contracted]), -1)
    if quantization == "int8":
        return quantize_panels_int8(matrix)
    return (pack_panels_bf16(matrix) if value.dtype == jnp.bfloat16 else pack_panels(matrix)), None, None


def _packings(state: nnx.State, quantization: str | None, bf16: bool = False):
    """(variable, its PanelWeight) for each f32 projection weight of `state` (PROJECTION_CONTRACTED_AXES, and a tied
    embedding, which is the lm_head too), and each bf16 one with `bf16`, each packed only when the caller asks for
    the next one."""
    if quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"weight quantization {quantization!r} is not supported; use one of {WEIGHT_QUANTIZATIONS}")
    dtypes = (jnp.float32, jnp.bfloat16) if bf16 else (jnp.float32,)
    flat = nnx.to_flat_state(state)
    tied = not any(str(path[-1]) == "lm_head" for path, _ in flat)
    for path, variable in flat:
        value, name = variable.get_value(), str(path[-1])
        if not isinstance(value, jax.Array) or value.dtype not in dtypes:
            continue
        if name in PROJECTION_CONTRACTED_AXES:
            contracted = PROJECTION_CONTRACTED_AXES[name]
            panels, scales, mins = _pack(value, contracted, False, quantization)
            yield variable, PanelWeight(panels, tuple(value.shape), contracted, scales=scales, mins=mins)
        elif name == "embed" and tied and value.ndim == 2:
            panels, scales, mins = _pack(value, 1, True, quantization)
            yield variable, PanelWeight(panels, tuple(value.shape), transposed=True, scales=scales, mins=mins)


def pack_projections(state: nnx.State, quantization: str | None = None, *, bf16: bool = False) -> nnx.State:
    """A new state whose f32 projection weights (and tied embedding) are PanelWeights, the rest as in `state`, which
    keeps its arrays.

    Args:
      state: a model's state.
      quantization: None to keep the weights' f32 values, or "int8" (a scale and min per group and column).
      bf16: pack bf16 projection weights too, as bf16 panels (pallas_kernels.pack_panels_bf16).
    """
    packings = _packings(state, quantization, bf16)
    replaced = {id(variable): variable.replace(panels) for variable, panels in packings}
    return nnx.from_flat_state(
        [(path, replaced.get(id(variable), variable)) for path, variable in nnx.to_flat_state(state)]
    )


def pack_projections_in_place(state: nnx.State, quantization: str | None = None, *, bf16: bool = False) -> None:
    """pack_projections, each variable of `state` given its PanelWeight in turn: a weight's [K, N] array is freed
    before the next one is packed, where nothing else holds it (so packing costs one weight's memory, not a model's)."""
    for variable, panels in _packings(state, quantization, bf16):
        variable.set_value(panels)


def unpacked_state(state: nnx.State) -> nnx.State:
    """`state` with every PanelWeight back in its own shape (what checkpoints store; an int8 one dequantized, a bf16
    one in bf16)."""
    flat = []
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        if isinstance(value, PanelWeight):
            variable = variable.replace(jax.jit(PanelWeight.unpack)(value))
        flat.append((path, variable))
    return nnx.from_flat_state(flat)


def panels_pay_here(native_matmul: bool, mesh: jax.sharding.Mesh | None) -> bool:
    """Whether a model should store its f32 projections as panels: it runs the native CPU kernels, on one device
    (a weight partitioned over a mesh stays as the mesh's [K, N] shards), on a CPU where the layout was measured.

    Args:
      native_matmul: the model runs the native CPU kernels (attention_impl resolved to cpu_native).
      mesh: the mesh its parameters are on, or None for one device.
    """
    return native_matmul and (mesh is None or mesh.devices.size == 1) and panel_layout_pays()


def num_parameters(state: nnx.State) -> int:
    """The weights' count in their own shapes (a PanelWeight's padding columns are not weights)."""
    leaves = jax.tree.leaves(state, is_leaf=lambda leaf: isinstance(leaf, PanelWeight))
    return sum(math.prod(leaf.shape) for leaf in leaves)
