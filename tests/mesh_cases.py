"""What the mesh tests share: the expected parameter shardings, and the collectives of a compiled step."""

import collections
import re

import jax
from jax.sharding import PartitionSpec as P

import paxkv.execution.step as step

# Written out here, independently of models/sharding.py: where each parameter's axes go under tensor
# parallelism (q/k/v/gate/up by output columns, o/down by input rows, embedding and lm_head by vocab);
# parameters are replicated over "data".
EXPECTED_SPECS = {
    "q_proj": P(None, "model", None),
    "k_proj": P(None, "model", None),
    "v_proj": P(None, "model", None),
    "o_proj": P("model", None, None),
    "gate": P(None, "model"),
    "up": P(None, "model"),
    "down": P("model", None),
    "embed": P("model", None),
    "lm_head": P(None, "model"),
}


def spec_of(array_or_spec) -> tuple:
    """A PartitionSpec (or an array's) without trailing Nones, so P(None,) and P() both read as replicated."""
    spec = tuple(getattr(getattr(array_or_spec, "sharding", None), "spec", array_or_spec))
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def step_collectives(run, mesh) -> collections.Counter:
    """Collective ops in the compiled text of the step's programs (its forward and its sampling, summed) as the model
    runner last called them in `run()` on `mesh`.

    Args:
      run: drives an engine on the mesh.
      mesh: the engine's mesh.
    """
    captured = {}

    def abstract(x):
        return (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) if hasattr(x, "shape") else x
        )

    def spy(name, program):
        def call(*args):
            static, rest = (args[:1], args[1:]) if name == "forward_step" else ((), args)
            captured[name] = (static, jax.tree.map(abstract, rest))
            return program(*args)

        return call

    programs = {name: getattr(step, name) for name in ("forward_step", "sample_step")}
    for name, program in programs.items():
        setattr(step, name, spy(name, program))
    try:
        run()
    finally:
        for name, program in programs.items():
            setattr(step, name, program)
    counts = collections.Counter()
    with jax.set_mesh(mesh):
        for name, (static, args) in captured.items():
            text = programs[name].lower(*static, *args).compile().as_text()
            counts.update(re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", text))
    return counts
