"""Projection weights laid out once for the native CPU matmul: PanelWeight, and the state transforms to and from it.

On CPU with the native kernels, an f32 projection weight is stored as pallas_kernels' column panels (one contiguous
run per 48 output columns) instead of [K, N]: every product with it, from one decode row to a 2048-token prefill
chunk, then runs through cpu_panel_matmul, whose reads of the weight overlap its arithmetic (pallas_kernels/
cpu_panel_matmul.py has the measurements). The weight is packed in place of the [K, N] array, never beside it. A tied
embedding [V, D] is stored as the panels of its transpose: the lm_head multiplies them, and a token's vector is read
from them (column t % 48 of panel t // 48), so the table is not kept twice.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.cpu_panel_matmul import PANEL_WIDTH, pack_panels, panel_layout_pays, unpack_panels

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
    """A projection weight of `shape` stored as f32 column panels of its [K, N] matrix (K = the product of its first
    `contracted` axes; with `transposed`, the weight is [N, K], a tied embedding whose rows are tokens' vectors);
    models.layers.project multiplies it without unpacking on the native CPU path."""

    panels: jax.Array  # f32[ceil(N / 48), K, 48]
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    contracted: int = dataclasses.field(default=1, metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def dtype(self):
        """The weight's dtype (the panels')."""
        return self.panels.dtype

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
        """The weight as the [K, N] matrix that was packed."""
        return unpack_panels(self.panels, self.columns)

    def unpack(self) -> jax.Array:  # shape
        """The weight in its own shape."""
        return self.matrix().T if self.transposed else self.matrix().reshape(self.shape)


def embedding_rows(embed, tokens: jax.Array) -> jax.Array:  # [T, D]
    """Rows `tokens` of an embedding table stored as an array, or as the PanelWeight of a tied embedding (token t's
    vector is column t % 48 of panel t // 48)."""
    if isinstance(embed, PanelWeight):
        return embed.panels[tokens // PANEL_WIDTH, :, tokens % PANEL_WIDTH]
    return jnp.take(embed, tokens, axis=0)


def as_matrix(weight, contracted: int):
    """`weight` as a [K, N] matrix for project(), K its first `contracted` axes: a PanelWeight is one already."""
    if isinstance(weight, PanelWeight):
        return weight
    return weight.reshape(math.prod(weight.shape[:contracted]), -1)


@functools.partial(jax.jit, static_argnames=("contracted", "transposed"))
def _pack(value: jax.Array, contracted: int, transposed: bool) -> jax.Array:
    """pack_panels of value's [K, N] matrix (of its transpose's: a tied embedding), in one program: no intermediate
    copy of the weight."""
    matrix = value.T if transposed else value.reshape(math.prod(value.shape[:contracted]), -1)
    return pack_panels(matrix)


def _packings(state: nnx.State):
    """(variable, its PanelWeight) for each f32 projection weight of `state` (PROJECTION_CONTRACTED_AXES, and a tied
    embedding, which is the lm_head too), each packed only when the caller asks for the next one."""
    flat = nnx.to_flat_state(state)
    tied = not any(str(path[-1]) == "lm_head" for path, _ in flat)
    for path, variable in flat:
        value, name = variable.get_value(), str(path[-1])
        if not isinstance(value, jax.Array) or value.dtype != jnp.float32:
            continue
        if name in PROJECTION_CONTRACTED_AXES:
            contracted = PROJECTION_CONTRACTED_AXES[name]
            yield variable, PanelWeight(_pack(value, contracted, False), tuple(value.shape), contracted)
        elif name == "embed" and tied and value.ndim == 2:
            yield variable, PanelWeight(_pack(value, 1, True), tuple(value.shape), transposed=True)


def pack_projections(state: nnx.State) -> nnx.State:
    """A new state whose f32 projection weights (and tied embedding) are PanelWeights, the rest as in `state`, which
    keeps its arrays."""
    replaced = {id(variable): variable.replace(panels) for variable, panels in _packings(state)}
    return nnx.from_flat_state(
        [(path, replaced.get(id(variable), variable)) for path, variable in nnx.to_flat_state(state)]
    )


def pack_projections_in_place(state: nnx.State) -> None:
    """pack_projections, each variable of `state` given its PanelWeight in turn: a weight's [K, N] array is freed
    before the next one is packed, where nothing else holds it (so packing costs one weight's memory, not a model's)."""
    for variable, panels in _packings(state):
        variable.set_value(panels)


def unpacked_state(state: nnx.State) -> nnx.State:
    """`state` with every PanelWeight back in its own shape (what checkpoints store)."""
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
