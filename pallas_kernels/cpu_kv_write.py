"""The KV write of a plain bf16 page pool on CPU, in place, through a native XLA FFI kernel (cpu_kv_write.cc).

XLA:CPU runs a bf16 scatter in f32: it widens the whole pool, scatters into the copy and narrows it back, so one
layer's write of a few tokens cost 18 ms at a 17 MB pool and 74 ms at 67 MB, where an f32 pool's is 0.02 ms. The
kernel writes the rows into the pool's own buffer (its output aliases the donated pool): what kv_pages.write_kv does
for a bf16 pool when the model runs the native CPU kernels (attention_impl "cpu_native"). Its result equals the
scatter's, bit for bit (kv_pages._scatter_rows is the reference).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.native_library import KV_WRITE_TARGET, native_kernel_error


def write_kv_rows_cpu(
    pages: jax.Array,  # [num_pages, page_size, W]
    rows: jax.Array,  # [T, W]
    slots: jax.Array,  # i32[T]
) -> jax.Array:  # pages, with row t at slot slots[t]
    """pages with each row written at its flat token slot (page * page_size + offset), in place where the pool is
    donated; a slot outside the pool is an error.

    Args:
      pages: one layer's plain page pool.
      rows: the new tokens' K/V rows (cast to the pool's dtype).
      slots: each row's slot; repeated slots keep the last row.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"the native KV write cannot run: {error}")
    if pages.ndim != 3 or rows.ndim != 2 or rows.shape[1] != pages.shape[2] or slots.shape != rows.shape[:1]:
        raise ValueError(
            f"the KV write takes pages[N, P, W], rows[T, W] and slots[T]; got {list(pages.shape)}, "
            f"{list(rows.shape)} and {list(slots.shape)}"
        )
    target, _ = KV_WRITE_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(pages.shape, pages.dtype), input_output_aliases={0: 0})
    return call(pages, rows.astype(pages.dtype), slots.astype(jnp.int32))
