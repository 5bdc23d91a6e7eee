"""The native CPU kernels' shared library: built from the C++ sources beside this file on first use, cached, loaded
and registered with XLA once per process.

The library is compiled with the system's C++ compiler (g++ or $CXX) against jaxlib's FFI headers and kept in a
cache folder keyed by everything that changes the binary (sources, headers, compiler, flags, CPU features, jaxlib);
where no compiler works, `native_kernel_error()` says why, and callers keep the pure-jnp paths.
"""

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

_HERE = os.path.dirname(os.path.abspath(__file__))
# One library from every kernel's source (one compile, one load).
SOURCES = tuple(
    os.path.join(_HERE, name)
    for name in (
        "cpu_paged_attention.cc",
        "cpu_small_matmul.cc",
        "cpu_blocked_matmul.cc",
        "cpu_amx_matmul.cc",
        "cpu_panel_matmul.cc",
        "cpu_gated_mlp.cc",
        "cpu_greedy_token.cc",
        "cpu_kv_write.cc",
        "cpu_hadamard.cc",
    )
)
# The headers they include from beside themselves: part of the library's cache key.
HEADERS = tuple(
    os.path.join(_HERE, name)
    for name in (
        "cpu_native_matmul_shape.h",
        "cpu_native_parallel.h",
        "cpu_native_register_tile.h",
        "cpu_native_vectors.h",
        "cpu_panel_row_packing.h",
        "cpu_panel_tiles.h",
        "cpu_paged_attention_lanes.h",
        "cpu_paged_attention_tiled.h",
    )
)
CACHE_ENV_VAR = "PAXKV_NATIVE_CACHE_DIR"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
# FFI target and library symbol of each kernel, by the dtype it reads (KV pages or weights).
ATTENTION_TARGETS = {
    jnp.dtype(jnp.float32): ("paxkv_cpu_paged_attention_f32", "PaxkvCpuPagedAttentionF32"),
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_paged_attention_bf16", "PaxkvCpuPagedAttentionBF16"),
    jnp.dtype(jnp.int8): ("paxkv_cpu_paged_attention_int8", "PaxkvCpuPagedAttentionInt8"),  # QuantizedKVPages
}
MATMUL_TARGETS = {
    jnp.dtype(jnp.float32): ("paxkv_cpu_small_matmul_f32", "PaxkvCpuSmallMatmulF32"),
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_small_matmul_bf16", "PaxkvCpuSmallMatmulBF16"),
}
BLOCKED_MATMUL_TARGETS = {
    jnp.dtype(jnp.float32): ("paxkv_cpu_blocked_matmul_f32", "PaxkvCpuBlockedMatmulF32"),
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_blocked_matmul_bf16", "PaxkvCpuBlockedMatmulBF16"),
}
AMX_MATMUL_TARGETS = {
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_amx_matmul_bf16", "PaxkvCpuAmxMatmulBF16"),
}
PANEL_MATMUL_TARGETS = {
    jnp.dtype(jnp.float32): ("paxkv_cpu_panel_matmul_f32", "PaxkvCpuPanelMatmulF32"),
    jnp.dtype(jnp.int8): ("paxkv_cpu_panel_matmul_int8", "PaxkvCpuPanelMatmulInt8"),  # with group scales
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_panel_matmul_bf16", "PaxkvCpuPanelMatmulBf16"),  # contraction rows in pairs
}
# Several products sharing x, one call (f32 or bf16 panels alike).
PANEL_MATMULS_TARGETS = {
    jnp.dtype(jnp.float32): ("paxkv_cpu_panel_matmuls_f32", "PaxkvCpuPanelMatmulsF32"),
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_panel_matmuls_bf16", "PaxkvCpuPanelMatmulsBf16"),
}
GATED_MLP_TARGETS = {
    jnp.dtype(jnp.float32): ("paxkv_cpu_gated_mlp_f32", "PaxkvCpuGatedMlpF32"),
    jnp.dtype(jnp.bfloat16): ("paxkv_cpu_gated_mlp_bf16", "PaxkvCpuGatedMlpBf16"),
}


# FFI target and library symbol of the greedy-token kernel (f32 logits).
GREEDY_TOKEN_TARGET = ("paxkv_cpu_greedy_tokens", "PaxkvCpuGreedyTokens")
# FFI target and library symbol of the in-place KV write (plain bf16 pools).
KV_WRITE_TARGET = ("paxkv_cpu_write_kv_rows", "PaxkvCpuWriteKvRows")
# FFI target and library symbol of the 8-bit KV rotation (f32 rows times a normalized Hadamard matrix).
HADAMARD_TARGET = ("paxkv_cpu_hadamard_rows", "PaxkvCpuHadamardRows")


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


@functools.cache
def cpu_feature_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them ("avx2", "avx512f"); empty where it cannot tell."""
    line = _cpu_flags()
    if not line.startswith("flags"):
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def library_path(compiler: str) -> str:
    """Where the library built from today's sources, headers, compiler, flags, CPU and jaxlib lives in the cache."""
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        with open(path, "rb") as f:
            key.update(f.read())
    for part in (compiler.encode(), " ".join(COMPILE_FLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
    key.update(importlib.metadata.version("jaxlib").encode())
    return os.path.join(_cache_dir(), f"paxkv_native-{key.hexdigest()[:16]}.so")


def _build(compiler: str) -> str:
    """Compile the library (or find it compiled) and return its path; raises on failure."""
    library = library_path(compiler)
    if os.path.exists(library):
        return library
    folder = os.path.dirname(library)
    os.makedirs(folder, exist_ok=True)
    # Compiled beside its final name, then renamed: processes building at once never load a half-written file.
    descriptor, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(descriptor)
    command = [compiler, *COMPILE_FLAGS, f"-I{jax.ffi.include_dir()}", *SOURCES, "-o", partial]
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
# Whether the registered library has the AMX matmul and the OS granted this process AMX's tile state.
_amx_granted: list[bool] = []


@functools.cache
def load() -> str | None:
    """Build (or find) and load the library, registering its kernels once per process; None when that worked, else
    why not."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return "no C++ compiler found (install g++, or set $CXX)"
    try:
        path = _build(compiler)
        library = ctypes.cdll.LoadLibrary(path)
        if not _registered_library:
            targets = (
                *ATTENTION_TARGETS.values(),
                *MATMUL_TARGETS.values(),
                *BLOCKED_MATMUL_TARGETS.values(),
                *AMX_MATMUL_TARGETS.values(),
                *PANEL_MATMUL_TARGETS.values(),
                *PANEL_MATMULS_TARGETS.values(),
                *GATED_MLP_TARGETS.values(),
                GREEDY_TOKEN_TARGET,
                KV_WRITE_TARGET,
                HADAMARD_TARGET,
            )
            for target, symbol in targets:
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
            _registered_library.append(path)
            _amx_granted.append(bool(library.PaxkvAmxAvailable()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return f"building the native CPU kernels failed: {error}"
    return None


def native_kernel_error() -> str | None:
    """Why the native kernels cannot run here (no compiler, a failed build), or None when they can."""
    return load()


def amx_available() -> bool:
    """Whether the native AMX matmul runs here: the library built with AMX (the CPU has amx_bf16) and the OS granted
    this process the tile state."""
    return load() is None and bool(_amx_granted) and _amx_granted[0]
