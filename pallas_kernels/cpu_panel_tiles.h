// Part of the native CPU matmuls on panels (included inside their anonymous namespaces after cpu_native_parallel.h,
// cpu_native_vectors.h and cpu_native_register_tile.h, never on its own): the panel layout's register tiles, how a
// product splits into work items and blocks, and the product itself (cpu_panel_matmul.cc describes the design).

#ifndef PAXKV_CPU_PANEL_TILES_H_
#define PAXKV_CPU_PANEL_TILES_H_

constexpr int64_t kPanelWidth = 48;                          // the layout's columns per panel (cpu_panel_matmul.py)
constexpr int64_t kTileVectors = 3;                          // output vectors per row in a tile
constexpr int64_t kTileWidth = kTileVectors * kLanes;        // 48 with AVX-512, 24 on 8-lane machines
constexpr int64_t kTilesAcross = kPanelWidth / kTileWidth;   // a panel's tiles side by side (1 or 2)
constexpr int64_t kRowBlock = kLanes == 16 ? 8 : 4;          // x rows in a register tile
constexpr int64_t kItemPanels = 4;                           // at most this many panels per work item
// Few rows (kFewRows or fewer) stream each panel from memory once, and a tile prefetches two blocks ahead only within
// its item: items of 4 panels left the first two of every item to the hardware prefetcher. At most 16 (SmolLM2 in
// bf16 on a 2-core Zen 4, the same decode step alternated in one process: batch 16 at context 2048 43.8 and 44.2 ->
// 42.7 and 42.8 ms, batch 32 at 128 34.6 and 33.8 -> 33.1 and 32.4; batch 1 and 64 the same within noise; the lm_head
// at 16 rows alone 3.19 -> 2.98 ms, and one item a thread 3.01).
constexpr int64_t kFewItemPanels = 16;
constexpr int64_t kItemsPerThread = 4;                       // many rows: items a thread, at least (row ranges)
constexpr int64_t kMinPartChunks = 8;                        // many rows: chunks of a row range, at least
// Up to kFewRows rows, all of them are multiplied with a panel kShallowBlock contraction rows (18 KiB of f32; int8
// weights: kGroupsFew groups, 6 KiB) at a time: the panel streams from memory, the arithmetic short. From kMidRows
// rows on, an f32 panel's block is kMidBlock rows deep (a contraction of at most kMidDepth in one block): its tiles'
// sums go through `out` half as often, and on a 2-core Zen 4 SmolLM2's products at 16-64 rows ran 2-8% faster than
// with kShallowBlock (three alternating builds; 1 and 8 rows unchanged, 96 kept there). kMidDepth was 288 until
// SmolLM2's 576-deep f32 lm_head, whose sums then went through its streamed output in three blocks, ran faster in one
// (576 x 49152 with the greedy token's pass, alternated in one process: 32 rows 10.39 -> 9.69 ms, 16 rows 5.62 ->
// 5.45, 64 rows 23.1 -> 22.6; its q/k/v and o at 32 rows and MLP at 16-64 unchanged within noise). More rows are
// multiplied kRowChunk at a time, kDeepBlock contraction steps (rows, or bf16 pairs of rows) at a time: fewer round
// trips of the sums through `out`, the panel in the second-level cache (147 KiB a panel). 768 takes SmolLM2's down
// projection in bf16 (1536 deep) in one block: with 576 it took two unequal ones, and 2048 x 1536 x 576 ran 4-6%
// slower (f32, two blocks against three: 19.6 against 19.3 ms, the same within noise). Blocks never change a sum's
// order (it continues through `out` exactly).
constexpr int64_t kFewRows = 64;
constexpr int64_t kShallowBlock = 96;
constexpr int64_t kMidRows = 16;
constexpr int64_t kMidBlock = 192;
constexpr int64_t kMidDepth = 576;
constexpr int64_t kRowChunk = 32;
constexpr int64_t kDeepBlock = 768;
constexpr int64_t kCacheLine = 64;
// Products with at least this many bytes of output store their final sums without reading the lines first (StreamVec):
// an output that size outgrows the second-level cache before anything reads it, and reading each line in just to
// overwrite it cost the writes. A 2048-token prompt's step on SmolLM2 in bf16 (q, o and down: 4.5 MiB each) took
// 1593 and 1581 ms against 1604 and 1614 (alternated in one process); 2048 x 576 x 1536 alone, 10.3 -> 9.3 ms. The
// lm_head's logits from 22 decode rows on stream too, which the greedy token's pass then reads from memory: SmolLM2's
// decode steps at batch 32 and 64 were unchanged within noise (40.7-42.0 and 79.8 ms against 41.8-42.1 and 82.2).
// 3 MiB rather than 4 (a 2-core Zen 4, the lm_head and the greedy token's pass as two programs, as a step runs them,
// alternated in one process): SmolLM2's bf16 lm_head at 16 rows (3 MiB) 3.40 -> 3.21 ms and at 21 rows 4.54 -> 4.17,
// the random 20M Llama's f32 one at 32 rows (32000 words, 3.9 MiB) 3.51-3.59 -> 3.17-3.29; at 13 and 14 rows (2.5 and
// 2.6 MiB) streaming cost 2-8%, so smaller outputs still store through the cache. (SmolLM2's f32 lm_head at 16 rows,
// bound by its 113 MB of reads, went 6.52-6.59 -> 6.65-6.74 ms: 0.1 ms of a 60 ms step.)
constexpr int64_t kStreamOutBytes = int64_t{3} << 20;
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
// With `stream` (the last block of a large output), the sums are stored by StreamVec.
// Never inlined: inlined into MultiplyPanelItem (every product but the gated MLP's gate and up), the tile's loop kept
// the prefetch cursor on the stack and general registers in vector ones, and one sample in six of its steps waited on
// the cursor's load and store. Out of line, as the gate and up products already called it, it keeps them in registers.
// Alternated in one process on a 2-core Zen 4: 30 chained SmolLM2 MLPs at 32 rows 34.4 -> 31.6 ms (bf16: 17.0 ->
// 16.0), at 8 rows 12.2 -> 11.4; the f32 lm_head at 32 rows 9.36 -> 8.98 and 9.69 -> 9.31 ms, bf16 at 16 rows 3.10 ->
// 3.01; 1, 256 and 2048 rows, and int8 weights, unchanged within noise.
template <int64_t kRows, typename Weight>
__attribute__((noinline)) void Tile(const float* x, const Weight* panel, int64_t depth, float* out, int64_t n_size,
                                    bool first, bool stream, const Groups* groups, Prefetcher& prefetch) {
  constexpr int64_t kTileLines = LinesOf(kTileWidth * static_cast<int64_t>(sizeof(Weight)));
  Vec acc[kRows][kTileVectors];
  const bool from_out = !first && groups == nullptr;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kTileVectors; ++v) acc[r][v] = from_out ? LoadVec(out + r * n_size + v * kLanes) : Vec{};
  }
  // A local copy of the prefetch cursor, written back after the steps: through the reference its counter was loaded and
  // stored every step, and in a register the tile runs 2-9% faster (alternated in one process on a 2-core Zen 4: f32
  // at 32 rows, 576 x 1536 from memory 0.380 -> 0.345 ms, 576 x 576 0.147 -> 0.142, the 576 x 49152 lm_head 11.6 ->
  // 11.2; bf16 at 16 rows, the lm_head 3.58 -> 3.51; 1 row unchanged). Captured by value instead, GCC dropped the
  // prefetches altogether (faster in cache, 12-15% slower from memory).
  Prefetcher l2_ahead = prefetch;
  AccumulateTile<kRows, kTileVectors, true>(acc, x, 0, panel, kPanelWidth, depth, [&l2_ahead, panel](int64_t k) {
    l2_ahead.Step();
    // The panel's rows kFirstLevelAhead steps on, into the first-level cache: a panel (576 x 48 floats of SmolLM2's
    // gate) outgrows that cache, and its tiles re-read it from the second level, or the first one from beyond. 30
    // SmolLM2 MLPs at 256 rows 161.9 -> 155.5 ms, at 2048 rows 1240 -> 1211 ms (8 and 64 rows: unchanged).
    const char* ahead = reinterpret_cast<const char*>(panel + (k + kFirstLevelAhead) * kPanelWidth);
    for (int64_t line = 0; line < kTileLines; ++line) __builtin_prefetch(ahead + line * kCacheLine, 0, 3);
  });
  prefetch = l2_ahead;
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
    for (int64_t v = 0; v < kTileVectors; ++v) {
      if (stream) {
        StreamVec(out + r * n_size + v * kLanes, acc[r][v]);
      } else {
        StoreVec(out + r * n_size + v * kLanes, acc[r][v]);
      }
    }
  }
}

