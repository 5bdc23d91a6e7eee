// The KV write of a plain bf16 page pool on CPU, in place, as an XLA FFI custom call (pallas_kernels/cpu_kv_write.py).
//
// XLA:CPU runs a bf16 scatter in f32: it widens the whole pool, scatters, and narrows it back, a copy of the pool
// per layer and step (18 ms at 17 MB, 74 ms at 67 MB), where an f32 pool's scatter writes the rows in place. This
// call writes each new token's row into its slot of the pool, whose buffer its output aliases: the bytes of the
// rows, nothing else.
//
// Layout (pallas_kernels/kv_pages.py): pages[num_pages, page_size, W], a token's slot page * page_size + offset;
// rows[T, W] in the pool's dtype. Rows are written in order, so where slots repeat (padding tokens all point into
// the null page 0) the last one stays, one of the orders an XLA scatter may take.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteRows(ffi::AnyBuffer pages, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slots,
                     ffi::Result<ffi::AnyBuffer> out) {
  auto page_dims = pages.dimensions();
  auto row_dims = rows.dimensions();
  if (page_dims.size() != 3 || row_dims.size() != 2 || row_dims[1] != page_dims[2] ||
      slots.dimensions().size() != 1 || slots.dimensions()[0] != row_dims[0] ||
      pages.element_type() != rows.element_type() || out->element_type() != pages.element_type()) {
    return ffi::Error::InvalidArgument("expected pages[N, P, W], rows[T, W] of the pages' dtype and slots[T]");
  }
  const int64_t num_slots = page_dims[0] * page_dims[1];
  const int64_t row_bytes = static_cast<int64_t>(rows.size_bytes()) / std::max<int64_t>(1, row_dims[0]);
  char* to = static_cast<char*>(out->untyped_data());
  if (to != pages.untyped_data()) std::memcpy(to, pages.untyped_data(), pages.size_bytes());  // not aliased
  const char* from = static_cast<const char*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < row_dims[0]; ++t) {  // every slot checked before any row is written
    if (slot[t] < 0 || slot[t] >= num_slots) return ffi::Error::InvalidArgument("a slot lies outside the pool");
  }
  for (int64_t t = 0; t < row_dims[0]; ++t) std::memcpy(to + slot[t] * row_bytes, from + t * row_bytes, row_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuWriteKvRows, WriteRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // pages: [N, P, W]
                                  .Arg<ffi::AnyBuffer>()         // rows: [T, W], the pages' dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots: [T]
                                  .Ret<ffi::AnyBuffer>());       // pages, aliasing the first argument
