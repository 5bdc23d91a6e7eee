// Activation rows times an f32 weight stored as column panels, as an XLA FFI custom call (pallas_kernels/
// cpu_panel_matmul.py; models.packed_weights packs a model's projections once, when an engine starts).
//
// A decode batch's f32 matmul at 8-64 rows is bound by arithmetic and by streaming its weights in about equal parts
// on a 2-core Xeon (SmolLM2's 30 MLPs at 32 rows: 5.1 GFLOP against 428 GFLOP/s of multiply-adds, 318 MB against 24
// GB/s), so the two have to overlap. The blocked kernel reads a [K, N] weight a band of columns at a time, each
// contraction row in another page, and packs it in cache before multiplying; its reads and its arithmetic
// take turns (43 ms for those MLPs). Here the weight was laid out once as panels[P, K, kPanelWidth] (column panel
// p holds w[:, p * kPanelWidth : (p + 1) * kPanelWidth], each row of it one run), so a work item streams one
// contiguous run of memory and multiplies straight from it; while a block of it is multiplied, the next block is
// prefetched one line per step of the contraction, spread over every tile, so the reads run beside the arithmetic
// (the same MLPs in 25 ms, measured with a standalone harness before this kernel).
//
// A register tile is kRowBlock x rows by kTileVectors vectors of outputs (AVX-512: 8 x 3 = 24 of the 32 registers;
// 8-lane machines: 4 x 3 of 16, a panel as two halves). A tile's sums run over a depth block in registers and
// continue through `out` across blocks, in the same order: each output sums over K in one order whatever the
// batch's other rows are (batch invariance).

#include <algorithm>
#include <atomic>
#include <chrono>
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

#include "cpu_native_parallel.h"  // ParallelFor, EvenItemSize
#include "cpu_native_vectors.h"   // Vec (the machine's width), Splat
#include "cpu_native_register_tile.h"  // AccumulateTile

constexpr int64_t kPanelWidth = 48;                          // the layout's columns per panel (cpu_panel_matmul.py)
constexpr int64_t kTileVectors = 3;                          // output vectors per row in a tile
constexpr int64_t kTileWidth = kTileVectors * kLanes;        // 48 with AVX-512, 24 on 8-lane machines
constexpr int64_t kTilesAcross = kPanelWidth / kTileWidth;   // a panel's tiles side by side (1 or 2)
constexpr int64_t kRowBlock = kLanes == 16 ? 8 : 4;          // x rows in a register tile
constexpr int64_t kItemPanels = 4;                           // at most this many panels per work item
// Up to kFewRows rows, all of them are multiplied with a panel kShallowBlock contraction rows (18 KiB) at a time: the
// panel streams from memory, the arithmetic short. More rows are multiplied kRowChunk at a time, kDeepBlock
// contraction rows at a time: fewer round trips of the sums through `out`, the panel in the second-level cache.
constexpr int64_t kFewRows = 64;
constexpr int64_t kShallowBlock = 96;
constexpr int64_t kRowChunk = 32;
constexpr int64_t kDeepBlock = 576;
constexpr int64_t kCacheLine = 64;
static_assert(kPanelWidth % kTileWidth == 0, "a panel is whole tiles wide");
constexpr int64_t kTileLines = (kTileWidth * static_cast<int64_t>(sizeof(float)) + kCacheLine - 1) / kCacheLine;
constexpr int64_t kFirstLevelAhead = 8;  // contraction steps

// Prefetches lines [next, last) of the run at `start` into the second-level cache, `per_step` of them with each
// call of Step (the tile's contraction steps carry them, so the reads spread over the block's arithmetic).
struct Prefetcher {
  const char* start;
  int64_t next, last, per_step;

  void Step() {
    for (int64_t i = 0; i < per_step && next < last; ++i, ++next) {
      __builtin_prefetch(start + next * kCacheLine, 0, 2);
    }
  }
};

// out[r, 0 : kTileWidth] (+)= x[r, 0 : depth] @ panel[0 : depth, 0 : kTileWidth] for r < kRows, the sums in
// registers; `first` starts them from zero, else from out. x rows are k_size apart, out rows n_size, panel rows
// kPanelWidth.
template <int64_t kRows>
void Tile(const float* x, int64_t k_size, const float* panel, int64_t depth, float* out, int64_t n_size, bool first,
          Prefetcher& prefetch) {
  Vec acc[kRows][kTileVectors];
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] = first ? Vec{} : LoadVec(out + r * n_size + v * kLanes);
  }
  AccumulateTile(acc, x, k_size, panel, kPanelWidth, depth, [&prefetch, panel](int64_t k) {
    prefetch.Step();
    // The panel's rows kFirstLevelAhead steps on, into the first-level cache: a panel (576 x 48 floats of SmolLM2's
    // gate) outgrows that cache, and its tiles re-read it from the second level, or the first one from beyond. 30
    // SmolLM2 MLPs at 256 rows 161.9 -> 155.5 ms, at 2048 rows 1240 -> 1211 ms (8 and 64 rows: unchanged).
    const char* ahead = reinterpret_cast<const char*>(panel + (k + kFirstLevelAhead) * kPanelWidth);
    for (int64_t line = 0; line < kTileLines; ++line) __builtin_prefetch(ahead + line * kCacheLine, 0, 3);
  });
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kTileVectors; ++v) StoreVec(out + r * n_size + v * kLanes, acc[r][v]);
  }
}