// Tile for the `rows` (< kRowBlock) x rows left after the full tiles, in one tile of that height.
template <int64_t kRows, typename Weight>
void RestTile(int64_t rows, const float* x, const Weight* panel, int64_t depth, float* out, int64_t n_size,
              bool first, bool stream, const Groups* groups, Prefetcher& prefetch) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return Tile<kRows>(x, panel, depth, out, n_size, first, stream, groups, prefetch);
    RestTile<kRows - 1>(rows, x, panel, depth, out, n_size, first, stream, groups, prefetch);
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
    // against 59.1-61.7 tok/s for a batch-1 generate), its panel rows being a third of f32's. The cursor is a local
    // copy, as in Tile: SmolLM2's int8 lm_head at one row, alternated in one process, 1.086 -> 1.031 and 1.210 ->
    // 1.144 ms (3 rows unchanged).
    Prefetcher l2_ahead = prefetch;
    AccumulateTile<kRows, kTileVectors, true>(acc, x + g0 * kRows, 0, group_panel, kPanelWidth, rows,
                                              [&l2_ahead](int64_t) { l2_ahead.Step(); });
    prefetch = l2_ahead;
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

// One weight as the panel product reads it: panels[P, K, kPanelWidth], and an int8 weight's group scales and mins
// laid out as the panels (see Groups; null for f32 and bf16 weights).
template <typename Weight>
struct PanelOperand {
  const Weight* panels;
  const float* scales = nullptr;
  const float* mins = nullptr;
};

