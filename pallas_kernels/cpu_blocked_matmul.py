"""Tens of activation rows times a weight matrix on CPU through a native XLA FFI kernel (cpu_blocked_matmul.cc),
beside the same pure-jnp reference as the small-row kernel (cpu_small_matmul.small_matmul_reference).

From about 9 rows a decode batch's matmul is bound by arithmetic. XLA:CPU runs SmolLM2's 32-row products at 65-90
GFLOP/s; this kernel's register tiles (6 rows x 2 vectors of fused multiply-adds over weights packed a block at a
time into the core's first-level cache, the next block prefetched) run them at about 125 (BUILD.md). bf16 weights
are widened once while packing, so they run as fast as f32 ones, where XLA:CPU's bf16 products run at 55-65% of its
f32 rate at 16-128 rows on a machine without AVX-512 BF16. Both weight layouts: [K, N] projections and the [N, K]
tied embedding as the lm_head (its blocks transposed while packing).

Its tiles are sized for AVX2's sixteen vector registers. On a machine with AVX-512, XLA:CPU's own matmuls beat it
(a 2-core Xeon with AVX-512 BF16 and AMX, SmolLM2's batch-32 decode step: f32 99 to 93 ms with XLA's, bf16 87 to 61
ms; the tied lm_head at 32 rows 15 against 9 ms in f32, 12 against 4 in bf16), so there it takes nothing.

Numerics are those of `models.layers.project`: activations rounded to the weight's dtype, exact products, f32 sums,
each output summed over K in one order whatever the other rows are.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_small_matmul import MAX_NATIVE_ROWS, call_native_matmul
from pallas_kernels.native_library import BLOCKED_MATMUL_TARGETS, cpu_feature_flags

# The row counts the kernel takes: above the small-row kernel's; f32 up to where XLA's own matmuls do as well (at
# 30 SmolLM2 layers and its lm_head: 64 rows even, 256 XLA's by 12%), bf16 at any count.
MIN_BLOCKED_ROWS = MAX_NATIVE_ROWS + 1
MAX_BLOCKED_F32_ROWS = 64


def blocked_kernel_beats_xla(cpu_flags: frozenset[str]) -> bool:
    """Whether the blocked kernel beats XLA:CPU's matmuls on a CPU with these feature flags: only without AVX-512."""
    return "avx512f" not in cpu_flags


def blocked_matmul_reads(rows: int, weight_dtype, cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether models.layers.project gives the blocked kernel a product of `rows` activation rows with a weight of
    this dtype (where it beats XLA:CPU).

    Args:
      rows: the product's activation rows.
      weight_dtype: the weight's storage dtype.
      cpu_flags: the CPU's feature flags (default: this machine's).
    """
    dtype = jnp.dtype(weight_dtype)
    if dtype not in BLOCKED_MATMUL_TARGETS or rows < MIN_BLOCKED_ROWS:
        return False
    if not blocked_kernel_beats_xla(cpu_feature_flags() if cpu_flags is None else cpu_flags):
        return False
    return dtype != jnp.float32 or rows <= MAX_BLOCKED_F32_ROWS


@functools.partial(jax.jit, static_argnames=("contraction_last",))
def blocked_matmul_cpu(
    x: jax.Array,  # f32[T, K]
    weight: jax.Array,  # [K, N], or [N, K] with contraction_last
    *,
    contraction_last: bool = False,
) -> jax.Array:  # f32[T, N]
    """small_matmul_reference through the blocked native kernel (any T; f32 or bf16 weights; on CPU).

    Args:
      x: activation rows in f32.
      weight: f32 or bf16 weights.
      contraction_last: the weight is [N, K] (a tied embedding as the lm_head) instead of [K, N].
    """
    return call_native_matmul(BLOCKED_MATMUL_TARGETS, x, weight, contraction_last)
