"""The native CPU attention kernel over int8 pools (values and scales; cpu_paged_attention_lanes.h) against the
pure-jnp reference, which dequantizes the pages it gathers."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import CASES, make_case, relative_error, standard_case, tokens_of_long_chunks

from pallas_kernels import cpu_paged_attention as native
from pallas_kernels import native_library, ragged_paged_attention_reference
from pallas_kernels.quantization import QuantizedKVPages

# Short runs (decode tokens, drafts) scale each key's integer dot product by the key's scale and each softmax weight
# by the value's scale, where the reference multiplies the dequantized values: both accumulate in f32, and only the
# order of the roundings differs (the plain pools' tolerance in test_cpu_native_attention.py).
TOLERANCE = 2e-6
# Runs of 8 or more tokens without a soft cap (prompt chunks) take the tiled path, which multiplies bf16 pairs as over
# a bf16 pool: the integers exactly, the queries rounded to bf16 (the checks give queries that stay bf16 values, so
# that is exact too: a rounded query's error grows with the scores, which these random pools make large) and each
# softmax weight, scaled by its value's scale, rounded to bf16: off by at most 2^-9 of itself, so
# each output element is within 2^-9 of the largest |value| it reads, beside f32 sums' noise
# (test_cpu_native_attention.py's test_bf16_pool_differs_only_by_the_weights_rounding makes the same argument).
MIN_TILED_RUN_TOKENS = 8  # cpu_paged_attention_tiled.h's kMinTiledRunTokens
INT8_TARGET = native_library.ATTENTION_TARGETS[jnp.dtype(jnp.int8)][0]


@pytest.fixture(autouse=True, scope="module")
def _kernel_builds():
    """The suite's machines have a compiler: the kernel must build there, not skip."""
    assert native_library.native_kernel_error() is None, native_library.native_kernel_error()


def _attend(case, impl, **options):
    options = dict(sm_scale=case.sm_scale, **options)
    return np.asarray(impl(case.q, case.kv_pages, case.metadata, **options))


def _native_calls(case, **options) -> int:
    """How many calls of the int8 kernel the native attention's program makes."""
    run = functools.partial(native.ragged_paged_attention_cpu, sm_scale=case.sm_scale, **options)
    return str(jax.make_jaxpr(run)(case.q, case.kv_pages, case.metadata)).count(INT8_TARGET)


def _tiled_tokens(case, soft_cap=None) -> np.ndarray:
    """bool[T]: a superset of the tokens on the tiled path (a chunk's last few tokens can form a short run)."""
    if soft_cap is not None:
        return np.zeros(case.q.shape[0], bool)  # the tiled path takes no soft cap
    return tokens_of_long_chunks(case, MIN_TILED_RUN_TOKENS)


def _largest_value(pool: QuantizedKVPages) -> float:
    """The largest |dequantized V| in the pool's used slots (unused ones hold NaN scales)."""
    values = np.asarray(jax.lax.bitcast_convert_type(pool.pages, jnp.int8), np.float32)
    values = values.reshape(*pool.pages.shape[:2], -1, pool.head_dim) * np.asarray(pool.token_scales())[..., None]
    return float(np.nanmax(np.abs(values[:, :, 1::2])))


def _check(case, **options):
    """The kernel reads the pool (one call) and matches the reference, for bf16-valued queries scaled by a power of
    two (so that the kernel's queries, q * sm_scale, are bf16 values too); padding gets zeros."""
    q = case.q.astype(jnp.bfloat16).astype(jnp.float32)
    case = dataclasses.replace(case, q=q, sm_scale=2.0 ** round(np.log2(case.sm_scale)))
    assert _native_calls(case, **options) == 1
    out = _attend(case, native.ragged_paged_attention_cpu, **options)
    ref = _attend(case, ragged_paged_attention_reference, **options)
    assert np.isfinite(out).all()  # NaN scales and the extreme value in every unused slot never reach an output
    live = case.num_live_tokens
    tiled = _tiled_tokens(case, options.get("soft_cap"))[:live]
    if (~tiled).any():
        assert relative_error(out[:live][~tiled], ref[:live][~tiled], int((~tiled).sum())) < TOLERANCE
    if tiled.any():
        largest = _largest_value(case.kv_pages)
        error = np.abs(out[:live][tiled] - ref[:live][tiled])
        np.testing.assert_array_less(error, (2.0**-9 + 1e-6) * largest)
    np.testing.assert_array_equal(out[live:], 0.0)