// How x[T, K] @ P panels splits into work items, one per few consecutive panels (one contiguous run) and, for many
// rows times few panels, per range of rows too; and how each item's products are blocked. Few rows: panel by panel,
// all rows at once. More: kRowChunk rows at a time through every panel of the item (the chunk of x stays in the
// second-level cache across the item's panels, as do the panels across chunks).
struct PanelSplit {
  int64_t t_size, k_size, n_size, num_panels;
  bool few, grouped, group_tiles;
  int64_t item_panels, items, row_chunk, depth_block, num_groups, tile_rows, row_parts, part_rows;

  // n_size: the output's columns, the first ceil(n_size / kPanelWidth) panels' (the last one's may be partial).
  PanelSplit(ffi::ThreadPool& pool, int64_t t_size, int64_t k_size, int64_t n_size, bool grouped)
      : t_size(t_size),
        k_size(k_size),
        n_size(n_size),
        num_panels((n_size + kPanelWidth - 1) / kPanelWidth),
        few(t_size <= kFewRows),
        grouped(grouped) {
    item_panels = EvenItemSize(pool, num_panels, few ? kFewItemPanels : kItemPanels);
    items = (num_panels + item_panels - 1) / item_panels;
    row_chunk = few ? t_size : kRowChunk;
    // An int8 weight's blocks are whole groups: for fewer rows than a Tile's, kGroupsFew of them (GroupTile keeps
    // their sums in registers); from kRowBlock rows on, one (Tile adds each group's part to out, with twice the
    // multiply-adds per widened vector: SmolLM2's 128 + 128 tokens at batch 8 went from 1.16-1.26x f32's speed to
    // 1.23-1.39x, at batch 32 from 0.88-0.94x to 0.93-0.97x).
    group_tiles = grouped && t_size < kRowBlock;
    const int64_t mid_block = k_size <= kMidDepth ? k_size : kMidBlock;
    const int64_t f32_block = !few ? kDeepBlock : t_size >= kMidRows ? mid_block : kShallowBlock;
    depth_block = !grouped ? f32_block : group_tiles ? kGroupsFew * kGroupRows : kGroupRows;
    num_groups = (k_size + kGroupRows - 1) / kGroupRows;
    tile_rows = group_tiles ? kGroupRowBlock : kRowBlock;
    // Many rows times a narrow weight leave few panel items (128 columns: 3 panels, 2 items, one with twice the
    // other's work): the rows are then split into ranges of at least kMinPartChunks whole chunks too, each (panel
    // group, row range) an item, until there are kItemsPerThread items a thread. On a 2-core Zen 4, 2048 rows: 2048 x
    // 576 x 192 (SmolLM2's k and v) 3.4 -> 2.4 ms, 2048 x 256 x 128 1.4-1.9 -> 0.9-1.1 ms, 2048 x 256 x 256 2.3-2.5 ->
    // 1.5-1.6 ms; 2048 x 576 x 1536 (enough panels already) unchanged; ranges of fewer chunks (128 rows in 4) ran
    // slower.
    const int64_t num_chunks = (t_size + row_chunk - 1) / row_chunk;
    const int64_t wanted = kItemsPerThread * std::max<int64_t>(1, pool.num_threads());
    const int64_t most_parts = std::max<int64_t>(1, num_chunks / kMinPartChunks);
    row_parts = few ? 1 : std::min(most_parts, std::max<int64_t>(1, (wanted + items - 1) / items));
    part_rows = (num_chunks + row_parts - 1) / row_parts * row_chunk;
  }

