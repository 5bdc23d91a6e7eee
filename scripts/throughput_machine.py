"""What a benchmark run ran on (scripts/bench_throughput.py): the machine in words, its measured matmul and memory-read
ceilings, and the checkout's commit."""

import os
import platform
import subprocess
import time

from throughput_report import MATMUL_SIZE, READ_BYTES  # scripts/ is on sys.path


def matmul_ceiling_gflops(size: int = MATMUL_SIZE, repeats: int = 10, dtype: str = "float32") -> float:
    """The matmul ceiling: a jitted jnp.dot of two size x size matrices (bf16: accumulated in f32, as paxkv's bf16
    weights multiply), best of `repeats`, in GFLOP/s.

    Args:
      size: the matrices' side.
      repeats: timed runs after one warm-up.
      dtype: the operands' dtype.
    """
    import jax
    import jax.numpy as jnp

    a, b = jax.random.normal(jax.random.key(0), (2, size, size), jnp.float32).astype(dtype)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def read_bandwidth_gbs(num_bytes: int = READ_BYTES, repeats: int = 10) -> float:
    """The memory read ceiling: a jitted sum over a num_bytes f32 array, best of `repeats`, in GB/s.

    Args:
      num_bytes: the array's size (far beyond the caches).
      repeats: timed runs after one warm-up.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def machine_description() -> str:
    """CPU model, core count and memory, in words."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cpus, {memory:.0f} GiB, {platform.system()} {platform.machine()}"


def checkout_commit(root: str | None = None) -> str | None:
    """The commit of this checkout (or of `root`), with +dirty when the tree has changes."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if commit.returncode == 0 else None
