// Part of cpu_paged_attention.cc (included inside its anonymous namespace, after Shapes, LoadValue, VisibleRange
// and the vector helpers, never on its own): the tiled path that prefill chunks take.

#ifndef PAXKV_CPU_PAGED_ATTENTION_TILED_H_
#define PAXKV_CPU_PAGED_ATTENTION_TILED_H_

// Runs of at least this many tokens take the tiled path; runs are cut every kMaxTiledRunTokens tokens there.
constexpr int64_t kMinTiledRunTokens = 8;
constexpr int64_t kMaxTiledRunTokens = 64;

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
  std::vector<float> q_t, out, weights, weight_pairs, running_max, running_sum, rescale;
  std::vector<int32_t> starts, ends;
};

// A bf16 pool's tiles multiply bf16 pairs (DotPairs: VDPBF16PS on AVX-512 BF16): the queries are rounded to bf16
// once per run, as pairs of adjacent head dims, and each page's softmax weights are rounded to bf16 as pairs of
// adjacent slots (PackPairs, InterleaveRows). Products are exact and every sum is f32, as in a bf16 MXU or
// tensor-core matmul; the rounding is the only change from f32 arithmetic on the same stored keys and values, and
// halves the multiply-adds.

// Scores of lanes [0, lanes) (a multiple of kScoreVecs * kLanes) against the page's slots [lo, hi), into
// weights[slot][lane]; q_t and weights hold `width` lanes per row.
// A bf16 pool's q_t holds [D / 2][width] pairs of head dims (2k low, 2k + 1 high), and its keys are taken a pair at a
// time as they lie in the page.
template <typename T>
void ScoreSlots(const float* q_t, const T* keys, int64_t row_width, int64_t D, int64_t width, int64_t lanes,
                int64_t lo, int64_t hi, float* weights) {
  constexpr bool kPairs = std::is_same_v<T, uint16_t>;
  for (int64_t v0 = 0; v0 < lanes; v0 += kScoreVecs * kLanes) {
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
      for (int64_t j = 0; j < kScoreTileSlots && s0 + j < hi; ++j) {
        for (int64_t c = 0; c < kScoreVecs; ++c) StoreVec(weights + (s0 + j) * width + v0 + c * kLanes, acc[j][c]);
      }
    }
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

// Lanes of a run that go through its pages together (whole score tiles and value tiles).
constexpr int64_t kBandLanes = 48;
static_assert(kBandLanes % (kScoreVecs * kLanes) == 0 && kBandLanes % kValueRows == 0, "a band is whole tiles");

// out[r0 + i][d0 : d0 + kVecs * kLanes] = out[...] * rescale[r0 + i] + sum over slots [lo, hi) of
// weights[slot][r0 + i] * value[slot][d0 : ...] for i < kRows (the online softmax's rescale folded in).
template <int64_t kRows, int64_t kVecs, typename T>
inline void ValueTile(const float* weights, const T* values, int64_t row_width, int64_t D, int64_t width, int64_t lo,
                      int64_t hi, const float* rescale, int64_t r0, int64_t d0, float* out) {
  Vec acc[kRows][kVecs];
  for (int64_t i = 0; i < kRows; ++i) {
    const Vec factor = Splat(rescale[r0 + i]);
    for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = LoadVec(out + (r0 + i) * D + d0 + c * kLanes) * factor;
  }
  if constexpr (std::is_same_v<T, uint16_t>) {  // weights: [(hi - lo + 1) / 2][width] pairs of slots
    for (int64_t slot = lo; slot < hi; slot += 2) {
      const uint16_t* first = values + slot * row_width + d0;
      Vec value[kVecs];  // an odd last slot pairs with itself, under a weight of zero
      InterleaveRows<kVecs>(first, slot + 1 < hi ? first + row_width : first, value);
      const float* weight = weights + (slot - lo) / 2 * width + r0;
#pragma GCC unroll 6
      for (int64_t i = 0; i < kRows; ++i) {
        const Vec w = SplatBits(weight + i);
        for (int64_t c = 0; c < kVecs; ++c) acc[i][c] = DotPairs(acc[i][c], w, value[c]);
      }
    }
  } else {
    for (int64_t slot = lo; slot < hi; ++slot) {
      Vec value[kVecs];
      for (int64_t c = 0; c < kVecs; ++c) value[c] = LoadValues(values + slot * row_width + d0 + c * kLanes);
      const float* weight = weights + slot * width + r0;
#pragma GCC unroll 6
      for (int64_t i = 0; i < kRows; ++i) {
        const Vec w = Splat(weight[i]);
        for (int64_t c = 0; c < kVecs; ++c) acc[i][c] += w * value[c];
      }
    }
  }
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t c = 0; c < kVecs; ++c) StoreVec(out + (r0 + i) * D + d0 + c * kLanes, acc[i][c]);
  }
}

