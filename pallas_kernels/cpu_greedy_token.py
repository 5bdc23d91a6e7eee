"""Each row's greedy token (its first largest logit, or a marker where the row holds NaN or infinity) on CPU through
a native XLA FFI kernel (cpu_greedy_token.cc), beside its pure-jnp reference.

XLA:CPU runs the reference as three reductions over the logits, each a pass over memory: 1.0-1.3 ms a batch-32
decode step at SmolLM2's 49152-token vocabulary and 0.75-0.9 ms at 32000 (a 20 M-parameter Llama's whole step is
8.3 ms) on a 2-core Zen 4. The kernel reads each row from memory once and answers the same index.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native_library import GREEDY_TOKEN_TARGET, native_kernel_error


def first_argmax(values: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first maximum, or the first NaN where a row holds one), as two plain
    reductions. i32[...].

    jnp.argmax lowers to one reduction over (value, index) pairs, which libtpu compiles slowly (v6e, [32, 128256]
    f32: 0.81 s alone and 5.3 s with the Gumbel noise fused into it, against 0.16 s and 2.2 s for these two) and
    XLA:CPU runs slowly ([32, 49152]: 3.8 ms against 1.3 ms; with the noise, 27 ms against 11 ms).
    """
    largest = jnp.max(values, axis=-1, keepdims=True)  # NaN where the row holds one
    index = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    hits = (values == largest) | jnp.isnan(values)
    return jnp.min(jnp.where(hits, index, values.shape[-1]), axis=-1)


def greedy_tokens_reference(logits: jax.Array, nonfinite: int) -> jax.Array:  # i32[S]
    """The index of each row's first largest value, or `nonfinite` where the row holds a NaN or an infinity, in jnp
    (first_argmax's two plain reductions).

    Args:
      logits: f32[S, V].
      nonfinite: the token reported for a row that is not all finite.
    """
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), first_argmax(logits), nonfinite).astype(jnp.int32)


def greedy_tokens_cpu(logits: jax.Array, nonfinite: int) -> jax.Array:  # i32[S]
    """greedy_tokens_reference through the native kernel (on CPU; f32 logits).

    Args:
      logits: f32[S, V].
      nonfinite: the token reported for a row that is not all finite.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native greedy-token kernel cannot run: {error}")
    if logits.ndim != 2:
        raise ValueError(f"greedy tokens take logits [S, V]; got shape {list(logits.shape)}")
    target, _ = GREEDY_TOKEN_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))
    return call(logits.astype(jnp.float32), nonfinite=np.int64(nonfinite))
