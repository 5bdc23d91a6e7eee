// Tens of activation rows times a weight matrix on CPU, as an XLA FFI custom call (pallas_kernels/
// cpu_blocked_matmul.py; models.layers.project gives it the products above the small-row kernel's rows).
//
// From about 9 rows on, a decode batch's matmul is bound by arithmetic, not by reading its weights, and XLA:CPU
// runs SmolLM2's 32-row products at 65-90 GFLOP/s on a machine whose f32 multiply-adds peak near 190. This kernel
// keeps the multiply-add units busy with a register tile of kRowBlock x rows by kPanelVectors vectors of outputs:
// each step of the contraction loads that many packed weight vectors and broadcasts kRowBlock x values, for
// kRowBlock * kPanelVectors independent fused multiply-adds (12: enough in flight to hide their latency, few
// enough for AVX2's 16 registers). 32 rows run at about 125 GFLOP/s on two cores.
//
// A work item is kItemPanels panels of kPanelWidth output columns. Its weights are packed kDepthBlock contraction
// rows at a time into one contiguous f32 block that stays in the core's first-level cache (bf16 widened there once)
// and serves every tile of x rows; a tile's sums continue across depth blocks through `out`, in the same order.
// While one block is multiplied, the next one's weights are prefetched: a decode step streams every weight from
// memory once, and without the prefetch, packing waited on it (75 against 100 GFLOP/s with the weights cached).
// Both weight layouts pack to the same panels:
// - w[K, N] (every projection): a panel row is a run of w's row;
// - w[N, K] (the tied embedding as the lm_head): 8 x 8 blocks of w are transposed in registers (AVX2), else value
//   by value.
// Each output sums over K in one order whatever the batch's other rows are (batch invariance within this kernel).

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
#include "cpu_native_vectors.h"   // Vec (the machine's width), LoadValues, Splat
#include "cpu_native_register_tile.h"  // AccumulateTile

constexpr int64_t kRowBlock = 6;                         // x rows in a register tile
constexpr int64_t kPanelVectors = 2;                     // output vectors per row in a tile
constexpr int64_t kPanelWidth = kPanelVectors * kLanes;  // a panel's columns (16 on AVX2, 32 on AVX-512)
constexpr int64_t kItemPanels = 4;                       // panels per work item
constexpr int64_t kDepthBlock = 6144 / (kItemPanels * kPanelWidth);  // packed rows per block (24 KiB of f32)
constexpr int64_t kCacheLine = 64;

