"""A gated MLP, down(silu(x @ gate) * (x @ up)), with its weights stored as column panels, on CPU in one native call
(cpu_gated_mlp.cc), beside its pure-jnp reference.

Through three panel matmuls (cpu_panel_matmul.py) and XLA's elementwise pass, a prompt chunk's gate and up products go
to memory and back, and silu(gate) * up goes to memory, back, and into a rounded and packed copy for the down
projection. The native call keeps gate's and up's products for a chunk of rows and one panel in the first-level cache
and writes silu(gate) * up straight into the down projection's packed input.

Numerics: the three products are panel_matmul_cpu's bit for bit; silu is the kernel's own (g * sigmoid(g), from
e^-|g|), within an f32 rounding or two of XLA's. With bf16 panels, h = silu(gate) * up is rounded to bf16 before the
down projection, as panel_matmul_cpu rounds any x. Each output row depends on its input row alone.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_panel_matmul import PANEL_WIDTH, norm_operands, panel_matmul_reference, rms_norm_reference
from pallas_kernels.native_library import GATED_MLP_TARGETS, native_kernel_error


def gated_mlp_reference(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    mlp_width: int,
    hidden: int,
    norm_weight: jax.Array | None = None,
    norm_eps: float = 0.0,
) -> jax.Array:  # f32[T, hidden]
    """down(silu(x @ gate) * (x @ up)) in jnp, each product as panel_matmul_reference computes it (x RMS-normed first,
    rms_norm_reference, where a norm weight is given).

    Args:
      x: f32[T, K] activation rows.
      gate, up: the [K, F] weights as panels: f32[P, K, 48] (pack_panels) or bf16[P, ceil(K / 2), 48, 2]
        (pack_panels_bf16).
      down: the [F, hidden] weight as panels of the same dtype.
      mlp_width: F, gate's and up's columns before padding.
      hidden: down's columns before padding.
      norm_weight: [K], an RMS norm's scale applied to x's rows first, or None.
      norm_eps: the norm's eps.
    """
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, norm_eps)
    h = jax.nn.silu(panel_matmul_reference(x, gate, mlp_width)) * panel_matmul_reference(x, up, mlp_width)
    return panel_matmul_reference(h, down, hidden)


def gated_mlp_cpu(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    mlp_width: int,
    hidden: int,
    norm_weight: jax.Array | None = None,
    norm_eps: float = 0.0,
) -> jax.Array:  # f32[T, hidden]
    """gated_mlp_reference through the native kernel (f32 x; f32 or bf16 panels, all three alike; any T; on CPU). A norm
    is applied to x's rows as they are packed (panel_matmuls_cpu's numerics).

    Args:
      x: f32[T, K] activation rows.
      gate, up: the [K, F] weights as panels: f32[P, K, 48] (pack_panels) or bf16[P, ceil(K / 2), 48, 2]
        (pack_panels_bf16), P = ceil(F / 48).
      down: the [F, hidden] weight as panels of the same dtype.
      mlp_width: F, gate's and up's columns before padding.
      hidden: down's columns before padding (the kernel writes only these).
      norm_weight: [K], an RMS norm's scale applied to x's rows first, or None.
      norm_eps: the norm's eps.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native CPU gated MLP cannot run: {error}")
    rows, depth = x.shape
    dtype = jnp.dtype(gate.dtype)
    paired = dtype == jnp.bfloat16

    def steps(n: int) -> int:
        return (n + 1) // 2 if paired else n

    tail = (PANEL_WIDTH, 2) if paired else (PANEL_WIDTH,)
    expected = {
        "gate": (-(-mlp_width // PANEL_WIDTH), steps(depth), *tail),
        "up": (-(-mlp_width // PANEL_WIDTH), steps(depth), *tail),
        "down": (-(-hidden // PANEL_WIDTH), steps(mlp_width), *tail),
    }
    weights = {"gate": gate, "up": up, "down": down}
    wrong = {
        name: (list(w.shape), str(w.dtype))
        for name, w in weights.items()
        if tuple(w.shape) != expected[name] or w.dtype != dtype
    }
    if dtype not in GATED_MLP_TARGETS or wrong or depth < 1 or mlp_width < 1:
        raise ValueError(
            f"the gated MLP takes x[T, K] (K >= 1) and f32 or bf16 panels, all three of one dtype: gate and up for "
            f"[K, F] weights, down for an [F, hidden] one (F = mlp_width = {mlp_width}, hidden = {hidden}, "
            f"K = {depth}; expected shapes {expected} for {dtype}); got x {list(x.shape)} and "
            f"{wrong or weights['gate'].dtype}"
        )
    norm_weight, norm_eps = norm_operands(norm_weight, norm_eps, depth)
    target, _ = GATED_MLP_TARGETS[dtype]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, hidden), jnp.float32))  # no padding columns written
    return call(x.astype(jnp.float32), norm_weight, gate, up, down, mlp_width=np.int64(mlp_width), norm_eps=norm_eps)
