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
//
// The tiles read x packed tile by tile, each step's rows side by side (PackRowTiles, once per call): broadcasting from
// one pointer at constant offsets. Read in place, a tile's 8 row pointers outgrew the general registers, and every
// step moved them through the stack and vector registers (30 SmolLM2 MLPs on a 2-core Zen 4, 32 / 256 / 2048 rows:
// 170 / 200 / 200 -> 179 / 214 / 208 GFLOP/s).
//
// int8 panels (weight-only quantization, PaxkvCpuPanelMatmulInt8) are widened to f32 as they are loaded, and carry an
// f32 scale and min per group of kGroupRows contraction rows and column (w = scale * q + min): a group's sums start from
// zero, and go into the total as scale * sums + min * (x's sum over the group), two fused multiply-adds spelled out so
// that every tile height rounds alike. Under kRowBlock rows, sums and totals stay in registers over kGroupsFew
// groups, in tiles of kGroupRowBlock rows; more rows take a block per group with kRowBlock-row tiles, the total
// through `out`. Both do the same operations in the same order.
//
// bf16 panels (PaxkvCpuPanelMatmulBf16) hold contraction rows in pairs, [P, ceil(K / 2), kPanelWidth, 2]: a step of
// the contraction is two rows, and a weight vector is kLanes columns' pairs, which AVX-512 BF16's VDPBF16PS multiplies
// by a pair of x's values rounded to bf16 (DotPairs): twice the multiply-adds per instruction and half the bytes of
// f32. x is rounded to bf16 once per call (ToBf16Pairs), and from there every path is the f32 one with Bf16Pair
// weights and half as many steps: the same tiles, blocks, packing and prefetches (a block of pairs holds as many
// bytes as an f32 block of as many steps).

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

#include "cpu_native_parallel.h"  // ParallelFor, EvenItemSize
#include "cpu_native_vectors.h"   // Vec (the machine's width), Splat
#include "cpu_native_register_tile.h"  // AccumulateTile

constexpr int64_t kPanelWidth = 48;                          // the layout's columns per panel (cpu_panel_matmul.py)
constexpr int64_t kTileVectors = 3;                          // output vectors per row in a tile
constexpr int64_t kTileWidth = kTileVectors * kLanes;        // 48 with AVX-512, 24 on 8-lane machines
constexpr int64_t kTilesAcross = kPanelWidth / kTileWidth;   // a panel's tiles side by side (1 or 2)
constexpr int64_t kRowBlock = kLanes == 16 ? 8 : 4;          // x rows in a register tile
constexpr int64_t kItemPanels = 4;                           // at most this many panels per work item
constexpr int64_t kItemsPerThread = 4;                       // many rows: items a thread, at least (row ranges)
constexpr int64_t kMinPartChunks = 8;                        // many rows: chunks of a row range, at least
// Up to kFewRows rows, all of them are multiplied with a panel kShallowBlock contraction rows (18 KiB of f32; int8
// weights: kGroupsFew groups, 6 KiB) at a time: the panel streams from memory, the arithmetic short. From kMidRows
// rows on, an f32 panel's block is kMidBlock rows deep (a contraction of at most kMidBlock * 3 / 2 in one block):
// its tiles' sums go through `out` half as often, and on a 2-core Zen 4 SmolLM2's products at 16-64 rows ran 2-8%
// faster than with kShallowBlock (three alternating builds; 1 and 8 rows unchanged, 96 kept there). More rows are
// multiplied kRowChunk at a time, kDeepBlock contraction rows at a time: fewer round trips of the sums through `out`,
// the panel in the second-level cache. Blocks never change a sum's order (it continues through `out` exactly).
constexpr int64_t kFewRows = 64;
constexpr int64_t kShallowBlock = 96;
constexpr int64_t kMidRows = 16;
constexpr int64_t kMidBlock = 192;
constexpr int64_t kRowChunk = 32;
constexpr int64_t kDeepBlock = 576;
constexpr int64_t kCacheLine = 64;
static_assert(kPanelWidth % kTileWidth == 0, "a panel is whole tiles wide");
constexpr int64_t kFirstLevelAhead = 8;  // contraction steps
// An int8 weight's contraction rows come in groups of kGroupRows, each with its own scale and min per column
// (cpu_panel_matmul.py's INT8_GROUP_ROWS: a GGUF block's 32).
constexpr int64_t kGroupRows = 32;
constexpr int64_t kGroupsFew = 4;

