"""The fixed rotation of 8-bit KV (quantization.rotation_matrix where head_dim is a power of two) on CPU, through a
native XLA FFI kernel (cpu_hadamard.cc): the fast Walsh-Hadamard transform of each row.

An 8-bit pool holds K and V turned by a normalized Hadamard matrix, so a layer turns q, k and v on the way in and its
attention's output on the way out. XLA:CPU runs each as a dot with the [D, D] matrix, its own thunk: 2.3 ms a layer
for a 2048-token prompt of SmolLM2 and 0.1 ms at 16 decode rows on a 2-core Zen 4. The kernel takes log2(D)
butterflies a row instead. Its result equals the dot's up to f32 rounding (quantization.rotate is the reference).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.native_library import HADAMARD_TARGET, native_kernel_error

# The widest rows the kernel takes (cpu_hadamard.cc's kMaxWidth).
MAX_WIDTH = 512


def turns_natively(head_dim: int) -> bool:
    """Whether hadamard_rows_cpu takes rows of this width: a power of two up to MAX_WIDTH, where rotation_matrix is
    the normalized Sylvester-Hadamard matrix."""
    return 0 < head_dim <= MAX_WIDTH and head_dim & (head_dim - 1) == 0


def hadamard_rows_cpu(x: jax.Array) -> jax.Array:  # [..., D] -> [..., D], x's dtype
    """x @ H_D / sqrt(D) over the last axis (the normalized Sylvester-Hadamard matrix, symmetric and its own
    inverse), computed in f32 by the native kernel and cast back to x's dtype.

    Args:
      x: rows of a power-of-two width D (turns_natively).
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native rotation kernel cannot run: {error}")
    head_dim = x.shape[-1]
    if not turns_natively(head_dim):
        raise ValueError(f"the native rotation takes rows of a power-of-two width up to {MAX_WIDTH}; got {head_dim}")
    rows = x.reshape(-1, head_dim).astype(jnp.float32)
    target, _ = HADAMARD_TARGET
    turned = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(rows.shape, jnp.float32))(rows)
    return turned.reshape(x.shape).astype(x.dtype)