// Eight f32 values from p (bf16 widened).
#if defined(__AVX2__)
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// rows[i][j] <- rows[j][i] for 8 x 8 f32.
inline void Transpose8x8(__m256 rows[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    s[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    rows[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    rows[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}
#endif

// The weight seen as panels: Pack(k0, k1, n0, width, panel) writes panel[k - k0, j] = w[k, n0 + j] (the
// contraction index first, whatever w's layout) as f32 for k in [k0, k1), j < width, and zeros past width.
template <typename W, bool kContractionLast>
struct Panels {
  const W* w;
  int64_t k_size, n_size;

  const W* At(int64_t k, int64_t n) const { return kContractionLast ? w + n * k_size + k : w + k * n_size + n; }

  void Pack(int64_t k0, int64_t k1, int64_t n0, int64_t width, float* panel) const {
    int64_t k = k0;
    if constexpr (kContractionLast) {
#if defined(__AVX2__)
      if (width == kPanelWidth) {  // 8 x 8 blocks of w's rows, transposed in registers
        for (; k + 8 <= k1; k += 8) {
          for (int64_t j = 0; j < kPanelWidth; j += 8) {
            __m256 block[8];
            for (int64_t i = 0; i < 8; ++i) block[i] = Load8(At(k, n0 + j + i));
            Transpose8x8(block);
            for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k - k0 + i) * kPanelWidth + j, block[i]);
          }
        }
      }
#endif
    } else if (width == kPanelWidth) {  // whole rows of vectors
      for (; k < k1; ++k) {
        for (int64_t v = 0; v < kPanelVectors; ++v) {
          StoreVec(panel + (k - k0) * kPanelWidth + v * kLanes, LoadValues(At(k, n0 + v * kLanes)));
        }
      }
    }
    for (; k < k1; ++k) {  // what is left, value by value
      for (int64_t j = 0; j < kPanelWidth; ++j) {
        panel[(k - k0) * kPanelWidth + j] = j < width ? LoadValue(At(k, n0 + j)) : 0.0f;
      }
    }
  }

  // The contiguous runs of w that hold rows [k0, k1) of panels [p0, p1): `count` runs of `bytes`, `stride` bytes
  // apart from `start` (a run of w's row per k, or of its column per n when the contraction is last).
  struct Runs {
    const char* start;
    int64_t count, stride, bytes;
  };
  Runs RunsOf(int64_t k0, int64_t k1, int64_t p0, int64_t p1) const {
    const int64_t n0 = p0 * kPanelWidth, n1 = std::min(n_size, p1 * kPanelWidth);
    const char* start = reinterpret_cast<const char*>(At(k0, n0));
    const int64_t size = static_cast<int64_t>(sizeof(W));
    if constexpr (kContractionLast) return {start, n1 - n0, k_size * size, (k1 - k0) * size};
    return {start, k1 - k0, n_size * size, (n1 - n0) * size};
  }
};

// out[t0 + r, n0 : n0 + width] (+)= x[t0 + r, k0 : k0 + depth] @ panel for r < kRows, the sums in registers.
// `first` starts them from zero, else from out (the previous depth blocks' sums, continued in the same order).
template <int64_t kRows>
void PanelTile(const float* x, int64_t k_size, const float* panel, int64_t k0, int64_t depth, float* out,
               int64_t n_size, int64_t n0, int64_t width, bool first) {
  Vec acc[kRows][kPanelVectors];
  float staged[kRows][kPanelWidth];  // a panel narrower than kPanelWidth passes through here
  for (int64_t r = 0; r < kRows; ++r) {
    const float* from = out + r * n_size + n0;
    if (!first && width < kPanelWidth) {
      std::copy(from, from + width, staged[r]);
      from = staged[r];
    }
    for (int64_t v = 0; v < kPanelVectors; ++v) acc[r][v] = first ? Vec{} : LoadVec(from + v * kLanes);
  }
  AccumulateTile(acc, x + k0, k_size, panel, kPanelWidth, depth, [](int64_t) {});
  for (int64_t r = 0; r < kRows; ++r) {
    float* to = width < kPanelWidth ? staged[r] : out + r * n_size + n0;
    for (int64_t v = 0; v < kPanelVectors; ++v) StoreVec(to + v * kLanes, acc[r][v]);
    if (width < kPanelWidth) std::copy(staged[r], staged[r] + width, out + r * n_size + n0);
  }
}

// PanelTile for the `rows` (< kRowBlock) x rows left after the full tiles, in one tile of that height.
template <int64_t kRows>
void RestTile(int64_t rows, const float* x, int64_t k_size, const float* panel, int64_t k0, int64_t depth, float* out,
              int64_t n_size, int64_t n0, int64_t width, bool first) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return PanelTile<kRows>(x, k_size, panel, k0, depth, out, n_size, n0, width, first);
    RestTile<kRows - 1>(rows, x, k_size, panel, k0, depth, out, n_size, n0, width, first);
  }
}