// Cache lines that `bytes` of a run span (rounded up).
constexpr int64_t LinesOf(int64_t bytes) { return (bytes + kCacheLine - 1) / kCacheLine; }

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

// An int8 weight's groups as one tile sees them: w = scale * q + min for each group of kGroupRows contraction rows and
// column, so a group's part of an output is scale * (x . q) + min * (the sum of x over the group). Scales and mins
// are laid out as the panels, [P, groups, kPanelWidth]: a panel's are one run, read as it streams (laid out
// [groups, N], each group's were a cache miss 6 KiB from the last, and one-row steps ran at 60% of the speed).
struct Groups {
  const float* scales;  // the tile's first column in its first group; the next group's at + kPanelWidth
  const float* mins;    // the same layout
  const float* x_sums;  // x's group sums at the tile's first row and first group; row r at + r * num_groups
  int64_t num_groups;
};

// One output vector's total after a group: the group's sums times its scales, plus x's group sum times its mins,
// added to `prior` unless `fresh`: two fused multiply-adds, the same on every path.
inline Vec AddGroup(Vec acc, Vec scale, Vec min, float x_sum, Vec prior, bool fresh) {
  const Vec scaled = fresh ? acc * scale : MultiplyAdd(acc, scale, prior);
  return MultiplyAdd(Splat(x_sum), min, scaled);
}

// out[r, 0 : kTileWidth] (+)= x[r, 0 : depth] @ panel[0 : depth, 0 : kTileWidth] for r < kRows, the sums in
// registers; `first` starts them from zero, else from out. An int8 weight (`groups` given) has one group per block:
// its sums start from zero and go into out by AddGroup (stored, if `first`). x is the tile's rows packed step by step
// from the block's first step (PackRowTiles: x[k * kRows + r]), out rows are n_size apart, panel rows kPanelWidth.
template <int64_t kRows, typename Weight>
void Tile(const float* x, const Weight* panel, int64_t depth, float* out, int64_t n_size, bool first,
          const Groups* groups, Prefetcher& prefetch) {
  constexpr int64_t kTileLines = LinesOf(kTileWidth * static_cast<int64_t>(sizeof(Weight)));
  Vec acc[kRows][kTileVectors];
  const bool from_out = !first && groups == nullptr;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] = from_out ? LoadVec(out + r * n_size + v * kLanes) : Vec{};
  }
  AccumulateTile<kRows, kTileVectors, true>(acc, x, 0, panel, kPanelWidth, depth, [&prefetch, panel](int64_t k) {
    prefetch.Step();
    // The panel's rows kFirstLevelAhead steps on, into the first-level cache: a panel (576 x 48 floats of SmolLM2's
    // gate) outgrows that cache, and its tiles re-read it from the second level, or the first one from beyond. 30
    // SmolLM2 MLPs at 256 rows 161.9 -> 155.5 ms, at 2048 rows 1240 -> 1211 ms (8 and 64 rows: unchanged).
    const char* ahead = reinterpret_cast<const char*>(panel + (k + kFirstLevelAhead) * kPanelWidth);
    for (int64_t line = 0; line < kTileLines; ++line) __builtin_prefetch(ahead + line * kCacheLine, 0, 3);
  });
  if (groups != nullptr) {
    for (int64_t v = 0; v < kTileVectors; ++v) {
      const Vec scale = LoadVec(groups->scales + v * kLanes), min = LoadVec(groups->mins + v * kLanes);
      for (int64_t r = 0; r < kRows; ++r) {
        const Vec prior = first ? Vec{} : LoadVec(out + r * n_size + v * kLanes);
        acc[r][v] = AddGroup(acc[r][v], scale, min, groups->x_sums[r * groups->num_groups], prior, first);
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kTileVectors; ++v) StoreVec(out + r * n_size + v * kLanes, acc[r][v]);
  }
}

