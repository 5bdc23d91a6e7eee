"""8-bit KV pages (FP8 or int8) with one bf16 scale per token and KV head, stored rotated.

Quantizing on write, dequantizing on read. Before K/V are quantized they are turned by a fixed
orthonormal matrix R (a normalized Hadamard matrix where head_dim is a power of two): q.k and the
attention-weighted sum of V are unchanged when q, k and v are all turned by R and the output is
turned back, but a rotated vector has its energy spread over all channels, so one outlier channel
no longer sets every other channel's step size. `ops.paged_attention` does the turning; the kernels
and the reference attend over whatever the pages hold.

The scales' layout is chosen for the TPU (kv_pages.py says why): one 32-bit word per (page, KV head,
token) holding the K scale's bf16 bits high and the V scale's low, the words of a page's heads in one
row of lanes, [num_pages, G, lanes], where G is the number of head groups the pool is sharded into
(1 unless the KV heads split over a mesh axis).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_hadamard import hadamard_rows_cpu, turns_natively

QUANTIZED_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)
# Scale words per page row are padded to whole TPU lane tiles.
LANE_TILE = 128
_HIGH_HALF = 0xFFFF0000


def is_quantized(dtype) -> bool:
    """Whether a page dtype is one of the 8-bit formats that carry scales (FP8 or int8)."""
    return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in QUANTIZED_DTYPES)


def largest_value(dtype) -> float:
    """The largest magnitude a quantized value may take: the format's max (127 for int8, kept symmetric)."""
    dtype = jnp.dtype(dtype)
    return 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)


