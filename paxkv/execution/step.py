"""The jitted engine step, in two programs: one ragged forward per data replica over its pages (forward_step),
then sampling of one token per row and per draft row, whose samples verify speculative drafts (sample_step;
paxkv.execution.verification)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models.paged_forward import bucket, logits_over_pages
from pallas_kernels import greedy_tokens_cpu, write_pages
from paxkv.execution.sampler import SamplingArrays, native_greedy_here, sample, top_logprobs
from paxkv.execution.step_inputs import StepInputs
from paxkv.execution.verification import DraftRows, count_accepted
from paxkv.scheduling.sampling_params import MAX_LOGPROBS
from paxkv.scheduling.stopping import NONFINITE_TOKEN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """One sampled token per row (the S usual rows, then the R draft rows) and, when asked for, log-probabilities
    under the raw (temperature 1) distribution."""

    tokens: jax.Array  # i32[S + R]
    logprobs: jax.Array  # f32[S + R] log-probability of each sampled token (0 unless asked for)
    ranks: jax.Array  # i32[S + R] 1-based rank of each sampled token, 1 = most likely (0 unless asked for)
    top_ids: jax.Array  # i32[S + R, k] most likely first, k = min(MAX_LOGPROBS, vocab); [S + R, 0] unless asked for
    top_logprobs: jax.Array  # f32[S + R, k] their log-probabilities; [S + R, 0] unless asked for
    num_accepted: jax.Array  # i32[S] drafts of each row that its samples accept (0 without drafts)


class StaticGraph:
    """A graphdef and its state's tree structure, as a jit static argument hashed by identity.

    Hashing a GraphDef walks the whole module tree, which costs milliseconds on every call. And the step programs
    take the state as its flat list of arrays (`weights`, in `state_treedef`'s order): flattening an nnx.State's
    variables on every call made the forward's dispatch 1.5-3.4 ms a step on SmolLM2, against 0.7-0.8 ms from the
    list (a decode step at batch 1 takes about 20 ms).
    """

    __slots__ = ("graphdef", "state_treedef")

    def __init__(self, graphdef: nnx.GraphDef, state_treedef):
        self.graphdef, self.state_treedef = graphdef, state_treedef

    def model(self, weights: list) -> nnx.Module:
        """The module over `weights`, the state's leaves in state_treedef's order (inside a traced program)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.state_treedef, weights))


# id(graphdef) -> (graphdef, the StaticGraphs of its equal graphdefs, one per state structure). Holding the graphdef
# keeps its id from being reused, and sharing the StaticGraphs of equal graphdefs lets every engine over the same
# architecture share compiled steps: a new load's graphdef is compared with the known ones once (a walk of the
# module tree), never again per step.
_STATIC_GRAPHS: dict[int, tuple[nnx.GraphDef, list[StaticGraph]]] = {}


def static_graph(graphdef: nnx.GraphDef, state: nnx.State) -> StaticGraph:
    """The one StaticGraph of `graphdef` and the structure of `state` (arrays or ShapeDtypeStructs), shared with
    every equal pair seen before. Its programs take jax.tree.leaves(state) as their weights."""
    entry = _STATIC_GRAPHS.get(id(graphdef))
    if entry is None:
        shared = next((graphs for other, graphs in _STATIC_GRAPHS.values() if other == graphdef), [])
        entry = _STATIC_GRAPHS[id(graphdef)] = (graphdef, shared)
    graphs, treedef = entry[1], jax.tree.structure(state)
    found = next((graph for graph in graphs if graph.state_treedef == treedef), None)
    if found is None:
        found = StaticGraph(graphdef, treedef)
        graphs.append(found)
    return found