// Tile for the `rows` (< kRowBlock) x rows left after the full tiles, in one tile of that height.
template <int64_t kRows, typename Weight>
void RestTile(int64_t rows, const float* x, const Weight* panel, int64_t depth, float* out, int64_t n_size,
              bool first, const Groups* groups, Prefetcher& prefetch) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return Tile<kRows>(x, panel, depth, out, n_size, first, groups, prefetch);
    RestTile<kRows - 1>(rows, x, panel, depth, out, n_size, first, groups, prefetch);
  }
}

// An int8 weight's Tile for few rows, over a block of whole groups: each group's sums start from zero in registers and
// go by AddGroup into the block's total, which stays in registers too and starts from out unless `first`. The same
// operations in the same order as Tile's, block by block (a group a block, the total through out), so a row's result
// is the same bits on both paths. Tiles are kGroupRowBlock rows high, to keep sums and totals in registers.
constexpr int64_t kGroupRowBlock = kLanes == 16 ? 4 : 2;
template <int64_t kRows>
void GroupTile(const float* x, const int8_t* panel, int64_t depth, float* out, int64_t n_size, bool first,
               const Groups& groups, Prefetcher& prefetch) {
  Vec total[kRows][kTileVectors];
  for (int64_t g0 = 0, g = 0; g0 < depth; g0 += kGroupRows, ++g) {
    Vec acc[kRows][kTileVectors] = {};
    const int8_t* group_panel = panel + g0 * kPanelWidth;
    const int64_t rows = std::min(kGroupRows, depth - g0);
    // Only the second-level prefetch: a first-level one each step, as Tile's, cost a one-row step 5-10% (54.0-56.9
    // against 59.1-61.7 tok/s for a batch-1 generate), its panel rows being a third of f32's.
    AccumulateTile<kRows, kTileVectors, true>(acc, x + g0 * kRows, 0, group_panel, kPanelWidth, rows,
                                              [&prefetch](int64_t) { prefetch.Step(); });
    for (int64_t v = 0; v < kTileVectors; ++v) {
      const Vec scale = LoadVec(groups.scales + g * kPanelWidth + v * kLanes);
      const Vec min = LoadVec(groups.mins + g * kPanelWidth + v * kLanes);
      for (int64_t r = 0; r < kRows; ++r) {
        const bool fresh = g == 0 && first;
        const Vec prior = g > 0 ? total[r][v] : first ? Vec{} : LoadVec(out + r * n_size + v * kLanes);
        total[r][v] = AddGroup(acc[r][v], scale, min, groups.x_sums[r * groups.num_groups + g], prior, fresh);
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kTileVectors; ++v) StoreVec(out + r * n_size + v * kLanes, total[r][v]);
  }
}

// GroupTile for the `rows` (< kGroupRowBlock) x rows left after the full tiles.
template <int64_t kRows>
void RestGroupTile(int64_t rows, const float* x, const int8_t* panel, int64_t depth, float* out, int64_t n_size,
                   bool first, const Groups& groups, Prefetcher& prefetch) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return GroupTile<kRows>(x, panel, depth, out, n_size, first, groups, prefetch);
    RestGroupTile<kRows - 1>(rows, x, panel, depth, out, n_size, first, groups, prefetch);
  }
}

// One row's sum over each group of kGroupRows of its values, into sums[0, num_groups): whole groups kLanes at a time
// (their vectors' lanes summed together by SumEachLane), the rest one by one; the same order whatever the batch is.
void RowGroupSums(const float* row, int64_t k_size, int64_t num_groups, float* sums) {
  static_assert(kGroupRows % kLanes == 0, "a group is whole vectors");
  const int64_t whole = k_size / kGroupRows;  // groups without a ragged end
  int64_t g = 0;
  for (; g + kLanes <= whole; g += kLanes) {
    Vec lanes[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      const float* group = row + (g + i) * kGroupRows;
      lanes[i] = LoadVec(group);
      for (int64_t k = kLanes; k < kGroupRows; k += kLanes) lanes[i] += LoadVec(group + k);
    }
    StoreVec(sums + g, SumEachLane(lanes));
  }
  for (; g < num_groups; ++g) {
    const float* group = row + g * kGroupRows;
    const int64_t width = std::min(kGroupRows, k_size - g * kGroupRows);
    Vec lanes{};
    int64_t k = 0;
    for (; k + kLanes <= width; k += kLanes) lanes += LoadVec(group + k);
    float sum = HorizontalSum(lanes);
    for (; k < width; ++k) sum += group[k];
    sums[g] = sum;
  }
}