def scale_lanes(heads_per_group: int, page_size: int) -> int:
    """Lanes of one page's scale row: a word per (KV head, token), padded to whole 128-lane tiles."""
    return -(-heads_per_group * page_size // LANE_TILE) * LANE_TILE


def pack_scale_words(key_scales: jax.Array, value_scales: jax.Array) -> jax.Array:  # u32[...]
    """One word per pair: the K scale's bf16 bits in the high half, the V scale's in the low half."""
    high = jax.lax.bitcast_convert_type(key_scales.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    low = jax.lax.bitcast_convert_type(value_scales.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    return (high << 16) | low


def unpack_scale_words(words: jax.Array) -> tuple[jax.Array, jax.Array]:  # (f32[...], f32[...])
    """(K scales, V scales) as f32, exactly the bf16 values packed: a bf16 is the high half of an f32."""
    key_scales = jax.lax.bitcast_convert_type(words & jnp.uint32(_HIGH_HALF), jnp.float32)
    value_scales = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
    return key_scales, value_scales


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["pages", "scales"], meta_fields=["value_dtype", "head_dim"]
)
@dataclasses.dataclass(frozen=True)
class QuantizedKVPages:
    """One layer's 8-bit page pool and its scales; a pytree that attention accepts in place of plain pages.

    Token t of page p holds K of KV head h in lanes [2hD, 2hD + D) of `pages[p, t]` and V in the next D,
    dequantized as `value * scale`; the scales of KV head h = g * K/G + i, token t, sit in word
    `scales[p, g, i * page_size + t]` (see pack_scale_words).

    The values are stored as unsigned bits: XLA:CPU scatters into an integer array in place but copies a
    whole float8 array on every scatter (measured: 0.02 ms against 98 ms for 8 tokens into 1,024 pages).
    Readers bitcast what they read, which is free.
    """

    pages: jax.Array  # u8[num_pages, page_size, 2 * K * D]: the 8-bit values' bits
    scales: jax.Array  # u32[num_pages, G, scale_lanes(K / G, page_size)]: packed K and V scales
    value_dtype: str  # "float8_e4m3fn", "float8_e5m2" or "int8"
    head_dim: int  # D

    @classmethod
    def from_values(cls, values: jax.Array, scales: jax.Array, num_groups: int = 1) -> "QuantizedKVPages":
        """Pack 8-bit pages [num_pages, P, 2K, D] and their scales [num_pages, P, 2K] (any float dtype).

        Args:
          values: the 8-bit K/V, K at even and V at odd head slots.
          scales: one per (page, token, head slot).
          num_groups: G, the head groups the scales are laid out in (the pool's shards over KV heads).
        """
        if not is_quantized(values.dtype):
            raise ValueError(f"pages must be float8 or int8, got {values.dtype}")
        num_pages, page_size, two_k, head_dim = values.shape
        num_kv_heads = two_k // 2
        if num_kv_heads % num_groups:
            raise ValueError(f"{num_kv_heads} KV heads do not split into {num_groups} groups")
        bits = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(num_pages, page_size, two_k * head_dim)
        words = pack_scale_words(scales[..., 0::2], scales[..., 1::2])  # u32[N, P, K]
        heads_per_group = num_kv_heads // num_groups
        # [N, P, G, K/G] -> [N, G, K/G, P] -> [N, G, K/G * P], padded to whole lane tiles.
        words = words.reshape(num_pages, page_size, num_groups, heads_per_group).transpose(0, 2, 3, 1)
        words = words.reshape(num_pages, num_groups, heads_per_group * page_size)
        lanes = scale_lanes(heads_per_group, page_size)
        words = jnp.pad(words, ((0, 0), (0, 0), (0, lanes - words.shape[-1])))
        return cls(bits, words, jnp.dtype(values.dtype).name, head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the pages, so callers can treat this like the plain page array."""
        return self.pages.shape

    @property
    def dtype(self):
        """The 8-bit storage dtype of the values."""
        return jnp.dtype(self.value_dtype)

    @property
    def num_kv_heads(self) -> int:
        """K, the KV heads a token row holds."""
        return self.pages.shape[2] // (2 * self.head_dim)

    @property
    def num_groups(self) -> int:
        """G, the head groups of the scale layout."""
        return self.scales.shape[1]

    def values(self) -> jax.Array:  # [num_pages, P, 2K * D] in dtype
        """The pages as their 8-bit values."""
        return jax.lax.bitcast_convert_type(self.pages, self.dtype)

    def token_scales(self, page_ids: jax.Array | None = None) -> jax.Array:  # f32[*page_ids.shape, P, 2K]
        """The scales of the given pages (all when None) per token and head slot, K at even and V at odd."""
        words = self.scales if page_ids is None else self.scales[page_ids]  # u32[..., G, lanes]
        page_size, num_kv_heads = self.pages.shape[1], self.num_kv_heads
        heads_per_group = num_kv_heads // self.num_groups
        lead = words.shape[:-2]
        words = words[..., : heads_per_group * page_size].reshape(*lead, num_kv_heads, page_size)
        key_scales, value_scales = unpack_scale_words(jnp.swapaxes(words, -1, -2))  # f32[..., P, K] each
        return jnp.stack([key_scales, value_scales], axis=-1).reshape(*lead, page_size, 2 * num_kv_heads)

    def gather(self, page_ids: jax.Array) -> jax.Array:  # f32[*page_ids.shape, P, 2K, D]
        """Dequantized f32 K/V of the given pages."""
        values = jax.lax.bitcast_convert_type(self.pages[page_ids], self.dtype).astype(jnp.float32)
        values = values.reshape(*values.shape[:-1], 2 * self.num_kv_heads, self.head_dim)
        return values * self.token_scales(page_ids)[..., None]


def empty_quantized_pages(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, num_groups: int = 1
) -> QuantizedKVPages:
    """A zeroed 8-bit pool with unit scales.

    Args:
      num_pages, page_size, num_kv_heads, head_dim: the pool's shape.
      dtype: float8_e4m3fn, float8_e5m2 or int8.
      num_groups: G, the head groups the scales are laid out in (the pool's shards over KV heads).
    """
    if not is_quantized(dtype):
        names = [jnp.dtype(d).name for d in QUANTIZED_DTYPES]
        raise ValueError(f"quantized pages need an 8-bit dtype ({names}), got {dtype}")
    if num_kv_heads % num_groups:
        raise ValueError(f"{num_kv_heads} KV heads do not split into {num_groups} groups")
    one = pack_scale_words(jnp.ones((), jnp.float32), jnp.ones((), jnp.float32))
    lanes = scale_lanes(num_kv_heads // num_groups, page_size)
    return QuantizedKVPages(
        pages=jnp.zeros((num_pages, page_size, 2 * num_kv_heads * head_dim), jnp.uint8),
        scales=jnp.full((num_pages, num_groups, lanes), one, jnp.uint32),
        value_dtype=jnp.dtype(dtype).name,
        head_dim=head_dim,
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
    """The whole pool in f32, one head slot per row: what the reference attends over for quantized pages."""
    return kv.gather(jnp.arange(kv.pages.shape[0]))


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


def rotate(x: jax.Array, *, native: bool = False) -> jax.Array:  # [..., D] -> [..., D]
    """x turned by rotation_matrix (x @ R), in f32 and cast back to x's dtype.

    Args:
      x: rows to turn.
      native: the model runs the native CPU kernels: a power-of-two D goes through cpu_hadamard's butterflies
        instead of a dot with R (the same values up to f32 rounding).
    """
    if native and turns_natively(x.shape[-1]):
        return hadamard_rows_cpu(x)
    matrix = jnp.asarray(rotation_matrix(x.shape[-1]))
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), matrix).astype(x.dtype)


def unrotate(x: jax.Array, *, native: bool = False) -> jax.Array:  # [..., D] -> [..., D]
    """The inverse of rotate (x @ R^T); `native` as for rotate (a normalized Hadamard matrix is its own inverse)."""
    if native and turns_natively(x.shape[-1]):
        return hadamard_rows_cpu(x)
    matrix = jnp.asarray(rotation_matrix(x.shape[-1]))
    return jnp.einsum("...e,de->...d", x.astype(jnp.float32), matrix).astype(x.dtype)
