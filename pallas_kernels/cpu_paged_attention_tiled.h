// Part of cpu_paged_attention.cc (included inside its anonymous namespace, after Shapes, LoadValue, VisibleRange
// and the vector helpers, never on its own): the tiled path that prefill chunks take.

#ifndef PAXKV_CPU_PAGED_ATTENTION_TILED_H_
#define PAXKV_CPU_PAGED_ATTENTION_TILED_H_

// Runs of at least this many tokens take the tiled path; runs are cut every kMaxTiledRunTokens tokens there.
constexpr int64_t kMinTiledRunTokens = 8;
constexpr int64_t kMaxTiledRunTokens = 64;
// Key positions a band takes per softmax step (whole pages, at least one): each step rescales the band's outputs once
// and runs the value tiles over all its slots. (Per page, 16 slots, a 2048-token prompt's attention took 18.2 ms a
// SmolLM2 layer in bf16 against 17.0 with 64; 128 gained 1% more and overflows the first-level cache.)
constexpr int64_t kBlockSlots = 64;

// The score tile: kScoreTileSlots keys by kScoreVecs vectors of query rows, sized to the register file: with AVX-512
// (32 registers of 16 lanes) 8 x 3 = 24 accumulators, with AVX2 (16 registers of 8 lanes) 6 x 2 = 12, chains enough
// to hide the multiply-adds' latency (4 x 2 left a 2048-token prompt's attention at 74 ms a layer on SmolLM2's
// heads, against 64). (8 x 3 tiles of 16-lane vectors, two AVX2 registers each, spilled every accumulator to the
// stack there: a 128-token prompt's attention took 5.7 ms a layer, against 0.56 ms with 4 x 2.)
#if defined(__AVX512F__)
constexpr int64_t kScoreTileSlots = 8;
constexpr int64_t kScoreVecs = 3;
#else
constexpr int64_t kScoreTileSlots = 6;
constexpr int64_t kScoreVecs = 2;
#endif

// One work item's buffers, kept per thread: rows across lanes, `width` lanes per row of each. A bf16 pool's run keeps
// its queries in q_t and its softmax weights in weight_pairs as bf16 pairs (see below), the bits in f32 slots.
struct TiledScratch {
  std::vector<float> q_t, out, weights, weight_pairs, block_values, block_max, running_max, running_sum, rescale,
      block_scales;
  std::vector<int32_t> starts, ends, row_offsets;
  std::vector<uint16_t> block_key_bits, block_value_bits;  // an int8 pool's block, its integers as bf16
};

// A bf16 pool's tiles multiply bf16 pairs (DotPairs: VDPBF16PS on AVX-512 BF16): the queries are rounded to bf16
// once per run, as pairs of adjacent head dims, and each block's softmax weights are rounded to bf16 as pairs of
// adjacent slots (PackPairs; the values are interleaved to match once per block and band, InterleaveRows). Products
// are exact and every sum is f32, as in a bf16 MXU or tensor-core matmul. The roundings are the change from f32
// arithmetic on the same stored keys and values (the weights' e^x, ExpForBf16, is within 2.9e-6 of itself, far inside
// their rounding's 2^-9), and halve the multiply-adds.

