"""The pure-jnp ragged paged attention against hand arithmetic and dense causal attention."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionMetadata, paged_attention, ragged_paged_attention_reference, write_kv

PADDED_TOKENS = 128
PADDED_SEQS = 8


def _pool(pages: np.ndarray, dtype=jnp.float32) -> jnp.ndarray:
    """A pool array from pages written per head slot ([num_pages, P, 2K, D] -> [num_pages, P, 2K * D])."""
    return jnp.asarray(pages.reshape(*pages.shape[:2], -1), dtype)


def test_hand_worked_decode():
    # One sequence, one head, head_dim 2, page_size 2, block table [3, 1] (non-contiguous).
    # Cached keys k0=[1,0], k1=[0,1] with values v0=[1,0], v1=[0,1] sit in page 3; the new
    # token (position 2) has k2=[1,1], v2=[1,1] and is written into page 1, offset 0.
    # Query q=[1,0], sm_scale=1: scores q.k = [1, 0, 1]; softmax = [e, 1, e] / (2e + 1).
    # out = (e*[1,0] + 1*[0,1] + e*[1,1]) / (2e + 1) = [2e, e + 1] / (2e + 1)
    #     = [5.436564 / 6.436564, 3.718282 / 6.436564] = [0.844637, 0.577682].
    pages = np.zeros((4, 2, 2, 2), np.float32)  # [num_pages, page_size, 2 * K, D]
    pages[3, 0, 0], pages[3, 0, 1] = [1, 0], [1, 0]  # k0, v0
    pages[3, 1, 0], pages[3, 1, 1] = [0, 1], [0, 1]  # k1, v1
    metadata = AttentionMetadata(
        slots=jnp.array([1 * 2 + 0], jnp.int32),
        block_tables=jnp.array([[3, 1]], jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        kv_lens=jnp.array([3], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    q = jnp.array([[[1.0, 0.0]]])
    new = jnp.array([[[1.0, 1.0]]])
    out, new_pages = paged_attention(q, new, new, _pool(pages), metadata, sm_scale=1.0)
    e = math.e
    np.testing.assert_allclose(np.asarray(out)[0, 0], [2 * e / (2 * e + 1), (e + 1) / (2 * e + 1)], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_pages)[1, 0], [1, 1, 1, 1])  # k2 | v2


def _dense_attention(q, k, v, query_positions, sm_scale, sliding_window=None):
    """f64 causal attention of queries at `query_positions` over k/v [L, K, D]."""
    num_q, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * sm_scale
    kv_pos = np.arange(k.shape[0])
    visible = kv_pos[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        visible &= kv_pos[None, :] > query_positions[:, None] - sliding_window
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def _random_batch(rng, *, kv_lens, q_lens, page_size, num_kv_heads, group, head_dim, kv_dtype):
    """Sequences with random history in randomly permuted pages, and their new tokens."""
    pages_per_seq = max(-(-n // page_size) for n in kv_lens) + 1
    num_pages = 1 + len(kv_lens) * pages_per_seq + 3
    page_ids = rng.permutation(np.arange(1, num_pages))  # never page 0
    block_tables = np.zeros((PADDED_SEQS, pages_per_seq), np.int32)
    pages = rng.normal(size=(num_pages, page_size, 2 * num_kv_heads, head_dim)).astype(np.float32)
    pages = np.array(jnp.asarray(pages, kv_dtype).astype(jnp.float32))  # garbage everywhere
    dense_k, dense_v, q_all, slots, _expected_rows = [], [], [], [], []
    cursor = 0
    for s, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=False)):
        table = page_ids[cursor : cursor + pages_per_seq]
        cursor += pages_per_seq
        block_tables[s] = table
        k = rng.normal(size=(kv_len, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.normal(size=(kv_len, num_kv_heads, head_dim)).astype(np.float32)
        k = np.asarray(jnp.asarray(k, kv_dtype).astype(jnp.float32))  # what the pool can hold
        v = np.asarray(jnp.asarray(v, kv_dtype).astype(jnp.float32))
        positions = np.arange(kv_len)
        seq_slots = table[positions // page_size] * page_size + positions % page_size
        flat = pages.reshape(-1, 2 * num_kv_heads, head_dim)
        history = kv_len - q_len  # already cached; the last q_len are written by the call
        flat[seq_slots[:history], 0::2] = k[:history]
        flat[seq_slots[:history], 1::2] = v[:history]
        dense_k.append(k)
        dense_v.append(v)
        q_all.append(rng.normal(size=(q_len, num_kv_heads * group, head_dim)).astype(np.float32))
        slots.append(seq_slots[history:])
    return pages, block_tables, dense_k, dense_v, q_all, slots


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv_read", ["per_token", "per_sequence", "per_block"])
def test_matches_dense_causal_attention(group, page_size, kv_dtype, kv_read):
    rng = np.random.default_rng(page_size * 10 + group)
    num_kv_heads, head_dim = 2, 16
    # Lengths that end exactly on a page boundary, one past it, one short, and tiny ones;
    # a mix of decodes (q_len 1), a whole prefill, and prefill chunks over history.
    kv_lens = [page_size, page_size + 1, 3 * page_size - 1, 1, 2 * page_size, 7]
    q_lens = [1, page_size + 1, 5, 1, page_size, 3]
    pages, block_tables, dense_k, dense_v, q_all, slots = _random_batch(
        rng,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
    )
    num_tokens = sum(q_lens)
    q = np.zeros((PADDED_TOKENS, num_kv_heads * group, head_dim), np.float32)
    k_new = np.zeros((PADDED_TOKENS, num_kv_heads, head_dim), np.float32)
    v_new = np.zeros_like(k_new)
    token_slots = np.zeros(PADDED_TOKENS, np.int32)  # padded tokens write into the null page
    cu = np.zeros(PADDED_SEQS + 1, np.int32)
    for s, q_len in enumerate(q_lens):
        start = cu[s]
        cu[s + 1] = start + q_len
        q[start : start + q_len] = q_all[s]
        k_new[start : start + q_len] = dense_k[s][-q_len:]
        v_new[start : start + q_len] = dense_v[s][-q_len:]
        token_slots[start : start + q_len] = slots[s]
    cu[len(q_lens) + 1 :] = num_tokens  # padded rows have q_len 0
    kv_lens_padded = np.zeros(PADDED_SEQS, np.int32)
    kv_lens_padded[: len(kv_lens)] = kv_lens
    metadata = AttentionMetadata(
        slots=jnp.asarray(token_slots),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(kv_lens_padded),
        num_seqs=jnp.asarray([len(kv_lens)], jnp.int32),
    )
    sm_scale = head_dim**-0.5
    new_pages = write_kv(_pool(pages, kv_dtype), jnp.asarray(k_new), jnp.asarray(v_new), metadata.slots)
    out = np.asarray(
        ragged_paged_attention_reference(jnp.asarray(q), new_pages, metadata, sm_scale=sm_scale, kv_read=kv_read)
    )
    for s, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=False)):
        expected = _dense_attention(q_all[s], dense_k[s], dense_v[s], np.arange(kv_len - q_len, kv_len), sm_scale)
        np.testing.assert_allclose(out[cu[s] : cu[s + 1]], expected, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(out[num_tokens:], 0.0)  # padded tokens attend to nothing
    # Every live page outside the written slots is untouched.
    flat_before = np.asarray(jnp.asarray(pages, kv_dtype)).reshape(-1, 2 * num_kv_heads, head_dim)
    flat_after = np.asarray(new_pages).reshape(-1, 2 * num_kv_heads, head_dim)
    untouched = np.ones(len(flat_before), bool)
    untouched[token_slots] = False
    np.testing.assert_array_equal(flat_after[untouched], flat_before[untouched])


@pytest.mark.parametrize("kv_read", ["per_token", "per_sequence", "per_block"])
def test_sliding_window_matches_dense(kv_read):
    rng = np.random.default_rng(7)
    page_size, window, kv_len = 8, 5, 21
    pages, block_tables, dense_k, dense_v, q_all, slots = _random_batch(
        rng,
        kv_lens=[kv_len],
        q_lens=[kv_len],
        page_size=page_size,
        num_kv_heads=1,
        group=2,
        head_dim=8,
        kv_dtype=jnp.float32,
    )
    metadata = AttentionMetadata(
        slots=jnp.asarray(slots[0]),
        block_tables=jnp.asarray(block_tables[:1]),
        cu_q_lens=jnp.asarray([0, kv_len], jnp.int32),
        kv_lens=jnp.asarray([kv_len], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )
    pages = write_kv(_pool(pages), jnp.asarray(dense_k[0]), jnp.asarray(dense_v[0]), metadata.slots)
    out = ragged_paged_attention_reference(
        jnp.asarray(q_all[0]), pages, metadata, sm_scale=0.3, sliding_window=window, kv_read=kv_read
    )
    expected = _dense_attention(q_all[0], dense_k[0], dense_v[0], np.arange(kv_len), 0.3, sliding_window=window)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("chunk_sizes", [[1] * 19, [5, 5, 5, 4], [16, 3], [7, 1, 11]])
@pytest.mark.parametrize("kv_read", ["per_token", "per_sequence", "per_block"])
def test_chunked_prefill_equals_one_prefill(chunk_sizes, kv_read):
    rng = np.random.default_rng(len(chunk_sizes))
    page_size, num_kv_heads, group, head_dim, length = 8, 2, 2, 16, 19
    table = np.array([5, 2, 7], np.int32)
    q = rng.normal(size=(length, num_kv_heads * group, head_dim)).astype(np.float32)
    k = rng.normal(size=(length, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(length, num_kv_heads, head_dim)).astype(np.float32)
    slots = table[np.arange(length) // page_size] * page_size + np.arange(length) % page_size
    empty = jnp.zeros((8, page_size, 2 * num_kv_heads * head_dim), jnp.float32)

    def run(pages, start, stop):
        metadata = AttentionMetadata(
            slots=jnp.asarray(slots[start:stop]),
            block_tables=jnp.asarray(table[None]),
            cu_q_lens=jnp.asarray([0, stop - start], jnp.int32),
            kv_lens=jnp.asarray([stop], jnp.int32),
            num_seqs=jnp.asarray([1], jnp.int32),
        )
        pages = write_kv(pages, jnp.asarray(k[start:stop]), jnp.asarray(v[start:stop]), metadata.slots)
        out = ragged_paged_attention_reference(
            jnp.asarray(q[start:stop]), pages, metadata, sm_scale=0.25, kv_read=kv_read
        )
        return out, pages

    whole_out, whole_pages = run(empty, 0, length)
    pages, outs, start = empty, [], 0
    for size in chunk_sizes:
        out, pages = run(pages, start, start + size)
        outs.append(np.asarray(out))
        start += size
    np.testing.assert_allclose(np.concatenate(outs), np.asarray(whole_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(pages), np.asarray(whole_pages))


def test_write_kv_interleaves_k_and_v():
    pages = jnp.zeros((3, 4, 8), jnp.float32)  # 2 kv heads of head_dim 2: rows k0 | v0 | k1 | v1
    k = jnp.arange(8, dtype=jnp.float32).reshape(2, 2, 2)
    v = -k
    new = np.asarray(write_kv(pages, k, v, jnp.array([5, 9], jnp.int32))).reshape(3, 4, 4, 2)
    np.testing.assert_array_equal(new[1, 1, 0::2], np.asarray(k[0]))  # slot 5 = page 1, offset 1
    np.testing.assert_array_equal(new[1, 1, 1::2], np.asarray(v[0]))
    np.testing.assert_array_equal(new[2, 1, 0::2], np.asarray(k[1]))  # slot 9 = page 2, offset 1
    assert np.count_nonzero(new) == np.count_nonzero(np.asarray(k)) + np.count_nonzero(np.asarray(v))


def test_gqa_rejects_mismatched_heads():
    metadata = AttentionMetadata(
        slots=jnp.zeros(1, jnp.int32),
        block_tables=jnp.ones((1, 1), jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        kv_lens=jnp.array([1], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_paged_attention_reference(jnp.zeros((1, 3, 4)), jnp.zeros((2, 4, 16)), metadata, sm_scale=1.0)


def _padded_metadata(token_slots, block_tables, q_lens, kv_lens) -> AttentionMetadata:
    """Metadata of live rows with these q/kv lengths, padded to PADDED_SEQS rows of no tokens."""
    num_tokens = sum(q_lens)
    cu = np.full(PADDED_SEQS + 1, num_tokens, np.int32)
    cu[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    return AttentionMetadata(
        slots=jnp.asarray(token_slots, jnp.int32),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(list(kv_lens) + [0] * (PADDED_SEQS - len(kv_lens)), jnp.int32),
        num_seqs=jnp.asarray([len(kv_lens)], jnp.int32),
    )


# (kv_lens, q_lens) of batches over several query blocks of 128 tokens.
_MULTI_BLOCK_LAYOUTS = {
    # A long prefill over history and a fresh one: 384 new tokens, 3 query blocks.
    "two_prefills": ([340, 84], [300, 84]),
    # Blocks holding 2 rows each: the per_block path loops over the rows present.
    "three_prefills": ([100, 160, 90], [100, 60, 90]),
    # A first block holding 4 rows (the most it loops over), then one.
    "four_rows": ([40, 70, 48, 100], [40, 30, 48, 90]),
    # A long prefill, then decodes and short chunks: the second block spans 6 rows and reads per token.
    "mixed": ([160, 33, 16, 40, 1, 130], [150, 1, 1, 40, 1, 30]),
}


@pytest.mark.parametrize("layout", sorted(_MULTI_BLOCK_LAYOUTS))
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("kv_read", ["per_sequence", "per_block"])
def test_batches_over_several_query_blocks(layout, sliding_window, kv_read):
    """Batches of 256+ tokens split into query blocks that skip KV blocks (and rows) they cannot see."""
    rng = np.random.default_rng(11)
    page_size, num_kv_heads, group, head_dim = 16, 2, 2, 16
    kv_lens, q_lens = _MULTI_BLOCK_LAYOUTS[layout]
    pages, block_tables, dense_k, dense_v, q_all, slots = _random_batch(
        rng,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        kv_dtype=jnp.float32,
    )
    num_tokens = sum(q_lens)
    padded = -(-num_tokens // 128) * 128 + 128  # always one query block of padding only
    token_slots = np.zeros(padded, np.int32)
    token_slots[:num_tokens] = np.concatenate(slots)
    metadata = _padded_metadata(token_slots, block_tables, q_lens, kv_lens)
    cu = np.asarray(metadata.cu_q_lens)
    new = [np.zeros((padded - num_tokens, num_kv_heads, head_dim), np.float32)]
    k_new = np.concatenate([k[-n:] for k, n in zip(dense_k, q_lens, strict=True)] + new)
    v_new = np.concatenate([v[-n:] for v, n in zip(dense_v, q_lens, strict=True)] + new)
    pages = write_kv(_pool(pages), jnp.asarray(k_new), jnp.asarray(v_new), metadata.slots)
    q = np.zeros((padded, num_kv_heads * group, head_dim), np.float32)
    q[:num_tokens] = np.concatenate(q_all)
    out = np.asarray(
        ragged_paged_attention_reference(
            jnp.asarray(q), pages, metadata, sm_scale=0.25, sliding_window=sliding_window, kv_read=kv_read
        )
    )
    for s, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
        expected = _dense_attention(
            q_all[s], dense_k[s], dense_v[s], np.arange(kv_len - q_len, kv_len), 0.25, sliding_window=sliding_window
        )
        np.testing.assert_allclose(out[cu[s] : cu[s + 1]], expected, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(out[num_tokens:], 0.0)


@pytest.mark.parametrize("kv_read", ["per_token", "per_sequence", "per_block"])
def test_nan_in_unused_slots_never_reaches_live_tokens(kv_read):
    """Garbage (NaN) in the null page, in free pages and past each length stays out of every output."""
    rng = np.random.default_rng(3)
    page_size, num_kv_heads, group, head_dim = 8, 2, 2, 16
    kv_lens, q_lens = [13, 5, 9], [13, 1, 2]
    pages, block_tables, dense_k, dense_v, q_all, slots = _random_batch(
        rng,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        kv_dtype=jnp.float32,
    )
    pages[:] = np.nan  # every slot not written below is garbage
    flat = pages.reshape(-1, 2 * num_kv_heads, head_dim)
    for s, kv_len in enumerate(kv_lens):
        positions = np.arange(kv_len)
        seq_slots = block_tables[s][positions // page_size] * page_size + positions % page_size
        flat[seq_slots, 0::2] = dense_k[s]
        flat[seq_slots, 1::2] = dense_v[s]
    num_tokens = sum(q_lens)
    padded = 32
    q = np.zeros((padded, num_kv_heads * group, head_dim), np.float32)
    q[:num_tokens] = np.concatenate(q_all)
    # Slots are unused (nothing is written); padded block-table entries point at the NaN null page.
    metadata = _padded_metadata(np.zeros(padded), block_tables, q_lens, kv_lens)
    cu = np.asarray(metadata.cu_q_lens)
    out = np.asarray(
        ragged_paged_attention_reference(jnp.asarray(q), _pool(pages), metadata, sm_scale=0.25, kv_read=kv_read)
    )
    assert np.isfinite(out).all()
    for s, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
        expected = _dense_attention(q_all[s], dense_k[s], dense_v[s], np.arange(kv_len - q_len, kv_len), 0.25)
        np.testing.assert_allclose(out[cu[s] : cu[s + 1]], expected, rtol=2e-5, atol=2e-5)
