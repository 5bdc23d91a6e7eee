"""The device mesh: parsing `data=D,model=M`, building the ("data", "model") mesh, and the page pool's sharding."""

import logging
import math

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pallas_kernels import heads_split, pool_partition_spec

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "model")


def parse_mesh_shape(mesh_shape: str | dict | None) -> dict[str, int] | None:
    """`"data=1,model=4"` (or a dict) as {"data": 1, "model": 4}; None stays None (the default mesh).

    Args:
      mesh_shape: a comma-separated list of axis=size, a dict of the same, or None.
    """
    if mesh_shape is None or mesh_shape == "":
        return None
    if isinstance(mesh_shape, str):
        sizes = {}
        for part in mesh_shape.split(","):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().lstrip("-").isdigit():
                raise ValueError(f"mesh {mesh_shape!r}: {part!r} is not axis=size; write e.g. 'data=1,model=4'")
            sizes[name.strip()] = int(size)
    elif isinstance(mesh_shape, dict):
        sizes = dict(mesh_shape)
    else:
        raise ValueError(f"mesh_shape must be a string like 'data=1,model=4' or a dict, not {mesh_shape!r}")
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh {mesh_shape!r}: unknown axis {unknown[0]!r}; the axes are {MESH_AXES}")
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh {mesh_shape!r}: axis {name!r} has size {size!r}; sizes are positive integers")
    return {axis: sizes.get(axis, 1) for axis in MESH_AXES}


def make_mesh(mesh_shape: str | dict | None = None, devices=None) -> Mesh:
    """The ("data", "model") mesh over `devices` (default: this process's devices, or all of them multi-host).

    Without a shape every device goes on "model" (tensor parallelism), except in a one-process CPU run,
    where forced host devices share the same cores and sharding gains nothing: there it is one device.
    A shape smaller than the machine takes the first devices (in one process) and logs it.

    Args:
      mesh_shape: "data=D,model=M", a dict, or None for the default.
      devices: the devices to lay out; default jax.devices().
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_shape(mesh_shape)
    if sizes is None:
        # One device on CPU (forced host devices share the cores), unless the run spans processes.
        on_cpu = devices[0].platform == "cpu" and jax.process_count() == 1
        sizes = {"data": 1, "model": 1 if on_cpu else len(devices)}
        devices = devices[: sizes["model"]]
    needed = math.prod(sizes.values())
    name = f"data={sizes['data']},model={sizes['model']}"
    if needed > len(devices):
        raise ValueError(
            f"mesh {name} needs {needed} devices, but only {len(devices)} are available ({devices[0].platform}); "
            f"choose sizes whose product is at most {len(devices)}"
        )
    if needed < len(devices):
        if jax.process_count() > 1:
            raise ValueError(
                f"mesh {name} covers {needed} of the {len(devices)} devices of this {jax.process_count()}-process "
                "run; across hosts every process's devices must be in the mesh, so choose sizes whose product is "
                f"{len(devices)} (or start fewer processes)"
            )
        # As vLLM's tensor_parallel_size=2 on an 8-GPU host: the first devices, the rest left idle.
        logger.info("mesh %s uses the first %d of %d %s devices", name, needed, len(devices), devices[0].platform)
        devices = devices[:needed]
    # jax.make_mesh orders the devices by the hardware's topology (TPU ICI rings), so "model" neighbours
    # are physical neighbours; on CPU and GPU it keeps their order.
    shape = (sizes["data"], sizes["model"])
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def kv_heads_sharded(num_kv_heads: int, mesh: Mesh) -> bool:
    """Whether the pool's KV heads split over "model" (pallas_kernels.heads_split); if not, every model shard holds
    all of them."""
    return heads_split(num_kv_heads, mesh.shape["model"])


def pool_sharding(pool, num_kv_heads: int, mesh: Mesh):
    """A sharding pytree for one layer's pool: pages on "data" (one partition per data replica), and KV heads
    on "model" when they divide it, else replicated.

    Args:
      pool: one layer's page pool ([num_pages, page_size, 2K * D] array or QuantizedKVPages).
      num_kv_heads: K.
      mesh: the device mesh.
    """
    heads = "model" if kv_heads_sharded(num_kv_heads, mesh) else None
    page_axis = "data" if mesh.shape["data"] > 1 else None
    specs = pool_partition_spec(pool, page_axis=page_axis, head_axis=heads)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def num_scale_groups(num_kv_heads: int, mesh: Mesh | None) -> int:
    """G, the head groups an 8-bit pool's scales are laid out in: one per model shard when the KV heads split."""
    if mesh is None or not kv_heads_sharded(num_kv_heads, mesh):
        return 1
    return mesh.shape["model"]


def describe_kv_layout(model_name: str, num_kv_heads: int, num_heads: int, mesh: Mesh) -> str:
    """One log line saying how attention and the pool lie on the mesh, loudly when KV heads are replicated."""
    model_size = mesh.shape["model"]
    if model_size == 1:
        pages = "; the page pool splits over data" if mesh.shape["data"] > 1 else ""
        return f"mesh data={mesh.shape['data']},model=1: no tensor parallelism{pages}"
    if kv_heads_sharded(num_kv_heads, mesh):
        return (
            f"mesh data={mesh.shape['data']},model={model_size}: {num_kv_heads} KV heads and the page pool split "
            f"{num_kv_heads // model_size} per model shard"
        )
    return (
        f"mesh data={mesh.shape['data']},model={model_size}: {model_name} has {num_kv_heads} KV heads "
        f"({num_heads} query heads), which do not divide model={model_size}, so the K/V projections, the KV "
        f"heads and the page pool are REPLICATED on every model shard (KV memory per device x{model_size}); "
        "query heads split only where they divide it, and the MLP and vocabulary stay split. Choose model = a "
        f"divisor of {num_kv_heads} to split the KV heads"
    )


def load_on_mesh(source, mesh_shape: str | dict | None, **load_kwargs):
    """models.load onto the mesh `mesh_shape` describes; a one-device mesh loads plainly.

    Args:
      source: what models.load accepts.
      mesh_shape: "data=D,model=M", a dict, or None for the default mesh (see make_mesh).
      **load_kwargs: the rest of models.load's arguments.
    """
    import models

    mesh = make_mesh(mesh_shape)
    return models.load(source, mesh=mesh if mesh.size > 1 else None, **load_kwargs)


def engine_mesh(loaded, mesh_shape: str | dict | None) -> Mesh | None:
    """The mesh an engine runs `loaded` on (None for one device), checked against `mesh_shape` and logged.

    Args:
      loaded: a models.LoadedModel, placed on its mesh by load_on_mesh or models.load(mesh=...).
      mesh_shape: the engine config's mesh_shape; when set, the model's mesh must have that shape.
    """
    have = dict(loaded.mesh.shape) if loaded.mesh is not None else {"data": 1, "model": 1}
    if mesh_shape is not None and parse_mesh_shape(mesh_shape) != have:
        raise ValueError(
            f"mesh_shape={mesh_shape!r}, but the model was loaded on data={have['data']},model={have['model']}; "
            "load it with paxkv.parallel.mesh.load_on_mesh(source, mesh_shape), as LLM and the CLI do"
        )
    if loaded.mesh is None or loaded.mesh.size == 1:
        return None
    mesh = loaded.mesh
    config = loaded.config
    layout = describe_kv_layout(config.model_type, config.num_kv_heads, config.num_heads, mesh)
    (logger.info if kv_heads_sharded(config.num_kv_heads, mesh) else logger.warning)(layout)
    return mesh
