"""How much of a run went to compiling: programs compiled, programs loaded from the persistent cache, seconds.

A run's first steps compile (or load) their programs, so a short run's tokens per second are mostly compile
time; the runner's summary reports the two apart. The counts come from JAX's monitoring events, which cover
every program the process builds.
"""

import dataclasses
import threading

from jax import monitoring

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"  # an XLA compile, or a persistent-cache load
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_READ = "/jax/compilation_cache/cache_retrieval_time_sec"


@dataclasses.dataclass(frozen=True)
class CompileTotals:
    """Process-wide totals since start-up; subtract two to get what happened between them."""

    programs: int = 0  # programs built: compiled by XLA or loaded from the persistent cache
    cache_hits: int = 0  # of them, loaded from the cache
    seconds: float = 0.0  # tracing, lowering, compiling and cache loads together
    cache_seconds: float = 0.0  # of it, reading the cache

    @property
    def compiled(self) -> int:
        """Programs XLA compiled (not found in the cache)."""
        return self.programs - self.cache_hits

    def __sub__(self, other: "CompileTotals") -> "CompileTotals":
        return CompileTotals(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))


_lock = threading.Lock()
_totals = {"programs": 0, "cache_hits": 0, "seconds": 0.0, "cache_seconds": 0.0}
_listening = False


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    with _lock:
        if event in (_TRACE, _LOWER, _BACKEND):
            _totals["seconds"] += seconds
        if event == _BACKEND:
            _totals["programs"] += 1
        elif event == _CACHE_READ:
            _totals["cache_seconds"] += seconds


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _totals["cache_hits"] += 1


def compile_totals() -> CompileTotals:
    """The totals so far; the first call starts listening (programs built before it are not counted)."""
    global _listening
    with _lock:
        if not _listening:
            monitoring.register_event_duration_secs_listener(_on_duration)
            monitoring.register_event_listener(_on_event)
            _listening = True
        return CompileTotals(**_totals)
