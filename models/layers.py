"""Model-agnostic layers: RMSNorm, the gated MLP and paged attention."""

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.packed_weights import PanelWeight, as_matrix
from models.rope import rotate
from models.sharding import attention_on_mesh, unpartitioned_here
from pallas_kernels import (
    AttentionMetadata,
    amx_matmul_cpu,
    amx_matmul_reads,
    blocked_matmul_cpu,
    blocked_matmul_reads,
    gated_mlp_cpu,
    native_matmul_reads,
    panel_matmul_cpu,
    panel_matmuls_cpu,
    rms_norm_reference,
    small_matmul_cpu,
)

# Letters in einsum strings:
#   T tokens, D hidden size, N query heads, K kv heads, H head_dim, F mlp width.


def project(spec: str, x: jax.Array, weight: jax.Array | PanelWeight, *, native: bool = False) -> jax.Array:
    """einsum(spec, x, weight) with the weight read in its storage dtype, never widened into a copy.

    Same dtypes (f32 on CPU, bf16 on TPU and GPU) multiply as they are. Narrower weights (bf16 under f32
    activations, the CPU's mixed mode) multiply x cast to the weight's dtype and accumulate in f32: XLA:CPU's
    bf16 matmuls run about 3x faster than f32 ones at 32 rows and read half the bytes at batch 1, where a
    widened copy of the weight would be made again every step. A single row is padded to two for that product,
    since XLA:CPU runs a one-row bf16 matmul about 10x slower than a two-row one (measured on 30 SmolLM2-sized
    weights).

    With `native` (the model runs the native CPU kernels), products of a few rows that XLA:CPU reads slowly go
    to pallas_kernels' native matmuls instead, with the same numerics: bf16 weights at 8 to 64 rows to the AMX
    kernel where the CPU has AMX, at 1 to 8 rows to the small-row kernel (f32 ones at 2 to 8: XLA reads f32 fastest
    at one row), and tens of rows to the blocked kernel where it beats XLA on this kind of CPU; never when the weight
    may be partitioned over a mesh axis here.

    A PanelWeight (an f32, int8 or bf16 weight laid out for the native CPU matmul, models.packed_weights) goes to the
    panel kernel at every row count; where the native kernels may not run, XLA multiplies the unpacked (dequantized)
    matrix.

    Args:
      spec: the einsum, x's letters first (its first axis is the tokens).
      x: activations [T, ...] in the compute dtype.
      weight: a parameter's value in its storage dtype, or a PanelWeight.
      native: whether the native CPU kernels may run (models.load resolved attention_impl to cpu_native).
    """
    if isinstance(weight, PanelWeight):
        return _project_panels(spec, x, weight, native)
    out = _native_project(spec, x, weight) if native else None
    if out is not None:
        return out
    if weight.dtype == x.dtype or jnp.dtype(weight.dtype).itemsize >= jnp.dtype(x.dtype).itemsize:
        return jnp.einsum(spec, x, weight.astype(x.dtype))
    rows = x.shape[0]
    narrow = x.astype(weight.dtype)
    if rows == 1:
        narrow = jnp.concatenate([narrow, jnp.zeros_like(narrow)])
    out = jnp.einsum(spec, narrow, weight, preferred_element_type=jnp.float32)
    return out[:rows].astype(x.dtype)


def project_together(
    x: jax.Array,
    products: list[tuple[str, jax.Array | PanelWeight]],
    *,
    native: bool = False,
    norm: "RMSNorm | None" = None,
):
    """[project(spec, norm(x), weight) for spec, weight in products], in one native call
    (pallas_kernels.panel_matmuls_cpu) where every weight is a PanelWeight of f32 or of bf16 alike over x's columns and
    the native kernels run here: x is normed, rounded and packed once, and the products' work goes over the threads
    together, each result the same bits as its own project() of the call's normed x. (An attention block's q, k and v
    on SmolLM2 in bf16, the step compiled both ways and alternated on a 2-core Zen 4: a 2048-token prefill step 1637
    and 1617 -> 1596 and 1605 ms, a decode step at batch 16 and context 2048 45.8 and 45.1 -> 44.9 and 43.7 ms.)

    Args:
      x: activations [T, K] in the compute dtype.
      products: (spec, weight) pairs as project() takes them, each spec contracting x's K.
      native: whether the native CPU kernels may run (as for project()).
      norm: an RMS norm the products take x through first (in the native call, as x is packed), or None.
    """
    weights = [weight for _, weight in products]
    shared = (
        native
        and x.dtype == jnp.float32
        and x.ndim == 2
        and all(isinstance(w, PanelWeight) and not w.transposed and _native_layout(s) == "KN" for s, w in products)
        and len({w.dtype for w in weights}) == 1
        and weights[0].dtype in (jnp.float32, jnp.bfloat16)
        and unpartitioned_here()
    )
    if not shared:
        x = x if norm is None else norm(x)
        return [project(spec, x, weight, native=native) for spec, weight in products]
    outs = panel_matmuls_cpu(x, [w.panels for w in weights], [w.columns for w in weights], *norm_operands(norm))
    return [out.reshape(x.shape[0], *w.output_shape) for out, w in zip(outs, weights, strict=True)]


