"""EngineLoop: one thread owns an Engine and steps it while there is work.

Other threads (the HTTP server's event loop) never touch the Engine: they queue commands (add a request, abort
one), and the engine thread applies them between steps and hands each request's outputs to that request's sink.
So a request is validated by the engine itself (its error reaches the caller before anything runs), and a
client that leaves has its request aborted, and its pages freed, before the next step.
"""

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from paxkv.core.engine import Engine
from paxkv.core.metrics import EngineMetrics
from paxkv.core.outputs import RequestOutput

logger = logging.getLogger(__name__)

# How long the idle engine thread waits for a command before it looks at its stop flag again.
IDLE_POLL_SECONDS = 0.5


class EngineDeadError(RuntimeError):
    """The engine thread has stopped, by a failure or by shutdown; no request can be served."""


class OutputSink(Protocol):
    """Where the engine thread delivers one request's outputs (each call must return at once)."""

    def put(self, output: RequestOutput) -> None: ...
    def fail(self, error: BaseException) -> None: ...


@dataclasses.dataclass(frozen=True)
class LoopState:
    """What the engine thread last saw, for the health check and the metrics (a consistent snapshot)."""

    num_running: int = 0
    num_waiting: int = 0
    metrics: EngineMetrics | None = None


@dataclasses.dataclass
class _Add:
    request_id: str
    arguments: dict  # Engine.add_request's keyword arguments besides the id
    sink: OutputSink
    on_added: Callable[[Exception | None], None]  # None when admitted, else the engine's ValueError


@dataclasses.dataclass
class _Abort:
    request_id: str


class EngineLoop:
    """Steps one Engine on a thread of its own; add() and abort() may be called from any thread."""

    def __init__(self, engine: Engine):
        """Args:
        engine: the engine; from start() on, only the loop's thread touches it.
        """
        self.engine = engine
        self.error: BaseException | None = None
        self.num_steps = 0
        self.state = LoopState(metrics=dataclasses.replace(engine.metrics))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._num_queued_adds = 0  # adds sent but not yet applied (read by other threads for admission control)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paxkv-engine", daemon=True)

    def start(self) -> "EngineLoop":
        """Start the engine thread."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request (their sinks get outputs with finish_reason "abort") and end the thread.

        Args:
          timeout: seconds to wait for the step in flight to finish.
        """
        self._stopping.set()
        self._commands.put(None)  # wake an idle thread
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread runs and has not failed: what /health reports."""
        return self._thread.is_alive() and self.error is None and not self._stopping.is_set()

    @property
    def num_pending(self) -> int:
        """Requests added but not running yet: queued for the engine thread or waiting in its scheduler."""
        return self._num_queued_adds + self.state.num_waiting

    def add(self, request_id: str, arguments: dict, sink: OutputSink, on_added: Callable) -> None:
        """Queue a request for the engine thread.

        Args:
          request_id: a unique id.
          arguments: Engine.add_request's keyword arguments (prompt_token_ids, sampling_params, prompt,
            cache_salt, priority).
          sink: receives the request's outputs, or its failure, on the engine thread.
          on_added: called on the engine thread with None once the engine admitted the request, or with the
            ValueError that refused it (the sink then gets nothing).
        Raises:
          EngineDeadError: the engine thread is not running.
        """
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason())
        with self._lock:
            self._num_queued_adds += 1
        self._commands.put(_Add(request_id, arguments, sink, on_added))
        if not self.is_alive:  # the thread ended after the check above, and may have drained its queue already
            self._refuse_queued()

    def abort(self, request_id: str) -> None:
        """Queue an abort (a request the engine no longer knows is ignored); its sink gets nothing more."""
        self._commands.put(_Abort(request_id))

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {self.error}"
        return "the engine is shutting down" if self._stopping.is_set() else "the engine is not running"

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._apply_commands(wait=not engine.has_unfinished_requests())
                if self._stopping.is_set() or not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                self.num_steps += 1
                self._deliver(outputs)
                self._snapshot()
        except BaseException as error:  # noqa: BLE001 - the loop reports every failure to every caller
            logger.exception("the engine thread failed; every request in flight gets an error")
            self.error = error
            self._fail_everything(error)
            return
        self._abort_everything()

    def _apply_commands(self, wait: bool) -> None:
        """Apply every queued command (None only wakes the thread); when `wait`, block briefly for the first one."""
        applied = False
        while True:
            try:
                command = self._commands.get(timeout=IDLE_POLL_SECONDS) if wait else self._commands.get_nowait()
            except queue.Empty:
                break
            wait = False
            if isinstance(command, _Add):
                self._apply_add(command)
                applied = True
            elif isinstance(command, _Abort) and command.request_id in self._sinks:
                del self._sinks[command.request_id]
                self.engine.abort(command.request_id)
                applied = True
        if applied:
            self._snapshot()

    def _apply_add(self, command: _Add) -> None:
        with self._lock:
            self._num_queued_adds -= 1
        try:
            self.engine.add_request(command.request_id, **command.arguments)
        except Exception as error:  # a ValueError names what is wrong; anything else is a bug, but only this one's
            if not isinstance(error, ValueError):
                logger.exception("adding request %s failed", command.request_id)
            command.on_added(error)
            return
        self._sinks[command.request_id] = command.sink
        command.on_added(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            sink.put(output)

    def _snapshot(self) -> None:
        scheduler = self.engine.scheduler
        self.state = LoopState(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            metrics=dataclasses.replace(self.engine.metrics),
        )

    def _fail_everything(self, error: BaseException) -> None:
        """After a failure: every request in flight gets the error, and every add still queued is refused."""
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.fail(error)
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Answer every add still queued with EngineDeadError (from any thread, once the engine thread has ended)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                with self._lock:
                    self._num_queued_adds -= 1
                command.on_added(EngineDeadError(self._dead_reason()))

    def _abort_everything(self) -> None:
        """At shutdown: abort what runs (each sink gets its output so far, finish_reason "abort"); refuse the rest."""
        for request_id, sink in list(self._sinks.items()):
            output = self.engine.abort(request_id)
            if output is not None:
                sink.put(output)
        self._sinks = {}
        self._fail_everything(EngineDeadError("the engine is shutting down"))
