"""Activation rows times an f32 weight laid out as column panels, on CPU through a native XLA FFI kernel
(cpu_panel_matmul.cc), beside its pure-jnp reference and the layout's pack and unpack.

The panel layout stores a [K, N] weight as panels[P, K, PANEL_WIDTH]: panel p holds columns [p * 48, p * 48 + 48) of
every contraction row, the last one padded with zero columns. A decode step then streams each panel as one run of
memory and multiplies straight from it, its reads overlapping its arithmetic, where a [K, N] weight has to be
gathered a band of columns at a time (each row in another page) and packed before the multiply-adds can start.
Measured on a 2-core Xeon with AVX-512 (30 SmolLM2 MLPs in one program, ms, best of 5), XLA on [K, N] against this
kernel: 1 row 17.8 / 16.1 (the small-row kernel on [K, N]: 15.2), 8 rows 34.4 / 18.1, 16 rows 38.8 / 22.2 (the
blocked kernel: 31.7), 32 rows 52.5 / 28.3 (43.3), 64 rows 62.0 / 50.3, 128 rows 99.0 / 87.7; from 65 rows on, a
chunk of rows runs through every panel of a work item (in a later run: 512 rows 339 / 317, 2048 rows 1358 / 1217).
So a weight stored as panels goes to this kernel at every row count; XLA multiplies the unpacked matrix only where
the native kernels may not run (it folds the unpacking into the dot at 2048 rows, but materializes it at a few rows:
91 ms at one).

Numerics: f32 products and sums, each output summed over K in one order whatever the other rows are.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.native_library import PANEL_MATMUL_TARGETS, cpu_feature_flags, native_kernel_error

PANEL_WIDTH = 48  # columns per panel: three 16-lane vectors (cpu_panel_matmul.cc's kPanelWidth)


def panel_layout_pays(cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether f32 projection weights are worth storing as panels on this CPU: where the kernel was measured to beat
    XLA and the blocked kernel (AVX-512; an 8-lane machine compiles it too, but nothing here measured it there).

    Args:
      cpu_flags: the CPU's feature flags as /proc/cpuinfo names them (default: this machine's).
    """
    flags = cpu_feature_flags() if cpu_flags is None else cpu_flags
    return "avx512f" in flags and native_kernel_error() is None


def pack_panels(weight: jax.Array) -> jax.Array:  # [K, N] -> [ceil(N / 48), K, 48]
    """`weight` in the panel layout, N padded with zero columns to whole panels."""
    depth, columns = weight.shape
    num_panels = -(-columns // PANEL_WIDTH)
    padded = jnp.pad(weight, ((0, 0), (0, num_panels * PANEL_WIDTH - columns)))
    return padded.reshape(depth, num_panels, PANEL_WIDTH).transpose(1, 0, 2)


def unpack_panels(panels: jax.Array, columns: int) -> jax.Array:  # [P, K, 48] -> [K, columns]
    """The [K, N] weight that pack_panels laid out (under jit, XLA folds this into the matmul that reads it)."""
    num_panels, depth, width = panels.shape
    return panels.transpose(1, 0, 2).reshape(depth, num_panels * width)[:, :columns]


def panel_matmul_reference(x: jax.Array, panels: jax.Array, columns: int) -> jax.Array:  # f32[T, columns]
    """x @ the unpacked weight in f32, in jnp.

    Args:
      x: f32[T, K] activation rows.
      panels: f32[P, K, 48], a weight as pack_panels laid it out.
      columns: N, the weight's columns before padding.
    """
    return jnp.dot(x, unpack_panels(panels, columns), precision=jax.lax.Precision.HIGHEST)


def panel_matmul_cpu(x: jax.Array, panels: jax.Array, columns: int) -> jax.Array:  # f32[T, columns]
    """panel_matmul_reference through the native kernel (f32 x and panels, any T, on CPU).

    Args:
      x: f32[T, K] activation rows.
      panels: f32[P, K, 48], a weight as pack_panels laid it out.
      columns: N, the weight's columns before padding (the kernel's padding columns are dropped).
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native CPU matmul cannot run: {error}")
    rows, depth = x.shape
    if panels.ndim != 3 or panels.shape[1:] != (depth, PANEL_WIDTH) or jnp.dtype(panels.dtype) != jnp.float32:
        raise ValueError(
            f"the panel matmul takes x[T, K] in f32 and f32 panels[P, K, {PANEL_WIDTH}] from pack_panels; got x "
            f"{list(x.shape)} {x.dtype} and panels {list(panels.shape)} {panels.dtype}"
        )
    if not 0 <= columns <= panels.shape[0] * PANEL_WIDTH:
        raise ValueError(f"columns={columns} does not fit {panels.shape[0]} panels of {PANEL_WIDTH}")
    target, _ = PANEL_MATMUL_TARGETS[jnp.dtype(jnp.float32)]
    padded = panels.shape[0] * PANEL_WIDTH
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, padded), jnp.float32))
    out = call(x.astype(jnp.float32), panels)
    return out if columns == padded else out[:, :columns]