def _project_panels(spec: str, x: jax.Array, weight: PanelWeight, native: bool) -> jax.Array:
    """project() of a PanelWeight: x[T, K] times the weight's [K, N] matrix, shaped [T, *the weight's output axes]."""
    if _native_layout(spec) != ("NK" if weight.transposed else "KN") or x.ndim != 2:
        raise ValueError(
            f"a PanelWeight multiplies x[T, K] by its leading axes (a transposed one by its last); {spec!r} does not"
        )
    rows = x.shape[0]
    if native and x.dtype == jnp.float32 and unpartitioned_here():
        out = panel_matmul_cpu(x, weight.panels, weight.columns, weight.scales, weight.mins)
    else:
        out = project("TK,KN->TN", x, weight.matrix())  # a bf16 matrix as any bf16 weight: x rounded to bf16
    return out.reshape(rows, *weight.output_shape)


def _native_layout(spec: str) -> str | None:
    """The small-row kernel's weight layout for spec: "KN" when it contracts x[T, K] with the weight's first axis,
    "NK" with the last of its two, else None (the kernel does not take it)."""
    operands, _ = spec.split("->")
    x_letters, weight_letters = operands.split(",")
    if len(x_letters) != 2:
        return None
    contracted = x_letters[1]
    if weight_letters[0] == contracted:
        return "KN"
    if len(weight_letters) == 2 and weight_letters[1] == contracted:
        return "NK"
    return None


def _native_matmul(spec: str, x: jax.Array, weight: jax.Array):
    """The native kernel that takes this product (AMX, small-row or blocked), or None: its layouts and dtypes, a row
    count where it beats XLA, and no automatic mesh axis over more than one device (the weight could be split there;
    shard_map'd steps are manual)."""
    rows = x.shape[0]
    fewest = 1 if weight.dtype == jnp.bfloat16 else 2
    layout = _native_layout(spec)
    if layout is None or x.dtype != jnp.float32 or rows < fewest or not unpartitioned_here():
        return None
    depth = x.shape[1]
    columns = weight.shape[0] if layout == "NK" else weight.size // depth
    if amx_matmul_reads(rows, weight.dtype, columns, depth, layout == "NK"):
        return amx_matmul_cpu
    if native_matmul_reads(rows, weight.dtype):
        return small_matmul_cpu
    if blocked_matmul_reads(rows, weight.dtype, layout == "NK"):
        return blocked_matmul_cpu
    return None


def _native_project(spec: str, x: jax.Array, weight: jax.Array):
    """project() through pallas_kernels' AMX, small-row or blocked matmul, the weight viewed as a matrix; None when
    none of them takes it."""
    matmul = _native_matmul(spec, x, weight)
    if matmul is None:
        return None
    if _native_layout(spec) == "NK":
        return matmul(x, weight, contraction_last=True)
    out = matmul(x, weight.reshape(weight.shape[0], -1))  # [T, N...]
    return out.reshape(x.shape[0], *weight.shape[1:])


