// Part of cpu_paged_attention.cc (included inside its anonymous namespace, after Shapes, LoadValue, VisibleRange
// and the vector helpers, never on its own): the tiled path that prefill chunks take.

#ifndef PAXKV_CPU_PAGED_ATTENTION_TILED_H_
#define PAXKV_CPU_PAGED_ATTENTION_TILED_H_

// Runs of at least this many tokens take the tiled path; runs are cut every kMaxTiledRunTokens tokens there.
constexpr int64_t kMinTiledRunTokens = 8;
constexpr int64_t kMaxTiledRunTokens = 64;

// The register tile: kTileSlots keys (or output dims) by kTileVecs vectors of query rows, sized to the register
// file: with AVX-512 (32 registers of 16 lanes) 8 x 3 = 24 accumulators; with AVX2 (16 registers of 8 lanes) 4 x 2
// for the values, and 6 x 2 for the scores (kScoreTileSlots: twelve chains of multiply-adds hide their latency, where
// eight left a 2048-token prompt's attention at 74 ms a layer on SmolLM2's heads, against 64; the value tile has no
// 6-row form, as head_dim is rarely a multiple of 6, and 4 dims x 3 vectors spilled).
// (8 x 3 tiles of 16-lane vectors, two AVX2 registers each, spilled every accumulator to the stack there: a
// 128-token prompt's attention took 5.7 ms a layer on SmolLM2's heads, against 0.56 ms with these.)
#if defined(__AVX512F__)
constexpr int64_t kTileSlots = 8;
constexpr int64_t kTileVecs = 3;
constexpr int64_t kScoreTileSlots = 8;
#else
constexpr int64_t kTileSlots = 4;
constexpr int64_t kTileVecs = 2;
constexpr int64_t kScoreTileSlots = 6;
#endif

// One work item's buffers, kept per thread: rows across lanes, `width` lanes per row of each.
struct TiledScratch {
  std::vector<float> q_t, out_t, weights, running_max, running_sum, rescale;
  std::vector<int32_t> starts, ends;
};

// Scores of the run's rows against the page's slots [lo, hi), into weights[slot][lane].
template <typename T>
void ScoreSlots(const float* q_t, const T* keys, int64_t row_width, int64_t D, int64_t width, int64_t lo, int64_t hi,
                float* weights) {
  for (int64_t v0 = 0; v0 < width; v0 += kTileVecs * kLanes) {
    for (int64_t s0 = lo; s0 < hi; s0 += kScoreTileSlots) {
      const T* key_rows[kScoreTileSlots];
      for (int64_t j = 0; j < kScoreTileSlots; ++j) key_rows[j] = keys + std::min(s0 + j, hi - 1) * row_width;
      Vec acc[kScoreTileSlots][kTileVecs] = {};
      for (int64_t d = 0; d < D; ++d) {
        Vec q_vecs[kTileVecs];
#pragma GCC unroll 3
        for (int64_t c = 0; c < kTileVecs; ++c) q_vecs[c] = LoadVec(q_t + d * width + v0 + c * kLanes);
#pragma GCC unroll 8
        for (int64_t j = 0; j < kScoreTileSlots; ++j) {
          const Vec key = Splat(LoadValue(key_rows[j] + d));
#pragma GCC unroll 3
          for (int64_t c = 0; c < kTileVecs; ++c) acc[j][c] += key * q_vecs[c];
        }
      }
      for (int64_t j = 0; j < kScoreTileSlots && s0 + j < hi; ++j) {
        for (int64_t c = 0; c < kTileVecs; ++c) StoreVec(weights + (s0 + j) * width + v0 + c * kLanes, acc[j][c]);
      }
    }
  }
}

// out_t[d][lane] += sum over slots [lo, hi) of weights[slot][lane] * value[slot][d].
template <typename T>
void AccumulateValues(const float* weights, const T* values, int64_t row_width, int64_t D, int64_t width, int64_t lo,
                      int64_t hi, float* out_t) {
  for (int64_t d0 = 0; d0 < D; d0 += kTileSlots) {
    for (int64_t v0 = 0; v0 < width; v0 += kTileVecs * kLanes) {
      Vec acc[kTileSlots][kTileVecs];
      for (int64_t j = 0; j < kTileSlots; ++j) {
        for (int64_t c = 0; c < kTileVecs; ++c) acc[j][c] = LoadVec(out_t + (d0 + j) * width + v0 + c * kLanes);
      }
      for (int64_t slot = lo; slot < hi; ++slot) {
        Vec w[kTileVecs];
#pragma GCC unroll 3
        for (int64_t c = 0; c < kTileVecs; ++c) w[c] = LoadVec(weights + slot * width + v0 + c * kLanes);
        const T* value = values + slot * row_width + d0;
#pragma GCC unroll 8
        for (int64_t j = 0; j < kTileSlots; ++j) {
          const Vec element = Splat(LoadValue(value + j));
#pragma GCC unroll 3
          for (int64_t c = 0; c < kTileVecs; ++c) acc[j][c] += element * w[c];
        }
      }
      for (int64_t j = 0; j < kTileSlots; ++j) {
        for (int64_t c = 0; c < kTileVecs; ++c) StoreVec(out_t + (d0 + j) * width + v0 + c * kLanes, acc[j][c]);
      }
    }
  }
}

