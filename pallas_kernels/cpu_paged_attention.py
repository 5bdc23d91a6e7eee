"""Paged attention on CPU through a native XLA FFI kernel (cpu_paged_attention.cc): every token of a plain f32 or
bf16 pool (decode tokens with or without speculative drafts, and prefill chunks); 8-bit pools keep the XLA
reference's blocked path and its per-token reader.

XLA:CPU's version of the per-token read gathers every token's KV block into a fresh array first, at about 4 GB/s;
the native kernel walks the pages in place (12-15 GB/s on 2 cores, 3x less time at batch 32). Prefill chunks take
its tiled path, a matrix-product-shaped loop over each page: SmolLM2's 2048-token prompt attends in about 40 ms a
layer there, against about 107 ms by the reference's 128 x 128 blocks (BUILD.md).

The shared library is compiled from the source beside this file (and the two headers it includes) on first use with
the system's C++ compiler (g++ or $CXX), against jaxlib's FFI headers, and kept in a cache folder keyed by everything
that changes the binary; where no compiler works, `native_kernel_error()` says why and `auto` keeps the pure-jnp
reference.
"""

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_pages import num_kv_heads_of
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.quantization import QuantizedKVPages
from pallas_kernels.reference import attend_per_token, ragged_attention_with_reader

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "cpu_paged_attention.cc")
# The headers it includes from beside itself: part of the library's cache key.
HEADERS = tuple(
    os.path.join(_HERE, name)
    for name in ("cpu_paged_attention_vectors.h", "cpu_paged_attention_lanes.h", "cpu_paged_attention_tiled.h")
)
CACHE_ENV_VAR = "PAXKV_NATIVE_CACHE_DIR"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# When the blocked path runs (kv_read="per_block", or an 8-bit pool under "auto"): query blocks whose rows average
# at most this many tokens (a decode token and its drafts) go to the per-token reader, longer chunks to the
# reference's matmuls.
NATIVE_RUN_TOKENS = 8
# FFI target and library symbol of each page dtype the kernel reads (8-bit pools keep the reference's reader).
_TARGETS = {
    jnp.dtype(jnp.float32): ("paxkv_cpu_paged_attention_f32", "PaxkvCpuPagedAttentionF32"),
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_paged_attention_bf16", "PaxkvCpuPagedAttentionBF16"),
}


def _cache_dir() -> str:
    """$PAXKV_NATIVE_CACHE_DIR, else $XDG_CACHE_HOME/paxkv/native (~/.cache/paxkv/native)."""
    explicit = os.environ.get(CACHE_ENV_VAR)
    if explicit:
        return explicit
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "paxkv", "native")


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), so a cache shared by machines never mixes them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _library_path(compiler: str) -> str:
    """Where the library built from today's source, headers, compiler, flags, CPU and jaxlib lives in the cache."""
    key = hashlib.sha256()
    for path in (SOURCE, *HEADERS):
        with open(path, "rb") as f:
            key.update(f.read())
    for part in (compiler.encode(), " ".join(COMPILE_FLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
    key.update(importlib.metadata.version("jaxlib").encode())
    return os.path.join(_cache_dir(), f"cpu_paged_attention-{key.hexdigest()[:16]}.so")


def _build(compiler: str) -> str:
    """Compile the kernel (or find it compiled) and return the shared library's path; raises on failure."""
    library = _library_path(compiler)
    if os.path.exists(library):
        return library
    folder = os.path.dirname(library)
    os.makedirs(folder, exist_ok=True)
    # Compiled beside its final name, then renamed: processes building at once never load a half-written file.
    descriptor, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(descriptor)
    command = [compiler, *COMPILE_FLAGS, f"-I{jax.ffi.include_dir()}", SOURCE, "-o", partial]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-2000:]}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return library


# XLA's handler registry is per process and refuses a second handler under a name, so the first library that
# loads serves the process (every build of one source is the same kernel).
_registered_library: list[str] = []


@functools.cache
def _load() -> str | None:
    """Build (or find) and load the kernel, registering it once per process; None when that worked, else why not."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return "no C++ compiler found (install g++, or set $CXX)"
    try:
        path = _build(compiler)
        library = ctypes.cdll.LoadLibrary(path)
        if not _registered_library:
            for target, symbol in _TARGETS.values():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
            _registered_library.append(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return f"building the native CPU attention kernel failed: {error}"
    return None


def native_kernel_error() -> str | None:
    """Why the native kernel cannot run here (no compiler, a failed build), or None when it can."""
    return _load()


def _native_reads(kv_pages) -> bool:
    """Whether the kernel reads this pool (plain f32 or bf16 pages; 8-bit pools keep the jnp reader)."""
    return not isinstance(kv_pages, QuantizedKVPages) and jnp.dtype(kv_pages.dtype) in _TARGETS


def _native_reader(q, kv_pages, block_tables, tokens, sliding_window, soft_cap):
    """attend_per_token's contract through the native kernel; 8-bit pools keep the jnp reader."""
    if not _native_reads(kv_pages):
        return attend_per_token(q, kv_pages, block_tables, tokens, sliding_window, soft_cap)
    num_kv_heads_of(kv_pages, q.shape[-1])  # checks the pool's width against head_dim
    target, _ = _TARGETS[jnp.dtype(kv_pages.dtype)]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        kv_pages,
        block_tables.astype(jnp.int32),
        tokens.row.astype(jnp.int32),
        tokens.query_positions.astype(jnp.int32),
        tokens.kv_lens.astype(jnp.int32),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "kv_read"))
def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_read: str = "auto",
) -> jax.Array:  # [T, num_q_heads, D]
    """ragged_paged_attention_reference through the native kernel: under kv_read="auto" it takes every token of a
    plain f32 or bf16 pool; 8-bit pools, and the other kv_read modes, keep the reference's paths around it.

    Args:
      q: queries of the new tokens, already rotated.
      kv_pages: one layer's page pool.
      metadata: the ragged batch layout.
      sm_scale, sliding_window, soft_cap, kv_read: as ragged_paged_attention_reference.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"attention_impl='cpu_native' cannot run: {error}; use attention_impl='xla'")
    if kv_read == "auto" and _native_reads(kv_pages):
        kv_read = "per_token"  # the kernel takes every token: decode runs and prefill chunks alike
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, kv_read=kv_read)
    return ragged_attention_with_reader(
        q, kv_pages, metadata, token_reader=_native_reader, reader_run_tokens=NATIVE_RUN_TOKENS, **options
    )