  int64_t NumItems() const { return items * row_parts; }
  // Item i's panels [p_begin, p_end) and rows [t_begin, t_end).
  void ItemBounds(int64_t i, int64_t& p_begin, int64_t& p_end, int64_t& t_begin, int64_t& t_end) const {
    p_begin = i % items * item_panels;
    p_end = std::min(num_panels, p_begin + item_panels);
    t_begin = i / items * part_rows;
    t_end = std::min(t_size, t_begin + part_rows);
  }
};

// Rows [t0, t0 + rows) of x (packed by PackRowTiles with split.tile_rows) times panel p of `weight`, into `out` (row
// t0's first column of the panel; rows n_size apart). With `prefetching` (an item's first chunk), the tiles prefetch
// the memory that follows each block, up to the item's last panel (`item_end`). x_sums: an int8 weight's GroupSums.
// With `stream_out`, the last block's tiles store by StreamVec (the caller fences them).
template <typename Weight>
void MultiplyPanelRows(const PanelSplit& split, const float* packed_x, const float* x_sums, PanelOperand<Weight> weight,
                       int64_t p, int64_t t0, int64_t rows, bool prefetching, const Weight* item_end, float* out,
                       int64_t n_size, bool stream_out = false) {
  constexpr int64_t kRowBytes = kPanelWidth * static_cast<int64_t>(sizeof(Weight));  // a panel's contraction row
  const int64_t k_size = split.k_size, depth_block = split.depth_block, num_groups = split.num_groups;
  const Weight* panel = weight.panels + p * k_size * kPanelWidth;
  const int64_t row_tiles = (rows + kRowBlock - 1) / kRowBlock;
  for (int64_t k0 = 0; k0 < k_size; k0 += depth_block) {
    const int64_t depth = std::min(depth_block, k_size - k0);
    // The block after the next one (of this panel, or the item's next panels): one block ahead, a decode row's reads
    // waited on memory more often (1 row of 30 SmolLM2 MLPs, 16.0 against 15.0 ms for the small-row kernel; two
    // ahead, even).
    const char* next = reinterpret_cast<const char*>(panel + (k0 + depth + depth_block) * kPanelWidth);
    const char* end = reinterpret_cast<const char*>(item_end);
    const int64_t available = prefetching ? std::max<int64_t>(0, (end - next) / kCacheLine) : 0;
    const int64_t lines = std::min(available, LinesOf(depth_block * kRowBytes));
    const int64_t steps = row_tiles * kTilesAcross * depth;
    Prefetcher prefetch{next, 0, lines, (lines + steps - 1) / steps};
    const bool first = k0 == 0, stream = stream_out && k0 + depth == k_size;
    for (int64_t across = 0; across < kTilesAcross; ++across) {
      const Weight* tile_panel = panel + k0 * kPanelWidth + across * kTileWidth;
      // Row t's tile (of `height` rows) from the block's first step.
      auto tile_x = [&](int64_t t, int64_t height) { return packed_x + (t0 + t) * k_size + k0 * height; };
      float* tile_out = out + across * kTileWidth;
      // The tile's groups at row t of this chunk (an int8 weight's).
      auto groups_at = [&](int64_t t) {
        const int64_t offset = (p * num_groups + k0 / kGroupRows) * kPanelWidth + across * kTileWidth;
        return Groups{weight.scales + offset, weight.mins + offset, x_sums + (t0 + t) * num_groups + k0 / kGroupRows,
                      num_groups};
      };
      int64_t t = 0;
      if constexpr (sizeof(Weight) == 1) {
        if (split.group_tiles) {
          for (; t + kGroupRowBlock <= rows; t += kGroupRowBlock) {
            GroupTile<kGroupRowBlock>(tile_x(t, kGroupRowBlock), tile_panel, depth, tile_out + t * n_size, n_size,
                                      first, groups_at(t), prefetch);
          }
          if (t < rows) {
            RestGroupTile<kGroupRowBlock - 1>(rows - t, tile_x(t, rows - t), tile_panel, depth, tile_out + t * n_size,
                                              n_size, first, groups_at(t), prefetch);
          }
          continue;
        }
      }
      for (; t + kRowBlock <= rows; t += kRowBlock) {
        const Groups groups = split.grouped ? groups_at(t) : Groups{};
        Tile<kRowBlock>(tile_x(t, kRowBlock), tile_panel, depth, tile_out + t * n_size, n_size, first, stream,
                        split.grouped ? &groups : nullptr, prefetch);
      }
      if (t < rows) {
        const Groups groups = split.grouped ? groups_at(t) : Groups{};
        RestTile<kRowBlock - 1>(rows - t, tile_x(t, rows - t), tile_panel, depth, tile_out + t * n_size, n_size, first,
                                stream, split.grouped ? &groups : nullptr, prefetch);
      }
    }
  }
}