// ValueTile for the `rows` (< kValueRows) rows left after the full tiles, in one tile of that height.
template <int64_t kRows, int64_t kVecs, typename T>
inline void ValueRestTile(int64_t rows, const float* weights, const T* values, int64_t row_width, int64_t D,
                          int64_t width, int64_t lo, int64_t hi, const float* rescale, int64_t r0, int64_t d0,
                          float* out) {
  if constexpr (kRows > 0) {
    if (rows == kRows) {
      return ValueTile<kRows, kVecs>(weights, values, row_width, D, width, lo, hi, rescale, r0, d0, out);
    }
    ValueRestTile<kRows - 1, kVecs>(rows, weights, values, row_width, D, width, lo, hi, rescale, r0, d0, out);
  }
}

// out[row][d] = out[row][d] * rescale[row] + sum over slots [lo, hi) of weights[slot][row] * value[slot][d], for
// rows [first_row, end_row), d in one band of kVecs vectors from d0.
template <int64_t kVecs, typename T>
void AccumulateValueVecs(const float* weights, const T* values, int64_t row_width, int64_t D, int64_t width,
                         int64_t first_row, int64_t end_row, int64_t lo, int64_t hi, const float* rescale, int64_t d0,
                         float* out) {
  int64_t r0 = first_row;
  for (; r0 + kValueRows <= end_row; r0 += kValueRows) {
    ValueTile<kValueRows, kVecs>(weights, values, row_width, D, width, lo, hi, rescale, r0, d0, out);
  }
  ValueRestTile<kValueRows - 1, kVecs>(end_row - r0, weights, values, row_width, D, width, lo, hi, rescale, r0, d0,
                                       out);
}

// AccumulateValueVecs over every d (D a multiple of kLanes).
template <typename T>
void AccumulateValues(const float* weights, const T* values, int64_t row_width, int64_t D, int64_t width,
                      int64_t first_row, int64_t end_row, int64_t lo, int64_t hi, const float* rescale, float* out) {
  int64_t d0 = 0;
  for (; d0 + kValueVecs * kLanes <= D; d0 += kValueVecs * kLanes) {
    AccumulateValueVecs<kValueVecs>(weights, values, row_width, D, width, first_row, end_row, lo, hi, rescale, d0,
                                    out);
  }
  for (; d0 < D; d0 += kLanes) {  // the vectors left, one at a time
    AccumulateValueVecs<1>(weights, values, row_width, D, width, first_row, end_row, lo, hi, rescale, d0, out);
  }
}

