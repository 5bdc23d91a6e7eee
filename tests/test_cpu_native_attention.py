"""The native CPU attention kernel (pallas_kernels/cpu_paged_attention.cc) against the pure-jnp reference."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import CASES, make_case, relative_error, standard_case, tokens_of_long_chunks

from pallas_kernels import cpu_paged_attention as native
from pallas_kernels import native_library, ragged_paged_attention_reference, resolve_attention_impl

# The kernel and the reference read the same stored values and both accumulate in f32; only the order of the
# sums differs.
TOLERANCE = 2e-6
# Except where a bf16 pool's tokens take the vectorized paths, which multiply bf16 pairs: the queries and the softmax
# weights are each rounded to bf16 once (half an ulp, 2^-9 relative), products are exact and sums f32, so the two
# roundings bound the error by bf16's epsilon, 2^-8. Those paths are the tiled one (runs of 8 or more tokens) and,
# for head_dim 32, 64 or 128, the short-run one; other head_dims' short runs keep f32 arithmetic.
BF16_PAIRS_TOLERANCE = 2.0**-8
MIN_TILED_RUN_TOKENS = 8  # cpu_paged_attention_tiled.h's kMinTiledRunTokens
LANES_HEAD_DIMS = (32, 64, 128)  # cpu_paged_attention_lanes.h's head_dims


def _both(case, **options):
    """(native, reference) outputs for one case."""
    options = dict(sm_scale=case.sm_scale, **options)
    out = native.ragged_paged_attention_cpu(case.q, case.kv_pages, case.metadata, **options)
    ref = ragged_paged_attention_reference(case.q, case.kv_pages, case.metadata, **options)
    return np.asarray(out), np.asarray(ref)


def _paired_tokens(case, soft_cap=None) -> np.ndarray:
    """bool[T]: a superset of the tokens that take the bf16-pair arithmetic (a chunk's last few tokens can form a
    short run)."""
    paired = np.zeros(case.q.shape[0], bool)
    if getattr(case.kv_pages, "dtype", None) != jnp.bfloat16:
        return paired
    if case.q.shape[-1] in LANES_HEAD_DIMS:
        return ~paired  # every run: tiled or short
    if soft_cap is not None:
        return paired  # the tiled path takes no soft cap
    return tokens_of_long_chunks(case, MIN_TILED_RUN_TOKENS)


def _check(case, **options):
    out, ref = _both(case, **options)
    assert np.isfinite(out).all()  # the NaN in every unused slot never reaches an output
    live = case.num_live_tokens
    paired = _paired_tokens(case, options.get("soft_cap"))[:live]
    for tokens, tolerance in ((~paired, TOLERANCE), (paired, BF16_PAIRS_TOLERANCE)):
        if tokens.any():
            assert relative_error(out[:live][tokens], ref[:live][tokens], int(tokens.sum())) < tolerance
    np.testing.assert_array_equal(out[live:], 0.0)  # padded tokens


@pytest.fixture(autouse=True, scope="module")
def _kernel_builds():
    """The suite's machines have a compiler: the kernel must build there, not skip."""
    assert native_library.native_kernel_error() is None, native_library.native_kernel_error()


# The plain-pool kernel cases (every batch kind, page size, head_dim and GQA ratio among them), and one FP8 case:
# FP8 pools keep the reference's reader inside the same path (int8 pools: test_cpu_native_attention_int8.py).
NATIVE_CASES = [case for case in CASES if case[0] in ("float32", "bfloat16")] + [("float8_e4m3fn", "mixed", 16, 64, 8)]


@pytest.mark.parametrize("kv_read", ["per_token", "auto"])
@pytest.mark.parametrize("kv_dtype,kind,page_size,head_dim,group", NATIVE_CASES)
def test_native_kernel_matches_the_reference(kv_dtype, kind, page_size, head_dim, group, kv_read):
    """Reading per token throughout, or as `auto` reads plain pools (every token by the kernel: the same call) and
    the FP8 case (decode blocks by the jnp reader, prefill blocks by the reference's matmuls)."""
    seed = CASES.index((kv_dtype, kind, page_size, head_dim, group))
    _check(standard_case(seed, kv_dtype, kind, page_size, head_dim, group), kv_read=kv_read)