// Work item i of out[T, N] = x[T, K] @ the panels of `weight` (N = split.n_size), x packed by PackRowTiles with
// split.tile_rows (x_sums: an int8 weight's GroupSums of x as it was): the item's chunks of rows through its panels in
// turn, the first chunk's tiles prefetching the memory that follows each block. A last panel wider than what is left
// of N is multiplied into a block of its own, whose first columns are then copied out: the same tiles and sums, and an
// output of N columns that needs no slicing afterwards. (A padded output sliced by XLA is a copy: the lm_head of a
// 32000-word vocabulary at 32 rows, followed by the greedy token's pass, took 4.02 ms sliced against 3.52 unsliced.)
template <typename Weight>
void MultiplyPanelItem(const PanelSplit& split, const float* packed_x, const float* x_sums, PanelOperand<Weight> weight,
                       float* out, int64_t i) {
  const int64_t n_size = split.n_size;
  const bool stream_out = split.t_size * n_size * static_cast<int64_t>(sizeof(float)) >= kStreamOutBytes;
  int64_t p_begin, p_end, t_begin, t_end;
  split.ItemBounds(i, p_begin, p_end, t_begin, t_end);
  const Weight* item_end = weight.panels + p_end * split.k_size * kPanelWidth;
  static_assert(kRowChunk <= kFewRows, "a chunk of rows (split.row_chunk) fits the partial panel's block");
  alignas(64) float partial[kFewRows * kPanelWidth];  // a partial panel's sums for a chunk, rows kPanelWidth apart
  for (int64_t t0 = t_begin; t0 < t_end; t0 += split.row_chunk) {
    const int64_t rows = std::min(split.row_chunk, t_end - t0);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t width = std::min(kPanelWidth, n_size - p * kPanelWidth);  // the panel's columns in out
      float* panel_out = out + t0 * n_size + p * kPanelWidth;
      if (width == kPanelWidth) {
        MultiplyPanelRows(split, packed_x, x_sums, weight, p, t0, rows, t0 == t_begin, item_end, panel_out, n_size,
                          stream_out);
        continue;
      }
      MultiplyPanelRows(split, packed_x, x_sums, weight, p, t0, rows, t0 == t_begin, item_end, partial, kPanelWidth);
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(partial + r * kPanelWidth, partial + r * kPanelWidth + width, panel_out + r * n_size);
      }
    }
  }
  if (stream_out) FenceStreams();
}

// out[T, N] = x[T, K] @ the panels of `weight` (MultiplyPanelItem's operands), the items over the pool.
template <typename Weight>
void MatmulPanels(ffi::ThreadPool& pool, const PanelSplit& split, const float* packed_x, const float* x_sums,
                  PanelOperand<Weight> weight, float* out) {
  auto item = [&](int64_t i) { MultiplyPanelItem(split, packed_x, x_sums, weight, out, i); };
  ParallelFor(pool, split.NumItems(), item);
}

#endif  // PAXKV_CPU_PANEL_TILES_H_
