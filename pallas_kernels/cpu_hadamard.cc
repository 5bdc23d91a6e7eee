// The fixed rotation of 8-bit KV on CPU, as an XLA FFI custom call (pallas_kernels/cpu_hadamard.py): each row of
// x[R, D] times the normalized Sylvester-Hadamard matrix H_D / sqrt(D), D a power of two.
//
// An 8-bit pool stores K and V turned by that matrix (pallas_kernels/quantization.py), so every layer turns q, k and
// v on the way in and the attention's output on the way out. XLA:CPU runs each as a [R, D] x [D, D] dot, its own
// thunk: 2.3 ms a layer for a 2048-token prompt of SmolLM2 (9 query and 3 KV heads of 64) and 0.1 ms at 16 decode
// rows, about 4% and 7% of the step. The matrix's entries are +-1, and it factors into log2(D) butterflies (the fast
// Walsh-Hadamard transform): D log2(D) additions a row instead of D^2 multiply-adds, on a row in registers.
//
// H_2n = [[H_n, H_n], [H_n, -H_n]], so x H_2n = [(x1 + x2) H_n, (x1 - x2) H_n] for x's halves x1 and x2: the first
// butterfly pairs lanes D/2 apart, the next D/4 apart within each half, down to neighbours. The result equals x @ H_D
// / sqrt(D) up to f32 rounding (the sums are taken in another order than a dot's). H is symmetric and orthonormal
// once scaled, so the same call turns a row back.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // cpu_native_vectors.h's intrinsics
#endif

namespace ffi = xla::ffi;

namespace {

#include "cpu_native_parallel.h"  // ParallelFor
#include "cpu_native_vectors.h"   // Vec, IntVec, kLanes, LoadVec, StoreVec, Splat, MultiplyAdd

// Rows per work item: 128 KiB of f32 rows at D = 64, so a decode step's rows (16 sequences of SmolLM2: 144 query
// rows) stay on the calling thread, and a 2048-token prompt's 18432 split over the pool.
constexpr int64_t kRowsPerItem = 512;
// The widest row the kernel takes (the attention kernels' head_dim is at most this).
constexpr int64_t kMaxWidth = 512;

// rows[r] @ H_D / sqrt(D) into out[r] for r in [0, count), a row in D / kLanes vectors. The butterflies whose lanes
// lie a vector or more apart add and subtract whole vectors; those within a vector take its lanes swapped in pairs
// `half` apart (one permute) and one multiply-add: lane i gets x[i] + x[i ^ half] where bit `half` of i is clear, and
// x[i ^ half] - x[i] where it is set, the same sums as a scalar butterfly's.
template <int64_t D>
void TurnRowsInVectors(const float* rows, float* out, int64_t count) {
  static_assert(D % kLanes == 0 && (D & (D - 1)) == 0, "D: a power of two, whole vectors");
  constexpr int64_t kVecs = D / kLanes;
  constexpr int kInVectorStages = __builtin_ctzll(kLanes);  // halves kLanes / 2, ..., 1
  IntVec partners[kInVectorStages];
  Vec signs[kInVectorStages];
  for (int stage = 0; stage < kInVectorStages; ++stage) {
    const int32_t half = static_cast<int32_t>(kLanes >> (stage + 1));
    for (int32_t lane = 0; lane < kLanes; ++lane) {
      partners[stage][lane] = lane ^ half;
      signs[stage][lane] = (lane & half) ? -1.0f : 1.0f;
    }
  }
  const Vec norm = Splat(1.0f / std::sqrt(static_cast<float>(D)));
  for (int64_t r = 0; r < count; ++r) {
    Vec v[kVecs];
    for (int64_t i = 0; i < kVecs; ++i) v[i] = LoadVec(rows + r * D + i * kLanes);
    for (int64_t half = kVecs / 2; half >= 1; half /= 2) {  // in vectors
      for (int64_t base = 0; base < kVecs; base += 2 * half) {
        for (int64_t i = base; i < base + half; ++i) {
          const Vec a = v[i], b = v[i + half];
          v[i] = a + b;
          v[i + half] = a - b;
        }
      }
    }
    for (int stage = 0; stage < kInVectorStages; ++stage) {
      for (int64_t i = 0; i < kVecs; ++i) {
        v[i] = MultiplyAdd(v[i], signs[stage], __builtin_shuffle(v[i], partners[stage]));
      }
    }
    for (int64_t i = 0; i < kVecs; ++i) StoreVec(out + r * D + i * kLanes, v[i] * norm);
  }
}

// The same for any power-of-two width, one lane at a time (widths below a vector, or none of the attention's).
void TurnRowsAnyWidth(const float* rows, float* out, int64_t count, int64_t width) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(width));
  float lanes[kMaxWidth];
  for (int64_t r = 0; r < count; ++r) {
    std::copy(rows + r * width, rows + (r + 1) * width, lanes);
    for (int64_t half = width / 2; half >= 1; half /= 2) {
      for (int64_t base = 0; base < width; base += 2 * half) {
        for (int64_t i = base; i < base + half; ++i) {
          const float a = lanes[i], b = lanes[i + half];
          lanes[i] = a + b;
          lanes[i + half] = a - b;
        }
      }
    }
    for (int64_t i = 0; i < width; ++i) out[r * width + i] = lanes[i] * norm;
  }
}

void TurnRowsOfWidth(const float* rows, float* out, int64_t count, int64_t width) {
  switch (width) {
    case 32:
      return TurnRowsInVectors<32>(rows, out, count);
    case 64:
      return TurnRowsInVectors<64>(rows, out, count);
    case 128:
      return TurnRowsInVectors<128>(rows, out, count);
    default:
      return TurnRowsAnyWidth(rows, out, count, width);
  }
}

ffi::Error Turn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("the rotation takes x[R, D]");
  const int64_t count = dims[0], width = dims[1];
  if (width < 1 || width > kMaxWidth || (width & (width - 1)) != 0) {
    return ffi::Error::InvalidArgument("the rotation's width D must be a power of two of at most 512");
  }
  const float* rows = x.typed_data();
  float* to = out->typed_data();
  const int64_t items = (count + kRowsPerItem - 1) / kRowsPerItem;
  auto item = [&](int64_t i) {
    const int64_t first = i * kRowsPerItem;
    TurnRowsOfWidth(rows + first * width, to + first * width, std::min(kRowsPerItem, count - first), width);
  };
  if (items <= 1) {
    if (count > 0) item(0);
  } else {
    ParallelFor(pool, items, item);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuHadamardRows, Turn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x: [R, D]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // x @ H_D / sqrt(D): [R, D]