INT8_CASES = [case for case in CASES if case[0] == "int8"]


@pytest.mark.parametrize("kv_read", ["per_token", "auto"])
@pytest.mark.parametrize("kv_dtype,kind,page_size,head_dim,group", INT8_CASES)
def test_int8_cases_match_the_reference(kv_dtype, kind, page_size, head_dim, group, kv_read):
    """Decode, mixed and prefill batches (pages of 16, 32 and 128): under `auto` the kernel takes every token of an
    int8 pool, prefill chunks too (runs of 8 or more tokens on the tiled path)."""
    seed = CASES.index((kv_dtype, kind, page_size, head_dim, group))
    _check(standard_case(seed, kv_dtype, kind, page_size, head_dim, group), kv_read=kv_read)


@pytest.mark.parametrize("seed", range(8))
def test_random_int8_layouts(seed):
    """Random head counts, GQA groups to 8, page sizes, lengths to 400, chunks beside decodes and drafts, padding,
    table widths and page orders, over head_dims 32, 64 and 128; with and without a sliding window or soft cap."""
    rng = np.random.default_rng(500 + seed)
    num_seqs = int(rng.integers(1, 7))
    kv_lens = rng.integers(1, 400, num_seqs).tolist()
    q_lens = [int(rng.integers(1, min(n, 40 if i % 3 == 0 else 9) + 1)) for i, n in enumerate(kv_lens)]
    case = make_case(
        seed,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=int(rng.choice([1, 4, 16, 32])),
        num_kv_heads=int(rng.choice([1, 2, 3, 8])),
        group=int(rng.choice([1, 2, 3, 4, 5, 8])),
        head_dim=(32, 64, 128)[seed % 3],
        kv_dtype="int8",
        padded_tokens=sum(q_lens) + int(rng.integers(0, 6)),
        padded_rows=num_seqs + int(rng.integers(0, 3)),
        extra_pages_per_seq=int(rng.integers(0, 3)),
    )
    _check(case, kv_read="auto")
    _check(case, kv_read="auto", sliding_window=int(rng.integers(1, 60)))
    _check(case, kv_read="per_token", soft_cap=3.0)


def _rebuilt(pool: QuantizedKVPages, scales=None, num_groups: int = 1) -> QuantizedKVPages:
    """The pool's int8 values with `scales` (f32[pages, P, 2K], K at even head slots; the pool's own when None), the
    scale words laid out in `num_groups` head groups (as a pool sharded over KV heads lays them out)."""
    num_pages, page_size, _ = pool.pages.shape
    values = jax.lax.bitcast_convert_type(pool.pages, jnp.int8).reshape(num_pages, page_size, -1, pool.head_dim)
    return QuantizedKVPages.from_values(values, pool.token_scales() if scales is None else scales, num_groups)


def test_scale_words_in_head_groups_give_the_same_bits():
    """Scales laid out in 2 groups of KV heads (words [pages, G, lanes]) are read at the same scale per (KV head,
    token) as in one group: the same output bits."""
    case = make_case(3, kv_lens=[37, 70, 5], q_lens=[1, 9, 1], page_size=16, num_kv_heads=4, group=2, head_dim=64,
                     kv_dtype="int8", padded_tokens=13, padded_rows=4)  # fmt: skip
    grouped = dataclasses.replace(case, kv_pages=_rebuilt(case.kv_pages, num_groups=2))
    assert grouped.kv_pages.scales.shape[1] == 2
    one_group = _attend(case, native.ragged_paged_attention_cpu, kv_read="per_token")
    two_groups = _attend(grouped, native.ragged_paged_attention_cpu, kv_read="per_token")
    np.testing.assert_array_equal(two_groups, one_group)