@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (None, 2.0), (20, 5.0), (1, None)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    case = standard_case(4, "float32", "mixed", 8, 64, 2)
    _check(case, kv_read="per_token", sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.mark.parametrize("seed", range(8))
def test_random_layouts(seed):
    """Random head counts, GQA groups, page sizes, lengths (to 300 positions), padding and table widths; head_dims
    32, 64 and 128 (the slots-across-lanes path), 24 and 80 (one dot product per key)."""
    rng = np.random.default_rng(100 + seed)
    num_seqs = int(rng.integers(1, 9))
    page_size = int(rng.choice([1, 4, 16, 32]))
    kv_lens = rng.integers(1, 300, num_seqs).tolist()
    q_lens = [int(rng.integers(1, min(n, 4) + 1)) for n in kv_lens]
    case = make_case(
        seed,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=page_size,
        num_kv_heads=int(rng.choice([1, 2, 3, 8])),
        group=int(rng.choice([1, 2, 3, 5])),
        head_dim=[24, 32, 64, 80, 128][seed % 5],
        kv_dtype=str(rng.choice(["float32", "bfloat16"])),
        padded_tokens=sum(q_lens) + int(rng.integers(0, 6)),
        padded_rows=num_seqs + int(rng.integers(0, 3)),
        extra_pages_per_seq=int(rng.integers(0, 3)),
    )
    _check(case, kv_read="per_token")


@pytest.mark.parametrize("num_seqs", [2, 6])
@pytest.mark.parametrize("group", range(1, 9))
def test_decode_rows_of_every_group_size(group, num_seqs):
    """Decode tokens of every GQA group to 8: query heads go through a page's slots up to four at a time, so each
    group size is another mix of 4-row blocks and a remainder. With 6 rows one item covers all of a row's KV heads;
    with 2, fewer than two items a thread, each KV head is an item of its own."""
    rng = np.random.default_rng(400 + 10 * group + num_seqs)
    kv_lens = rng.integers(1, 200, num_seqs).tolist()
    case = make_case(
        group,
        kv_lens=kv_lens,
        q_lens=[1] * num_seqs,
        page_size=16,
        num_kv_heads=int(rng.choice([1, 2, 3])),
        group=group,
        head_dim=64,
        kv_dtype="float32",
        padded_tokens=num_seqs + 2,
        padded_rows=num_seqs + 1,
    )
    _check(case, kv_read="per_token")
    _check(case, kv_read="per_token", soft_cap=4.0)


@pytest.mark.parametrize("seed", range(4))
def test_rows_of_a_token_and_its_drafts(seed):
    """Speculative verification's shape: each row a decode token and up to 8 drafts (runs the kernel reads each page
    once for), in half the cases beside a longer chunk (the kernel's tiled path), long histories, padding."""
    rng = np.random.default_rng(200 + seed)
    num_seqs = int(rng.integers(1, 6))
    kv_lens = rng.integers(20, 700, num_seqs).tolist()
    q_lens = [int(rng.integers(1, 10)) for _ in kv_lens]
    if seed % 2:  # a chunk beside them
        q_lens[-1] = min(kv_lens[-1], 1 + 16 * int(rng.integers(1, 3)) + int(rng.integers(0, 16)))
    case = make_case(
        seed,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=int(rng.choice([8, 16])),
        num_kv_heads=int(rng.choice([1, 3])),
        group=int(rng.choice([1, 3, 4])),
        head_dim=64,
        kv_dtype=str(rng.choice(["float32", "bfloat16"])),
        padded_tokens=sum(q_lens) + int(rng.integers(0, 8)),
        padded_rows=num_seqs + int(rng.integers(0, 2)),
    )
    for kv_read in ("auto", "per_token"):
        _check(case, kv_read=kv_read)
    _check(case, kv_read="per_token", sliding_window=int(rng.integers(1, 40)))


@pytest.mark.parametrize("seed", range(8))
def test_prefill_chunks_of_random_layouts(seed):
    """Chunks of 8 to 200 tokens (the kernel's tiled path: cut into runs of up to 64, query rows across SIMD lanes)
    beside short runs, with random page sizes, GQA groups to 8, head_dims, windows, padding and page orders."""
    rng = np.random.default_rng(300 + seed)
    num_seqs = int(rng.integers(1, 5))
    kv_lens = rng.integers(8, 400, num_seqs).tolist()
    q_lens = [
        int(rng.integers(1, min(n, 200) + 1)) if i % 2 == 0 else int(rng.integers(1, 9)) for i, n in enumerate(kv_lens)
    ]
    q_lens[0] = max(q_lens[0], min(kv_lens[0], 8))  # at least one chunk on the tiled path
    case = make_case(
        seed,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_size=int(rng.choice([1, 4, 16, 32])),
        num_kv_heads=int(rng.choice([1, 2, 3])),
        group=int(rng.choice([1, 2, 3, 5, 8])),
        head_dim=int(rng.choice([16, 32, 64, 128])),
        kv_dtype=str(rng.choice(["float32", "bfloat16"])),
        padded_tokens=sum(q_lens) + int(rng.integers(0, 20)),
        padded_rows=num_seqs + int(rng.integers(0, 2)),
        extra_pages_per_seq=int(rng.integers(0, 3)),
    )
    _check(case, kv_read="auto")
    _check(case, kv_read="auto", sliding_window=int(rng.integers(1, 100)))


@pytest.mark.parametrize("head_dim,soft_cap", [(20, None), (64, 3.0)])
def test_prefill_chunks_the_tiled_path_does_not_take(head_dim, soft_cap):
    """A head_dim that is not a multiple of the vector width (8 lanes with AVX2, 16 with AVX-512), or a soft cap, keep
    every run on the short-run paths (cut every 16 tokens): one dot product per key for head_dim 20, slots across
    lanes for 64."""
    case = make_case(
        7,
        kv_lens=[150, 90],
        q_lens=[150, 40],
        page_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=head_dim,
        kv_dtype="float32",
        padded_tokens=200,
    )
    _check(case, kv_read="auto", soft_cap=soft_cap)


@pytest.mark.parametrize("page_size,head_dim,group", [(16, 64, 3), (32, 128, 2), (1, 16, 5), (4, 32, 1)])
def test_bf16_pool_differs_only_by_the_weights_rounding(page_size, head_dim, group):
    """With queries that are already bf16 values, a bf16 pool's prefill chunks and decode runs differ from the f32
    reference only by the softmax weights' rounding to bf16 (each weight off by at most 2^-9 of itself), so every
    output element is within 2^-9 of the largest |value| it reads (and f32 sums' noise): a misplaced pair of slots or
    of head dims would be off by whole values. A slot whose partner is out of sight pairs under a zero weight (page
    size 1, windows, spans cut by the visible range)."""
    case = make_case(
        page_size,
        kv_lens=[300, 70, 9, 150, 41],
        q_lens=[200, 70, 9, 1, 3],
        page_size=page_size,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        kv_dtype="bfloat16",
        padded_tokens=290,
    )
    case.q = case.q.astype(jnp.bfloat16).astype(jnp.float32)
    pool = np.asarray(case.kv_pages, np.float32).reshape(*case.kv_pages.shape[:2], 2, 2, head_dim)  # [., P, K, 2, D]
    largest_value = np.nanmax(np.abs(pool[:, :, :, 1]))
    for sliding_window in (None, 37):
        out, ref = _both(case, sliding_window=sliding_window)
        live = case.num_live_tokens
        assert np.isfinite(out).all()
        np.testing.assert_array_less(np.abs(out[:live] - ref[:live]), 2.0**-9 * largest_value + 1e-5)
        assert np.abs(out[:live] - ref[:live]).max() > 1e-4 * largest_value  # rounded weights, not f32 noise


@pytest.mark.parametrize("kv_dtype,page_size", [("float32", 16), ("bfloat16", 16), ("bfloat16", 4)])
@pytest.mark.parametrize("sliding_window", [None, 50])
def test_a_prompt_token_gets_the_same_bits_in_any_chunk(kv_dtype, page_size, sliding_window):
    """The tiled path's softmax steps over key blocks aligned to the position, not to where a chunk starts, so a
    token's output is the same bits whether its prompt came in one chunk or in chunks cut elsewhere (batch
    invariance): row 0 takes 300 tokens at once, row 1 the last 256 of the same prompt over the same pages, and a
    third row the last 100 at another offset in the batch. (Every run is 8 tokens or more: shorter ones take the
    short-run path, whose arithmetic differs.)"""
    case = make_case(
        7,
        kv_lens=[300, 300, 300],
        q_lens=[300, 256, 100],
        page_size=page_size,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        kv_dtype=kv_dtype,
    )
    tables = np.asarray(case.metadata.block_tables).copy()
    tables[1:] = tables[0]  # one prompt's pages for every row
    q = np.asarray(case.q).copy()
    q[300:556] = q[44:300]
    q[556:] = q[200:300]
    case.metadata = dataclasses.replace(case.metadata, block_tables=jnp.asarray(tables))
    options = dict(sm_scale=case.sm_scale, sliding_window=sliding_window, kv_read="auto")
    out = np.asarray(native.ragged_paged_attention_cpu(jnp.asarray(q), case.kv_pages, case.metadata, **options))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[300:556], out[44:300])
    np.testing.assert_array_equal(out[556:], out[200:300])


