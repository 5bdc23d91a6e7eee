// A few activation rows times a weight matrix on CPU, as an XLA FFI custom call (pallas_kernels/cpu_small_matmul.py).
//
// At one to eight rows (a batch-1 decode, a token and its drafts, a small batch) a matmul is bound by reading its
// weights, and XLA:CPU reads them slowly there: bf16 weights at about 10 GB/s at any row count (it pads one row to
// two), f32 ones at about 29 GB/s for one row but 11-16 GB/s for 2-8 rows. This kernel streams the weights once,
// widening bf16 to f32 in registers (the high half of an f32) and accumulating in f32.
//
// Two weight layouts:
// - "KN", w[K, N] (contraction first: every projection of paxkv's models): K is split into bands of rows, one band
//   a work item, so each item reads one contiguous block of w; kDepthStep rows' vectors are widened once and added
//   into every x row's sums, which stay in the core's cache; the items' sums are added in item order at the end;
// - "NK", w[N, K] (contraction last: the tied embedding as the lm_head): 64 output rows are one item; each weight
//   row is read once for up to 4 x rows (a lone row takes 4 weight rows at a time), as dot products across the
//   vector lanes.
// The split depends on the shapes and the thread count only, so a row's result is the same bit for bit whatever
// other rows are in the batch.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>


#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // cpu_native_vectors.h's intrinsics
#endif

namespace ffi = xla::ffi;