// AttendRun's contract for a run of kMinTiledRunTokens to kMaxTiledRunTokens tokens, without a soft cap, and
// head_dim a multiple of kTileSlots. Row r = i * G + g of the run is lane r of every [.][width] buffer.
template <typename T>
void AttendRunTiled(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables, int64_t first_token,
                    int64_t count, int64_t kv_head, int32_t row, const int32_t* positions, const int32_t* kv_lens,
                    int64_t sliding_window, float* out) {
  const int64_t G = s.group, D = s.head_dim, P = s.page_size, num_rows = count * G;
  const int64_t tile_rows = kTileVecs * kLanes, width = (num_rows + tile_rows - 1) / tile_rows * tile_rows;
  thread_local TiledScratch scratch;
  scratch.q_t.assign(D * width, 0.0f);
  scratch.out_t.assign(D * width, 0.0f);
  scratch.weights.resize(P * width);
  scratch.running_max.assign(width, kMaskValue);
  scratch.running_sum.assign(width, 0.0f);
  scratch.rescale.resize(width);
  scratch.starts.assign(width, 0);  // lanes past the run's rows, and empty tokens, see nothing
  scratch.ends.assign(width, 0);
  int64_t run_start = std::numeric_limits<int64_t>::max(), run_end = 0;
  int64_t latest_start = 0, earliest_end = std::numeric_limits<int64_t>::max();  // over tokens that see anything
  for (int64_t i = 0; i < count; ++i) {
    const TokenRange range = VisibleRange(positions[first_token + i], kv_lens[first_token + i], sliding_window);
    if (range.end > range.start) {
      run_start = std::min(run_start, range.start);
      run_end = std::max(run_end, range.end);
      latest_start = std::max(latest_start, range.start);
      earliest_end = std::min(earliest_end, range.end);
    }
    const float* q_heads = q + ((first_token + i) * s.num_q_heads + kv_head * G) * D;  // [G, D]
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lane = i * G + g;
      scratch.starts[lane] = static_cast<int32_t>(range.start);
      scratch.ends[lane] = static_cast<int32_t>(range.end);
      for (int64_t d = 0; d < D; ++d) scratch.q_t[d * width + lane] = q_heads[g * D + d];
    }
  }
  const int32_t* table = RowTable(s, block_tables, row);
  float* weights = scratch.weights.data();
  for (int64_t first = run_start - run_start % P; first < run_end; first += P) {
    const int64_t page_id = PageAt(s, table, first / P);
    const T* page = pages + page_id * P * s.row_width;
    // Slots some token of the run sees: all lie inside the sequence, so they hold written, finite K and V.
    const int64_t lo = std::max(first, run_start) - first, hi = std::min(first + P, run_end) - first;
    // Lanes of tokens that see nothing, and padding lanes, compute on these finite values and are dropped at the end.
    const bool masked = latest_start > first + lo || earliest_end < first + hi;
    ScoreSlots(scratch.q_t.data(), page + 2 * kv_head * D, s.row_width, D, width, lo, hi, weights);
    for (int64_t v = 0; v < width; v += kLanes) {
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
      for (int64_t slot = lo; slot < hi; ++slot) {
        Vec weight = Exp(LoadVec(weights + slot * width + v) - new_max);
        if (masked) {
          const IntVec position = IntVec{} + static_cast<int32_t>(first + slot);
          weight = (position >= starts) & (position < ends) ? weight : Splat(0.0f);
        }
        StoreVec(weights + slot * width + v, weight);
        sum += weight;
      }
      StoreVec(scratch.running_max.data() + v, new_max);
      StoreVec(scratch.running_sum.data() + v, sum);
      StoreVec(scratch.rescale.data() + v, rescale);
    }
    for (int64_t d = 0; d < D; ++d) {
      float* out_row = scratch.out_t.data() + d * width;
      for (int64_t v = 0; v < width; v += kLanes) {
        StoreVec(out_row + v, LoadVec(out_row + v) * LoadVec(scratch.rescale.data() + v));
      }
    }
    AccumulateValues(weights, page + (2 * kv_head + 1) * D, s.row_width, D, width, lo, hi, scratch.out_t.data());
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
      for (int64_t d = 0; d < D; ++d) out_heads[g * D + d] = scratch.out_t[d * width + lane] * inverse;
    }
  }
}

#endif  // PAXKV_CPU_PAGED_ATTENTION_TILED_H_