// Tile for the `rows` (< kRowBlock) x rows left after the full tiles, in one tile of that height.
template <int64_t kRows>
void RestTile(int64_t rows, const float* x, int64_t k_size, const float* panel, int64_t depth, float* out,
              int64_t n_size, bool first, Prefetcher& prefetch) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return Tile<kRows>(x, k_size, panel, depth, out, n_size, first, prefetch);
    RestTile<kRows - 1>(rows, x, k_size, panel, depth, out, n_size, first, prefetch);
  }
}

// out[T, P * kPanelWidth] = x[T, K] @ the panels, one work item per few consecutive panels (one contiguous run).
// Few rows: panel by panel, all rows at once. More: kRowChunk rows at a time through every panel of the item (the
// chunk of x stays in the second-level cache across the item's panels, as do the panels across chunks). The first
// chunk's tiles prefetch the memory that follows each block.
void MatmulPanels(ffi::ThreadPool& pool, const float* x, const float* panels, float* out, int64_t t_size,
                  int64_t k_size, int64_t num_panels) {
  const int64_t n_size = num_panels * kPanelWidth;
  const int64_t item_panels = EvenItemSize(pool, num_panels, kItemPanels);
  const int64_t items = (num_panels + item_panels - 1) / item_panels;
  const int64_t lines_per_row = kPanelWidth * static_cast<int64_t>(sizeof(float)) / kCacheLine;
  const bool few = t_size <= kFewRows;
  const int64_t row_chunk = few ? t_size : kRowChunk, depth_block = few ? kShallowBlock : kDeepBlock;
  auto item = [&](int64_t i) {
    const int64_t p_begin = i * item_panels, p_end = std::min(num_panels, p_begin + item_panels);
    const char* item_end = reinterpret_cast<const char*>(panels + p_end * k_size * kPanelWidth);
    // Rows [t0, t0 + rows) of out's panel p.
    auto multiply = [&](int64_t p, int64_t t0, int64_t rows) {
      const float* panel = panels + p * k_size * kPanelWidth;
      const int64_t row_tiles = (rows + kRowBlock - 1) / kRowBlock;
      for (int64_t k0 = 0; k0 < k_size; k0 += depth_block) {
        const int64_t depth = std::min(depth_block, k_size - k0);
        // The block after the next one (of this panel, or the item's next panels): one block ahead, a decode row's
        // reads waited on memory more often (1 row of 30 SmolLM2 MLPs, 16.0 against 15.0 ms for the small-row
        // kernel; two ahead, even).
        const char* next = reinterpret_cast<const char*>(panel + (k0 + depth + depth_block) * kPanelWidth);
        const int64_t available = t0 == 0 ? std::max<int64_t>(0, (item_end - next) / kCacheLine) : 0;
        const int64_t lines = std::min(available, depth_block * lines_per_row);
        const int64_t steps = row_tiles * kTilesAcross * depth;
        Prefetcher prefetch{next, 0, lines, (lines + steps - 1) / steps};
        const bool first = k0 == 0;
        for (int64_t across = 0; across < kTilesAcross; ++across) {
          const float* tile_panel = panel + k0 * kPanelWidth + across * kTileWidth;
          const float* tile_x = x + t0 * k_size + k0;
          float* tile_out = out + t0 * n_size + p * kPanelWidth + across * kTileWidth;
          int64_t t = 0;
          for (; t + kRowBlock <= rows; t += kRowBlock) {
            Tile<kRowBlock>(tile_x + t * k_size, k_size, tile_panel, depth, tile_out + t * n_size, n_size, first,
                            prefetch);
          }
          if (t < rows) {
            RestTile<kRowBlock - 1>(rows - t, tile_x + t * k_size, k_size, tile_panel, depth, tile_out + t * n_size,
                                    n_size, first, prefetch);
          }
        }
      }
    };
    for (int64_t t0 = 0; t0 < t_size; t0 += row_chunk) {
      for (int64_t p = p_begin; p < p_end; ++p) multiply(p, t0, std::min(row_chunk, t_size - t0));
    }
  };
  ParallelFor(pool, items, item);
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto x_dims = x.dimensions();
  auto p_dims = panels.dimensions();
  if (x_dims.size() != 2 || p_dims.size() != 3 || p_dims[2] != kPanelWidth) {
    return ffi::Error::InvalidArgument("expected x[T, K] and panels[P, K, 48]");
  }
  const int64_t t_size = x_dims[0], k_size = x_dims[1], num_panels = p_dims[0];
  if (p_dims[1] != k_size) return ffi::Error::InvalidArgument("the panels' contraction dimension does not match x's");
  float* result = out->typed_data();
  if (t_size == 0 || num_panels == 0) return ffi::Error::Success();
  if (k_size == 0) {
    std::fill(result, result + t_size * num_panels * kPanelWidth, 0.0f);
    return ffi::Error::Success();
  }
  MatmulPanels(pool, x.typed_data(), panels.typed_data(), result, t_size, k_size, num_panels);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulF32, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // panels: [P, K, 48]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, P * 48]