namespace {

#include "cpu_native_parallel.h"  // ParallelFor
#include "cpu_native_matmul_shape.h"  // MatmulShapeOf
#include "cpu_native_vectors.h"   // Vec (the machine's width), LoadValues, Splat, HorizontalSum

// KN: weight rows whose vectors are widened once and used by every x row. Each x row's sums are loaded and stored
// once per depth step, so a deeper step does fewer of them per multiply-add: 8 rather than 4 took 30 SmolLM2 f32
// MLPs at 8 rows from 29.6 to 21.1 ms and at 4 rows from 18.6 to 14.6 on a Xeon (AVX-512; 30.8 to 19.8 and 23.6
// to 17.2 built for AVX2 there), one row unchanged; SmolLM2's batch-8 decode step 50.5 to 46.4 ms.
constexpr int64_t kDepthStep = 8;
constexpr int64_t kItemsPerThread = 2;  // KN: bands of w's rows per thread
constexpr int64_t kNkRowsPerItem = 64;  // NK: output rows per work item
// KN: how far ahead of the rows in use the weights are prefetched. Without it a core streamed bf16 weights from
// memory at half the rate it multiplies them from cache (Xeon with AVX-512: 30 SmolLM2 MLPs at one row, 18 GB/s on
// two cores without, 30-36 with any distance from one depth step to 16 KB).
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kCacheLine = 64;

// KN, w[K, N]: partial[t, :] = x[t, k0 : k1] @ w[k0 : k1, :], walking the item's rows of w (one contiguous block)
// kDepthStep rows at a time, each step's vectors widened once and added into every x row's sums.
template <typename W>
void KnRows(const float* x, const W* w, float* partial, int64_t t_size, int64_t k_size, int64_t n_size, int64_t k0,
            int64_t k1) {
  const int64_t vector_end = n_size / kLanes * kLanes;
  // Weight rows read ahead: at least kPrefetchBytes past the rows in use, in whole depth steps.
  const int64_t step_bytes = kDepthStep * n_size * static_cast<int64_t>(sizeof(W));
  const int64_t ahead_rows = kDepthStep * std::max<int64_t>(1, (kPrefetchBytes + step_bytes - 1) / step_bytes);
  std::fill(partial, partial + t_size * n_size, 0.0f);
  int64_t k = k0;
  for (; k + kDepthStep <= k1; k += kDepthStep) {
    const W* rows = w + k * n_size;
    int64_t n = 0;
    // Two vectors of columns at a time: each x value broadcast serves two multiply-adds (the loads, not the
    // multiply-adds, bound this loop at 8 rows). Each output's sum runs over k in the same order either way.
    for (; n + 2 * kLanes <= vector_end; n += 2 * kLanes) {
      Vec left[kDepthStep], right[kDepthStep];
      for (int64_t d = 0; d < kDepthStep; ++d) {
        const char* ahead = reinterpret_cast<const char*>(rows + (ahead_rows + d) * n_size + n);
        for (int64_t byte = 0; byte < 2 * kLanes * static_cast<int64_t>(sizeof(W)); byte += kCacheLine) {
          __builtin_prefetch(ahead + byte);
        }
        left[d] = LoadValues(rows + d * n_size + n);
        right[d] = LoadValues(rows + d * n_size + n + kLanes);
      }
      for (int64_t t = 0; t < t_size; ++t) {
        const float* xt = x + t * k_size + k;
        float* sums = partial + t * n_size + n;
        Vec acc_left = LoadVec(sums), acc_right = LoadVec(sums + kLanes);
        for (int64_t d = 0; d < kDepthStep; ++d) {
          const Vec value = Splat(xt[d]);
          acc_left += value * left[d];
          acc_right += value * right[d];
        }
        StoreVec(sums, acc_left);
        StoreVec(sums + kLanes, acc_right);
      }
    }
    for (; n < vector_end; n += kLanes) {
      Vec weights[kDepthStep];
      for (int64_t d = 0; d < kDepthStep; ++d) weights[d] = LoadValues(rows + d * n_size + n);
      for (int64_t t = 0; t < t_size; ++t) {
        const float* xt = x + t * k_size + k;
        Vec acc = LoadVec(partial + t * n_size + n);
        for (int64_t d = 0; d < kDepthStep; ++d) acc += Splat(xt[d]) * weights[d];
        StoreVec(partial + t * n_size + n, acc);
      }
    }
    for (int64_t n = vector_end; n < n_size; ++n) {
      for (int64_t t = 0; t < t_size; ++t) {
        float sum = partial[t * n_size + n];
        for (int64_t d = 0; d < kDepthStep; ++d) sum += x[t * k_size + k + d] * LoadValue(rows + d * n_size + n);
        partial[t * n_size + n] = sum;
      }
    }
  }
  for (; k < k1; ++k) {  // the item's last rows, one at a time
    for (int64_t t = 0; t < t_size; ++t) {
      const float xk = x[t * k_size + k];
      for (int64_t n = 0; n < n_size; ++n) partial[t * n_size + n] += xk * LoadValue(w + k * n_size + n);
    }
  }
}

// Split over K: each item reads one contiguous band of w's rows into sums of its own, which are added in item
// order at the end. The split depends on K and the thread count only, never on T.
template <typename W>
void MatmulKn(ffi::ThreadPool& pool, const float* x, const W* w, float* out, int64_t t_size, int64_t k_size,
              int64_t n_size) {
  const int64_t target_items = kItemsPerThread * std::max<int64_t>(1, pool.num_threads());
  const int64_t band =
      std::max<int64_t>(kDepthStep, (k_size / target_items + kDepthStep - 1) / kDepthStep * kDepthStep);
  const int64_t items = (k_size + band - 1) / band;
  std::vector<float> partials(items * t_size * n_size);
  auto item = [&](int64_t i) {
    KnRows(x, w, partials.data() + i * t_size * n_size, t_size, k_size, n_size, i * band,
           std::min(k_size, (i + 1) * band));
  };
  ParallelFor(pool, items, item);
  const int64_t size = t_size * n_size;
  std::copy(partials.begin(), partials.begin() + size, out);
  for (int64_t i = 1; i < items; ++i) {
    const float* part = partials.data() + i * size;
    for (int64_t j = 0; j < size; ++j) out[j] += part[j];
  }
}

// NK, w[N, K]: out[t, n] = x[t] . w[n] for n in [n0, n1) and kRows x rows from t0, kCols weight rows at a time (the
// last few one by one), each weight row read once for all of them. Each output is one chain of sums over K, whatever
// kRows and kCols are; kRows * kCols chains run side by side so that no chain's add latency bounds the loop.
template <typename W, int64_t kRows, int64_t kCols>
void NkRowsFor(const float* x, const W* w, float* out, int64_t k_size, int64_t n_size, int64_t t0, int64_t n0,
               int64_t n1) {
  const int64_t vector_end = k_size / kLanes * kLanes;
  const int64_t row_bytes = k_size * static_cast<int64_t>(sizeof(W));
  const int64_t ahead_rows = std::max<int64_t>(kCols, (kPrefetchBytes + row_bytes - 1) / row_bytes);
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols) {
    const W* weights = w + n * k_size;
    // The rows ahead_rows on (weight rows are contiguous, so this keeps kPrefetchBytes or more in flight).
    const char* ahead = reinterpret_cast<const char*>(weights + ahead_rows * k_size);
    for (int64_t byte = 0; byte < kCols * row_bytes; byte += kCacheLine) __builtin_prefetch(ahead + byte);
    Vec acc[kRows][kCols] = {};
    for (int64_t k = 0; k < vector_end; k += kLanes) {
      Vec wv[kCols];
      for (int64_t c = 0; c < kCols; ++c) wv[c] = LoadValues(weights + c * k_size + k);
      for (int64_t r = 0; r < kRows; ++r) {
        const Vec xv = LoadVec(x + (t0 + r) * k_size + k);
        for (int64_t c = 0; c < kCols; ++c) acc[r][c] += xv * wv[c];
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) {
        float sum = HorizontalSum(acc[r][c]);
        for (int64_t k = vector_end; k < k_size; ++k) {
          sum += x[(t0 + r) * k_size + k] * LoadValue(weights + c * k_size + k);
        }
        out[(t0 + r) * n_size + n + c] = sum;
      }
    }
  }
  if constexpr (kCols > 1) {
    if (n < n1) NkRowsFor<W, kRows, 1>(x, w, out, k_size, n_size, t0, n, n1);
  }
}

