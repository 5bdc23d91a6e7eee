"""JAX's persistent compilation cache, on by default for the CLI and the tests."""

import os

import jax

ENV_VAR = "PAXKV_COMPILATION_CACHE_DIR"
# Compilations quicker than this many seconds are not cached (default 0: all are).
MIN_SECONDS_ENV_VAR = "PAXKV_COMPILATION_CACHE_MIN_SECONDS"


def default_cache_dir() -> str:
    """$PAXKV_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/paxkv/jax_compilation_cache (~/.cache/...)."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "paxkv", "jax_compilation_cache")


def enable_compilation_cache(cache_dir: str | None = None) -> str:
    """Point JAX's persistent cache at `cache_dir` and cache every compilation, however quick.

    $PAXKV_COMPILATION_CACHE_MIN_SECONDS raises that floor (the tests' CLI subprocesses use 2 s).

    JAX writes entries without a lock or an atomic rename, so processes that compile the same program
    at the same time into one folder can read each other's half-written entries (and crash
    deserializing them): give concurrent processes separate folders, as the tests do per xdist worker.

    Args:
      cache_dir: the cache folder; default_cache_dir() when None.
    Returns:
      The folder used.
    """
    cache_dir = cache_dir or default_cache_dir()
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ.get(MIN_SECONDS_ENV_VAR) or 0.0))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir
