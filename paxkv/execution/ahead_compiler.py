"""Step programs compiled on a worker thread before any step runs them, so that trying a new step shape never
stalls the engine.

Plain step programs are compiled at warm-up (ModelRunner.warm_up), but a speculating step's forward depends on its
draft-row bucket R as well, and the adaptive draft budget (paxkv.speculation.draft_budget) only learns which R a
workload wants as it runs. Compiling one inside a step costs seconds on CPU (dozens of steps), so the budget never
runs an uncompiled shape: it asks for the one it expects to repay a compile, keeps drafting with the programs it
has, and takes the new one once it is ready. The compile still takes CPU time from the steps while it runs, but no
step waits for it.

The programs are JAX's ahead-of-time Compiled objects (jit(...).trace(...).lower().compile()), called directly: a
jitted call after a background compile would trace and lower again before finding the executable.
"""

import atexit
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import weakref

import jax

from paxkv.execution.step import StaticGraph, StepBatch, forward_step, sample_step

logger = logging.getLogger(__name__)

# (T bucket, S bucket, R draft-row bucket): a forward's program.
ForwardKey = tuple[int, int, int]
# (S bucket, R bucket, logprobs?, all greedy?): a sampling program without vocabulary arrays (penalties and
# min_tokens, which rule drafting out: paxkv.speculation.drafter.can_speculate).
SamplingKey = tuple[int, int, bool, bool]


def abstract(tree):
    """The pytree's arrays as ShapeDtypeStructs with their shardings (numpy leaves without one, as a jitted call
    would place them)."""

    def shape_of(leaf):
        sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(shape_of, tree)


@dataclasses.dataclass
class _Job:
    """One requested forward and sampling (either may be compiled already), every argument abstract."""

    forward_key: ForwardKey
    sampling_key: SamplingKey
    state: object
    kv_caches: list
    batch: StepBatch  # the step's batch as ShapeDtypeStructs (drafts included when R > 0)


class AheadCompiler:
    """A worker thread that compiles requested step programs (execution.step's forward_step and sample_step) and
    hands them to the runner once they are ready."""

    def __init__(self, graph: StaticGraph, mesh):
        """Args:
        graph: the model's graphdef, as the step's static argument.
        mesh: the engine's mesh (the programs compile under it), or None for one device.
        """
        self._graph, self._mesh = graph, mesh
        self._forwards: dict[ForwardKey, jax.stages.Compiled] = {}
        self._samplings: dict[SamplingKey, jax.stages.Compiled] = {}
        self._requested: set[ForwardKey | SamplingKey] = set()
        self._lock = threading.Lock()  # guards the jobs, the worker's start and end, and stopping
        self._jobs: collections.deque[_Job] = collections.deque()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None  # the worker, while it has jobs
        self._stopping = False
        self._finished_seconds: queue.SimpleQueue[float] = queue.SimpleQueue()  # not yet taken
        self.num_programs = 0  # Compiled programs made, forwards and samplings
        self.num_failed = 0  # requests whose compile raised (their steps compile in the jitted call instead)

    def request(self, forward_key: ForwardKey, sampling_key: SamplingKey, state, kv_caches: list, example) -> None:
        """Compile, in the background, the forward of `forward_key` and the sampling of `sampling_key`, those of
        them not compiled or asked for already.

        Args:
          forward_key: (T, S, R), the padded shape of `example`.
          sampling_key: (S, R, logprobs?, all greedy?), the step's sampling variant.
          state: the model's state (only shapes and shardings are read, here, on the calling thread).
          kv_caches: the pool's target layers (likewise).
          example: a step batch of that shape (execution.step_arguments.empty_step_batch).
        """
        if forward_key in self._requested and sampling_key in self._requested:
            return
        self._requested.update((forward_key, sampling_key))
        job = _Job(forward_key, sampling_key, abstract(state), abstract(kv_caches), abstract(example))
        with self._lock:
            if self._stopping:
                return
            self._jobs.append(job)
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="paxkv-ahead-compiler", daemon=True)
                self._thread.start()
                _COMPILERS.add(self)

    def forward(self, key: ForwardKey) -> jax.stages.Compiled | None:
        """The forward program of `key`, once compiled."""
        return self._forwards.get(key)

    def sampling(self, key: SamplingKey) -> jax.stages.Compiled | None:
        """The sampling program of `key`, once compiled."""
        return self._samplings.get(key)

    def take_compile_seconds(self) -> list[float]:
        """The wall times of the compiles finished since the last call."""
        taken = []
        while not self._finished_seconds.empty():
            taken.append(self._finished_seconds.get())
        return taken

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every requested compile has finished; whether they had within `timeout` seconds."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        """End the worker after the compile it is running, dropping the rest (at interpreter exit: XLA must not be
        compiling then)."""
        with self._lock:
            self._stopping, thread = True, self._thread
            self._jobs.clear()
        if thread is not None:
            thread.join(timeout=60)

    def _work(self) -> None:
        """The worker: compile jobs in request order; end when none is left (a later request starts another)."""
        while True:
            with self._lock:
                if not self._jobs or self._stopping:
                    self._thread = None
                    self._idle.set()
                    return
                job = self._jobs.popleft()
            start = time.perf_counter()
            try:
                self._compile(job)
                self._finished_seconds.put(time.perf_counter() - start)
            except Exception:  # the step compiles in its jitted call instead, as without this worker
                self.num_failed += 1
                logger.warning("compiling step shape %s ahead of use failed", job.forward_key, exc_info=True)

    def _compile(self, job: _Job) -> None:
        """Compile a job's forward unless it is compiled already, then its sampling (whose input is the forward's
        logits, shaped and sharded as the forward gives them), and publish each."""
        batch = job.batch
        with jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext():
            forward = self._forwards.get(job.forward_key)
            if forward is None:
                draft_indices = None if batch.drafts is None else batch.drafts.logits_indices
                traced = forward_step.trace(self._graph, job.state, job.kv_caches, batch.inputs, draft_indices)
                forward = self._forwards[job.forward_key] = traced.lower().compile()
                self.num_programs += 1
            if job.sampling_key not in self._samplings:
                logits_info = jax.tree.leaves(forward.out_info)[0]
                sharding = forward.output_shardings[0]
                logits = jax.ShapeDtypeStruct(logits_info.shape, logits_info.dtype, sharding=sharding)
                _, _, with_logprobs, greedy_only = job.sampling_key
                traced = sample_step.trace(logits, dataclasses.replace(batch, inputs=None), with_logprobs, greedy_only)
                self._samplings[job.sampling_key] = traced.lower().compile()
                self.num_programs += 1


# Every compiler with a worker, stopped at interpreter exit.
_COMPILERS: "weakref.WeakSet[AheadCompiler]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every worker before the interpreter (and XLA) shuts down."""
    for compiler in list(_COMPILERS):
        compiler.stop()
