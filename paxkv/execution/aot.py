"""The engine's step compiled ahead of time from shapes alone: for TPUs and GPUs this machine lacks
(scripts/aot_compile.py), and at start, to refuse a step that would not fit in device memory.

Everything here feeds the step Engine runs (execution.step: forward_step, then sample_step): the abstract
model comes from models' own abstract_model and sharding table, the pool from kv_pool.abstract_pool, and the batch
arrays from the same host builders Engine uses, so what compiles here is what an engine would run.
"""

import contextlib
import dataclasses
import logging
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import models
from models.loaded_model import abstract_model
from models.sharding import restore_target, state_shardings
from pallas_kernels import pages_for
from paxkv.execution.chained_decode import MIN_STOP_IDS, ChainArrays, chained_decode_step
from paxkv.execution.kv_pool import abstract_pool, kv_bytes_per_page, kv_storage_dtype
from paxkv.execution.step import StepBatch, compile_forward, compile_sampling, step_model
from paxkv.execution.step_arguments import empty_step_batch
from paxkv.execution.step_inputs import (
    MIN_PREFILL_TOKENS,
    NO_PADDING,
    StepPadding,
    power_of_two_bucket,
    power_of_two_buckets,
    prefill_bucket,
)
from paxkv.parallel.mesh import num_scale_groups

logger = logging.getLogger(__name__)

# Llama-3-8B's config.json, as its model card gives it: the shape compiled for the TPU checks.
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What XLA's memory analysis says one step program needs per device."""

    argument_bytes: int  # weights, pool and batch
    output_bytes: int
    alias_bytes: int  # outputs that reuse a donated argument's buffer (the pool)
    temp_bytes: int  # activations and scratch
    code_bytes: int

    @property
    def total_bytes(self) -> int:
        """Everything the program holds at once."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def beyond_arguments_bytes(self) -> int:
        """What the step needs on top of its (already allocated) arguments."""
        return self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @classmethod
    def of_step(cls, forward: "StepMemory", sampling: "StepMemory", logits_bytes: int) -> "StepMemory":
        """The step's two programs run in turn: the forward (weights, pool and inputs in; the pool, aliased, and the
        logits out), then the sampling (the logits in). Arguments are both programs' less the logits, which the
        forward makes; the temporaries are the larger peak: the forward's own, or the logits held through the
        sampling's."""
        return cls(
            argument_bytes=forward.argument_bytes + sampling.argument_bytes - logits_bytes,
            output_bytes=forward.output_bytes - logits_bytes + sampling.output_bytes,
            alias_bytes=forward.alias_bytes,
            temp_bytes=max(
                forward.temp_bytes + logits_bytes - sampling.output_bytes, logits_bytes + sampling.temp_bytes
            ),
            code_bytes=forward.code_bytes + sampling.code_bytes,
        )

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> "StepMemory":
        """The memory analysis of a compiled program."""
        stats = compiled.memory_analysis()
        return cls(
            argument_bytes=int(stats.argument_size_in_bytes),
            output_bytes=int(stats.output_size_in_bytes),
            alias_bytes=int(stats.alias_size_in_bytes),
            temp_bytes=int(stats.temp_size_in_bytes),
            code_bytes=int(getattr(stats, "generated_code_size_in_bytes", 0)),
        )


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """One step's compiled programs (a T bucket and an S bucket: the forward and the sampling) and what they cost."""

    num_tokens: int  # T
    num_seqs: int  # S
    compile_seconds: float
    memory: StepMemory
    flops: float
    bytes_accessed: float
    num_passes: int = 1  # K: a chained decode program's passes (T = S tokens each), 1 for a plain step


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """An engine's device state as ShapeDtypeStructs: the split model, the pool, and the pool's geometry."""

    graphdef: nnx.GraphDef
    state: nnx.State
    kv_caches: list
    page_size: int
    pages_per_seq: int
    vocab_size: int
    mesh: Mesh | None  # None: one device, no mesh (as Engine runs it)

    @property
    def num_replicas(self) -> int:
        """D, the data replicas (the step's batch has a leading [D] axis)."""
        return self.mesh.shape["data"] if self.mesh is not None else 1


