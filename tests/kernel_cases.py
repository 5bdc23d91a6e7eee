"""Random ragged paged-attention inputs shared by the kernel tests and the kernel benchmark's checks."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import AttentionMetadata
from pallas_kernels.quantization import QuantizedKVPages, quantize_per_row

# Per-dtype tolerance on ||out - ref|| / ||ref||, as the kernel issue states them.
RELATIVE_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float8_e4m3fn": 1e-2, "float8_e5m2": 1e-2, "int8": 1e-2}

# (kv_lens, q_lens) for the batch kinds; page-boundary lengths are filled in per page size.
BATCH_KINDS = ("decode", "prefill", "mixed")

# (kv dtype, batch kind, page size, head_dim, query heads per KV head). Every dtype meets every
# batch kind; every page size, head_dim and GQA ratio appears several times.
CASES = [
    ("float32", "decode", 8, 64, 1),
    ("float32", "prefill", 16, 128, 2),
    ("float32", "mixed", 32, 64, 4),
    ("float32", "mixed", 64, 128, 8),
    ("bfloat16", "decode", 16, 128, 4),
    ("bfloat16", "prefill", 32, 64, 8),
    ("bfloat16", "mixed", 8, 128, 1),
    ("float8_e4m3fn", "decode", 64, 64, 2),
    ("float8_e4m3fn", "prefill", 8, 64, 4),
    ("float8_e4m3fn", "mixed", 16, 64, 8),
    ("float8_e4m3fn", "mixed", 32, 128, 1),
    ("float8_e5m2", "mixed", 16, 64, 2),
    ("int8", "decode", 16, 128, 4),
    ("int8", "mixed", 32, 64, 2),
    # Pages of 128: the GPU kernel reads prefill blocks (64 tokens) and, at head_dim 256, decode blocks as
    # slices of a page.
    ("float32", "mixed", 128, 64, 4),
    ("int8", "prefill", 128, 128, 2),
    ("bfloat16", "decode", 128, 256, 2),
]


@dataclasses.dataclass
class AttentionCase:
    """One call's inputs: queries, the pool (plain or FP8 with scales) and the ragged layout."""

    q: jnp.ndarray  # [T, N, D]
    kv_pages: jnp.ndarray | QuantizedKVPages
    metadata: AttentionMetadata
    num_live_tokens: int
    sm_scale: float


def batch_lengths(kind: str, page_size: int) -> tuple[list[int], list[int]]:
    """kv and q lengths for a batch kind, covering kv length 1, exactly a page boundary, and one past it."""
    if kind == "decode":
        kv_lens = [1, page_size, page_size + 1, 3 * page_size, 2 * page_size + 5, 7]
        return kv_lens, [1] * len(kv_lens)
    if kind == "prefill":
        # Fresh prompts and a chunk over history.
        return [page_size, 2 * page_size + 1, 1, 3 * page_size + 3], [page_size, 2 * page_size + 1, 1, page_size + 2]
    # Mixed: decodes around prefill chunks.
    kv_lens = [page_size + 1, 2 * page_size, 1, 3 * page_size + 7, page_size]
    q_lens = [1, 2 * page_size, 1, 9, 1]
    return kv_lens, q_lens


