"""Logical parameter axes, the one table that maps them onto a ("data", "model") mesh, and attention on a mesh."""

import functools
import logging

import jax
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import heads_split, paged_attention, pool_partition_spec

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
    """Map one parameter's logical axes to a PartitionSpec, replicating dims the mesh cannot split.

    Args:
      logical_axes: one logical axis name (or None) per dimension.
      shape: the parameter's shape.
      mesh: the device mesh.
      rules: logical axis -> mesh axis.
      name: the parameter's path, for logs and errors.
    """
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


def state_shardings(
    abstract_state: nnx.State, mesh: Mesh, rules: dict[str, str | None] | None = None
) -> dict[tuple, NamedSharding]:
    """A NamedSharding for every variable of a model state, from its `logical_axes` metadata.

    Args:
      abstract_state: the (abstract or concrete) state of an NNX model.
      mesh: the device mesh.
      rules: logical axis -> mesh axis; DEFAULT_SHARDING_RULES when None.
    Returns:
      state path -> sharding, for every variable.
    """
    rules = DEFAULT_SHARDING_RULES if rules is None else rules
    shardings = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        axes = variable.get_metadata().get("logical_axes")
        if axes is None:
            spec = PartitionSpec()
        else:
            name = "/".join(str(p) for p in path)
            spec = logical_partition_spec(axes, variable.get_value().shape, mesh, rules, name=name)
        shardings[path] = NamedSharding(mesh, spec)
    return shardings


def restore_target(abstract_state: nnx.State, shardings: dict[tuple, jax.sharding.Sharding]) -> dict:
    """The nested dict of sharded ShapeDtypeStructs that orbax restores onto.

    Args:
      abstract_state: the model's abstract state.
      shardings: state path -> sharding (see state_shardings).
    """
    target = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        value = variable.get_value()
        target[path] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=shardings[path])
    return traverse_util.unflatten_dict(target)


def unpartitioned_here() -> bool:
    """No automatic mesh axis over more than one device where this is traced (an array could be split there, which a
    native CPU kernel cannot take; shard_map'd steps are manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not any(mesh.shape[axis] > 1 for axis in mesh.axis_names if axis not in mesh.manual_axes)


def attention_on_mesh(q, k, v, kv_pages, metadata, *, attention_impl: str, **options):
    """paged_attention, run per model shard under shard_map when a kernel (Pallas, or the native CPU one) meets a
    mesh.

    The XLA path is plain jnp, which the compiler partitions by itself. A kernel is one opaque call
    that the partitioner would feed whole (gathering the pool onto every device), and that libtpu refuses to
    partition at all, so under a context mesh (jax.set_mesh) each shard runs the kernel on its own KV heads:
    q, k, v and the pool's head axis split on "model" when the KV heads divide it, else everything is
    replicated and each shard attends over all heads.

    Args:
      q, k, v, kv_pages, metadata: as pallas_kernels.paged_attention.
      attention_impl: a resolved implementation name (models.load resolves it once); options: sm_scale,
        sliding_window, soft_cap.
    """
    call = functools.partial(paged_attention, attention_impl=attention_impl, **options)
    mesh = jax.sharding.get_abstract_mesh()
    # Mosaic and Triton calls must see no automatic axis at all, even one of size 1: every axis not already
    # manual (inside a data-parallel step "data" is) goes manual here.
    automatic = [name for name in mesh.axis_names if name not in mesh.manual_axes]
    if attention_impl == "xla" or mesh.empty or not automatic:
        return call(q, k, v, kv_pages, metadata)
    num_kv_heads = k.shape[1]
    heads = "model" if "model" in automatic and heads_split(num_kv_heads, mesh.shape["model"]) else None
    per_token = PartitionSpec(None, heads, None)  # [T, heads, D]
    pages = pool_partition_spec(kv_pages, page_axis=None, head_axis=heads)
    metadata_spec = jax.tree.map(lambda _: PartitionSpec(), metadata)
    sharded = jax.shard_map(
        call,
        in_specs=(per_token, per_token, per_token, pages, metadata_spec),
        out_specs=(per_token, pages),
        axis_names=set(automatic),
        check_vma=False,
    )
    return sharded(q, k, v, kv_pages, metadata)