@pytest.mark.parametrize("head_slot", [2, 3])  # KV head 1's K, then its V
def test_each_scale_reaches_its_own_key_or_value(head_slot):
    """Doubling one (page, token, KV head)'s K or V scale moves exactly the outputs of the query heads on that KV
    head in the one sequence that sees the slot, as it moves the reference's (a kernel that reads a neighbour's
    word, or K's half of it for V's, fails here)."""
    case = standard_case(11, "int8", "decode", 16, 64, 2)  # decode rows of 1, 16, 17, 48, 37 and 7 positions
    case = dataclasses.replace(case, q=case.q * 0.01)  # small scores: every slot's weight reaches the output
    sequence, slot, kv_head, group = 3, 5, head_slot // 2, 2
    page = int(np.asarray(case.metadata.block_tables)[sequence, 1])  # positions 16-31 of the sequence
    scales = np.asarray(case.kv_pages.token_scales()).copy()
    scales[page, slot, head_slot] *= 2  # exact in bf16
    moved = dataclasses.replace(case, kv_pages=_rebuilt(case.kv_pages, jnp.asarray(scales)))
    before = _attend(case, native.ragged_paged_attention_cpu, kv_read="per_token")
    after = _attend(moved, native.ragged_paged_attention_cpu, kv_read="per_token")
    ref = _attend(moved, ragged_paged_attention_reference, kv_read="per_token")
    assert relative_error(after, ref, case.num_live_tokens) < TOLERANCE
    differs = np.abs(after - before).max(axis=-1) > 0  # [T, N]
    expected = np.zeros_like(differs)
    expected[sequence, kv_head * group : (kv_head + 1) * group] = True
    np.testing.assert_array_equal(differs, expected)


@pytest.mark.parametrize("page_size,head_dim,group", [(16, 64, 3), (4, 128, 2), (32, 32, 5)])
def test_prompt_chunks_multiply_the_integers_as_a_bf16_pool_would(page_size, head_dim, group):
    """With every scale 1, chunks of whole 64-token runs (the tiled path) over an int8 pool give the bits the kernel
    gives over a bf16 pool holding the same integers (exact in bf16): the block's integers copied as bf16 pairs, the
    queries and weights rounded alike; a wrong copy, pairing or scale fails here."""
    case = make_case(5, kv_lens=[64, 200, 150], q_lens=[64, 128, 64], page_size=page_size, num_kv_heads=2,
                     group=group, head_dim=head_dim, kv_dtype="int8")  # fmt: skip
    pool = case.kv_pages
    unit = _rebuilt(pool, jnp.ones(pool.pages.shape[:2] + (2 * pool.num_kv_heads,), jnp.float32))
    integers = jax.lax.bitcast_convert_type(pool.pages, jnp.int8).astype(jnp.bfloat16)
    int8_out = _attend(dataclasses.replace(case, kv_pages=unit), native.ragged_paged_attention_cpu)
    bf16_out = _attend(dataclasses.replace(case, kv_pages=integers), native.ragged_paged_attention_cpu)
    np.testing.assert_array_equal(int8_out, bf16_out)


def test_other_head_dims_keep_the_jnp_reader():
    """An int8 pool of head_dim 80 (not 32, 64 or 128) is read by the reference's reader: no kernel call, and the
    reference's values."""
    case = make_case(9, kv_lens=[20, 45], q_lens=[1, 1], page_size=16, num_kv_heads=2, group=3, head_dim=80,
                     kv_dtype="int8")  # fmt: skip
    assert _native_calls(case, kv_read="per_token") == 0
    out = _attend(case, native.ragged_paged_attention_cpu, kv_read="per_token")
    ref = _attend(case, ragged_paged_attention_reference, kv_read="per_token")
    assert relative_error(out, ref, case.num_live_tokens) < TOLERANCE


def test_the_kernel_refuses_an_int8_head_dim_it_does_not_take():
    """Called directly with head_dim 48, the int8 kernel returns an error that names the head_dims it takes."""
    case = make_case(2, kv_lens=[20], q_lens=[1], page_size=16, num_kv_heads=1, group=1, head_dim=48, kv_dtype="int8")
    call = jax.ffi.ffi_call(INT8_TARGET, jax.ShapeDtypeStruct(case.q.shape, jnp.float32))
    metadata = case.metadata
    with pytest.raises(Exception, match="head_dim 32, 64 or 128"):
        jax.block_until_ready(
            call(
                case.q,
                case.kv_pages.pages,
                case.kv_pages.scales,
                metadata.block_tables,
                jnp.zeros(case.q.shape[0], jnp.int32),
                jnp.full(case.q.shape[0], 19, jnp.int32),
                jnp.full(case.q.shape[0], 20, jnp.int32),
                sliding_window=np.int64(0),
                soft_cap=np.float32(0.0),
            )
        )
