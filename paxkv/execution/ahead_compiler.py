"""Programs compiled on a worker thread before any step runs them, so that trying a new step shape never stalls the
engine.

Plain step programs are compiled at warm-up (ModelRunner.warm_up), but a speculating step's forward depends on its
draft-row bucket R as well, a draft model's program on the tokens it catches up over, and the adaptive draft budget
(paxkv.speculation.draft_budget) only learns which ones a workload wants as it runs. Compiling one inside a step
costs seconds on CPU (dozens of steps), so the budget never runs a step whose programs are not compiled: it asks
for the ones it expects to repay a compile, keeps drafting with what it has, and takes the new ones once ready.
A compile still takes CPU time from the steps while it runs (the engine does not time steps then), but no step
waits for one.

The programs are JAX's ahead-of-time Compiled objects (jit(...).trace(...).lower().compile()), called directly: a
jitted call after a background compile would trace and lower again before finding the executable. Each request
is a key and a function that compiles its program from abstract arguments (`abstract`, taken on the caller's
thread); requests run in order, so a program may build on one requested before it (a sampling on its forward's
output shapes).
"""

import atexit
import collections
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable

import jax

logger = logging.getLogger(__name__)


def abstract(tree):
    """The pytree's arrays as ShapeDtypeStructs with their shardings (numpy leaves without one, as a jitted call
    would place them)."""

    def shape_of(leaf):
        sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(shape_of, tree)


class AheadCompiler:
    """A worker thread that compiles requested programs, one at a time in request order, and hands each over once
    it is ready."""

    def __init__(self, mesh):
        """Args:
        mesh: the engine's mesh (every program compiles under it), or None for one device.
        """
        self._mesh = mesh
        self._programs: dict[Hashable, jax.stages.Compiled] = {}
        self._requested: set[Hashable] = set()
        self._lock = threading.Lock()  # guards the jobs, the worker's start and end, and stopping
        self._jobs: collections.deque[tuple[Hashable, Callable[[], jax.stages.Compiled]]] = collections.deque()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None  # the worker, while it has jobs
        self._stopping = False
        self._finished_seconds: queue.SimpleQueue[float] = queue.SimpleQueue()  # not yet taken
        self.num_programs = 0  # programs compiled
        self.num_failed = 0  # requests whose compile raised (their steps compile in the jitted call instead)
        self.num_jobs_started = 0  # jobs the worker has taken up

    def request(self, key: Hashable, compile_program: Callable[[], jax.stages.Compiled]) -> None:
        """Have `compile_program()` run on the worker (under the mesh) and its program kept as `key`, unless that
        key was asked for before.

        Args:
          key: the program's name, as `program` takes it.
          compile_program: compiles it from abstract arguments only (the pool's arrays are donated meanwhile).
        """
        if key in self._requested:
            return
        self._requested.add(key)
        with self._lock:
            if self._stopping:
                return
            self._jobs.append((key, compile_program))
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="paxkv-ahead-compiler", daemon=True)
                self._thread.start()
                _COMPILERS.add(self)

    def program(self, key: Hashable) -> jax.stages.Compiled | None:
        """The program of `key`, once compiled."""
        return self._programs.get(key)

    def take_compile_seconds(self) -> list[float]:
        """The wall times of the compiles finished since the last call."""
        taken = []
        while not self._finished_seconds.empty():
            taken.append(self._finished_seconds.get())
        return taken

    def quiet_mark(self) -> int | None:
        """A mark for quiet_since: None while a compile is running or waiting (the steps share the CPU with it)."""
        return self.num_jobs_started if self._idle.is_set() else None

    def quiet_since(self, mark: int | None) -> bool:
        """Whether no compile ran at any time since quiet_mark gave `mark`, so that a step timed over that span
        measured the step alone."""
        return mark is not None and self.quiet_mark() == mark

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
                key, compile_program = self._jobs.popleft()
                self.num_jobs_started += 1
            start = time.perf_counter()
            try:
                with jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext():
                    self._programs[key] = compile_program()
                self.num_programs += 1
                self._finished_seconds.put(time.perf_counter() - start)
            except Exception:  # the step compiles in its jitted call instead, as without this worker
                self.num_failed += 1
                logger.warning("compiling %s ahead of use failed", key, exc_info=True)


# Every compiler with a worker, stopped at interpreter exit.
_COMPILERS: "weakref.WeakSet[AheadCompiler]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every worker before the interpreter (and XLA) shuts down."""
    for compiler in list(_COMPILERS):
        compiler.stop()