def make_case(
    seed: int,
    *,
    kv_lens: list[int],
    q_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    kv_dtype: str,
    padded_tokens: int | None = None,
    padded_rows: int | None = None,
    extra_pages_per_seq: int = 1,
    q_dtype=jnp.float32,
) -> AttentionCase:
    """Random history in randomly permuted (non-contiguous) pages, with NaN in every unused slot.

    Args:
      kv_lens, q_lens: per live sequence; its new tokens are the last q_len of kv_len.
      padded_tokens, padded_rows: pad T and S past the live ones (padded rows have no tokens).
      extra_pages_per_seq: block-table columns beyond the longest sequence (padded with page 0).
    """
    rng = np.random.default_rng(seed)
    num_seqs = len(kv_lens)
    num_tokens = sum(q_lens)
    padded_tokens = padded_tokens or num_tokens
    padded_rows = padded_rows or num_seqs
    pages_per_seq = max(-(-n // page_size) for n in kv_lens) + extra_pages_per_seq
    num_pages = 1 + num_seqs * pages_per_seq + 3
    shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
    values = rng.standard_normal(shape).astype(np.float32)
    # Unused slots hold NaN: a kernel that lets them reach a live token's output fails loudly.
    used = np.zeros(shape[:2], bool)
    block_tables = np.zeros((padded_rows, pages_per_seq), np.int32)
    permutation = rng.permutation(np.arange(1, num_pages))
    for s, kv_len in enumerate(kv_lens):
        pages = permutation[s * pages_per_seq : s * pages_per_seq + -(-kv_len // page_size)]
        block_tables[s, : len(pages)] = pages
        for position in range(kv_len):
            used[pages[position // page_size], position % page_size] = True
    values[~used] = np.nan
    cu_q_lens = np.full(padded_rows + 1, num_tokens, np.int32)
    cu_q_lens[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    slots = np.zeros(padded_tokens, np.int32)  # padded tokens point into the null page
    token = 0
    for s, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
        for position in range(kv_len - q_len, kv_len):
            slots[token] = block_tables[s, position // page_size] * page_size + position % page_size
            token += 1
    metadata = AttentionMetadata(
        slots=jnp.asarray(slots),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu_q_lens),
        kv_lens=jnp.asarray(list(kv_lens) + [0] * (padded_rows - num_seqs), jnp.int32),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
    )
    q = rng.standard_normal((padded_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    if kv_dtype.startswith("float8") or kv_dtype == "int8":
        token_rows = values.reshape(num_pages, page_size, 2 * num_kv_heads, head_dim)
        # Give rows different magnitudes, as real K/V have, so per-row scales matter.
        token_rows = token_rows * rng.uniform(0.05, 20.0, size=shape[:3] + (1,)).astype(np.float32)
        kv_pages = _quantized_pool(np.nan_to_num(token_rows), used, kv_dtype)
    else:
        kv_pages = jnp.asarray(values.reshape(num_pages, page_size, -1), jnp.dtype(kv_dtype))
    return AttentionCase(
        q=jnp.asarray(q, q_dtype),
        kv_pages=kv_pages,
        metadata=metadata,
        num_live_tokens=num_tokens,
        sm_scale=head_dim**-0.5,
    )


@functools.partial(jax.jit, static_argnums=2)
def _quantized_pool(token_rows: jax.Array, used: jax.Array, kv_dtype: str) -> QuantizedKVPages:
    """8-bit pages of `token_rows` [N, P, 2K, D] with unused slots (used: bool[N, P]) poisoned, as one program:
    op by op, each case's new shapes compiled a dozen small programs (10.8 s for the 17 CASES, against 2.1 s)."""
    quantized, scales = quantize_per_row(token_rows, jnp.dtype(kv_dtype))
    # Unused slots: NaN values where the format has one (int8 has none: its extreme), NaN scales.
    filler = jnp.asarray(np.nan if kv_dtype != "int8" else -128, quantized.dtype)
    pages = jnp.where(used[..., None, None], quantized, filler)
    scales = jnp.where(used[..., None], scales, jnp.nan)
    return QuantizedKVPages.from_values(pages, scales)


def standard_case(seed, kv_dtype, kind, page_size, head_dim, group, num_kv_heads=2, **kwargs) -> AttentionCase:
    """A batch of one kind with 5 padded tokens (into the null page) and two padded, empty sequence rows."""
    kv_lens, q_lens = batch_lengths(kind, page_size)
    return make_case(
        seed,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        padded_tokens=sum(q_lens) + 5,
        padded_rows=len(kv_lens) + 2,
        **kwargs,
    )


def relative_error(out, ref, num_live_tokens: int) -> float:
    """||out - ref|| / ||ref|| over the live tokens, in f64."""
    out = np.asarray(out, np.float64)[:num_live_tokens]
    ref = np.asarray(ref, np.float64)[:num_live_tokens]
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def tokens_of_long_chunks(case: AttentionCase, min_tokens: int) -> np.ndarray:
    """bool[T]: the tokens of sequences that bring at least min_tokens new tokens in this batch."""
    chunk = np.zeros(case.q.shape[0], bool)
    cu_q_lens = np.asarray(case.metadata.cu_q_lens)
    for seq in range(int(np.asarray(case.metadata.num_seqs)[0])):
        if cu_q_lens[seq + 1] - cu_q_lens[seq] >= min_tokens:
            chunk[cu_q_lens[seq] : cu_q_lens[seq + 1]] = True
    return chunk


def one_prompt_metadata(page_size: int, length: int, pages=(1, 2, 3)) -> AttentionMetadata:
    """One sequence's first `length` tokens as one chunk, written from slot 0 of its first page (page 1; the null page
    0 unused)."""
    first_slot = pages[0] * page_size
    return AttentionMetadata(
        slots=jnp.arange(first_slot, first_slot + length, dtype=jnp.int32),
        block_tables=jnp.asarray([list(pages)], jnp.int32),
        cu_q_lens=jnp.asarray([0, length], jnp.int32),
        kv_lens=jnp.asarray([length], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )
