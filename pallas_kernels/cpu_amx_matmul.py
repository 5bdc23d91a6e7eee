"""Activation rows times bf16 weights on Intel's AMX tile units through a native XLA FFI kernel (cpu_amx_matmul.cc),
beside the same pure-jnp reference as the other native matmuls (cpu_small_matmul.small_matmul_reference).

At 8 to 64 rows (a decode batch) a bf16 product is bound by streaming its weights, and XLA:CPU's bf16 matmuls, which
run on AMX too, read them at 8-14 GB/s there. This kernel reads each weight row as one run across a work item's band
of columns, re-lays it in pairs of rows for the tiles in the core's cache, and multiplies it into the sums of every
32 rows; the tied lm_head's [N, K] rows are A tiles as they are. On a 2-core Xeon (AMX, 30 SmolLM2-sized MLPs and its
lm_head in one program, ms, best of 5), XLA against the kernel: 8 rows 23.0 / 17.6, 16 rows 24.3 / 17.5, 32 rows
28.7 / 20.0, 64 rows 35.4 / 31.7, 96 rows 41.3 / 42.0 (so from 65 rows on XLA keeps them); below 8 rows the
small-row kernel is faster still (4 rows 14.1 against 16.1).

Numerics are those of `models.layers.project`: activations rounded to bf16, exact products, f32 sums, each output
summed over K in one order whatever the other rows are (AMX flushes denormal inputs and sums to zero).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_small_matmul import call_native_matmul
from pallas_kernels.native_library import AMX_MATMUL_TARGETS, amx_available

MIN_AMX_ROWS = 8
MAX_AMX_ROWS = 64
AMX_COLUMN_MULTIPLE = 16  # N: whole tiles of 16 columns
AMX_ROW_DEPTH_MULTIPLE = 32  # K of an [N, K] weight, whose rows are loaded as tiles of 32 values


def amx_matmul_reads(rows: int, weight_dtype, columns: int, depth: int, contraction_last: bool = False) -> bool:
    """Whether models.layers.project gives the AMX kernel this product: bf16 weights at MIN_AMX_ROWS to MAX_AMX_ROWS
    rows, whole tiles of columns, on a CPU whose AMX this process may use.

    Args:
      rows: the product's activation rows.
      weight_dtype: the weight's storage dtype.
      columns: N, the product's output columns.
      depth: K, the contraction's length.
      contraction_last: the weight is [N, K] (a tied embedding as the lm_head).
    """
    if jnp.dtype(weight_dtype) not in AMX_MATMUL_TARGETS or not MIN_AMX_ROWS <= rows <= MAX_AMX_ROWS:
        return False
    if columns % AMX_COLUMN_MULTIPLE or (contraction_last and depth % AMX_ROW_DEPTH_MULTIPLE):
        return False
    return amx_available()


@functools.partial(jax.jit, static_argnames=("contraction_last",))
def amx_matmul_cpu(
    x: jax.Array,  # f32[T, K]
    weight: jax.Array,  # bf16[K, N], or [N, K] with contraction_last
    *,
    contraction_last: bool = False,
) -> jax.Array:  # f32[T, N]
    """small_matmul_reference through the AMX kernel (any T; bf16 weights with N a multiple of 16, and K of 32 when
    contraction_last; on a CPU with AMX).

    Args:
      x: activation rows in f32.
      weight: bf16 weights.
      contraction_last: the weight is [N, K] (a tied embedding as the lm_head) instead of [K, N].
    """
    rows, depth = x.shape
    columns = weight.shape[0 if contraction_last else -1]
    if not amx_available():
        raise RuntimeError("the AMX matmul needs a CPU with amx_bf16 (and an OS that grants its tile state)")
    if (
        jnp.dtype(weight.dtype) not in AMX_MATMUL_TARGETS
        or columns % AMX_COLUMN_MULTIPLE
        or (contraction_last and depth % AMX_ROW_DEPTH_MULTIPLE)
    ):
        raise ValueError(
            f"the AMX matmul takes bf16 weights with N a multiple of {AMX_COLUMN_MULTIPLE} (and K of "
            f"{AMX_ROW_DEPTH_MULTIPLE} for an [N, K] weight), not {weight.dtype}{list(weight.shape)}; "
            "models.layers.project gives other products to the other kernels or XLA"
        )
    return call_native_matmul(AMX_MATMUL_TARGETS, x, weight, contraction_last)