// One work item per kItemPanels panels (a band of output columns), packed a depth block at a time and walked panel
// by panel for every tile of x rows.
template <typename W, bool kContractionLast>
void MatmulPanels(ffi::ThreadPool& pool, const float* x, const Panels<W, kContractionLast>& weights, float* out,
                  int64_t t_size) {
  const int64_t k_size = weights.k_size, n_size = weights.n_size;
  const int64_t panels = (n_size + kPanelWidth - 1) / kPanelWidth;
  const int64_t item_panels = EvenItemSize(pool, panels, kItemPanels);  // no thread left with an extra item
  const int64_t items = (panels + item_panels - 1) / item_panels;
  const int64_t tiles_per_panel = (t_size + kRowBlock - 1) / kRowBlock;
  auto item = [&](int64_t i) {
    alignas(64) float packed[kItemPanels * kDepthBlock * kPanelWidth];
    const int64_t p_begin = i * item_panels, p_end = std::min(panels, p_begin + item_panels);
    for (int64_t k0 = 0; k0 < k_size; k0 += kDepthBlock) {
      const int64_t depth = std::min(kDepthBlock, k_size - k0);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t n0 = p * kPanelWidth;
        weights.Pack(k0, k0 + depth, n0, std::min(kPanelWidth, n_size - n0),
                     packed + (p - p_begin) * kDepthBlock * kPanelWidth);
      }
      // The next depth block's weights are fetched into the second-level cache, a few lines before each tile, so
      // that packing them does not wait on memory (a decode step streams every weight from memory once). The
      // cursor walks the block's runs line by line by additions alone: divisions here cost as much as the tiles.
      const int64_t next_k0 = k0 + depth, next_k1 = std::min(k_size, next_k0 + kDepthBlock);
      const auto runs = next_k0 < k_size ? weights.RunsOf(next_k0, next_k1, p_begin, p_end)
                                         : typename Panels<W, kContractionLast>::Runs{nullptr, 0, 0, 0};
      const int64_t run_lines = (runs.bytes + kCacheLine - 1) / kCacheLine;
      const int64_t tiles = (p_end - p_begin) * tiles_per_panel;
      const int64_t per_tile = (runs.count * run_lines + tiles - 1) / tiles;
      const char* run = runs.start;
      int64_t run_left = runs.count, line = 0;
      auto prefetch_some = [&] {
        for (int64_t j = 0; j < per_tile && run_left > 0; ++j) {
          __builtin_prefetch(run + line * kCacheLine, 0, 2);  // into the second-level cache
          if (++line == run_lines) line = 0, run += runs.stride, --run_left;
        }
      };
      const bool first = k0 == 0;
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int64_t n0 = p * kPanelWidth, width = std::min(kPanelWidth, n_size - n0);
        const float* panel = packed + (p - p_begin) * kDepthBlock * kPanelWidth;
        int64_t t = 0;
        for (; t + kRowBlock <= t_size; t += kRowBlock) {
          prefetch_some();
          PanelTile<kRowBlock>(x + t * k_size, k_size, panel, k0, depth, out + t * n_size, n_size, n0, width, first);
        }
        if (t < t_size) {
          prefetch_some();
          RestTile<kRowBlock - 1>(t_size - t, x + t * k_size, k_size, panel, k0, depth, out + t * n_size, n_size, n0,
                                  width, first);
        }
      }
    }
  };
  ParallelFor(pool, items, item);
}

template <typename W>
ffi::Error BlockedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, bool contraction_last,
                         ffi::ResultBuffer<ffi::F32> out) {
  MatmulShape shape;
  if (ffi::Error error = MatmulShapeOf(x, w, contraction_last, shape); error.failure()) return error;
  if (WroteEmptyProduct(shape, out->typed_data())) return ffi::Error::Success();
  const W* w_data = reinterpret_cast<const W*>(w.untyped_data());
  if (contraction_last) {
    MatmulPanels(pool, x.typed_data(), Panels<W, true>{w_data, shape.k_size, shape.n_size}, out->typed_data(),
                 shape.t_size);
  } else {
    MatmulPanels(pool, x.typed_data(), Panels<W, false>{w_data, shape.k_size, shape.n_size}, out->typed_data(),
                 shape.t_size);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuBlockedMatmulF32, BlockedMatmul<float>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w: f32[K, N], or [N, K] if contraction_last
                                  .Attr<bool>("contraction_last")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuBlockedMatmulBF16, BlockedMatmul<uint16_t>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w: bf16[K, N], or [N, K] if contraction_last
                                  .Attr<bool>("contraction_last")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N]