template <typename W>
void MatmulNk(ffi::ThreadPool& pool, const float* x, const W* w, float* out, int64_t t_size, int64_t k_size,
              int64_t n_size) {
  const int64_t items = (n_size + kNkRowsPerItem - 1) / kNkRowsPerItem;
  auto item = [&](int64_t i) {
    const int64_t n0 = i * kNkRowsPerItem, n1 = std::min(n_size, n0 + kNkRowsPerItem);
    int64_t t0 = 0;
    for (; t0 + 4 <= t_size; t0 += 4) NkRowsFor<W, 4, 1>(x, w, out, k_size, n_size, t0, n0, n1);
    for (; t0 < t_size; ++t0) NkRowsFor<W, 1, 4>(x, w, out, k_size, n_size, t0, n0, n1);
  };
  ParallelFor(pool, items, item);
}

template <typename W>
ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, bool contraction_last,
                       ffi::ResultBuffer<ffi::F32> out) {
  MatmulShape shape;
  if (ffi::Error error = MatmulShapeOf(x, w, contraction_last, shape); error.failure()) return error;
  if (WroteEmptyProduct(shape, out->typed_data())) return ffi::Error::Success();
  const W* w_data = reinterpret_cast<const W*>(w.untyped_data());
  if (contraction_last) {
    MatmulNk(pool, x.typed_data(), w_data, out->typed_data(), shape.t_size, shape.k_size, shape.n_size);
  } else {
    MatmulKn(pool, x.typed_data(), w_data, out->typed_data(), shape.t_size, shape.k_size, shape.n_size);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuSmallMatmulF32, SmallMatmul<float>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w: f32[K, N], or [N, K] if contraction_last
                                  .Attr<bool>("contraction_last")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuSmallMatmulBF16, SmallMatmul<uint16_t>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w: bf16[K, N], or [N, K] if contraction_last
                                  .Attr<bool>("contraction_last")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N]
