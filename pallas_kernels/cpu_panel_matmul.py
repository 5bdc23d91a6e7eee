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

bf16 panels (pack_panels_bf16) hold a bf16 weight's contraction rows in pairs, [P, ceil(K / 2), 48, 2] (K padded with
a zero row to even): each element is the two values of one column that AVX-512 BF16's VDPBF16PS multiplies at once,
by x's values rounded to bf16. Twice the multiply-adds per instruction of f32, and half the bytes. Numerics are those
of a bf16 weight in models.layers.project: x rounded to bf16, products exact in f32, f32 sums (rounded after each
product, the pair's second row first; denormal inputs and sums flushed to zero where the instruction runs).

int8 panels (weight-only quantization, quantize_panels_int8) hold q = round((w - min) / scale) with an f32 scale and
min per column and group of INT8_GROUP_ROWS contraction rows, spanning the group's values in 256 levels. The groups
are a GGUF block's 32 contraction rows: a Q4_1 block that uses its lowest and highest levels comes back within f32
rounding (its 16 levels are every 17th of the 256), and any other weight within half a step. The kernel widens q to
f32 as it reads it, sums x times it over a group, and adds scale times that sum plus min times x's sum over the group
to the output: x @ (q * scale + min) up to f32 rounding. At one row a weight streams 31% of the f32 bytes.

panel_matmuls_cpu multiplies one x by several f32 or bf16 panel weights in one call (an attention block's q, k and v):
x is rounded and packed once, and every product's work items go over the threads together, each product split as its
own call splits it, so each output is that call's bits. Given an RMS norm's weight, it norms x's rows as it packs them
(rms_norm_reference's formula, the squares summed in the kernel's own order).
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native_library import (
    PANEL_MATMUL_TARGETS,
    PANEL_MATMULS_TARGETS,
    cpu_feature_flags,
    native_kernel_error,
)

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


def bf16_panels_pay(cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether bf16 projection weights are worth storing as bf16 panels on this CPU: AVX-512 BF16 without AMX (a CPU
    with AMX multiplies bf16 faster with its tiles: the AMX kernel at decode sizes, XLA's AMX matmuls for prompts).

    Args:
      cpu_flags: the CPU's feature flags as /proc/cpuinfo names them (default: this machine's).
    """
    flags = cpu_feature_flags() if cpu_flags is None else cpu_flags
    return "avx512_bf16" in flags and "amx_bf16" not in flags and panel_layout_pays(flags)


def pack_panels_bf16(weight: jax.Array) -> jax.Array:  # [K, N] -> bf16[ceil(N / 48), ceil(K / 2), 48, 2]
    """`weight` rounded to bf16 in the paired panel layout: element [p, k, c, j] is w[2k + j, 48p + c], K padded with a
    zero row to even and N with zero columns to whole panels."""
    depth, columns = weight.shape
    num_panels = -(-columns // PANEL_WIDTH)
    padded = jnp.pad(weight.astype(jnp.bfloat16), ((0, depth % 2), (0, num_panels * PANEL_WIDTH - columns)))
    return padded.reshape(-1, 2, num_panels, PANEL_WIDTH).transpose(2, 0, 3, 1)


INT8_GROUP_ROWS = 32  # contraction rows per scale and min (cpu_panel_matmul.cc's kGroupRows)


def quantize_panels_int8(weight: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`weight` [K, N] as int8 panels s8[P, K, 48] and f32 scales and mins [P, G, 48] (laid out as the panels), one
    per group of INT8_GROUP_ROWS contraction rows and column (G = ceil(K / 32); padding columns: zeros).

    A group's 256 levels span its values in that column: scale = (max - min) / 255, level -128 is its min and 127 its
    max, and every value rounds to the nearest level (a group of equal values has scale 0 and level -128).
    """
    weight = weight.astype(jnp.float32)
    depth, columns = weight.shape
    num_groups = -(-depth // INT8_GROUP_ROWS)
    # The last group's missing rows repeat its last row, which moves neither its min nor its max.
    grouped = jnp.pad(weight, ((0, num_groups * INT8_GROUP_ROWS - depth), (0, 0)), mode="edge")
    grouped = grouped.reshape(num_groups, INT8_GROUP_ROWS, columns)
    low, high = jnp.min(grouped, axis=1), jnp.max(grouped, axis=1)  # f32[G, N]
    scales = (high - low) / 255
    mins = low + 128 * scales  # the value of level 0
    safe = jnp.where(scales > 0, scales, 1.0)[:, None, :]
    levels = jnp.clip(jnp.round((grouped - low[:, None, :]) / safe) - 128, -128, 127).astype(jnp.int8)
    panels = pack_panels(levels.reshape(-1, columns)[:depth])  # s8[P, K, 48]
    return panels, pack_panels(scales), pack_panels(mins)


def group_rows(per_group: jax.Array, depth: int) -> jax.Array:  # f32[K, N']
    """Each contraction row's value of a [P, G, 48] per-group array, as [K, N']: row k takes group k // 32's."""
    return jnp.repeat(unpack_panels(per_group, per_group.shape[0] * PANEL_WIDTH), INT8_GROUP_ROWS, axis=0)[:depth]


def unpack_panels(panels: jax.Array, columns: int, depth: int | None = None) -> jax.Array:  # [K, columns]
    """The [K, N] weight that pack_panels (or pack_panels_bf16: pass K as `depth`) laid out (under jit, XLA folds
    this into the matmul that reads it)."""
    if panels.ndim == 4:  # bf16 pairs [P, K / 2, 48, 2]
        num_panels, pairs, width, _ = panels.shape
        matrix = panels.transpose(1, 3, 0, 2).reshape(2 * pairs, num_panels * width)
        return matrix[: 2 * pairs if depth is None else depth, :columns]
    num_panels, rows, width = panels.shape
    return panels.transpose(1, 0, 2).reshape(rows, num_panels * width)[:, :columns]


def dequantized_matrix(
    panels: jax.Array,
    columns: int,
    scales: jax.Array | None = None,
    mins: jax.Array | None = None,
    depth: int | None = None,
) -> jax.Array:  # [K, N]
    """The [K, N] weight that panels hold: pack_panels' (f32) and pack_panels_bf16's (bf16; K = `depth`) as laid out,
    quantize_panels_int8's levels times their scales plus their mins (f32)."""
    matrix = unpack_panels(panels, columns, depth)
    if scales is None:
        return matrix
    depth = matrix.shape[0]
    return matrix.astype(jnp.float32) * group_rows(scales, depth)[:, :columns] + group_rows(mins, depth)[:, :columns]


def panel_matmul_reference(
    x: jax.Array, panels: jax.Array, columns: int, scales: jax.Array | None = None, mins: jax.Array | None = None
) -> jax.Array:  # f32[T, columns]
    """x @ the unpacked (and dequantized) weight in f32, in jnp (bf16 panels: x rounded to bf16 first).

    Args:
      x: f32[T, K] activation rows.
      panels: f32[P, K, 48] from pack_panels, s8[P, K, 48] from quantize_panels_int8, or bf16[P, ceil(K / 2), 48, 2]
        from pack_panels_bf16.
      columns: N, the weight's columns before padding.
      scales, mins: f32[P, ceil(K / 32), 48], the int8 panels' group scales and mins (None for f32 panels).
    """
    matrix = dequantized_matrix(panels, columns, scales, mins, depth=x.shape[1]).astype(jnp.float32)
    if panels.dtype == jnp.bfloat16:
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.dot(x, matrix, precision=jax.lax.Precision.HIGHEST)


def panel_matmul_cpu(
    x: jax.Array, panels: jax.Array, columns: int, scales: jax.Array | None = None, mins: jax.Array | None = None
) -> jax.Array:  # f32[T, columns]
    """panel_matmul_reference through the native kernel (f32 x; f32 panels, int8 ones with their scales, or bf16 pairs;
    any T; on CPU).

    Args:
      x: f32[T, K] activation rows.
      panels: f32[P, K, 48] from pack_panels, s8[P, K, 48] from quantize_panels_int8, or bf16[P, ceil(K / 2), 48, 2]
        from pack_panels_bf16.
      columns: N, the weight's columns before padding (the kernel's padding columns are dropped).
      scales, mins: f32[P, ceil(K / 32), 48], the int8 panels' group scales and mins (None for f32 panels).
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native CPU matmul cannot run: {error}")
    rows, depth = x.shape
    dtype = jnp.dtype(panels.dtype)
    quantized = dtype == jnp.int8
    paired = dtype == jnp.bfloat16
    expected_layout = ((depth + 1) // 2, PANEL_WIDTH, 2) if paired else (depth, PANEL_WIDTH)
    if panels.shape[1:] != expected_layout or dtype not in PANEL_MATMUL_TARGETS:
        raise ValueError(
            f"the panel matmul takes x[T, K] in f32 and f32 or int8 panels[P, K, {PANEL_WIDTH}] or bf16 "
            f"panels[P, ceil(K / 2), {PANEL_WIDTH}, 2]; got x {list(x.shape)} {x.dtype} and panels "
            f"{list(panels.shape)} {panels.dtype}"
        )
    padded = panels.shape[0] * PANEL_WIDTH
    num_groups = -(-depth // INT8_GROUP_ROWS)
    groups = (scales, mins)
    shapes = [None if a is None else tuple(a.shape) for a in groups]
    expected = (panels.shape[0], num_groups, PANEL_WIDTH)
    if shapes != ([expected] * 2 if quantized else [None, None]):
        raise ValueError(
            f"int8 panels take scales and mins f32{list(expected)} (one per group of {INT8_GROUP_ROWS} contraction "
            f"rows and column, from quantize_panels_int8) and f32 and bf16 panels neither; got {dtype} panels, "
            f"scales and mins of shapes {shapes}"
        )
    if not 0 <= columns <= padded:
        raise ValueError(f"columns={columns} does not fit {panels.shape[0]} panels of {PANEL_WIDTH}")
    target, _ = PANEL_MATMUL_TARGETS[dtype]
    # The kernel writes the first `columns` columns only: a padded output sliced here would be an XLA copy.
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, columns), jnp.float32))
    operands = (x.astype(jnp.float32), panels) + tuple(a.astype(jnp.float32) for a in groups if quantized)
    return call(*operands)


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:  # f32[..., K]
    """x RMS-normed over its last axis in f32 (models.layers.RMSNorm): x * rsqrt(mean(x * x) + eps) * weight.

    Args:
      x: [..., K] rows.
      weight: [K], the norm's scale.
      eps: added to each row's mean square.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed * weight.astype(jnp.float32)


def norm_operands(norm_weight: jax.Array | None, norm_eps: float, depth: int) -> tuple[jax.Array, np.float32]:
    """The native calls' norm operands: the weight as f32[K] (f32[0] for no norm) and eps, checked against x's K."""
    if norm_weight is None:
        return jnp.zeros((0,), jnp.float32), np.float32(0.0)
    if tuple(norm_weight.shape) != (depth,):
        shape = list(norm_weight.shape)
        raise ValueError(f"the RMS norm's weight must be [K] = [{depth}] over x's columns; got {shape}")
    return norm_weight.astype(jnp.float32), np.float32(norm_eps)


def panel_matmuls_cpu(
    x: jax.Array,
    panels: list[jax.Array],
    columns: list[int],
    norm_weight: jax.Array | None = None,
    norm_eps: float = 0.0,
) -> list[jax.Array]:
    """[panel_matmul_cpu(x, p, n) for p, n in zip(panels, columns)] in one native call: x is rounded and packed once and
    every product's work goes over the threads together (an attention block's q, k and v). Each output is the
    separate call's, bit for bit. With a norm weight, the products take rms_norm_reference(x, norm_weight, norm_eps)
    instead, normed as x is packed (the normed rows never go to memory; the squares summed in another order than
    XLA's, so within an f32 rounding of the normed x's products).

    Args:
      x: f32[T, K] activation rows.
      panels: the weights, all f32[P_i, K, 48] (pack_panels) or all bf16[P_i, ceil(K / 2), 48, 2] (pack_panels_bf16).
      columns: each weight's N before padding.
      norm_weight: [K], an RMS norm's scale applied to x's rows first, or None.
      norm_eps: the norm's eps.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native CPU matmul cannot run: {error}")
    rows, depth = x.shape
    dtypes = {jnp.dtype(p.dtype) for p in panels}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    paired = dtype == jnp.bfloat16
    layout = ((depth + 1) // 2, PANEL_WIDTH, 2) if paired else (depth, PANEL_WIDTH)
    wrong = [list(p.shape) for p in panels if p.shape[1:] != layout]
    if not panels or len(panels) != len(columns) or dtype not in PANEL_MATMULS_TARGETS or wrong:
        raise ValueError(
            f"panel_matmuls_cpu takes x[T, K] and one or more weights of one dtype, all f32 panels[P, K, "
            f"{PANEL_WIDTH}] or all bf16 panels[P, ceil(K / 2), {PANEL_WIDTH}, 2], with a column count each; got x "
            f"{list(x.shape)}, panels {[(list(p.shape), str(p.dtype)) for p in panels]} and columns {list(columns)}"
        )
    for p, n in zip(panels, columns, strict=True):
        if not 0 <= n <= p.shape[0] * PANEL_WIDTH:
            raise ValueError(f"columns={n} does not fit {p.shape[0]} panels of {PANEL_WIDTH}")
    norm_weight, norm_eps = norm_operands(norm_weight, norm_eps, depth)
    target, _ = PANEL_MATMULS_TARGETS[dtype]
    shapes = [jax.ShapeDtypeStruct((rows, n), jnp.float32) for n in columns]
    return list(jax.ffi.ffi_call(target, shapes)(x.astype(jnp.float32), norm_weight, *panels, norm_eps=norm_eps))