// AttendRun's contract for a run of kMinTiledRunTokens to kMaxTiledRunTokens tokens, without a soft cap, and
// head_dim a multiple of kLanes. Row r = i * G + g of the run is lane r of every [.][width] buffer, and row r of
// out[width][D].
template <typename T>
void AttendRunTiled(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables, int64_t first_token,
                    int64_t count, int64_t kv_head, int32_t row, const int32_t* positions, const int32_t* kv_lens,
                    int64_t sliding_window, float* out) {
  constexpr bool kPairs = std::is_same_v<T, uint16_t>;
  const int64_t G = s.group, D = s.head_dim, P = s.page_size, num_rows = count * G;
  const int64_t tile_rows = kScoreVecs * kLanes, width = (num_rows + tile_rows - 1) / tile_rows * tile_rows;
  thread_local TiledScratch scratch;
  scratch.q_t.assign(D * width, 0.0f);
  scratch.out.assign(width * D, 0.0f);
  scratch.weights.resize(P * width);
  if constexpr (kPairs) scratch.weight_pairs.resize((P + 1) / 2 * width);
  scratch.running_max.assign(width, kMaskValue);
  scratch.running_sum.assign(width, 0.0f);
  scratch.rescale.resize(width);
  scratch.starts.assign(width, 0);  // lanes past the run's rows, and empty tokens, see nothing
  scratch.ends.assign(width, 0);
  for (int64_t i = 0; i < count; ++i) {
    const TokenRange range = VisibleRange(positions[first_token + i], kv_lens[first_token + i], sliding_window);
    const float* q_heads = q + ((first_token + i) * s.num_q_heads + kv_head * G) * D;  // [G, D]
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lane = i * G + g;
      scratch.starts[lane] = static_cast<int32_t>(range.start);
      scratch.ends[lane] = static_cast<int32_t>(range.end);
      for (int64_t d = 0; d < D; ++d) scratch.q_t[d * width + lane] = q_heads[g * D + d];
    }
  }
  if constexpr (kPairs) {  // [D, width] f32 to [D / 2, width] pairs, in place (row k is written after rows 2k, 2k + 1)
    for (int64_t k = 0; k < D / 2; ++k) {
      for (int64_t v = 0; v < width; v += kLanes) {
        const Vec low = LoadVec(&scratch.q_t[2 * k * width + v]), high = LoadVec(&scratch.q_t[(2 * k + 1) * width + v]);
        StoreVec(&scratch.q_t[k * width + v], PackPairs(low, high));
      }
    }
  }
  const int32_t* table = RowTable(s, block_tables, row);
  float* weights = scratch.weights.data();
  float* weight_pairs = scratch.weight_pairs.data();  // empty but for a bf16 pool
  // The run's lanes a band at a time, each band over every page it sees: a band's queries, sums and weights stay in
  // the first-level cache across the pages (all 192 lanes of a 64-token run at once had 108 KiB of them per page).
  for (int64_t band = 0; band < width; band += kBandLanes) {
    const int64_t band_end = std::min(width, band + kBandLanes);
    int64_t run_start = std::numeric_limits<int64_t>::max(), run_end = 0;
    int64_t latest_start = 0, earliest_end = std::numeric_limits<int64_t>::max();  // over lanes that see anything
    for (int64_t lane = band; lane < band_end; ++lane) {
      const int64_t start = scratch.starts[lane], end = scratch.ends[lane];
      if (end > start) {
        run_start = std::min(run_start, start);
        run_end = std::max(run_end, end);
        latest_start = std::max(latest_start, start);
        earliest_end = std::min(earliest_end, end);
      }
    }
    for (int64_t first = run_start - run_start % P; first < run_end; first += P) {
      const int64_t page_id = PageAt(s, table, first / P);
      const T* page = pages + page_id * P * s.row_width;
      // Slots some lane of the band sees: all lie inside the sequence, so they hold written, finite K and V.
      const int64_t lo = std::max(first, run_start) - first, hi = std::min(first + P, run_end) - first;
      // Lanes that see nothing, and padding lanes, compute on these finite values and are dropped at the end.
      const bool masked = latest_start > first + lo || earliest_end < first + hi;
      ScoreSlots(scratch.q_t.data() + band, page + 2 * kv_head * D, s.row_width, D, width, band_end - band, lo, hi,
                 weights + band);
      for (int64_t v = band; v < band_end; v += kLanes) {
        const IntVec starts = LoadIntVec(scratch.starts.data() + v), ends = LoadIntVec(scratch.ends.data() + v);
        const Vec old_max = LoadVec(scratch.running_max.data() + v);
        Vec new_max = old_max;
        for (int64_t slot = lo; slot < hi; ++slot) {
          Vec score = LoadVec(weights + slot * width + v);
          if (masked) {
            const IntVec position = IntVec{} + static_cast<int32_t>(first + slot);
            score = (position >= starts) & (position < ends) ? score : Splat(kMaskValue);
            StoreVec(weights + slot * width + v, score);
          }
          new_max = Max(new_max, score);
        }
        const Vec rescale = Exp(old_max - new_max);
        Vec sum = LoadVec(scratch.running_sum.data() + v) * rescale;
        auto weight_of = [&](int64_t slot) {  // the slot's softmax weight for lanes [v, v + kLanes)
          const Vec weight = Exp(LoadVec(weights + slot * width + v) - new_max);
          if (!masked) return weight;
          const IntVec position = IntVec{} + static_cast<int32_t>(first + slot);
          return (position >= starts) & (position < ends) ? weight : Splat(0.0f);
        };
        if constexpr (kPairs) {  // slots (lo, lo + 1), (lo + 2, lo + 3) ... as bf16 pairs, an odd last one with a 0
          for (int64_t slot = lo; slot < hi; slot += 2) {
            const Vec low = weight_of(slot), high = slot + 1 < hi ? weight_of(slot + 1) : Splat(0.0f);
            sum += low;
            sum += high;
            StoreVec(weight_pairs + (slot - lo) / 2 * width + v, PackPairs(low, high));
          }
        } else {
          for (int64_t slot = lo; slot < hi; ++slot) {
            const Vec weight = weight_of(slot);
            StoreVec(weights + slot * width + v, weight);
            sum += weight;
          }
        }
        StoreVec(scratch.running_max.data() + v, new_max);
        StoreVec(scratch.running_sum.data() + v, sum);
        StoreVec(scratch.rescale.data() + v, rescale);
      }
      const float* value_weights = kPairs ? weight_pairs : weights;
      AccumulateValues(value_weights, page + (2 * kv_head + 1) * D, s.row_width, D, width, band, band_end, lo, hi,
                       scratch.rescale.data(), scratch.out.data());
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    float* out_heads = out + ((first_token + i) * s.num_q_heads + kv_head * G) * D;  // [G, D]
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lane = i * G + g;
      if (scratch.ends[lane] <= scratch.starts[lane]) {  // padding, or nothing visible: zeros
        std::fill(out_heads + g * D, out_heads + (g + 1) * D, 0.0f);
        continue;
      }
      const float inverse = 1.0f / std::max(scratch.running_sum[lane], 1e-30f);
      for (int64_t d = 0; d < D; ++d) out_heads[g * D + d] = scratch.out[lane * D + d] * inverse;
    }
  }
}

#endif  // PAXKV_CPU_PAGED_ATTENTION_TILED_H_
