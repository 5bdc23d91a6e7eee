"""Tens of activation rows times a weight matrix on CPU through a native XLA FFI kernel (cpu_blocked_matmul.cc),
beside the same pure-jnp reference as the small-row kernel (cpu_small_matmul.small_matmul_reference).

From about 9 rows a decode batch's matmul is bound by arithmetic. XLA:CPU runs SmolLM2's 32-row products at 65-90
GFLOP/s; this kernel's register tiles (6 rows x 2 vectors of fused multiply-adds over weights packed a block at a
time into the core's first-level cache, the next block prefetched) run them at about 125 (BUILD.md). bf16 weights
are widened once while packing, so they run as fast as f32 ones, where XLA:CPU's bf16 products run at 55-65% of its
f32 rate at 16-128 rows on a machine without AVX-512 BF16. Both weight layouts: [K, N] projections and the [N, K]
tied embedding as the lm_head (its blocks transposed while packing).

Which products it takes depends on the machine (`blocked_matmul_reads`). On a 2-core Xeon with AVX-512, AVX-512 BF16
and AMX, XLA:CPU's own matmuls beat it everywhere but at 9 to 32 rows of f32 [K, N] weights (30 SmolLM2 MLPs, ms,
kernel against XLA: f32 16 rows 27 / 32, 32 rows 36 / 44, 64 rows 55 / 51; bf16 32 rows 29 / 23, 64 rows 50 / 25,
XLA's bf16 products running on the bf16 instructions; the tied lm_head, whose blocks it transposes value by value
without AVX2's 8 x 8 shuffles, at 32 rows f32 12.9 / 10.3, bf16 9.3 / 4.3).

Numerics are those of `models.layers.project`: activations rounded to the weight's dtype, exact products, f32 sums,
each output summed over K in one order whatever the other rows are.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_small_matmul import MAX_NATIVE_ROWS, call_native_matmul
from pallas_kernels.native_library import BLOCKED_MATMUL_TARGETS, cpu_feature_flags

# The row counts the kernel takes: above the small-row kernel's; f32 up to where XLA's own matmuls do as well (at
# 30 SmolLM2 layers and its lm_head on AVX2: 64 rows even, 256 XLA's by 12%; with AVX-512, 64 rows XLA's by 8%), bf16
# at any count where XLA's bf16 products have no bf16 instructions to run on.
MIN_BLOCKED_ROWS = MAX_NATIVE_ROWS + 1
MAX_BLOCKED_F32_ROWS = 64
MAX_BLOCKED_F32_ROWS_AVX512 = 32


def blocked_matmul_reads(
    rows: int, weight_dtype, contraction_last: bool = False, cpu_flags: frozenset[str] | None = None
) -> bool:
    """Whether models.layers.project gives the blocked kernel a product of `rows` activation rows with a weight of
    this dtype and layout: where it beats XLA:CPU on this kind of machine (the module docstring's measurements).

    Args:
      rows: the product's activation rows.
      weight_dtype: the weight's storage dtype.
      contraction_last: the weight is [N, K] (a tied embedding as the lm_head).
      cpu_flags: the CPU's feature flags as /proc/cpuinfo names them (default: this machine's).
    """
    dtype = jnp.dtype(weight_dtype)
    if dtype not in BLOCKED_MATMUL_TARGETS or rows < MIN_BLOCKED_ROWS:
        return False
    flags = cpu_feature_flags() if cpu_flags is None else cpu_flags
    if "avx512f" not in flags:  # AVX2 and older: XLA:CPU's matmuls are slow at tens of rows
        return dtype != jnp.float32 or rows <= MAX_BLOCKED_F32_ROWS
    if contraction_last or dtype != jnp.float32:  # XLA's are faster: its transposes, its bf16 instructions
        return dtype != jnp.float32 and "avx512_bf16" not in flags and "amx_bf16" not in flags
    return rows <= MAX_BLOCKED_F32_ROWS_AVX512


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