// x's group sums, [T, num_groups], rows split over the pool.
std::vector<float> GroupSums(ffi::ThreadPool& pool, const float* x, int64_t t_size, int64_t k_size,
                             int64_t num_groups) {
  std::vector<float> sums(t_size * num_groups);
  constexpr int64_t kRowsPerItem = 64;
  auto rows = [&](int64_t item) {
    for (int64_t t = item * kRowsPerItem; t < std::min(t_size, (item + 1) * kRowsPerItem); ++t) {
      RowGroupSums(x + t * k_size, k_size, num_groups, sums.data() + t * num_groups);
    }
  };
  ParallelFor(pool, (t_size + kRowsPerItem - 1) / kRowsPerItem, rows);
  return sums;
}

// Rows [0, rows) of `from` (rows k_size apart), steps [k0, k1), into `to` laid out [K, rows] (step k's values side by
// side at to + k * rows).
void PackSteps(const float* from, int64_t rows, int64_t k_size, int64_t k0, int64_t k1, float* to) {
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t r = 0; r < rows; ++r) to[k * rows + r] = from[r * k_size + k];
  }
}

// PackSteps for a full tile, kLanes steps at a time as an in-register transpose: kRowBlock vectors in, their lanes out
// step by step (one value at a time, the copy cost about 1% of a 32-row matmul more).
void PackFullTile(const float* from, int64_t k_size, float* to) {
  int64_t k = 0;
#if defined(__AVX512F__)
  static_assert(kRowBlock == 8 && kLanes == 16, "an AVX-512 tile is 8 rows of 16-lane vectors");
  for (; k + kLanes <= k_size; k += kLanes) {
    __m512 a[8], t[8], u[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm512_loadu_ps(from + r * k_size + k);
    for (int r = 0; r < 8; r += 2) {  // rows r, r + 1 interleaved within each 128-bit lane
      t[r] = _mm512_unpacklo_ps(a[r], a[r + 1]);
      t[r + 1] = _mm512_unpackhi_ps(a[r], a[r + 1]);
    }
    for (int half = 0; half < 2; ++half) {  // u[4 * half + m]: step 4L + m of rows 4 * half .. + 3, in lane L
      u[4 * half + 0] = _mm512_shuffle_ps(t[4 * half], t[4 * half + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * half + 1] = _mm512_shuffle_ps(t[4 * half], t[4 * half + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[4 * half + 2] = _mm512_shuffle_ps(t[4 * half + 1], t[4 * half + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * half + 3] = _mm512_shuffle_ps(t[4 * half + 1], t[4 * half + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    // The upper 256 bits of v (AVX-512F alone: _mm512_extractf32x8_ps would need AVX-512DQ).
    auto upper = [](__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); };
    for (int m = 0; m < 4; ++m) {
      // Lanes (L, L + 1) of rows 0-3 and of rows 4-7, reordered to [rows 0-3, rows 4-7] of step 4L + m, then of
      // step 4(L + 1) + m.
      const __m512 low = _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 high = _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 2, 3, 2));
      const __m512 steps01 = _mm512_shuffle_f32x4(low, low, _MM_SHUFFLE(3, 1, 2, 0));
      const __m512 steps23 = _mm512_shuffle_f32x4(high, high, _MM_SHUFFLE(3, 1, 2, 0));
      _mm256_storeu_ps(to + (k + m) * 8, _mm512_castps512_ps256(steps01));
      _mm256_storeu_ps(to + (k + 4 + m) * 8, upper(steps01));
      _mm256_storeu_ps(to + (k + 8 + m) * 8, _mm512_castps512_ps256(steps23));
      _mm256_storeu_ps(to + (k + 12 + m) * 8, upper(steps23));
    }
  }
#elif defined(__AVX2__)
  static_assert(kRowBlock == 4 && kLanes == 8, "an AVX2 tile is 4 rows of 8-lane vectors");
  for (; k + kLanes <= k_size; k += kLanes) {
    __m256 a[4];
    for (int r = 0; r < 4; ++r) a[r] = _mm256_loadu_ps(from + r * k_size + k);
    const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
    const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
    const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2))};
    for (int m = 0; m < 4; ++m) {  // u[m]'s 128-bit lane L: step 4L + m of the 4 rows
      _mm_storeu_ps(to + (k + m) * 4, _mm256_castps256_ps128(u[m]));
      _mm_storeu_ps(to + (k + 4 + m) * 4, _mm256_extractf128_ps(u[m], 1));
    }
  }
#endif
  PackSteps(from, kRowBlock, k_size, k, k_size, to);
}

// Buffers for packed x, kept from call to call: as many as calls ever ran at once (XLA may run independent matmuls side
// by side), each as large as the largest x it held (a 2048-token prefill's 2048 x 1536 floats, 12.6 MB). One per
// calling thread instead held 40-75 MB more at peak (a generate's warm-up runs every step shape).
class PackedBuffers {
 public:
  std::vector<float> Take(int64_t size) {
    std::vector<float> buffer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        buffer = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    return buffer;
  }
  void Give(std::vector<float> buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(buffer));
  }

 private:
  std::mutex mutex_;
  std::vector<std::vector<float>> free_;
};
PackedBuffers packed_buffers;

// x[T, K]'s rows packed tile by tile into `packed` for the tiles' AccumulateTile: the tile of rows [t0, t0 + h) (h =
// tile_rows, or the rows left at the end) at + t0 * K, laid out [K, h], each step's h values side by side. One row is
// its own packing. The copy is T x K floats (a few microseconds at a decode batch's 32 rows, beside 30-300 of
// multiply-adds).
const float* PackRowTiles(ffi::ThreadPool& pool, const float* x, int64_t t_size, int64_t k_size, int64_t tile_rows,
                          std::vector<float>& packed) {
  if (t_size == 1) return x;
  packed = packed_buffers.Take(t_size * k_size);
  float* to = packed.data();
  auto pack = [&](int64_t tile) {
    const int64_t t0 = tile * tile_rows, rows = std::min(tile_rows, t_size - t0);
    if (rows == kRowBlock) return PackFullTile(x + t0 * k_size, k_size, to + t0 * k_size);
    PackSteps(x + t0 * k_size, rows, k_size, 0, k_size, to + t0 * k_size);
  };
  const int64_t tiles = (t_size + tile_rows - 1) / tile_rows;
  if (t_size <= kFewRows) {
    for (int64_t tile = 0; tile < tiles; ++tile) pack(tile);
  } else {
    ParallelFor(pool, tiles, pack);
  }
  return to;
}

// x[T, K] rounded to bf16, each row padded with a zero to whole pairs: [T, ceil(K / 2)] Bf16Pairs (contraction rows
// 2k and 2k + 1 of a row in pair k), viewed as floats for PackRowTiles, which only moves them. Rows split over the
// pool when there are many.
const float* ToBf16Pairs(ffi::ThreadPool& pool, const float* x, int64_t t_size, int64_t k_size,
                         std::vector<float>& pairs) {
  const int64_t pair_steps = (k_size + 1) / 2;
  pairs = packed_buffers.Take(t_size * pair_steps);
  uint16_t* to = reinterpret_cast<uint16_t*>(pairs.data());
  auto row = [&](int64_t t) {
    const float* from = x + t * k_size;
    uint16_t* row_to = to + t * 2 * pair_steps;
    RoundToBf16s(from, k_size, row_to);
    if (k_size % 2) row_to[k_size] = 0;
  };
  constexpr int64_t kRowsPerItem = 64;
  auto rows = [&](int64_t item) {
    for (int64_t t = item * kRowsPerItem; t < std::min(t_size, (item + 1) * kRowsPerItem); ++t) row(t);
  };
  if (t_size <= kRowsPerItem) {
    rows(0);
  } else {
    ParallelFor(pool, (t_size + kRowsPerItem - 1) / kRowsPerItem, rows);
  }
  return pairs.data();
}

// out[T, P * kPanelWidth] = x[T, K] @ the panels (an int8 weight's with `scales` and `mins`: see Groups), one work item
// per few consecutive panels (one contiguous run). Few rows: panel by panel, all rows at once. More: kRowChunk rows at
// a time through every panel of the item (the chunk of x stays in the second-level cache across the item's panels, as
// do the panels across chunks). The first chunk's tiles prefetch the memory that follows each block.
template <typename Weight>
void MatmulPanels(ffi::ThreadPool& pool, const float* x, const Weight* panels, const float* scales, const float* mins,
                  float* out, int64_t t_size, int64_t k_size, int64_t num_panels) {
  const int64_t n_size = num_panels * kPanelWidth;
  const int64_t item_panels = EvenItemSize(pool, num_panels, kItemPanels);
  const int64_t items = (num_panels + item_panels - 1) / item_panels;
  constexpr int64_t kRowBytes = kPanelWidth * static_cast<int64_t>(sizeof(Weight));  // a panel's contraction row
  const bool few = t_size <= kFewRows, grouped = scales != nullptr;
  const int64_t row_chunk = few ? t_size : kRowChunk;
  // An int8 weight's blocks are whole groups: for fewer rows than a Tile's, kGroupsFew of them (GroupTile keeps their
  // sums in registers); from kRowBlock rows on, one (Tile adds each group's part to out, with twice the multiply-adds
  // per widened vector: SmolLM2's 128 + 128 tokens at batch 8 went from 1.16-1.26x f32's speed to 1.23-1.39x, at
  // batch 32 from 0.88-0.94x to 0.93-0.97x).
  const bool group_tiles = grouped && t_size < kRowBlock;
  const int64_t mid_block = k_size <= kMidBlock * 3 / 2 ? k_size : kMidBlock;
  const int64_t f32_block = !few ? kDeepBlock : t_size >= kMidRows ? mid_block : kShallowBlock;
  const int64_t depth_block = !grouped ? f32_block : group_tiles ? kGroupsFew * kGroupRows : kGroupRows;
  const int64_t num_groups = (k_size + kGroupRows - 1) / kGroupRows;
  const std::vector<float> x_sums = grouped ? GroupSums(pool, x, t_size, k_size, num_groups) : std::vector<float>();
  const int64_t tile_rows = group_tiles ? kGroupRowBlock : kRowBlock;
  // Many rows times a narrow weight leave few panel items (128 columns: 3 panels, 2 items, one with twice the other's
  // work): the rows are then split into ranges of at least kMinPartChunks whole chunks too, each (panel group, row
  // range) an item, until there are kItemsPerThread items a thread. On a 2-core Zen 4, 2048 rows: 2048 x 576 x 192
  // (SmolLM2's k and v) 3.4 -> 2.4 ms, 2048 x 256 x 128 1.4-1.9 -> 0.9-1.1 ms, 2048 x 256 x 256 2.3-2.5 -> 1.5-1.6 ms;
  // 2048 x 576 x 1536 (enough panels already) unchanged; ranges of fewer chunks (128 rows in 4) ran slower.
  const int64_t num_chunks = (t_size + row_chunk - 1) / row_chunk;
  const int64_t wanted = kItemsPerThread * std::max<int64_t>(1, pool.num_threads());
  const int64_t most_parts = std::max<int64_t>(1, num_chunks / kMinPartChunks);
  const int64_t row_parts = few ? 1 : std::min(most_parts, std::max<int64_t>(1, (wanted + items - 1) / items));
  const int64_t part_rows = (num_chunks + row_parts - 1) / row_parts * row_chunk;
  std::vector<float> packed;  // back to packed_buffers at the end
  const float* packed_x = PackRowTiles(pool, x, t_size, k_size, tile_rows, packed);
  auto item = [&](int64_t i) {
    const int64_t p_begin = i % items * item_panels, p_end = std::min(num_panels, p_begin + item_panels);
    const int64_t t_begin = i / items * part_rows, t_end = std::min(t_size, t_begin + part_rows);
    const char* item_end = reinterpret_cast<const char*>(panels + p_end * k_size * kPanelWidth);
    // Rows [t0, t0 + rows) of out's panel p.
    auto multiply = [&](int64_t p, int64_t t0, int64_t rows) {
      const Weight* panel = panels + p * k_size * kPanelWidth;
      const int64_t row_tiles = (rows + kRowBlock - 1) / kRowBlock;
      for (int64_t k0 = 0; k0 < k_size; k0 += depth_block) {
        const int64_t depth = std::min(depth_block, k_size - k0);
        // The block after the next one (of this panel, or the item's next panels): one block ahead, a decode row's
        // reads waited on memory more often (1 row of 30 SmolLM2 MLPs, 16.0 against 15.0 ms for the small-row
        // kernel; two ahead, even).
        const char* next = reinterpret_cast<const char*>(panel + (k0 + depth + depth_block) * kPanelWidth);
        const int64_t available = t0 == t_begin ? std::max<int64_t>(0, (item_end - next) / kCacheLine) : 0;
        const int64_t lines = std::min(available, LinesOf(depth_block * kRowBytes));
        const int64_t steps = row_tiles * kTilesAcross * depth;
        Prefetcher prefetch{next, 0, lines, (lines + steps - 1) / steps};
        const bool first = k0 == 0;
        for (int64_t across = 0; across < kTilesAcross; ++across) {
          const Weight* tile_panel = panel + k0 * kPanelWidth + across * kTileWidth;
          // Row t's tile (of `height` rows) from the block's first step.
          auto tile_x = [&](int64_t t, int64_t height) { return packed_x + (t0 + t) * k_size + k0 * height; };
          float* tile_out = out + t0 * n_size + p * kPanelWidth + across * kTileWidth;
          // The tile's groups at row t of this chunk (an int8 weight's).
          auto groups_at = [&](int64_t t) {
            const int64_t offset = (p * num_groups + k0 / kGroupRows) * kPanelWidth + across * kTileWidth;
            return Groups{scales + offset, mins + offset, x_sums.data() + (t0 + t) * num_groups + k0 / kGroupRows,
                          num_groups};
          };
          int64_t t = 0;
          if constexpr (sizeof(Weight) == 1) {
            if (group_tiles) {
              for (; t + kGroupRowBlock <= rows; t += kGroupRowBlock) {
                GroupTile<kGroupRowBlock>(tile_x(t, kGroupRowBlock), tile_panel, depth, tile_out + t * n_size,
                                          n_size, first, groups_at(t), prefetch);
              }
              if (t < rows) {
                RestGroupTile<kGroupRowBlock - 1>(rows - t, tile_x(t, rows - t), tile_panel, depth,
                                                  tile_out + t * n_size, n_size, first, groups_at(t), prefetch);
              }
              continue;
            }
          }
          for (; t + kRowBlock <= rows; t += kRowBlock) {
            const Groups groups = grouped ? groups_at(t) : Groups{};
            Tile<kRowBlock>(tile_x(t, kRowBlock), tile_panel, depth, tile_out + t * n_size, n_size, first,
                            grouped ? &groups : nullptr, prefetch);
          }
          if (t < rows) {
            const Groups groups = grouped ? groups_at(t) : Groups{};
            RestTile<kRowBlock - 1>(rows - t, tile_x(t, rows - t), tile_panel, depth, tile_out + t * n_size, n_size,
                                    first, grouped ? &groups : nullptr, prefetch);
          }
        }
      }
    };
    for (int64_t t0 = t_begin; t0 < t_end; t0 += row_chunk) {
      for (int64_t p = p_begin; p < p_end; ++p) multiply(p, t0, std::min(row_chunk, t_end - t0));
    }
  };
  ParallelFor(pool, items * row_parts, item);
  if (!packed.empty()) packed_buffers.Give(std::move(packed));
}

// Checks the operands' shapes: x[T, K] and panels[P, K, 48].
ffi::Error CheckPanelShapes(ffi::Span<const int64_t> x_dims, ffi::Span<const int64_t> p_dims) {
  if (x_dims.size() != 2 || p_dims.size() != 3 || p_dims[2] != kPanelWidth) {
    return ffi::Error::InvalidArgument("expected x[T, K] and panels[P, K, 48]");
  }
  if (p_dims[1] != x_dims[1]) {
    return ffi::Error::InvalidArgument("the panels' contraction dimension does not match x's");
  }
  return ffi::Error::Success();
}

template <typename Weight>
ffi::Error RunPanelMatmul(ffi::ThreadPool& pool, const float* x, ffi::Span<const int64_t> x_dims, const Weight* panels,
                          ffi::Span<const int64_t> p_dims, const float* scales, const float* mins, float* result) {
  if (ffi::Error error = CheckPanelShapes(x_dims, p_dims); error.failure()) return error;
  const int64_t t_size = x_dims[0], k_size = x_dims[1], num_panels = p_dims[0];
  if (t_size == 0 || num_panels == 0) return ffi::Error::Success();
  if (k_size == 0) {
    std::fill(result, result + t_size * num_panels * kPanelWidth, 0.0f);
    return ffi::Error::Success();
  }
  MatmulPanels(pool, x, panels, scales, mins, result, t_size, k_size, num_panels);
  return ffi::Error::Success();
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                       ffi::ResultBuffer<ffi::F32> out) {
  return RunPanelMatmul(pool, x.typed_data(), x.dimensions(), panels.typed_data(), panels.dimensions(), nullptr,
                        nullptr, out->typed_data());
}

ffi::Error PanelMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                           ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> out) {
  auto p_dims = panels.dimensions();
  if (p_dims.size() == 3) {
    for (auto dims : {scales.dimensions(), mins.dimensions()}) {
      if (dims.size() != 3 || dims[0] != p_dims[0] || dims[1] != (p_dims[1] + kGroupRows - 1) / kGroupRows ||
          dims[2] != kPanelWidth) {
        return ffi::Error::InvalidArgument("expected scales and mins [P, ceil(K / 32), 48], one per group and column");
      }
    }
  }
  return RunPanelMatmul(pool, x.typed_data(), x.dimensions(), panels.typed_data(), p_dims, scales.typed_data(),
                        mins.typed_data(), out->typed_data());
}