// Scores of lanes [0, lanes) (a multiple of kScoreVecs * kLanes) against the page's slots [lo, hi), into
// weights[slot][lane]; q_t and weights hold `width` lanes per row. lane_max[lane] becomes the larger of itself and
// the lane's largest score here.
// A bf16 pool's q_t holds [D / 2][width] pairs of head dims (2k low, 2k + 1 high), and its keys are taken a pair at a
// time as they lie in the page.
// key_scales, unless null, scales each slot's scores (an int8 pool's K scales, per slot of the page).
template <typename T>
void ScoreSlots(const float* q_t, const T* keys, int64_t row_width, int64_t D, int64_t width, int64_t lanes,
                int64_t lo, int64_t hi, float* weights, float* lane_max, const float* key_scales) {
  constexpr bool kPairs = std::is_same_v<T, uint16_t>;
  for (int64_t v0 = 0; v0 < lanes; v0 += kScoreVecs * kLanes) {
    Vec tile_max[kScoreVecs];
    for (int64_t c = 0; c < kScoreVecs; ++c) tile_max[c] = LoadVec(lane_max + v0 + c * kLanes);
    for (int64_t s0 = lo; s0 < hi; s0 += kScoreTileSlots) {
      const T* key_rows[kScoreTileSlots];
      for (int64_t j = 0; j < kScoreTileSlots; ++j) key_rows[j] = keys + std::min(s0 + j, hi - 1) * row_width;
      Vec acc[kScoreTileSlots][kScoreVecs] = {};
      for (int64_t d = 0; d < D; d += kPairs ? 2 : 1) {
        const float* q_row = q_t + (kPairs ? d / 2 : d) * width + v0;
        Vec q_vecs[kScoreVecs];
#pragma GCC unroll 3
        for (int64_t c = 0; c < kScoreVecs; ++c) q_vecs[c] = LoadVec(q_row + c * kLanes);
#pragma GCC unroll 8
        for (int64_t j = 0; j < kScoreTileSlots; ++j) {
          if constexpr (kPairs) {
            const Vec key = SplatBits(key_rows[j] + d);
#pragma GCC unroll 3
            for (int64_t c = 0; c < kScoreVecs; ++c) acc[j][c] = DotPairs(acc[j][c], q_vecs[c], key);
          } else {
            const Vec key = Splat(LoadValue(key_rows[j] + d));
#pragma GCC unroll 3
            for (int64_t c = 0; c < kScoreVecs; ++c) acc[j][c] += key * q_vecs[c];
          }
        }
      }
      if (key_scales != nullptr) {
        for (int64_t j = 0; j < kScoreTileSlots; ++j) {
          const Vec scale = Splat(key_scales[std::min(s0 + j, hi - 1)]);
          for (int64_t c = 0; c < kScoreVecs; ++c) acc[j][c] *= scale;
        }
      }
      // (Slots past hi repeat slot hi - 1's score, so they leave the max as it is.)
      for (int64_t j = 0; j < kScoreTileSlots; ++j) {
        for (int64_t c = 0; c < kScoreVecs; ++c) tile_max[c] = Max(tile_max[c], acc[j][c]);
      }
      for (int64_t j = 0; j < kScoreTileSlots && s0 + j < hi; ++j) {
        for (int64_t c = 0; c < kScoreVecs; ++c) StoreVec(weights + (s0 + j) * width + v0 + c * kLanes, acc[j][c]);
      }
    }
    for (int64_t c = 0; c < kScoreVecs; ++c) StoreVec(lane_max + v0 + c * kLanes, tile_max[c]);
  }
}

// The value tile: kValueRows query rows (their weights broadcast) by kValueVecs vectors of head dims (the values
// loaded as they lie in the page): 6 x 4 = 24 of AVX-512's 32 registers, 6 x 2 = 12 of AVX2's 16. (The transposed
// tile, 4 dims x 2 vectors of rows over out[d][row], left 8 chains and took half the attention's time. With the
// run's lanes in bands, 6 x 4 on AVX-512 took 694 ms against 742 for 6 x 2, 701 for 4 x 4 and 715 for 3 x 4 on 30
// layers of a 2048-token prompt; before the bands, 6 x 4 and 6 x 2 had measured the same.)
constexpr int64_t kValueRows = 6;
#if defined(__AVX512F__)
constexpr int64_t kValueVecs = 4;
#else
constexpr int64_t kValueVecs = 2;
#endif

// Lanes of a run that go through its pages together (whole score tiles and value tiles). Each band reads a block's
// keys and interleaves its values again: a 2048-token prompt's attention on one SmolLM2 layer (bf16 pool, 2-core Zen
// 4) took 16.46 and 16.42 ms with 96 against 17.09 and 16.87 with 48 and 16.98 and 17.63 with 192 (f32 pool: 28.7 and
// 28.8 against 28.9 and 29.4; 512 tokens the same within noise).
constexpr int64_t kBandLanes = 96;
static_assert(kBandLanes % (kScoreVecs * kLanes) == 0 && kBandLanes % kValueRows == 0, "a band is whole tiles");

