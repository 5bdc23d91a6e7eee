"""8-bit KV pages (FP8 or int8) with one bf16 scale per token and KV head, stored rotated.

Quantizing on write, dequantizing on read. Before K/V are quantized they are turned by a fixed
orthonormal matrix R (a normalized Hadamard matrix where head_dim is a power of two): q.k and the
attention-weighted sum of V are unchanged when q, k and v are all turned by R and the output is
turned back, but a rotated vector has its energy spread over all channels, so one outlier channel
no longer sets every other channel's step size. `ops.paged_attention` does the turning; the kernels
and the reference attend over whatever the pages hold.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZED_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)


def is_quantized(dtype) -> bool:
    """Whether a page dtype is one of the 8-bit formats that carry scales (FP8 or int8)."""
    return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in QUANTIZED_DTYPES)


def largest_value(dtype) -> float:
    """The largest magnitude a quantized value may take: the format's max (127 for int8, kept symmetric)."""
    dtype = jnp.dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pages", "scales"], meta_fields=["value_dtype"])
@dataclasses.dataclass(frozen=True)
class QuantizedKVPages:
    """One layer's 8-bit page pool and its scales; a pytree that attention accepts in place of plain pages.

    Token t of page p, KV slot c (K of head h at c = 2h, V at c = 2h + 1) holds
    `values()[p, t, c, :].astype(f32) * scale_values()[p, c, t]`. Scales sit page-major with the token
    on the last (lane) axis, so a kernel folds them into a block's scores and probabilities
    as one row vector instead of dequantizing the K/V tiles.

    Both arrays are stored as unsigned bits: XLA:CPU scatters into an integer array in place but
    copies a whole float8 or bf16 array on every scatter (measured: 0.02 ms against 98 ms for 8
    tokens into 1,024 pages). Readers bitcast what they read, which is free.
    """

    pages: jax.Array  # u8[num_pages, page_size, 2 * K, D]: the 8-bit values' bits
    scales: jax.Array  # u16[num_pages, 2 * K, page_size]: the bf16 scales' bits
    value_dtype: str  # "float8_e4m3fn", "float8_e5m2" or "int8"

    @classmethod
    def from_values(cls, values: jax.Array, scales: jax.Array) -> "QuantizedKVPages":
        """Wrap 8-bit pages [num_pages, P, 2K, D] and their scales [num_pages, 2K, P] (any float dtype)."""
        if not is_quantized(values.dtype):
            raise ValueError(f"pages must be float8 or int8, got {values.dtype}")
        bits = jax.lax.bitcast_convert_type(values, jnp.uint8)
        scale_bits = jax.lax.bitcast_convert_type(scales.astype(jnp.bfloat16), jnp.uint16)
        return cls(bits, scale_bits, jnp.dtype(values.dtype).name)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the pages, so callers can treat this like the plain page array."""
        return self.pages.shape

    @property
    def dtype(self):
        """The 8-bit storage dtype of the values."""
        return jnp.dtype(self.value_dtype)

    def values(self) -> jax.Array:  # [num_pages, P, 2K, D] in dtype
        """The pages as their 8-bit values."""
        return jax.lax.bitcast_convert_type(self.pages, self.dtype)

    def scale_values(self) -> jax.Array:  # bf16[num_pages, 2K, P]
        """The scales as bf16."""
        return jax.lax.bitcast_convert_type(self.scales, jnp.bfloat16)

    def gather(self, page_ids: jax.Array) -> jax.Array:  # f32[*page_ids.shape, P, 2K, D]
        """Dequantized f32 K/V of the given pages."""
        values = jax.lax.bitcast_convert_type(self.pages[page_ids], self.dtype).astype(jnp.float32)
        scales = jax.lax.bitcast_convert_type(self.scales[page_ids], jnp.bfloat16).astype(jnp.float32)
        return values * jnp.swapaxes(scales, -1, -2)[..., None]


def empty_quantized_pages(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> QuantizedKVPages:
    """A zeroed 8-bit pool with unit scales.

    Args:
      num_pages, page_size, num_kv_heads, head_dim: the pool's shape.
      dtype: float8_e4m3fn, float8_e5m2 or int8.
    """
    if not is_quantized(dtype):
        names = [jnp.dtype(d).name for d in QUANTIZED_DTYPES]
        raise ValueError(f"quantized pages need an 8-bit dtype ({names}), got {dtype}")
    return QuantizedKVPages.from_values(
        jnp.zeros((num_pages, page_size, 2 * num_kv_heads, head_dim), dtype),
        jnp.ones((num_pages, 2 * num_kv_heads, page_size), jnp.bfloat16),
    )


def quantize_per_row(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Quantize along the last axis with one bf16 scale per row: x ~= q.astype(f32) * scale.

    The scale is the row's largest magnitude over the format's largest value, rounded up to a
    bf16, so nothing saturates. The error per element is then at most half a step: for FP8 a
    2^-4 (e4m3) or 2^-3 (e5m2) share of the element's own magnitude in the normal range; for
    int8, scale / 2 whatever the element.

    Args:
      x: [..., D] values.
      dtype: float8_e4m3fn, float8_e5m2 or int8.
    Returns:
      (quantized [..., D] in dtype, bf16 scales [...]).
    """
    largest = largest_value(dtype)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [...]
    exact = jnp.where(amax > 0, amax / largest, 1.0)  # all-zero rows get scale 1 and store zeros
    rounded = exact.astype(jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(rounded, jnp.uint16)
    # A positive bf16 one ulp up is its bits plus one.
    bumped = jax.lax.bitcast_convert_type(bits + jnp.uint16(1), jnp.bfloat16)
    scale = jnp.where(rounded.astype(jnp.float32) < exact, bumped, rounded)
    scaled = jnp.clip(x / scale.astype(jnp.float32)[..., None], -largest, largest)
    if jnp.dtype(dtype) == jnp.int8:
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scale


def dequantize_pages(kv: QuantizedKVPages) -> jax.Array:  # f32[num_pages, page_size, 2K, D]
    """The whole pool in f32: what the reference attends over for quantized pages."""
    scales = kv.scale_values().astype(jnp.float32).transpose(0, 2, 1)[..., None]
    return kv.values().astype(jnp.float32) * scales


@functools.cache
def rotation_matrix(head_dim: int) -> np.ndarray:  # f32[head_dim, head_dim]
    """The fixed orthonormal matrix quantized K/V are turned by before they are stored.

    A normalized Sylvester-Hadamard matrix when head_dim is a power of two (every entry
    +-1/sqrt(D), so each output channel mixes all inputs equally); otherwise a seeded random
    orthogonal matrix, which spreads outliers almost as well.
    """
    if head_dim & (head_dim - 1) == 0:
        matrix = np.ones((1, 1))
        while matrix.shape[0] < head_dim:
            matrix = np.block([[matrix, matrix], [matrix, -matrix]])
        matrix = matrix / np.sqrt(head_dim)
    else:
        orthogonal, upper = np.linalg.qr(np.random.default_rng(0).standard_normal((head_dim, head_dim)))
        matrix = orthogonal * np.sign(np.diag(upper))
    matrix = matrix.astype(np.float32)
    matrix.flags.writeable = False  # cached and shared
    return matrix


def rotate(x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
    """x turned by rotation_matrix (x @ R), in f32 and cast back to x's dtype."""
    matrix = jnp.asarray(rotation_matrix(x.shape[-1]))
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), matrix).astype(x.dtype)


def unrotate(x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
    """The inverse of rotate (x @ R^T)."""
    matrix = jnp.asarray(rotation_matrix(x.shape[-1]))
    return jnp.einsum("...e,de->...d", x.astype(jnp.float32), matrix).astype(x.dtype)