ffi::Error PanelMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer panels,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto x_dims = x.dimensions();
  auto p_dims = panels.dimensions();
  if (panels.element_type() != ffi::DataType::BF16 || x_dims.size() != 2 || p_dims.size() != 4 ||
      p_dims[2] != kPanelWidth || p_dims[3] != 2) {
    return ffi::Error::InvalidArgument("expected x[T, K] and bf16 panels[P, ceil(K / 2), 48, 2]");
  }
  if (p_dims[1] != (x_dims[1] + 1) / 2) {
    return ffi::Error::InvalidArgument("the panels' contraction pairs do not match x's contraction dimension");
  }
  const int64_t t_size = x_dims[0], k_size = x_dims[1], num_panels = p_dims[0];
  float* result = out->typed_data();
  if (t_size == 0 || num_panels == 0) return ffi::Error::Success();
  if (k_size == 0) {
    std::fill(result, result + t_size * num_panels * kPanelWidth, 0.0f);
    return ffi::Error::Success();
  }
  std::vector<float> pairs;  // back to packed_buffers at the end
  const float* x_pairs = ToBf16Pairs(pool, x.typed_data(), t_size, k_size, pairs);
  MatmulPanels(pool, x_pairs, reinterpret_cast<const Bf16Pair*>(panels.untyped_data()), nullptr, nullptr, result,
               t_size, (k_size + 1) / 2, num_panels);
  packed_buffers.Give(std::move(pairs));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulF32, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // panels: [P, K, 48]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, P * 48]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulInt8, PanelMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()     // panels: [P, K, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scales: [P, ceil(K / 32), 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // mins: [P, ceil(K / 32), 48]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, P * 48]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulBf16, PanelMatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: [T, K]
                                  .Arg<ffi::AnyBuffer>()           // panels: bf16[P, ceil(K / 2), 48, 2]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, P * 48]