def abstract_engine(
    config: models.ModelConfig,
    mesh: Mesh,
    *,
    num_pages: int,
    page_size: int,
    max_model_len: int,
    dtype: str = "bfloat16",
    compute_dtype: str = "bfloat16",
    kv_cache_dtype: str = "auto",
    attention_impl: str = "pallas_tpu",
) -> AbstractEngine:
    """The weights, their shardings and the page pool of an engine on `mesh`, from the config alone.

    Args:
      config: the model.
      mesh: the ("data", "model") mesh (of a TPU topology's devices for deviceless compiles).
      num_pages, page_size: the pool; max_model_len sets the block-table width.
      dtype, compute_dtype: parameter and activation dtypes (float32 or bfloat16).
      kv_cache_dtype: as EngineConfig.kv_cache_dtype.
      attention_impl: a resolved implementation name (the target's kernel; resolution reads the backend,
        which here is not the target's).
    """
    model_kwargs = dict(
        param_dtype=models.loading.DTYPES[dtype],
        compute_dtype=models.loading.DTYPES[compute_dtype],
        attention_impl=attention_impl,
    )
    graphdef, state = abstract_model(config, model_kwargs)
    nnx.replace_by_pure_dict(state, restore_target(state, state_shardings(state, mesh)))
    kv_dtype = kv_storage_dtype(kv_cache_dtype, models.loading.DTYPES[compute_dtype])
    kv_caches = abstract_pool(config, num_pages, page_size, kv_dtype, mesh)
    return AbstractEngine(
        graphdef, state, kv_caches, page_size, pages_for(max_model_len, page_size), config.vocab_size, mesh
    )


def pages_for_memory(
    config: models.ModelConfig, memory_bytes: int, page_size: int, kv_cache_dtype: str, dtype: str, mesh: Mesh
) -> int:
    """Pages a KV budget of `memory_bytes` (the whole pool, over all devices' shards) holds, for activations of
    `dtype`."""
    kv_dtype = kv_storage_dtype(kv_cache_dtype, models.loading.DTYPES[dtype])
    num_groups = num_scale_groups(config.num_kv_heads, mesh)
    per_page = kv_bytes_per_page(
        config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype, page_size, num_groups
    )
    return max(2, memory_bytes // per_page)


def abstract_step_batch(
    engine: AbstractEngine, num_tokens: int, num_seqs: int, *, vocab_arrays: bool = False
) -> StepBatch:
    """The step's batch for a (T, S) bucket as ShapeDtypeStructs: [D, ...] leaves, split on "data" when D > 1.

    The arrays are step_arguments.empty_step_batch's, made by the builders Engine uses, so their shapes and dtypes
    are the engine's.

    Args:
      engine: the abstract engine.
      num_tokens, num_seqs: the T and S buckets.
      vocab_arrays: include the per-row vocabulary arrays (penalties and min_tokens), the largest variant.
    """
    batch = empty_step_batch(
        engine.num_replicas,
        num_tokens,
        num_seqs,
        pages_per_seq=engine.pages_per_seq,
        vocab_size=engine.vocab_size,
        vocab_arrays=vocab_arrays,
    )
    sharding = _batch_sharding(engine)
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), batch)


def _batch_sharding(engine: AbstractEngine) -> NamedSharding | None:
    """How a step's [D, ...] arrays lie: split on "data" when D > 1, whole on every device otherwise."""
    spec = PartitionSpec("data") if engine.num_replicas > 1 else PartitionSpec()
    return NamedSharding(engine.mesh, spec) if engine.mesh is not None else None


def abstract_chain_arrays(engine: AbstractEngine, num_seqs: int, num_passes: int) -> ChainArrays:
    """A chained decode step's ChainArrays for S rows and K passes as ShapeDtypeStructs, laid out as the batch's."""
    d, sharding = engine.num_replicas, _batch_sharding(engine)
    shapes = ((d, num_passes, num_seqs), (d, num_seqs), (d, num_seqs, MIN_STOP_IDS))
    return ChainArrays(*(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for shape in shapes))


def compile_step(
    engine: AbstractEngine, num_tokens: int, num_seqs: int, *, with_logprobs: bool = False, vocab_arrays: bool = False
) -> StepProgram:
    """Compile the step's forward and sampling for one (T, S) bucket under the engine's mesh; raises what the
    compiler raises.

    Args:
      engine: the abstract (or a real engine's) state.
      num_tokens, num_seqs: the T and S buckets.
      with_logprobs: compile the logprobs variant.
      vocab_arrays: include the per-row vocabulary arrays (see abstract_step_batch).
    """
    batch = abstract_step_batch(engine, num_tokens, num_seqs, vocab_arrays=vocab_arrays)
    start = time.perf_counter()
    with jax.set_mesh(engine.mesh) if engine.mesh is not None else contextlib.nullcontext():
        graph, weights = step_model(engine.graphdef, engine.state)
        forward = compile_forward(graph, weights, engine.kv_caches, batch)
        sampling = compile_sampling(forward, batch, with_logprobs, greedy_only=False)
    info = jax.tree.leaves(forward.out_info)[0]
    logits = jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=forward.output_shardings[0])
    seconds = time.perf_counter() - start
    logits_bytes = math.prod(logits.shape) * logits.dtype.itemsize // _num_shards(logits.sharding, logits.shape)
    costs = [_cost(program) for program in (forward, sampling)]
    return StepProgram(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        compile_seconds=seconds,
        memory=StepMemory.of_step(StepMemory.of(forward), StepMemory.of(sampling), logits_bytes),
        flops=sum(float(cost.get("flops", 0.0)) for cost in costs),
        bytes_accessed=sum(float(cost.get("bytes accessed", 0.0)) for cost in costs),
    )


