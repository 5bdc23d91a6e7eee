"""JAX's persistent compilation cache, on by default for the CLI and the tests."""

import os

import jax

ENV_VAR = "PAXKV_COMPILATION_CACHE_DIR"
# A size limit turns on JAX's LRU eviction, and with it a file lock around every read and write. Without
# the lock a process can read an entry another is still writing (xdist workers compile the same
# programs) and crash deserializing the truncated executable.
MAX_CACHE_BYTES = 4 << 30


def default_cache_dir() -> str:
    """$PAXKV_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/paxkv/jax_compilation_cache (~/.cache/...)."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "paxkv", "jax_compilation_cache")


def enable_compilation_cache(cache_dir: str | None = None) -> str:
    """Point JAX's persistent cache at `cache_dir`, cache every compilation however quick, bounded and locked.

    Args:
      cache_dir: the cache folder; default_cache_dir() when None.
    Returns:
      The folder used.
    """
    cache_dir = cache_dir or default_cache_dir()
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    return cache_dir
