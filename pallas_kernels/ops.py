"""The one attention entry point models call, and the choice of implementation behind it."""

import logging

import jax

from pallas_kernels.cpu_paged_attention import native_kernel_error, ragged_paged_attention_cpu
from pallas_kernels.kv_pages import write_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.paged_attention_gpu import paged_attention_gpu
from pallas_kernels.quantization import QuantizedKVPages, rotate, unrotate
from pallas_kernels.ragged_paged_attention_tpu import ragged_paged_attention_tpu
from pallas_kernels.reference import ragged_paged_attention_reference

logger = logging.getLogger(__name__)

# What a config may ask for.
ATTENTION_IMPLS = ("auto", "pallas", "interpret", "xla")
# What runs: a resolved name says which kernel and whether it is interpreted.
RESOLVED_IMPLS = ("xla", "cpu_native", "pallas_tpu", "pallas_gpu", "interpret_tpu", "interpret_gpu")


def resolve_attention_impl(attention_impl: str = "auto", backend: str | None = None) -> str:
    """Turn a configured implementation name into the one that will run on this backend.

    `auto` picks the Pallas TPU kernel on TPU, the Pallas GPU kernel on GPU and, on CPU, the XLA
    reference with the native kernel reading pages per token (`cpu_native`), or the plain XLA
    reference where that kernel cannot be built (the reason is logged). `interpret` runs a Pallas
    kernel in Pallas' interpreter: the GPU kernel on a GPU backend, otherwise the TPU kernel. The
    resolved names themselves are accepted too, e.g. `interpret_gpu` to interpret the GPU kernel on
    CPU, or `xla` for the pure-jnp reference alone.

    Args:
      attention_impl: auto | pallas | interpret | xla, or one of RESOLVED_IMPLS.
      backend: tpu | gpu | cpu; by default jax.default_backend() at the time of the call.
    """
    if attention_impl == "cpu_native" and (backend or jax.default_backend()) != "cpu":
        raise ValueError("attention_impl='cpu_native' runs on CPU only; use 'auto' to pick the backend's kernel")
    if attention_impl in RESOLVED_IMPLS:
        return attention_impl
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(
            f"attention_impl={attention_impl!r} is not one of {ATTENTION_IMPLS}; use 'auto' to pick from the backend"
        )
    backend = backend or jax.default_backend()
    if attention_impl == "xla":
        return "xla"
    if attention_impl == "interpret":
        return "interpret_gpu" if backend in ("gpu", "cuda", "rocm") else "interpret_tpu"
    if backend == "tpu":
        return "pallas_tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "pallas_gpu"
    if attention_impl == "auto":
        error = native_kernel_error() if backend == "cpu" else "not a CPU backend"
        if error is not None:
            logger.warning("attention on %s: the XLA reference, without the native CPU kernel (%s)", backend, error)
            return "xla"
        return "cpu_native"
    raise ValueError(
        f"attention_impl='pallas' needs a TPU or GPU, but the backend is {backend!r}; "
        "use 'xla' (the fast path on CPU), 'interpret' (the Pallas kernels, interpreted) or 'auto'"
    )


def ragged_attention(
    q: jax.Array,  # [T, num_q_heads, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    attention_impl: str,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_q_heads, D]
    """Attend each new token over its sequence's pages (already written) with a resolved implementation.

    Args:
      q: queries of the new tokens, already rotated.
      kv_pages: one layer's page pool, plain or 8-bit (FP8 or int8) with scales.
      metadata: the ragged batch layout.
      sm_scale: multiplier applied to q.k.
      attention_impl: one of RESOLVED_IMPLS.
      sliding_window, soft_cap: optional local attention and logit soft-cap.
    """
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if attention_impl == "xla":
        return ragged_paged_attention_reference(q, kv_pages, metadata, **options)
    if attention_impl == "cpu_native":
        return ragged_paged_attention_cpu(q, kv_pages, metadata, **options)
    if attention_impl in ("pallas_tpu", "interpret_tpu"):
        return ragged_paged_attention_tpu(q, kv_pages, metadata, interpret=attention_impl == "interpret_tpu", **options)
    if attention_impl in ("pallas_gpu", "interpret_gpu"):
        return paged_attention_gpu(q, kv_pages, metadata, interpret=attention_impl == "interpret_gpu", **options)
    raise ValueError(f"attention_impl={attention_impl!r} is not resolved; pass it through resolve_attention_impl")


def paged_attention(
    q: jax.Array,  # [T, num_q_heads, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    kv_pages: jax.Array | QuantizedKVPages,  # [num_pages, page_size, 2 * K * D]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    attention_impl: str = "xla",
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array | QuantizedKVPages]:  # ([T, num_q_heads, D], kv_pages)
    """Write this step's K/V into the pool, then attend each token over its sequence's pages.

    The write is one XLA scatter into the donated pool (quantizing for 8-bit pools), for every
    implementation (a bf16 pool under cpu_native: the native in-place write); the attention kernels then
    read the pages it wrote. An 8-bit pool holds K/V
    turned by quantization.rotation_matrix R: q is turned the same way, so q.k is unchanged,
    and the output is turned back.

    Args:
      q, k, v: projections of the new tokens (q and k already rotated).
      kv_pages: one layer's page pool, plain or 8-bit (FP8 or int8) with scales; returned updated.
      metadata: the ragged batch layout.
      sm_scale: multiplier applied to q.k.
      attention_impl: a configured or resolved implementation name (see resolve_attention_impl).
      sliding_window: optional local-attention window, in tokens.
      soft_cap: optional logit soft-cap.
    """
    attention_impl = resolve_attention_impl(attention_impl)
    quantized = isinstance(kv_pages, QuantizedKVPages)
    native = attention_impl == "cpu_native"
    if quantized:
        q, k, v = rotate(q, native=native), rotate(k, native=native), rotate(v, native=native)
    kv_pages = write_kv(kv_pages, k, v, metadata.slots, native=native)
    out = ragged_attention(
        q,
        kv_pages,
        metadata,
        sm_scale=sm_scale,
        attention_impl=attention_impl,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    return (unrotate(out, native=native) if quantized else out), kv_pages