// out[r0 + i][d0 : d0 + kVecs * kLanes] = out[...] * rescale[r0 + i] + sum over steps t of weights[t][r0 + i] *
// values[t][d0 : ...] for i < kRows (the online softmax's rescale folded in). A step is a slot, or with kPairs a pair
// of slots: values[t] then holds [D] bf16 pairs and weights[t] the two slots' weights as a pair.
// The loops over rows and vectors are unrolled by pragma: left to GCC, the sums went through the stack on the way in
// and out of every call (a fifth of the tile's time; 108 stack accesses in its code, 38 after). SmolLM2's 2048-token
// prompt over a bf16 pool, one layer alternated in one process: 15.76 -> 15.35 and 16.91 -> 16.37 ms; 512 tokens
// 1.49 -> 1.43; an f32 pool unchanged.
template <int64_t kRows, int64_t kVecs, bool kPairs>
inline void ValueTile(const float* weights, const float* values, int64_t D, int64_t width, int64_t steps,
                      const float* rescale, int64_t r0, int64_t d0, float* out) {
  Vec acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int64_t i = 0; i < kRows; ++i) {
    const Vec factor = Splat(rescale[r0 + i]);
#pragma GCC unroll 4
    for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = LoadVec(out + (r0 + i) * D + d0 + c * kLanes) * factor;
  }
  for (int64_t t = 0; t < steps; ++t) {
    Vec value[kVecs];
#pragma GCC unroll 4
    for (int64_t c = 0; c < kVecs; ++c) value[c] = LoadVec(values + t * D + d0 + c * kLanes);
    const float* weight = weights + t * width + r0;
#pragma GCC unroll 6
    for (int64_t i = 0; i < kRows; ++i) {
      if constexpr (kPairs) {
        const Vec w = SplatBits(weight + i);
        for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = DotPairs(acc[i][c], w, value[c]);
      } else {
        const Vec w = Splat(weight[i]);
        for (int64_t c = 0; c < kVecs; ++c) acc[i][c] += w * value[c];
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < kRows; ++i) {
#pragma GCC unroll 4
    for (int64_t c = 0; c < kVecs; ++c) StoreVec(out + (r0 + i) * D + d0 + c * kLanes, acc[i][c]);
  }
}

// ValueTile for the `rows` (< kValueRows) rows left after the full tiles, in one tile of that height.
template <int64_t kRows, int64_t kVecs, bool kPairs>
inline void ValueRestTile(int64_t rows, const float* weights, const float* values, int64_t D, int64_t width,
                          int64_t steps, const float* rescale, int64_t r0, int64_t d0, float* out) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return ValueTile<kRows, kVecs, kPairs>(weights, values, D, width, steps, rescale, r0, d0, out);
    ValueRestTile<kRows - 1, kVecs, kPairs>(rows, weights, values, D, width, steps, rescale, r0, d0, out);
  }
}

// out[row][d] = out[row][d] * rescale[row] + sum over steps t of weights[t][row] * values[t][d], for rows
// [first_row, end_row), d in one band of kVecs vectors from d0.
template <int64_t kVecs, bool kPairs>
void AccumulateValueVecs(const float* weights, const float* values, int64_t D, int64_t width, int64_t first_row,
                         int64_t end_row, int64_t steps, const float* rescale, int64_t d0, float* out) {
  int64_t r0 = first_row;
  for (; r0 + kValueRows <= end_row; r0 += kValueRows) {
    ValueTile<kValueRows, kVecs, kPairs>(weights, values, D, width, steps, rescale, r0, d0, out);
  }
  ValueRestTile<kValueRows - 1, kVecs, kPairs>(end_row - r0, weights, values, D, width, steps, rescale, r0, d0, out);
}

