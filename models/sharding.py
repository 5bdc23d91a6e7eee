"""Logical parameter axes, and the one table that maps them onto a ("data", "model") mesh."""

import logging

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axis -> mesh axis. Tensor parallelism splits heads, MLP width and vocab over "model".
DEFAULT_SHARDING_RULES: dict[str, str | None] = {
    "vocab": "model",
    "embed": None,
    "q_heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
}


def logical_partition_spec(
    logical_axes, shape, mesh: Mesh, rules: dict[str, str | None], *, name: str = ""
) -> PartitionSpec:
    """Map one parameter's logical axes to a PartitionSpec, replicating dims the mesh cannot split."""
    spec = []
    used = set()
    for axis_name, size in zip(logical_axes, shape, strict=True):
        mesh_axis = rules.get(axis_name) if axis_name is not None else None
        if mesh_axis is None:
            spec.append(None)
            continue
        if mesh_axis in used:
            raise ValueError(f"{name}: two logical axes map to mesh axis {mesh_axis!r}; fix the sharding rules")
        if size % mesh.shape[mesh_axis]:
            logging.info(
                "%s: dim %s of size %d does not divide mesh axis %s=%d; replicating it",
                name,
                axis_name,
                size,
                mesh_axis,
                mesh.shape[mesh_axis],
            )
            spec.append(None)
            continue
        used.add(mesh_axis)
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: dict[str, str | None] | None = None) -> nnx.State:
    """A NamedSharding for every variable of a model state, from its `logical_axes` metadata.

    Args:
      abstract_state: the (abstract or concrete) state of an NNX model.
      mesh: the device mesh.
      rules: logical axis -> mesh axis; DEFAULT_SHARDING_RULES when None.
    """
    rules = DEFAULT_SHARDING_RULES if rules is None else rules

    def sharding_of(path, variable):
        axes = variable.get_metadata().get("logical_axes")
        shape = variable.get_value().shape
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        name = "/".join(str(p) for p in path)
        return NamedSharding(mesh, logical_partition_spec(axes, shape, mesh, rules, name=name))

    return nnx.map_state(sharding_of, abstract_state)


def with_shardings(abstract_state: nnx.State, shardings: nnx.State) -> nnx.State:
    """Attach shardings to an abstract state's ShapeDtypeStructs (orbax restores onto them)."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_state,
        shardings,
    )