def init_param(rngs: nnx.Rngs | None, shape, dtype, logical_axes, scale: float = 0.02) -> nnx.Param:
    """A normal-initialized parameter tagged with its logical sharding axes; zeros without `rngs` (for building a
    model's shapes under nnx.eval_shape: each draw from nnx.Rngs there updates a traced counter, and JAX describes
    the tracer's origin by walking the whole trace so far, which made SmolLM2's 211 parameters cost 1.7 s)."""
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype), logical_axes=logical_axes)
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=logical_axes)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm, computed in f32 (the native CPU products apply it as they pack their input rows:
    project_together, GatedMLP)."""

    def __init__(self, size: int, *, eps: float, param_dtype, logical_axis: str | None = "embed"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((size,), param_dtype), logical_axes=(logical_axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm_reference(x, self.weight[...], self.eps).astype(x.dtype)


def norm_operands(norm: RMSNorm | None) -> tuple[jax.Array | None, float]:
    """(weight, eps) of an RMS norm as the native products take it (their norm_weight and norm_eps), or (None, 0)."""
    return (None, 0.0) if norm is None else (norm.weight[...], norm.eps)


def _fuses_gated_mlp(x: jax.Array, weights) -> bool:
    """Whether the MLP runs as one native call (pallas_kernels.gated_mlp_cpu): its three weights stored as panels of
    one dtype, f32 or bf16 (not int8), f32 x, and no weight partitioned over a mesh axis here. 30 SmolLM2 MLPs on a
    2-core Zen 4, three panel matmuls with XLA's silu(gate) * up between them against the one call (bf16 panels,
    median ms): 2048 rows 958 -> 844, 64 rows 29.8 -> 27.4, 32 rows 17.5 -> 16.3, one row 6.6 -> 6.5; f32 panels at
    one row 12.3 -> 12.7 (streaming the weights, the call saves nothing there). Every row count takes the same path,
    so a request's tokens do not depend on its batch (the call's silu rounds as XLA's may not)."""
    return (
        x.dtype == jnp.float32
        and all(isinstance(w, PanelWeight) and not w.transposed for w in weights)
        and len({w.dtype for w in weights}) == 1
        and weights[0].dtype in (jnp.float32, jnp.bfloat16)
        and unpartitioned_here()
    )


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, param_dtype, native_matmul: bool = False, rngs: nnx.Rngs | None):
        d, f = config.hidden_size, config.intermediate_size
        self.native_matmul = native_matmul
        self.gate = init_param(rngs, (d, f), param_dtype, ("embed", "mlp"))
        self.up = init_param(rngs, (d, f), param_dtype, ("embed", "mlp"))
        self.down = init_param(rngs, (f, d), param_dtype, ("mlp", "embed"))

    def __call__(self, x: jax.Array, norm: RMSNorm | None = None) -> jax.Array:  # [T, D] -> [T, D]
        """The MLP of norm(x) (of x without a norm); the native call norms x's rows as it packs them."""
        native = self.native_matmul
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        if native and _fuses_gated_mlp(x, (gate, up, down)):
            panels = (gate.panels, up.panels, down.panels)
            return gated_mlp_cpu(x, *panels, gate.columns, down.columns, *norm_operands(norm))
        x = x if norm is None else norm(x)
        gated = jax.nn.silu(project("TD,DF->TF", x, gate, native=native)) * project("TD,DF->TF", x, up, native=native)
        return project("TF,FD->TD", gated, down, native=native)


class PagedAttention(nnx.Module):
    """Multi-head attention with GQA whose K/V live in a page pool."""

    def __init__(self, config: ModelConfig, *, param_dtype, attention_impl: str, rngs: nnx.Rngs | None):
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.head_dim = h
        self.sliding_window = config.sliding_window
        self.attention_impl = attention_impl
        self.native_matmul = attention_impl == "cpu_native"  # the native CPU kernels run here: small-row matmuls too
        self.q_proj = init_param(rngs, (d, n, h), param_dtype, ("embed", "q_heads", "head_dim"))
        self.k_proj = init_param(rngs, (d, k, h), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj = init_param(rngs, (d, k, h), param_dtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj = init_param(rngs, (n, h, d), param_dtype, ("q_heads", "head_dim", "embed"))
        if config.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((n, h), param_dtype), logical_axes=("q_heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((k, h), param_dtype), logical_axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((k, h), param_dtype), logical_axes=("kv_heads", "head_dim"))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = nnx.Param(jnp.zeros((d,), param_dtype), logical_axes=("embed",)) if config.o_bias else None
        if config.qk_norm:
            norm = dict(eps=config.rms_norm_eps, param_dtype=param_dtype, logical_axis="head_dim")
            self.q_norm, self.k_norm = RMSNorm(h, **norm), RMSNorm(h, **norm)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        rope: tuple[jax.Array, jax.Array],  # (cos, sin) of each token's angles, f32[T, H // 2] each (rope_angles)
        kv_pages: jax.Array,  # [num_pages, page_size, 2K * H]
        metadata: AttentionMetadata,
        norm: RMSNorm | None = None,  # applied to x first (inside the native q/k/v call where it runs)
    ) -> tuple[jax.Array, jax.Array]:
        dtype = x.dtype
        native = self.native_matmul
        q, k, v = project_together(
            x,
            [("TD,DNH->TNH", self.q_proj[...]), ("TD,DKH->TKH", self.k_proj[...]), ("TD,DKH->TKH", self.v_proj[...])],
            native=native,
            norm=norm,
        )
        if self.q_bias is not None:
            q = q + self.q_bias[...].astype(dtype)
            k = k + self.k_bias[...].astype(dtype)
            v = v + self.v_bias[...].astype(dtype)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, *rope), rotate(k, *rope)
        out, kv_pages = attention_on_mesh(
            q,
            k,
            v,
            kv_pages,
            metadata,
            sm_scale=self.head_dim**-0.5,
            attention_impl=self.attention_impl,
            sliding_window=self.sliding_window,
        )  # [T, N, H]
        num_tokens, num_heads, head_dim = out.shape
        # As [T, N * H] @ [N * H, D]: one plain matmul over the weight's own layout (the 3-index einsum let XLA
        # pick a transposed copy of the weight, made again every step).
        o_proj = as_matrix(self.o_proj[...], contracted=2)
        out = project("TI,ID->TD", out.reshape(num_tokens, num_heads * head_dim), o_proj, native=native)
        if self.o_bias is not None:
            out = out + self.o_bias[...].astype(dtype)
        return out, kv_pages
