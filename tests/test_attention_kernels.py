"""The Pallas TPU and GPU attention kernels, interpreted on CPU, against the pure-jnp reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kernel_cases import BATCH_KINDS, CASES, RELATIVE_TOLERANCE, batch_lengths, relative_error, standard_case

from pallas_kernels import (
    paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
    resolve_attention_impl,
)

KERNELS = {
    "tpu": lambda case, **kw: ragged_paged_attention_tpu(
        case.q, case.kv_pages, case.metadata, sm_scale=case.sm_scale, interpret=True, **kw
    ),
    "gpu": lambda case, **kw: paged_attention_gpu(
        case.q, case.kv_pages, case.metadata, sm_scale=case.sm_scale, interpret=True, **kw
    ),
}


def _check_against_reference(out, case, kv_dtype, **options):
    ref = ragged_paged_attention_reference(case.q, case.kv_pages, case.metadata, sm_scale=case.sm_scale, **options)
    out = np.asarray(out, np.float32)
    live = out[: case.num_live_tokens]
    # The interpreters start every output buffer as NaN (checked below); a live row left NaN was never written.
    assert np.isfinite(live).all(), "a live row of the output was not written (or saw NaN from an unused slot)"
    assert relative_error(out, ref, case.num_live_tokens) <= RELATIVE_TOLERANCE[kv_dtype]
    # Padded tokens see nothing; both write zeros there.
    np.testing.assert_array_equal(out[case.num_live_tokens :], 0.0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("kv_dtype,kind,page_size,head_dim,group", CASES)
def test_kernel_matches_reference(kernel, kv_dtype, kind, page_size, head_dim, group):
    seed = CASES.index((kv_dtype, kind, page_size, head_dim, group))
    case = standard_case(seed, kv_dtype, kind, page_size, head_dim, group)
    _check_against_reference(KERNELS[kernel](case), case, kv_dtype)


# (kernel, queries_per_block, pages_per_block). The TPU kernel's tiles are whole sublane groups: with 2 query heads
# per KV head and f32 queries, at least 4 tokens (8 rows); the GPU kernel pads small tiles with dummy heads.
BLOCK_SIZES = [("gpu", 1, 1), ("gpu", 2, 4), ("gpu", 8, 2), ("gpu", 32, 1)]
BLOCK_SIZES += [("tpu", 4, 1), ("tpu", 4, 4), ("tpu", 8, 2), ("tpu", 32, 1)]


@pytest.mark.parametrize("kernel,queries_per_block,pages_per_block", BLOCK_SIZES)
def test_block_sizes_do_not_change_the_result(kernel, queries_per_block, pages_per_block):
    """Query blocks spanning many sequences, a sequence spanning many blocks, KV blocks of 1 to 4 pages."""
    case = standard_case(3, "float32", "mixed", 8, 64, 2)
    out = KERNELS[kernel](case, queries_per_block=queries_per_block, pages_per_block=pages_per_block)
    _check_against_reference(out, case, "float32")


def test_tpu_kernel_refuses_tiles_of_partial_sublanes():
    case = standard_case(3, "float32", "mixed", 8, 64, 2)
    with pytest.raises(ValueError, match="2 rows, not a multiple of 8"):
        KERNELS["tpu"](case, queries_per_block=1)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("sliding_window,soft_cap", [(5, None), (None, 2.0), (20, 5.0)])
def test_sliding_window_and_soft_cap(kernel, sliding_window, soft_cap):
    case = standard_case(4, "float32", "mixed", 8, 64, 2)
    out = KERNELS[kernel](case, sliding_window=sliding_window, soft_cap=soft_cap, pages_per_block=1)
    _check_against_reference(out, case, "float32", sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_tpu_kernel_splits_many_kv_heads_into_lane_aligned_blocks(kv_dtype):
    """16 KV heads (an MHA model's): programs of 8 heads each, DMAing their lanes of every page and their
    128 scale words of the page's row."""
    case = standard_case(6, kv_dtype, "mixed", 16, 64, 1, num_kv_heads=16)
    _check_against_reference(KERNELS["tpu"](case), case, kv_dtype)
    _check_against_reference(KERNELS["tpu"](case, heads_per_block=16), case, kv_dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_group_of_three_query_heads(kernel):
    """SmolLM2's 9 query heads over 3 KV heads: the GPU kernel pads the group to 4."""
    case = standard_case(5, "bfloat16", "mixed", 16, 64, 3, num_kv_heads=3)
    _check_against_reference(KERNELS[kernel](case), case, "bfloat16")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_bfloat16_queries(kernel):
    """bf16 queries and pages, as the model computes on TPU and GPU."""
    case = standard_case(6, "bfloat16", "mixed", 16, 128, 4, q_dtype=jnp.bfloat16)
    _check_against_reference(KERNELS[kernel](case), case, "bfloat16")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_batch_with_no_live_sequences(kernel):
    case = standard_case(7, "float32", "decode", 16, 64, 2)
    empty = dataclasses.replace(case.metadata, num_seqs=jnp.zeros((1,), jnp.int32))
    empty = dataclasses.replace(empty, cu_q_lens=jnp.zeros_like(empty.cu_q_lens))
    out = np.asarray(KERNELS[kernel](dataclasses.replace(case, metadata=empty)))
    np.testing.assert_array_equal(out, 0.0)


def test_interpreters_poison_unwritten_output():
    """The premise of the written-rows check: an output block a kernel never writes comes back NaN."""

    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    x = jnp.ones((8, 128), jnp.float32)
    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kv_dtype,kind,page_size,group", [("float32", "mixed", 8, 2), ("float8_e4m3fn", "decode", 16, 4)]
)
def test_tpu_kernel_under_tpu_interpreter(kv_dtype, kind, page_size, group):
    """The TPU interpreter simulates HBM, VMEM and DMA: every page copy must stay in range and be waited on."""
    case = standard_case(8, kv_dtype, kind, page_size, 64, group, num_kv_heads=1)
    try:
        out = ragged_paged_attention_tpu(
            case.q, case.kv_pages, case.metadata, sm_scale=case.sm_scale, interpret=pltpu.InterpretParams()
        )
        _check_against_reference(out, case, kv_dtype)
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.slow
def test_tpu_interpreter_catches_an_out_of_range_page():
    """The check above can fail: a block table naming a page past the pool raises."""
    case = standard_case(9, "float32", "decode", 8, 64, 1, num_kv_heads=1)
    tables = np.asarray(case.metadata.block_tables).copy()
    tables[1, 0] = 10_000
    bad = dataclasses.replace(case.metadata, block_tables=jnp.asarray(tables))
    try:
        with pytest.raises(Exception, match="Out-of-bounds"):
            ragged_paged_attention_tpu(
                case.q, case.kv_pages, bad, sm_scale=case.sm_scale, interpret=pltpu.InterpretParams()
            ).block_until_ready()
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize(
    "asked,backend,resolved",
    [
        ("auto", "tpu", "pallas_tpu"),
        ("auto", "gpu", "pallas_gpu"),
        ("auto", "cpu", "cpu_native"),  # the native kernel builds on the suite's machines
        ("cpu_native", "cpu", "cpu_native"),
        ("pallas", "tpu", "pallas_tpu"),
        ("pallas", "gpu", "pallas_gpu"),
        ("interpret", "cpu", "interpret_tpu"),
        ("interpret", "gpu", "interpret_gpu"),
        ("xla", "tpu", "xla"),
        ("interpret_gpu", "cpu", "interpret_gpu"),
    ],
)
def test_dispatch(asked, backend, resolved):
    assert resolve_attention_impl(asked, backend=backend) == resolved


def test_dispatch_errors_name_the_fix():
    with pytest.raises(ValueError, match="needs a TPU or GPU.*'interpret'"):
        resolve_attention_impl("pallas", backend="cpu")
    with pytest.raises(ValueError, match="not one of"):
        resolve_attention_impl("triton", backend="cpu")
    with pytest.raises(ValueError, match="'cpu_native' runs on CPU only; use 'auto'"):
        resolve_attention_impl("cpu_native", backend="tpu")


def test_gpu_kernel_refuses_non_power_of_two_pages():
    case = standard_case(10, "float32", "decode", 8, 64, 1)
    odd = jnp.zeros((4, 12, 4 * 64), jnp.float32)
    with pytest.raises(ValueError, match="page_size to be a power of two"):
        paged_attention_gpu(case.q, odd, case.metadata, sm_scale=1.0, interpret=True)


def test_batch_kinds_cover_page_boundaries():
    """The lengths the kernels are tested on include 1, a page boundary and one past it."""
    for page_size in (8, 16, 32, 64):
        lengths = {n for kind in BATCH_KINDS for n in batch_lengths(kind, page_size)[0]}
        assert {1, page_size, page_size + 1} <= lengths