def step_model(graphdef: nnx.GraphDef, state: nnx.State) -> tuple[StaticGraph, list]:
    """(static_graph(graphdef, state), the state's leaves): the model as the step programs take it."""
    return static_graph(graphdef, state), jax.tree.leaves(state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Everything one step reads besides the model and the pool; every leaf has a leading replica axis [D, ...]."""

    inputs: StepInputs | None  # the padded ragged batch of each replica, over its local pages (None: sampling only)
    sampling: SamplingArrays  # S rows per replica
    token_counts: jax.Array | None  # i32[D, S, vocab] generated-token counts, only when a row has penalties
    prompt_mask: jax.Array | None  # bool[D, S, vocab] prompt tokens, only when a row has a repetition penalty
    suppress: jax.Array | None  # bool[D, S, vocab] tokens a row may not produce yet (min_tokens)
    drafts: DraftRows | None = None  # [D, R, ...] draft rows to verify, only when some row speculates

    @property
    def num_replicas(self) -> int:
        """D."""
        return self.sampling.temperature.shape[0]

    def greedy_only(self) -> bool:
        """Whether every row and draft row of every replica is greedy (on the host only)."""
        return self.sampling.all_greedy() and (self.drafts is None or self.drafts.sampling.all_greedy())


def run_step(
    graph: StaticGraph,
    weights: list[jax.Array],
    kv_caches: list,
    batch: StepBatch,
    with_logprobs: bool = False,
    greedy_only: bool = False,
    forward: jax.stages.Compiled | None = None,
    sampling: jax.stages.Compiled | None = None,
    native: bool = False,
) -> tuple[SampledTokens, list]:  # every SampledTokens leaf [D, S + R, ...]
    """One engine step as two programs: forward_step writes K/V and computes the rows' logits, then sample_step
    samples them (either one compiled ahead of time, where given).

    The forward compiles once per (T, S, R) shape and the sampling once per (S + R, variant), so a new
    sampling option (logprobs, penalties, min_tokens) costs a small program, not a new forward, and the
    sampling program is shared by every T bucket and every model with the same vocabulary.

    Args:
      graph, weights: the split model (static_graph, and its state's leaves).
      kv_caches: the page pools, donated to the forward.
      batch: the replicas' padded batches, sampling arrays and optional vocabulary arrays (None compiles them away).
      with_logprobs: also return log-probabilities, ranks and the MAX_LOGPROBS most likely tokens (static).
      greedy_only: every row is greedy (static; batch.greedy_only()): the sampling compiles only the argmax.
      forward, sampling: the two programs of this shape and variant compiled ahead of time
        (paxkv.execution.ahead_compiler), or None for the jitted ones.
      native: the model runs the native CPU kernels (static; see sample_step).
    """
    draft_indices = None if batch.drafts is None else batch.drafts.logits_indices
    if forward is None:
        logits, kv_caches = forward_step(graph, weights, kv_caches, batch.inputs, draft_indices)
    else:
        logits, kv_caches = forward(weights, kv_caches, batch.inputs, draft_indices)
    sampling_batch = dataclasses.replace(batch, inputs=None)
    if sampling is None:
        sampled = sample_step(logits, sampling_batch, with_logprobs, greedy_only, native)
    else:
        sampled = sampling(logits, sampling_batch)
    return sampled, kv_caches


def per_replica(body, num_replicas: int, replicated_args, per_replica_args):
    """Run `body(*replicated_args, *per_replica_args)` on each data replica's own slice of the [D, ...] arrays.

    With D > 1 (under jax.set_mesh) shard_map makes "data" manual: each replica sees its own [1, ...] slice, and
    nothing crosses replicas; "model" stays automatic, so tensor parallelism inside a replica works the same.
    With D = 1 the body sees the whole [1, ...] arrays: the same program without the shard_map.
    """
    if num_replicas == 1:
        return body(*replicated_args, *per_replica_args)
    split = PartitionSpec("data")
    sharded = jax.shard_map(
        body,
        in_specs=(*(jax.tree.map(lambda _: PartitionSpec(), a) for a in replicated_args),)
        + (split,) * len(per_replica_args),
        out_specs=split,
        axis_names={"data"},
        check_vma=False,
    )
    return sharded(*replicated_args, *per_replica_args)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def forward_step(
    graph: StaticGraph,
    weights: list[jax.Array],  # the state's leaves (StaticGraph)
    kv_caches: list[jax.Array],  # num_layers x [D * N, page_size, 2K * H], pages split on "data" when D > 1
    inputs: StepInputs,  # [D, ...] leaves
    draft_indices: jax.Array | None,  # i32[D, R] the tokens whose logits verify each draft row; None without drafts
) -> tuple[jax.Array, list[jax.Array]]:  # (f32[D, S + R, vocab], kv_caches)
    """Write every replica's K/V into its pages and return the logits of its rows: one program for D >= 1.

    A plain jax.jit over (graphdef, weights) with the pool donated, so updates happen in place. A Pallas kernel
    nests its own shard_map over "model" (models.sharding).
    """

    def replica_forward(weights, kv_caches, inputs, draft_indices):
        local = jax.tree.map(lambda leaf: leaf[0], inputs)  # this replica's [T], [S, ...] arrays
        logits_indices = local.logits_indices  # i32[S]
        if draft_indices is not None:  # the draft rows follow the usual ones
            logits_indices = jnp.concatenate([logits_indices, draft_indices[0]])  # i32[S + R]
        logits, kv_caches = logits_over_pages(
            graph.model(weights), local.tokens, local.positions, kv_caches, local.metadata, logits_indices
        )  # f32[S + R, vocab], split over "model" where the lm_head is
        # Sample from whole rows: one all-gather of the logits, not a collective per reduction the sampler makes.
        return replicated(logits)[None], kv_caches

    num_replicas = inputs.tokens.shape[0]
    return per_replica(replica_forward, num_replicas, (weights,), (kv_caches, inputs, draft_indices))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def sample_step(
    logits: jax.Array,  # f32[D, S + R, vocab]
    batch: StepBatch,  # its sampling arrays, vocabulary arrays and drafts (inputs None)
    with_logprobs: bool = False,
    greedy_only: bool = False,
    native: bool = False,
) -> SampledTokens:  # every leaf [D, S + R, ...] (num_accepted [D, S])
    """Sample one token per row of every replica, verify its drafts, and when asked, report log-probabilities.

    Args:
      logits: each replica's row logits, as forward_step returns them.
      batch: the step's batch without its inputs.
      with_logprobs: also return each sampled token's log-probability and rank, and the MAX_LOGPROBS most
        likely tokens of each row (static; zeros and empty arrays otherwise).
      greedy_only: every row is greedy (static): only the argmax is compiled, not the filters and draws.
      native: the model runs the native CPU kernels (static: its attention_impl resolved to cpu_native), so plain
        greedy rows may take the native argmax (sampler.native_greedy_here); False for programs compiled for
        another platform.
    """

    def replica_sample(logits, batch):
        local = jax.tree.map(lambda leaf: leaf[0], batch)  # this replica's [S, ...] arrays
        sampled = sample_rows(logits[0], local, with_logprobs, greedy_only, native)
        return jax.tree.map(lambda leaf: leaf[None], sampled)

    return per_replica(replica_sample, batch.num_replicas, (), (logits, batch))


def compile_forward(graph: StaticGraph, weights: list, kv_caches: list, batch: StepBatch) -> jax.stages.Compiled:
    """forward_step compiled ahead of time for a batch's shapes (every argument may be a ShapeDtypeStruct)."""
    draft_indices = None if batch.drafts is None else batch.drafts.logits_indices
    return forward_step.trace(graph, weights, kv_caches, batch.inputs, draft_indices).lower().compile()


def compile_sampling(
    forward: jax.stages.Compiled, batch: StepBatch, with_logprobs: bool, greedy_only: bool, native: bool = False
) -> jax.stages.Compiled:
    """sample_step compiled ahead of time for the logits `forward` returns, shaped and sharded as it returns them,
    and a batch's shapes (its inputs unused); `native` as sample_step's."""
    info = jax.tree.leaves(forward.out_info)[0]
    logits = jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=forward.output_shardings[0])
    sampling_batch = dataclasses.replace(batch, inputs=None)
    return sample_step.trace(logits, sampling_batch, with_logprobs, greedy_only, native).lower().compile()


def replicated(x: jax.Array) -> jax.Array:
    """`x` whole on every device of the context mesh's automatic axes; unchanged without a mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec())


def sample_rows(
    logits: jax.Array, batch: StepBatch, with_logprobs: bool, greedy_only: bool, native: bool
) -> SampledTokens:
    """The body of sample_step for one replica's rows (logits f32[S + R, vocab], batch leaves [S, ...]), inside a
    traced program (chained decode passes sample with it too)."""
    drafts = batch.drafts
    num_seqs = batch.sampling.temperature.shape[0]
    sampling = batch.sampling
    vocab_arrays = (batch.token_counts, batch.prompt_mask, batch.suppress)
    if drafts is not None:  # the draft rows follow the usual ones; a speculating row has no vocabulary arrays
        sampling = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), sampling, drafts.sampling)
        num_draft_rows = drafts.logits_indices.shape[0]
        vocab_arrays = [
            None if a is None else jnp.pad(a, ((0, num_draft_rows), (0, 0))) for a in vocab_arrays
        ]  # [S + R, vocab]
    token_counts, prompt_mask, suppress = vocab_arrays
    if greedy_only and all(a is None for a in vocab_arrays) and native_greedy_here(native):
        # Every row's argmax of its raw logits: the maximum, its first index and finiteness in one native pass.
        tokens = greedy_tokens_cpu(logits, NONFINITE_TOKEN)  # i32[S + R]
    else:
        tokens, _ = sample(
            logits, sampling, token_counts, prompt_mask=prompt_mask, suppress=suppress, greedy_only=greedy_only
        )
        # A row whose logits hold NaN or Inf has no token to sample: report NONFINITE_TOKEN, never argmax's 0.
        tokens = jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), tokens, NONFINITE_TOKEN)  # i32[S + R]
    if drafts is None:
        num_accepted = jnp.zeros(num_seqs, jnp.int32)
    else:
        num_accepted = count_accepted(tokens[num_seqs:], drafts, num_seqs)  # i32[S]
    num_rows = logits.shape[0]
    if with_logprobs:
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)  # f32[S, vocab]
        token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)  # f32[S, 1]
        # As vLLM: the number of tokens at least as likely (1 for a unique most likely token; ties count).
        ranks = jnp.sum(raw_logprobs >= token_logprobs, axis=-1, dtype=jnp.int32)  # i32[S]
        token_logprobs = token_logprobs[:, 0]
        top_ids, top_values = top_logprobs(logits, min(MAX_LOGPROBS, logits.shape[-1]))  # i32[S, k], f32[S, k]
    else:
        token_logprobs, ranks = jnp.zeros(num_rows, jnp.float32), jnp.zeros(num_rows, jnp.int32)
        top_ids, top_values = jnp.zeros((num_rows, 0), jnp.int32), jnp.zeros((num_rows, 0), jnp.float32)
    return SampledTokens(tokens, token_logprobs, ranks, top_ids, top_values, num_accepted)


_STEP_PROGRAMS = (forward_step, sample_step)


def num_step_compilations() -> int:
    """How many distinct step programs (forwards and samplings) this process has compiled."""
    return sum(program._cache_size() for program in _STEP_PROGRAMS)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("native",))
def copy_pages(kv_caches, sources: jax.Array, destinations: jax.Array, native: bool = False):
    """Copy whole pages within every layer's pool (copy-on-write of shared pages); the pool is donated.

    Args:
      kv_caches: per-layer page pools (any pytree whose leaves have the page on axis 0, FP8 scales included).
      sources, destinations: i32[C] page pairs; padding pairs copy the null page onto itself.
      native: the pool is on one CPU device whose model runs the native kernels (pallas_kernels.write_pages).
    """
    return jax.tree.map(lambda pool: write_pages(pool, destinations, pool[sources], native=native), kv_caches)


def page_copy_arrays(page_copies: list[tuple[int, int]]) -> tuple[jax.Array, jax.Array]:
    """(sources, destinations) padded to a power of two with null-page pairs, so copy_pages compiles rarely.

    Args:
      page_copies: (source, destination) pairs with distinct destinations.
    """
    size = bucket(len(page_copies))
    pairs = list(page_copies) + [(0, 0)] * (size - len(page_copies))
    sources, destinations = zip(*pairs, strict=True)
    return jnp.asarray(sources, jnp.int32), jnp.asarray(destinations, jnp.int32)