def compile_chained_step(engine: AbstractEngine, num_seqs: int, num_passes: int) -> StepProgram:
    """Compile the chained decode program (execution.chained_decode: K passes of a plain decode step's forward and
    sampler in one loop) for an S bucket under the engine's mesh; raises what the compiler raises.

    Args:
      engine: the abstract (or a real engine's) state.
      num_seqs: the S bucket; each pass is a decode step of S tokens.
      num_passes: K, EngineConfig.num_scheduler_steps.
    """
    batch = abstract_step_batch(engine, num_seqs, num_seqs)
    chain = abstract_chain_arrays(engine, num_seqs, num_passes)
    start = time.perf_counter()
    with jax.set_mesh(engine.mesh) if engine.mesh is not None else contextlib.nullcontext():
        graph, weights = step_model(engine.graphdef, engine.state)
        traced = chained_decode_step.trace(graph, weights, engine.kv_caches, batch, chain, False, False)
        program = traced.lower().compile()
    cost = _cost(program)
    return StepProgram(
        num_tokens=num_seqs,
        num_seqs=num_seqs,
        compile_seconds=time.perf_counter() - start,
        memory=StepMemory.of(program),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        num_passes=num_passes,
    )


def _cost(compiled: jax.stages.Compiled) -> dict:
    """XLA's cost analysis of a compiled program (a dict, empty where the backend gives none)."""
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


def _num_shards(sharding, shape) -> int:
    """Into how many pieces `sharding` splits an array of `shape` (1 without a sharding)."""
    if sharding is None:
        return 1
    return math.prod(shape) // math.prod(sharding.shard_shape(shape)) if math.prod(shape) else 1


def step_buckets(
    max_num_batched_tokens: int, max_num_seqs: int, padding: StepPadding = NO_PADDING
) -> list[tuple[int, int]]:
    """The (T, S) bucket pairs a step can take (as padded_batch_sizes pads): T one of the padding's token buckets
    (at least its tokens), S from the padding's rows up to the row budget and never above T (a row holds at least one
    token); decodes at T = S (or the token floor above S), prefills at T of at least MIN_PREFILL_TOKENS and at most
    the budget's prefill size (prefill_bucket)."""
    token_buckets = padding.token_buckets(max_num_batched_tokens)
    smallest = power_of_two_bucket(padding.row_floor(max_num_batched_tokens), max_num_seqs)
    seq_buckets = [s for s in power_of_two_buckets(max_num_seqs) if s >= smallest]
    token_floor = padding.token_floor(max_num_batched_tokens)
    prefill_floor = prefill_bucket(max(MIN_PREFILL_TOKENS, token_floor), max_num_batched_tokens)
    prefill_ceiling = prefill_bucket(max_num_batched_tokens, max_num_batched_tokens)

    def taken(t: int, s: int) -> bool:
        decode = t == power_of_two_bucket(max(s, token_floor), max_num_batched_tokens)
        return decode or s < t and prefill_floor <= t <= prefill_ceiling

    return [(t, s) for t in token_buckets for s in seq_buckets if taken(t, s)]


def device_memory(mesh: Mesh | None) -> tuple[int, int] | None:
    """(memory limit, bytes in use) of the first device of `mesh` (or the default device); None where the backend
    reports no limit (CPU)."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without memory statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def check_step_fits(program: StepProgram, memory_limit_bytes: int, in_use_bytes: int, *, what: str) -> None:
    """Raise a ValueError naming the fix when a step needs more memory than the device has left.

    Args:
      program: the largest step program, compiled.
      memory_limit_bytes, in_use_bytes: the device's memory limit and what is allocated now (weights, pool).
      what: the budgets that sized this step, for the message.
    """
    needed = program.memory.beyond_arguments_bytes
    free = memory_limit_bytes - in_use_bytes
    if needed <= free:
        return
    if program.num_passes > 1:
        name = f"the largest chained decode step (S={program.num_seqs} rows, {program.num_passes} passes; {what})"
        fixes = "max_num_seqs, or chain no decodes (num_scheduler_steps=1)"
    else:
        name = f"the largest step (T={program.num_tokens} tokens, S={program.num_seqs} rows; {what})"
        fixes = "max_num_batched_tokens or max_num_seqs"
    raise ValueError(
        f"{name} needs {needed / 2**30:.2f} GiB of device memory beyond its arguments, but only "
        f"{free / 2**30:.2f} GiB of {memory_limit_bytes / 2**30:.2f} GiB is free after the weights and the KV pool; "
        f"lower kv_cache_memory_bytes (--kv_cache_memory), {fixes}"
    )