def _bf16_values(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (nearest even), as float64."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16), np.float64)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_each_softmax_weight_read_through_one_hot_values(kv_dtype):
    """Slot i's value is the unit vector e_i, so a prompt token's output element i is slot i's softmax weight as the
    tiled path multiplied it, over the sum of the weights: the weights' exponential is checked one by one, not
    through an average. In f32 each weight is e^(s_i - max) in float64 to within the scores' f32 sums. Over a bf16
    pool each is that value rounded to bf16: ExpForBf16 is within 2.9e-6 of e^x, so only a weight within that of a
    rounding boundary can round the other way (1 of 5424 here). An exponential off by up to 6e-4 (0.505 for its
    r^2 coefficient) left 5258 of them off, through their sum if not their rounding."""
    head_dim, group, num_kv_heads, kv_len, q_len = 64, 3, 2, 64, 16
    case = make_case(
        11,
        kv_lens=[kv_len],
        q_lens=[q_len],
        page_size=16,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
    )
    rng = np.random.default_rng(12)
    keys = _bf16_values(rng.standard_normal((num_kv_heads, kv_len, head_dim)))  # [K, positions, D]
    q = _bf16_values(rng.standard_normal((q_len, num_kv_heads * group, head_dim)) * 0.4)  # scores of a few units
    pool = np.array(case.kv_pages, np.float32).reshape(*case.kv_pages.shape[:2], num_kv_heads, 2, head_dim)
    table = np.asarray(case.metadata.block_tables)[0]
    for position in range(kv_len):
        page, slot = table[position // 16], position % 16
        pool[page, slot, :, 0] = keys[:, position]
        pool[page, slot, :, 1] = np.eye(head_dim)[position]  # every head's value: e_position
    kv_pages = jnp.asarray(pool.reshape(case.kv_pages.shape), jnp.dtype(kv_dtype))
    options = dict(sm_scale=1.0, kv_read="auto")
    out = native.ragged_paged_attention_cpu(jnp.asarray(q, jnp.float32), kv_pages, case.metadata, **options)
    out = np.asarray(out, np.float64)
    mismatched = total = 0
    for i in range(q_len):
        position = kv_len - q_len + i  # the token sees positions [0, position]
        for head in range(num_kv_heads * group):
            scores = keys[head // group, : position + 1] @ q[i, head]
            weights = np.exp(scores - scores.max())
            got = out[i, head, : position + 1] * weights.sum()  # the weights as multiplied, times the exact sum
            assert np.all(out[i, head, position + 1 :] == 0.0)  # no weight for positions out of sight
            if kv_dtype == "float32":
                np.testing.assert_allclose(got, weights, rtol=1e-5, atol=1e-7)  # the scores' f32 sums: ~1e-6
            else:
                np.testing.assert_allclose(got, _bf16_values(weights), rtol=2.0**-7)  # at most one bf16 step off
                mismatched += int(np.sum(np.abs(got - _bf16_values(weights)) > 1e-5 * weights))
                total += position + 1
    if kv_dtype == "bfloat16":
        assert mismatched <= 0.02 * total, f"{mismatched} of {total} weights off their exact value's rounding"


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_padding_in_the_last_row_changes_no_output(kv_dtype):
    """Padded tokens take the last row when every row is live; they run apart from that row's live tokens, so a
    decode token followed by 30 padded tokens (enough for the tiled path) is computed as with none, bit for bit."""
    case = make_case(
        11,
        kv_lens=[50, 120, 33],
        q_lens=[1, 40, 1],
        page_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        kv_dtype=kv_dtype,
        padded_tokens=42 + 30,
        padded_rows=3,
    )
    live = case.num_live_tokens
    unpadded = dataclasses.replace(
        case, q=case.q[:live], metadata=dataclasses.replace(case.metadata, slots=case.metadata.slots[:live])
    )
    padded_out, _ = _both(case)
    out, _ = _both(unpadded)
    np.testing.assert_array_equal(padded_out[:live], out)
    np.testing.assert_array_equal(padded_out[live:], 0.0)


def test_bad_page_ids_read_inside_the_pool():
    """A block table naming pages past the pool is clamped as XLA clamps a gather: a wrong answer, never a read
    outside the pool's memory."""
    case = standard_case(1, "float32", "decode", 16, 64, 2)
    metadata = case.metadata
    broken = metadata.__class__(**{**vars(metadata), "block_tables": metadata.block_tables + 10**6})
    out = native.ragged_paged_attention_cpu(case.q, case.kv_pages, broken, sm_scale=case.sm_scale, kv_read="per_token")
    assert np.asarray(out).shape == case.q.shape


def test_auto_resolves_to_the_native_kernel_on_cpu():
    assert resolve_attention_impl("auto", backend="cpu") == "cpu_native"
    assert resolve_attention_impl("xla", backend="cpu") == "xla"  # the pure-jnp reference stays selectable
    assert resolve_attention_impl("auto", backend="tpu") == "pallas_tpu"


def test_without_a_compiler_auto_keeps_the_reference_and_cpu_native_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native_library.CACHE_ENV_VAR, str(tmp_path / "cache"))
    native_library.load.cache_clear()
    try:
        assert "building the native CPU kernels failed" in native_library.native_kernel_error()
        assert resolve_attention_impl("auto", backend="cpu") == "xla"
        assert "without the native CPU kernel" in caplog.text
        case = standard_case(0, "float32", "decode", 8, 64, 1)
        with pytest.raises(RuntimeError, match="cpu_native' cannot run: building .* use attention_impl='xla'"):
            jax.jit(lambda q: native.ragged_paged_attention_cpu(q, case.kv_pages, case.metadata, sm_scale=1.0))(case.q)
    finally:
        monkeypatch.undo()
        native_library.load.cache_clear()  # the next caller finds the real one again
    assert native_library.native_kernel_error() is None


def test_the_library_is_built_once_and_reused(monkeypatch, tmp_path):
    """A fresh cache folder gets one library; a second process-level load finds it instead of compiling. (A one-line
    source stands in for the kernels, whose compile takes seconds; the process registered the real ones first.)"""
    assert native_library.native_kernel_error() is None  # the kernels are registered: a later load only opens files
    source = tmp_path / "stand_in.cc"
    source.write_text('extern "C" int paxkv_stand_in() { return 1; }\n')
    cache = tmp_path / "cache"
    monkeypatch.setenv(native_library.CACHE_ENV_VAR, str(cache))
    monkeypatch.setattr(native_library, "SOURCES", (str(source),))
    monkeypatch.setattr(native_library, "HEADERS", ())
    native_library.load.cache_clear()
    try:
        assert native_library.native_kernel_error() is None
        (library,) = list(cache.iterdir())
        built = library.stat().st_mtime_ns
        native_library.load.cache_clear()
        assert native_library.native_kernel_error() is None and library.stat().st_mtime_ns == built
        assert list(cache.iterdir()) == [library]
    finally:
        monkeypatch.undo()
        native_library.load.cache_clear()
    assert jnp.dtype(jnp.bfloat16) in native_library.ATTENTION_TARGETS


def test_an_edited_source_or_header_builds_a_new_library(monkeypatch, tmp_path):
    """Every source and the headers they include are part of the library's cache key: editing one never loads a
    stale build."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    for group in ("SOURCES", "HEADERS"):
        for index, path in enumerate(getattr(native_library, group)):
            edited = tmp_path / os.path.basename(path)
            edited.write_text(open(path).read() + "// edited\n")
            unedited = native_library.library_path(compiler)
            paths = list(getattr(native_library, group))
            paths[index] = str(edited)
            with monkeypatch.context() as patch:
                patch.setattr(native_library, group, tuple(paths))
                assert native_library.library_path(compiler) != unedited, path
            assert native_library.library_path(compiler) == unedited
