"""The native in-place KV write of bf16 pools (pallas_kernels/cpu_kv_write.cc) against XLA's scatter: rows
(write_kv, and its choice between the two) and whole pages (copy_pages)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import write_kv
from pallas_kernels.cpu_kv_write import write_kv_rows_cpu
from pallas_kernels.kv_pages import _scatter_rows
from pallas_kernels.native_library import native_kernel_error
from paxkv.execution.step import copy_pages

needs_native = pytest.mark.skipif(native_kernel_error() is not None, reason="the native CPU kernels do not build here")


def _pool(seed, num_pages=6, page_size=4, width=12, dtype=jnp.bfloat16):
    """A random pool, so that a write that touched the wrong slot (or the wrong bytes) would show."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((num_pages, page_size, width)), dtype)


@needs_native
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_land_in_their_slots_bit_for_bit_as_xla_scatters_them(dtype):
    """Distinct slots anywhere in the pool (the null page's, a page's last, the pool's last), in a donated jitted
    program as a step runs it: every byte equals XLA's scatter, bf16 and f32 alike."""
    pages = _pool(0, dtype=dtype)
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((5, 12)), dtype)
    slots = jnp.asarray([0, 3, 9, 23, 14], jnp.int32)
    expected = np.asarray(jax.jit(_scatter_rows)(pages, rows, slots).astype(jnp.float32))
    written = jax.jit(write_kv_rows_cpu, donate_argnums=0)(jnp.array(pages), rows, slots)
    assert written.dtype == dtype and written.shape == pages.shape
    np.testing.assert_array_equal(np.asarray(written.astype(jnp.float32)), expected)
    # Not donated, outside jit: the caller's pool stays as it was.
    before = np.asarray(pages.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(write_kv_rows_cpu(pages, rows, slots).astype(jnp.float32)), expected)
    np.testing.assert_array_equal(np.asarray(pages.astype(jnp.float32)), before)


@needs_native
def test_repeated_slots_keep_the_last_row_and_an_empty_write_changes_nothing():
    """Padding tokens all point into the null page's slot 0: the last of them stays (one order a scatter may take)."""
    pages = _pool(2)
    rows = jnp.asarray(np.arange(3 * 12).reshape(3, 12), jnp.bfloat16)
    written = np.asarray(write_kv_rows_cpu(pages, rows, jnp.asarray([0, 7, 0], jnp.int32)).astype(jnp.float32))
    np.testing.assert_array_equal(written.reshape(-1, 12)[0], np.arange(24, 36))
    np.testing.assert_array_equal(written.reshape(-1, 12)[7], np.arange(12, 24))
    empty = write_kv_rows_cpu(pages, jnp.zeros((0, 12), jnp.bfloat16), jnp.zeros((0,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(empty.astype(jnp.float32)), np.asarray(pages.astype(jnp.float32)))


@needs_native
def test_a_slot_outside_the_pool_or_rows_of_another_width_are_refused():
    pages = _pool(3)
    with pytest.raises(Exception, match="outside the pool"):
        write_kv_rows_cpu(pages, jnp.ones((1, 12), jnp.bfloat16), jnp.asarray([24], jnp.int32)).block_until_ready()
    with pytest.raises(ValueError, match="rows"):
        write_kv_rows_cpu(pages, jnp.ones((1, 10), jnp.bfloat16), jnp.asarray([2], jnp.int32))


@needs_native
def test_write_kv_takes_the_native_write_for_bf16_pools_only_when_asked():
    """write_kv(native=True) on a bf16 pool is the native call and gives the scatter's pages; f32 pools, and bf16
    ones without `native` (any other attention_impl, or a program compiled for a TPU or GPU), keep XLA's scatter."""
    k = jnp.asarray(np.random.default_rng(4).standard_normal((3, 3, 2)), jnp.float32)  # [T, K, D]: width 12
    v = k + 1
    slots = jnp.asarray([1, 5, 22], jnp.int32)
    for dtype in (jnp.bfloat16, jnp.float32):
        pages = _pool(5, dtype=dtype)
        lowered = {
            native: jax.jit(lambda p, native=native: write_kv(p, k, v, slots, native=native)) for native in (0, 1)
        }
        hlo = {native: fn.lower(pages).as_text() for native, fn in lowered.items()}
        assert ("paxkv_cpu_write_kv_rows" in hlo[1]) == (dtype == jnp.bfloat16)
        assert "paxkv_cpu_write_kv_rows" not in hlo[0]
        outputs = [np.asarray(fn(pages).astype(jnp.float32)) for fn in lowered.values()]
        np.testing.assert_array_equal(outputs[0], outputs[1])


@needs_native
def test_page_copies_through_the_native_write_equal_xlas():
    """copy_pages (copy-on-write) with `native`: a bf16 pool's pages land as whole runs of slots, bit for bit what
    XLA's scatter gives, padding pairs (the null page onto itself) included; an f32 pool beside it keeps XLA's."""
    pools = [_pool(6), _pool(7, dtype=jnp.float32)]
    sources, destinations = jnp.asarray([1, 4, 0, 0], jnp.int32), jnp.asarray([3, 5, 0, 0], jnp.int32)
    expected = [
        np.asarray(p.astype(jnp.float32)) for p in copy_pages([jnp.array(p) for p in pools], sources, destinations)
    ]
    hlo = copy_pages.lower(pools, sources, destinations, True).as_text()
    assert hlo.count("paxkv_cpu_write_kv_rows") == 1  # the bf16 pool only
    copied = copy_pages([jnp.array(p) for p in pools], sources, destinations, True)
    for out, want in zip(copied, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
    np.testing.assert_array_equal(expected[0][3], np.asarray(pools[0][1].astype(jnp.float32)))
