"""A few activation rows times a weight matrix on CPU through a native XLA FFI kernel (cpu_small_matmul.cc), beside
its pure-jnp reference.

At one to eight rows (a batch-1 decode, a token and its drafts, a small batch) a matmul is bound by reading its
weights, and XLA:CPU reads them slowly there: bf16 weights at about 10 GB/s at any row count, f32 ones well for one
row but at about half that rate for 2 to 8. The kernel streams each weight once (bf16 widened to f32 in registers,
f32 sums): on 30 SmolLM2-sized layers and its lm_head, bf16 at one row 26 to 13 ms, f32 at 4 rows 45 to 26 ms
(BUILD.md). Prefetching the weight rows ahead and a caller that spins for the other thread's last item took the one-row
bf16 MLPs from 13.5 to 6.3 ms on a 2-core Xeon.

Numerics are those of `models.layers.project`: activations rounded to the weight's dtype, exact products, f32 sums.
Each output's sum runs over K in one order whatever the other rows are.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.native_library import MATMUL_TARGETS, native_kernel_error

# The most rows the kernel takes; larger products are the blocked kernel's (cpu_blocked_matmul.py) or XLA's.
MAX_NATIVE_ROWS = 8


def native_matmul_reads(rows: int, weight_dtype) -> bool:
    """Whether the kernel takes a product of `rows` activation rows with a weight of this dtype."""
    return 1 <= rows <= MAX_NATIVE_ROWS and jnp.dtype(weight_dtype) in MATMUL_TARGETS


def small_matmul_reference(
    x: jax.Array,  # f32[T, K]
    weight: jax.Array,  # [K, N], or [N, K] with contraction_last
    *,
    contraction_last: bool = False,
) -> jax.Array:  # f32[T, N]
    """x @ weight (or x @ weight.T) with x rounded to the weight's dtype and f32 accumulation, in jnp.

    Args:
      x: activation rows in f32.
      weight: f32 or bf16 weights.
      contraction_last: the weight is [N, K] (a tied embedding as the lm_head) instead of [K, N].
    """
    rounded = x.astype(weight.dtype).astype(jnp.float32)
    wide = weight.astype(jnp.float32)
    return jnp.dot(rounded, wide.T if contraction_last else wide, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("contraction_last",))
def small_matmul_cpu(
    x: jax.Array,  # f32[T, K]
    weight: jax.Array,  # [K, N], or [N, K] with contraction_last
    *,
    contraction_last: bool = False,
) -> jax.Array:  # f32[T, N]
    """small_matmul_reference through the native kernel (T <= MAX_NATIVE_ROWS, f32 or bf16 weights, on CPU).

    Args:
      x: activation rows in f32.
      weight: f32 or bf16 weights.
      contraction_last: the weight is [N, K] instead of [K, N].
    """
    rows = x.shape[0]
    if not native_matmul_reads(rows, weight.dtype):
        raise ValueError(
            f"the native CPU matmul takes 1 to {MAX_NATIVE_ROWS} rows of f32 or bf16 weights, not {rows} rows of "
            f"{weight.dtype}; larger products go to the blocked kernel or XLA (models.layers.project chooses)"
        )
    return call_native_matmul(MATMUL_TARGETS, x, weight, contraction_last)


def call_native_matmul(targets: dict, x: jax.Array, weight: jax.Array, contraction_last: bool) -> jax.Array:
    """x (rounded to the weight's dtype) @ weight through the native kernel in `targets` for the weight's dtype, after
    checking that the kernels are built and the operands fit: the small-row and blocked matmuls' shared call."""
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native CPU matmul cannot run: {error}")
    rows, depth = x.shape
    if jnp.dtype(weight.dtype) not in targets:
        raise ValueError(f"the native CPU matmul takes f32 or bf16 weights, not {weight.dtype}")
    if weight.ndim != 2 or weight.shape[1 if contraction_last else 0] != depth:
        raise ValueError(
            f"x is [{rows}, {depth}] but the weight is {weight.shape} (contraction_last={contraction_last})"
        )
    columns = weight.shape[0 if contraction_last else 1]
    target, _ = targets[jnp.dtype(weight.dtype)]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, columns), jnp.float32))
    rounded = x.astype(weight.dtype).astype(jnp.float32)
    return call(rounded, weight, contraction_last=contraction_last)