// AccumulateValueVecs over every d (D a multiple of kLanes).
template <bool kPairs>
void AccumulateValues(const float* weights, const float* values, int64_t D, int64_t width, int64_t first_row,
                      int64_t end_row, int64_t steps, const float* rescale, float* out) {
  int64_t d0 = 0;
  for (; d0 + kValueVecs * kLanes <= D; d0 += kValueVecs * kLanes) {
    AccumulateValueVecs<kValueVecs, kPairs>(weights, values, D, width, first_row, end_row, steps, rescale, d0, out);
  }
  for (; d0 < D; d0 += kLanes) {  // the vectors left, one at a time
    AccumulateValueVecs<1, kPairs>(weights, values, D, width, first_row, end_row, steps, rescale, d0, out);
  }
}

// An int8 row's D integers (a multiple of kLanes) as bf16, exactly (a magnitude up to 128 has 8 significant bits).
inline void IntegersAsBf16(const int8_t* row, int64_t D, uint16_t* out) {
  alignas(64) float widened[kLanes];
  for (int64_t d = 0; d < D; d += kLanes) {
    StoreVec(widened, LoadValues(row + d));
    RoundToBf16s(widened, kLanes, out + d);
  }
}

// The K (high half) or V (low half) scale in an int8 pool's scale word (ScaleWords).
inline float ScaleOf(uint32_t word, bool key) {
  const uint32_t bits = key ? word & 0xFFFF0000u : word << 16;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

// AttendRun's contract for a run of kMinTiledRunTokens to kMaxTiledRunTokens tokens, without a soft cap, and
// head_dim a multiple of kLanes. Row r = i * G + g of the run is lane r of every [.][width] buffer, and row r of
// out[width][D]. Over an int8 pool (T = int8_t, with its scales) the tiles multiply bf16 pairs as over a bf16 pool:
// each block's integers are copied as bf16 (exact; a key once per band, amortized over the band's rows), each score
// is scaled by its key's K scale, and each softmax weight by its value's V scale before it is rounded to bf16.
template <typename T>
void AttendRunTiled(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables, int64_t first_token,
                    int64_t count, int64_t kv_head, int32_t row, const int32_t* positions, const int32_t* kv_lens,
                    int64_t sliding_window, float* out, const ScaleWords& scales) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  constexpr bool kPairs = std::is_same_v<T, uint16_t> || kInt8;
  using PairT = std::conditional_t<kInt8, uint16_t, T>;  // what the tiles read: an int8 pool's block as bf16
  const int64_t G = s.group, D = s.head_dim, P = s.page_size, num_rows = count * G;
  const int64_t tile_rows = kScoreVecs * kLanes, width = (num_rows + tile_rows - 1) / tile_rows * tile_rows;
  thread_local TiledScratch scratch;
  scratch.q_t.resize(D * width);
  scratch.out.assign(width * D, 0.0f);
  // Whole pages, an even number of positions (bf16 pairs of slots start at even positions).
  const int64_t block_pages = std::max<int64_t>(1, kBlockSlots / P);
  const int64_t block_slots = (block_pages + block_pages * P % 2) * P;
  scratch.weights.resize(block_slots * width);
  if constexpr (kPairs) scratch.weight_pairs.resize((block_slots + 1) / 2 * width);
  scratch.block_values.resize(block_slots * D);
  if constexpr (kInt8) {
    scratch.block_key_bits.resize(block_slots * D);
    scratch.block_value_bits.resize(block_slots * D);
    scratch.block_scales.resize(2 * block_slots);
  }
  scratch.block_max.resize(kBandLanes);
  scratch.running_max.assign(width, kMaskValue);
  scratch.running_sum.assign(width, 0.0f);
  scratch.rescale.resize(width);
  scratch.starts.assign(width, 0);  // lanes past the run's rows, and empty tokens, see nothing
  scratch.ends.assign(width, 0);
  // Lane i * G + g's query row, as an offset from token first_token's first head of kv_head (padding lanes load none:
  // zeros).
  scratch.row_offsets.assign(width, 0);
  // The buffers' addresses, taken once: in a loop each use of the thread_local looks it up again, a call each time
  // (that had been 1-3% of a prompt's attention).
  float* q_t = scratch.q_t.data();
  float* out_rows = scratch.out.data();
  float* weights = scratch.weights.data();
  float* weight_pairs = scratch.weight_pairs.data();  // empty but for a bf16 or int8 pool (pairs)
  float* block_values = scratch.block_values.data();
  // An int8 pool's block (else empty): its keys' and values' integers as bf16, [block_slots][D] each, and the slots'
  // K scales, then their V scales.
  uint16_t* block_key_bits = scratch.block_key_bits.data();
  uint16_t* block_value_bits = scratch.block_value_bits.data();
  float* key_scales = scratch.block_scales.data();
  float* value_scales = key_scales + block_slots;
  float* block_max = scratch.block_max.data();  // [band lanes]: the block's largest score each
  float* running_max = scratch.running_max.data();
  float* running_sum = scratch.running_sum.data();
  float* rescales = scratch.rescale.data();
  int32_t* lane_starts = scratch.starts.data();
  int32_t* lane_ends = scratch.ends.data();
  int32_t* row_offsets = scratch.row_offsets.data();
  for (int64_t i = 0; i < count; ++i) {
    const TokenRange range = VisibleRange(positions[first_token + i], kv_lens[first_token + i], sliding_window);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lane = i * G + g;
      lane_starts[lane] = static_cast<int32_t>(range.start);
      lane_ends[lane] = static_cast<int32_t>(range.end);
      row_offsets[lane] = static_cast<int32_t>(i * s.num_q_heads * D + g * D);
    }
  }
  // q_t[d][lane] = the lane's q[d]; a bf16 pool's as [D / 2][width] pairs (dims 2k low, 2k + 1 high). kLanes lanes
  // by kLanes dims at a time, loaded as the rows lie and transposed.
  const float* q_base = q + (first_token * s.num_q_heads + kv_head * G) * D;
  for (int64_t v = 0; v < width; v += kLanes) {
    for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
      Vec dims[kLanes];  // lane v + j's q[d0 : d0 + kLanes] in dims[j]; after the transpose, q[d0 + j] of each lane
      for (int64_t j = 0; j < kLanes; ++j) {
        dims[j] = v + j < num_rows ? LoadVec(q_base + row_offsets[v + j] + d0) : Splat(0.0f);
      }
      TransposeLanes(dims);
      for (int64_t j = 0; j < kLanes; j += kPairs ? 2 : 1) {
        if constexpr (kPairs) {
          StoreVec(q_t + (d0 + j) / 2 * width + v, PackPairs(dims[j], dims[j + 1]));
        } else {
          StoreVec(q_t + (d0 + j) * width + v, dims[j]);
        }
      }
    }
  }
  const int32_t* table = RowTable(s, block_tables, row);
  // The run's lanes a band at a time, each band over every block of pages it sees: a band's queries, sums and weights
  // stay in the cache across the blocks (all 192 lanes of a 64-token run at once had 108 KiB of them per page).
  for (int64_t band = 0; band < width; band += kBandLanes) {
    const int64_t band_end = std::min(width, band + kBandLanes);
    int64_t run_start = std::numeric_limits<int64_t>::max(), run_end = 0;
    int64_t latest_start = 0, earliest_end = std::numeric_limits<int64_t>::max();  // over lanes that see anything
    for (int64_t lane = band; lane < band_end; ++lane) {
      const int64_t start = lane_starts[lane], end = lane_ends[lane];
      if (end > start) {
        run_start = std::min(run_start, start);
        run_end = std::max(run_end, end);
        latest_start = std::max(latest_start, start);
        earliest_end = std::min(earliest_end, end);
      }
    }
    // Blocks of block_slots positions, aligned to multiples of it whatever the band, so each lane's arithmetic is
    // the same in any run: slots outside [run_start, run_end) are seen by no lane of the band and are skipped.
    for (int64_t first = run_start - run_start % block_slots; first < run_end; first += block_slots) {
      const T* page_of_block[kBlockSlots];  // the block's pages, from the one holding `first`
      const uint32_t* scales_of_block[kBlockSlots];  // an int8 pool's: the words of kv_head's tokens in each
      for (int64_t page = 0; page < block_slots / P; ++page) {
        const int64_t page_id = first + page * P < run_end ? PageAt(s, table, first / P + page) : -1;
        page_of_block[page] = page_id >= 0 ? pages + page_id * P * s.row_width : nullptr;
        if constexpr (kInt8) scales_of_block[page] = page_id >= 0 ? scales.Head(s, page_id, kv_head) : nullptr;
      }
      // Slots some lane of the band sees, from an even position: all lie inside the sequence, so they hold written,
      // finite K and V. (Pairs of slots start at even positions whatever the band's first one: with a window a
      // lane's pairs would otherwise depend on the other lanes of its band.)
      const int64_t lo = (std::max(first, run_start) - first) & ~int64_t{1};
      const int64_t hi = std::min(first + block_slots, run_end) - first;
      // Lanes that see nothing, and padding lanes, compute on these finite values and are dropped at the end.
      const bool masked = latest_start > first + lo || earliest_end < first + hi;
      std::fill_n(block_max, band_end - band, kMaskValue);
      for (int64_t page = lo / P; page * P < hi; ++page) {
        const int64_t page_lo = std::max(lo, page * P) - page * P, page_hi = std::min(hi, (page + 1) * P) - page * P;
        if constexpr (kInt8) {
          uint16_t* keys = block_key_bits + page * P * D;  // [P][D], slots [page_lo, page_hi) filled
          for (int64_t slot = page_lo; slot < page_hi; ++slot) {
            IntegersAsBf16(page_of_block[page] + slot * s.row_width + 2 * kv_head * D, D, keys + slot * D);
            key_scales[page * P + slot] = ScaleOf(scales_of_block[page][slot], true);
            value_scales[page * P + slot] = ScaleOf(scales_of_block[page][slot], false);
          }
          ScoreSlots(q_t + band, static_cast<const uint16_t*>(keys), D, D, width, band_end - band, page_lo, page_hi,
                     weights + page * P * width + band, block_max, key_scales + page * P);
        } else {
          ScoreSlots(q_t + band, page_of_block[page] + 2 * kv_head * D, s.row_width, D, width,
                     band_end - band, page_lo, page_hi, weights + page * P * width + band, block_max, nullptr);
        }
      }
      for (int64_t v = band; v < band_end; v += kLanes) {
        const IntVec starts = LoadIntVec(lane_starts + v), ends = LoadIntVec(lane_ends + v);
        const Vec old_max = LoadVec(running_max + v);
        // Every lane sees every slot of an unmasked block, so its max is the scores' (ScoreSlots took it); a masked
        // block's scores that a lane does not see become kMaskValue first.
        Vec new_max = old_max;
        if (!masked) {
          new_max = Max(old_max, LoadVec(block_max + v - band));
        } else {
          for (int64_t slot = lo; slot < hi; ++slot) {
            const IntVec position = IntVec{} + static_cast<int32_t>(first + slot);
            const Vec score = LoadVec(weights + slot * width + v);
            const Vec seen = (position >= starts) & (position < ends) ? score : Splat(kMaskValue);
            StoreVec(weights + slot * width + v, seen);
            new_max = Max(new_max, seen);
          }
        }
        const Vec rescale = kPairs ? ExpForBf16(old_max - new_max) : Exp(old_max - new_max);
        Vec sum = LoadVec(running_sum + v) * rescale;
        auto weight_of = [&](int64_t slot) {  // the slot's softmax weight for lanes [v, v + kLanes)
          const Vec score = LoadVec(weights + slot * width + v);
          const Vec weight = kPairs ? ExpForBf16(score - new_max) : Exp(score - new_max);
          if (!masked) return weight;
          const IntVec position = IntVec{} + static_cast<int32_t>(first + slot);
          return (position >= starts) & (position < ends) ? weight : Splat(0.0f);
        };
        if constexpr (kPairs) {  // slots (lo, lo + 1), (lo + 2, lo + 3) ... as bf16 pairs, an odd last one with a 0
          for (int64_t slot = lo; slot < hi; slot += 2) {
            Vec low = weight_of(slot), high = slot + 1 < hi ? weight_of(slot + 1) : Splat(0.0f);
            sum += low;
            sum += high;
            if constexpr (kInt8) {  // the values' scales, after the sum
              low *= Splat(value_scales[slot]);
              high *= Splat(slot + 1 < hi ? value_scales[slot + 1] : 0.0f);
            }
            StoreVec(weight_pairs + (slot - lo) / 2 * width + v, PackPairs(low, high));
          }
        } else {
          for (int64_t slot = lo; slot < hi; ++slot) {
            const Vec weight = weight_of(slot);
            StoreVec(weights + slot * width + v, weight);
            sum += weight;
          }
        }
        StoreVec(running_max + v, new_max);
        StoreVec(running_sum + v, sum);
        StoreVec(rescales + v, rescale);
      }
      // The block's values, [hi - lo][D] (or [(hi - lo + 1) / 2][D] bf16 pairs), from its pages' rows.
      auto pool_value_row = [&](int64_t slot) {
        return page_of_block[slot / P] + (slot % P) * s.row_width + (2 * kv_head + 1) * D;
      };
      auto value_row = [&](int64_t slot) -> const PairT* {
        if constexpr (kInt8) {
          return block_value_bits + slot * D;
        } else {
          return pool_value_row(slot);
        }
      };
      if constexpr (kInt8) {
        for (int64_t slot = lo; slot < hi; ++slot) IntegersAsBf16(pool_value_row(slot), D, block_value_bits + slot * D);
      }
      if constexpr (kPairs) {
        for (int64_t slot = lo; slot < hi; slot += 2) {  // an odd last slot pairs with itself, under a weight of zero
          const PairT* first_row = value_row(slot);
          const PairT* second_row = slot + 1 < hi ? value_row(slot + 1) : first_row;
          float* pair_row = block_values + (slot - lo) / 2 * D;
          int64_t c = 0;
          for (; c + 2 <= D / kLanes; c += 2) {
            Vec two[2];
            InterleaveRows<2>(first_row + c * kLanes, second_row + c * kLanes, two);
            StoreVec(pair_row + c * kLanes, two[0]);
            StoreVec(pair_row + (c + 1) * kLanes, two[1]);
          }
          for (; c < D / kLanes; ++c) {
            Vec one[1];
            InterleaveRows<1>(first_row + c * kLanes, second_row + c * kLanes, one);
            StoreVec(pair_row + c * kLanes, one[0]);
          }
        }
        AccumulateValues<true>(weight_pairs, block_values, D, width, band, band_end, (hi - lo + 1) / 2,
                               rescales, out_rows);
      } else {
        for (int64_t slot = lo; slot < hi; ++slot) std::copy_n(value_row(slot), D, block_values + (slot - lo) * D);
        AccumulateValues<false>(weights + lo * width, block_values, D, width, band, band_end, hi - lo,
                                rescales, out_rows);
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    float* out_heads = out + ((first_token + i) * s.num_q_heads + kv_head * G) * D;  // [G, D]
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lane = i * G + g;
      if (lane_ends[lane] <= lane_starts[lane]) {  // padding, or nothing visible: zeros
        std::fill(out_heads + g * D, out_heads + (g + 1) * D, 0.0f);
        continue;
      }
      const Vec inverse = Splat(1.0f / std::max(running_sum[lane], 1e-30f));
      for (int64_t d = 0; d < D; d += kLanes) {
        StoreVec(out_heads + g * D + d, LoadVec(out_rows + lane * D + d) * inverse);
      }
    }
  }
}

#endif  // PAXKV_CPU_PAGED_ATTENTION_TILED_H_
