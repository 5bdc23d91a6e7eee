// Part of cpu_paged_attention.cc (included inside its anonymous namespace, after Shapes, VisibleRange, kMaxRunTokens
// and the vector helpers, never on its own): the path that short runs (decode tokens, a token and its drafts) take
// when head_dim is 32, 64 or 128.
//
// A page's slots lie across SIMD lanes, kLanes at a time: each query row's scores against those slots are one
// vector (its dot products with the keys, summed by a butterfly across the lanes), so the softmax's maximum,
// exponentials and sum are vector operations, and the value update keeps the row's output in registers while it
// walks the slots. The softmax is updated once per 16 slots (kSlotSpan). The query heads of one token that share a
// KV head go through a span together, up to MaxSpanRows at a time, each value row loaded once for all of them;
// each row's arithmetic never depends on the other rows of its run. Over a bf16 pool the products are bf16 pairs, as
// on the tiled path (see cpu_paged_attention.cc).

#ifndef PAXKV_CPU_PAGED_ATTENTION_LANES_H_
#define PAXKV_CPU_PAGED_ATTENTION_LANES_H_

// Slot s's lane index, for the visibility mask.
inline IntVec LaneIndices() {
  IntVec lanes;
  for (int j = 0; j < kLanes; ++j) lanes[j] = j;
  return lanes;
}

// Slots per softmax update: 16 (two vectors of scores on AVX2, one on AVX-512), so that the update's serial part
// (the horizontal maximum and sum, the rescale's exponential) is paid once per 16 slots, not per 8.
constexpr int64_t kSlotVecs = kLanes >= 16 ? 1 : 16 / kLanes;
constexpr int64_t kSlotSpan = kSlotVecs * kLanes;

// Whether a bf16 pool's scores take two slots a vector (AVX-512, see AttendSlotSpan). Its queries are then held with
// each 256-bit half of their pairs twice over: [D / 16][the half's 8 pairs, the same 8 pairs], D floats of bits.
template <typename T>
constexpr bool kJoinedSlots = std::is_same_v<T, uint16_t> && kLanes == 16;

// Floats (or bf16 pairs' bits in f32 slots) a query row takes in q_rows: D, D / 2 pairs, or with kJoinedSlots D.
template <typename T>
constexpr int64_t QueryWidth(int64_t D) {
  return std::is_same_v<T, uint16_t> && !kJoinedSlots<T> ? D / 2 : D;
}

// kRows query rows of one token (query heads sharing a KV head, so the same slots [lo, hi) visible) against slots
// [chunk, chunk + n) of a page (n <= kSlotSpan): updates each row's running maximum, sum and output accumulator
// acc[r][kChunks * kLanes] (online softmax). The rows are independent chains worked side by side, and each value row
// is loaded once for all of them: one row at a time, the value update was a chain of 16 dependent FMAs per vector.
//
// Over a bf16 pool the products are of bf16 pairs (DotPairs), as on the tiled path: q_rows hold the queries as pairs
// of adjacent head dims (kChunks / 2 vectors), and the weights are rounded to bf16 in pairs of adjacent slots.
// With AVX-512 (kJoinedSlots) a score vector holds two slots: a 256-bit half of slot 2k's key pairs beside the same
// half of slot 2k + 1's (JoinHalves), multiplied by that half of the query twice over, puts each slot's products in
// its own 8 lanes, so the butterfly starts a level in (SumEachLaneOfHalves). That saves its first level, two shuffles
// and an add per row and slot pair, for one join per half and slot pair, made once for all the rows.
//
// next_rows, unless null, is this KV head's first row in the same slots of the row's next page: as each value row is
// read, the same slot's K and V rows there are prefetched (PrefetchSlotRows).
//
// scales, for an int8 pool, are the span's K scales [kSlotSpan] and then its V scales [kSlotSpan] (else null): a
// score is the key's integer dot product times its K scale, and a weight is multiplied by its V scale before it
// meets the value's integers (the softmax sum takes the weight as it was).
template <int kChunks, int kRows, typename T>
inline void AttendSlotSpan(const float* const (&q_rows)[kRows], const T* keys, const T* values, int64_t row_width,
                           int64_t n, int64_t lo, int64_t hi, float soft_cap, float* running_max, float* running_sum,
                           float* const (&acc)[kRows], const T* next_rows, const float* scales) {
  constexpr bool kPairs = std::is_same_v<T, uint16_t>;
  constexpr int kQueryVecs = kPairs ? kChunks / 2 : kChunks;
  Vec scores[kRows][kSlotVecs];
  if constexpr (kJoinedSlots<T>) {
    constexpr int kHalves = kChunks * kLanes / 16;  // 256-bit halves of a key's pairs
    Vec partial[kRows][kSlotSpan / 2];              // [r][k]: lanes 0-7 slot 2k's, 8-15 slot 2k + 1's
#pragma GCC unroll 8
    for (int64_t k = 0; k < kSlotSpan / 2; ++k) {  // slots past n repeat slot n - 1, and are masked below
      const T* first = keys + std::min<int64_t>(2 * k, n - 1) * row_width;
      const T* second = keys + std::min<int64_t>(2 * k + 1, n - 1) * row_width;
      Vec joined[kHalves];
#pragma GCC unroll 8
      for (int h = 0; h < kHalves; ++h) joined[h] = JoinHalves(first + 16 * h, second + 16 * h);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        Vec dot = {};
#pragma GCC unroll 8
        for (int h = 0; h < kHalves; ++h) dot = DotPairs(dot, joined[h], LoadVec(q_rows[r] + h * kLanes));
        partial[r][k] = dot;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) scores[r][0] = SumEachLaneOfHalves(partial[r]);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    // Each key's integers widened once for all the rows (slot by slot: its vectors, then each row's dot product),
    // where the loop below, a row at a time, would widen them once per row.
    Vec q[kRows][kChunks];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) q[r][c] = LoadVec(q_rows[r] + c * kLanes);
    }
    Vec partial[kRows][kSlotSpan];
#pragma GCC unroll 16
    for (int64_t j = 0; j < kSlotSpan; ++j) {
      Vec key[kChunks];
      if (j < n) {
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) key[c] = LoadValues(keys + j * row_width + c * kLanes);
      }
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        Vec dot = {};
        if (j < n) {
#pragma GCC unroll 16
          for (int c = 0; c < kChunks; ++c) dot += q[r][c] * key[c];
        }
        partial[r][j] = dot;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      for (int64_t b = 0; b < kSlotVecs; ++b) {
        scores[r][b] = SumEachLane(partial[r] + b * kLanes) * LoadVec(scales + b * kLanes);
      }
    }
  } else {
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      Vec q[kQueryVecs];
#pragma GCC unroll 16
      for (int c = 0; c < kQueryVecs; ++c) q[c] = LoadVec(q_rows[r] + c * kLanes);
#pragma GCC unroll 4
      for (int64_t b = 0; b < kSlotVecs; ++b) {
        Vec partial[kLanes];
#pragma GCC unroll 16
        for (int64_t j = 0; j < kLanes; ++j) {
          Vec dot = {};
          if (b * kLanes + j < n) {
            const T* key = keys + (b * kLanes + j) * row_width;
            if constexpr (kPairs) {
              const Bf16Pair* key_pairs = reinterpret_cast<const Bf16Pair*>(key);
#pragma GCC unroll 8
              for (int c = 0; c < kQueryVecs; ++c) dot = DotPairs(dot, q[c], LoadValues(key_pairs + c * kLanes));
            } else {
#pragma GCC unroll 16
              for (int c = 0; c < kChunks; ++c) dot += q[c] * LoadValues(key + c * kLanes);
            }
          }
          partial[j] = dot;
        }
        scores[r][b] = SumEachLane(partial);  // lane j: slot b * kLanes + j's score
      }
    }
  }
  const IntVec lanes = LaneIndices();
  IntVec visible[kSlotVecs];
  for (int64_t b = 0; b < kSlotVecs; ++b) {
    const IntVec slot = lanes + static_cast<int32_t>(b * kLanes);
    visible[b] = (slot >= static_cast<int32_t>(lo)) & (slot < static_cast<int32_t>(hi));
  }
  alignas(64) float weight[kRows][kSlotSpan];
  float rescale[kRows];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    Vec block_max = Splat(kMaskValue);
    for (int64_t b = 0; b < kSlotVecs; ++b) {
      if (soft_cap > 0.0f) {
        for (int j = 0; j < kLanes; ++j) scores[r][b][j] = soft_cap * std::tanh(scores[r][b][j] / soft_cap);
      }
      // A select: garbage in unused slots never reaches the sums.
      scores[r][b] = visible[b] ? scores[r][b] : Splat(kMaskValue);
      block_max = Max(block_max, scores[r][b]);
    }
    // The maximum moves only where a score passes it. Where none does, the rescale is exp(0) = 1 exactly, so the
    // horizontal maximum and the exponential are skipped without changing a bit.
    float new_max = running_max[r];
    rescale[r] = 1.0f;
    if (AnyAbove(block_max, new_max)) {
      new_max = HorizontalMax(block_max);
      rescale[r] = std::exp(running_max[r] - new_max);
    }
    Vec total = {};
    for (int64_t b = 0; b < kSlotVecs; ++b) {
      Vec weights = Exp(scores[r][b] - Splat(new_max));
      weights = visible[b] ? weights : Vec{};
      total += weights;
      if constexpr (std::is_same_v<T, int8_t>) weights *= LoadVec(scales + kSlotSpan + b * kLanes);  // after the sum
      StoreVec(weight[r] + b * kLanes, weights);
    }
    running_sum[r] = running_sum[r] * rescale[r] + HorizontalSum(total);
    running_max[r] = new_max;
  }
  bool rescaled = false;
  for (int r = 0; r < kRows; ++r) rescaled |= rescale[r] != 1.0f;
  Vec out[kRows][kChunks];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) {
      out[r][c] = LoadVec(acc[r] + c * kLanes);
      if (rescaled) out[r][c] *= rescale[r];  // times 1 changes no bit: skipped when no row's maximum moved
    }
  }
  if constexpr (kPairs) {  // slots (2k, 2k + 1); a slot outside [lo, hi) has weight 0 and borrows its partner's row
    uint16_t weight_pairs[kRows][kSlotSpan];  // slots 2k and 2k + 1 side by side: pair k
    for (int r = 0; r < kRows; ++r) RoundToBf16s(weight[r], kSlotSpan, weight_pairs[r]);
    for (int64_t k = lo / 2; k <= (hi - 1) / 2; ++k) {
      const T* first = values + std::max(2 * k, lo) * row_width;
      const T* second = values + std::min(2 * k + 1, hi - 1) * row_width;
      if (next_rows != nullptr) {  // the same two slots of the next page
        PrefetchSlotRows(next_rows + (first - values), kChunks * kLanes);
        PrefetchSlotRows(next_rows + (second - values), kChunks * kLanes);
      }
      Vec v[kChunks];
      InterleaveRows<kChunks>(first, second, v);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const Vec w = SplatBits(&weight_pairs[r][2 * k]);
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) out[r][c] = DotPairs(out[r][c], w, v[c]);
      }
    }
  } else {
    for (int64_t j = lo; j < hi; ++j) {
      const T* value = values + j * row_width;
      if (next_rows != nullptr) PrefetchSlotRows(next_rows + j * row_width, kChunks * kLanes);
      Vec v[kChunks];
#pragma GCC unroll 16
      for (int c = 0; c < kChunks; ++c) v[c] = LoadValues(value + c * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const Vec w = Splat(weight[r][j]);
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) out[r][c] += w * v[c];
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) StoreVec(acc[r] + c * kLanes, out[r][c]);
  }
}

// Query heads [g, g + kRows) of one token's group against a slot span: AttendSlotSpan with the token's state.
// q_heads holds a query row per head (a bf16 pool's: D / 2 pairs).
template <int kChunks, int kRows, typename T>
inline void AttendHeadsSpan(const float* q_heads, const T* keys, int64_t row_width, int64_t n, int64_t lo, int64_t hi,
                            float soft_cap, int64_t g, float* running_max, float* running_sum, float* acc,
                            const T* next_rows, const float* scales) {
  constexpr int64_t D = kChunks * kLanes, query_width = QueryWidth<T>(D);
  const float* q_rows[kRows];
  float* acc_rows[kRows];
  for (int r = 0; r < kRows; ++r) {
    q_rows[r] = q_heads + (g + r) * query_width;
    acc_rows[r] = acc + (g + r) * D;
  }
  AttendSlotSpan<kChunks, kRows>(q_rows, keys, keys + D, row_width, n, lo, hi, soft_cap, running_max + g,
                                 running_sum + g, acc_rows, next_rows, scales);
}

// An int8 pool's scales (pallas_kernels/quantization.py): words[num_pages, groups, lanes], one u32 per (KV head,
// token) holding the K scale's bf16 bits high and the V scale's low; KV head h = g * K / groups + i, token t sits in
// word [page, g, i * page_size + t]. Null for plain pools.
struct ScaleWords {
  const uint32_t* words = nullptr;
  int64_t groups = 1, lanes = 0;

  // The words of one KV head's tokens in a page, token-major.
  const uint32_t* Head(const Shapes& s, int64_t page_id, int64_t kv_head) const {
    const int64_t heads_per_group = s.num_kv_heads / groups;
    const int64_t group = kv_head / heads_per_group, index = kv_head % heads_per_group;
    return words + (page_id * groups + group) * lanes + index * s.page_size;
  }
};

// The K and V scales of n slots (one word each) as f32, into scales[kSlotSpan] (K) and scales[kSlotSpan + ...] (V);
// slots n and up get 0.
inline void UnpackSpanScales(const uint32_t* words, int64_t n, float* scales) {
  for (int64_t slot = 0; slot < kSlotSpan; ++slot) {
    const uint32_t word = slot < n ? words[slot] : 0;
    const uint32_t key_bits = word & 0xFFFF0000u, value_bits = word << 16;
    std::memcpy(scales + slot, &key_bits, sizeof(float));
    std::memcpy(scales + kSlotSpan + slot, &value_bits, sizeof(float));
  }
}

// Query rows that share one span's loads: the value update holds rows x kChunks accumulators, kept to half the
// register file (16 of AVX-512's 32, 8 of AVX2's 16) beside the value vectors: head_dim 64 takes 4 rows on AVX-512
// and 1 on AVX2, head_dim 128 takes 2 and 1.
template <int kChunks>
constexpr int MaxSpanRows() {
  constexpr int accumulators = kLanes >= 16 ? 16 : 8;
  return std::max(1, std::min(4, accumulators / kChunks));
}

// Tokens [first, first + count) of one row against KV heads [head_begin, head_end), head_dim = kChunks * kLanes:
// AttendRun's contract for each of those heads. The heads are interleaved page by page, so that each page's rows are
// read once, front to back, whichever heads the item covers. Over an int8 pool (T = int8_t, with its scales) the
// arithmetic is the f32 path's on the stored integers, each span's scales applied to its scores and weights
// (AttendSlotSpan): widening the integers into an f32 span first, scaled or not, took 1.3x as long (BUILD.md).
template <int kChunks, typename T>
void AttendRunLanes(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables, int64_t first_token,
                    int64_t count, int64_t head_begin, int64_t head_end, int32_t row, const int32_t* positions,
                    const int32_t* kv_lens, int64_t sliding_window, float soft_cap, float* out,
                    const ScaleWords& scales) {
  constexpr int64_t D = kChunks * kLanes;
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  alignas(64) float span_scales[2 * kSlotSpan];  // an int8 pool's: the span's K scales, then its V scales
  const int64_t G = s.group, P = s.page_size, H = head_end - head_begin;
  TokenRange ranges[kMaxRunTokens];
  const auto [run_start, run_end] = RunRanges(positions, kv_lens, first_token, count, sliding_window, ranges);
  // [H, count * G, D] accumulators and [H, count * G] running maxima and sums, head-major then token-major.
  std::vector<float> acc(H * count * G * D, 0.0f), running_max(H * count * G, kMaskValue),
      running_sum(H * count * G, 0.0f);
  constexpr bool kPairs = std::is_same_v<T, uint16_t>;
  // A bf16 pool's queries, rounded to bf16: [count, N, D], pairs of head dims; with kJoinedSlots [count, N, 2 * D],
  // each 16-value half twice.
  constexpr int64_t kQueryBits = 2 * QueryWidth<T>(D);  // uint16 a head
  std::vector<uint16_t> q_pairs;
  if constexpr (kPairs) {
    const int64_t num_heads = count * s.num_q_heads;
    q_pairs.resize(num_heads * kQueryBits);
    RoundToBf16s(q + first_token * s.num_q_heads * D, num_heads * D, q_pairs.data());
    if constexpr (kJoinedSlots<T>) {  // in place, back to front: the j-th 16 values go to 32j and 32j + 16
      for (int64_t j = num_heads * D / 16 - 1; j >= 0; --j) {
        uint16_t* to = q_pairs.data() + 32 * j;
        std::memmove(to + 16, q_pairs.data() + 16 * j, 16 * sizeof(uint16_t));
        std::memmove(to, q_pairs.data() + 16 * j, 16 * sizeof(uint16_t));
      }
    }
  }
  const int32_t* table = RowTable(s, block_tables, row);
  for (int64_t first = run_start - run_start % P; first < run_end; first += P) {
    const int64_t page_id = PageAt(s, table, first / P);
    if (first == run_start - run_start % P) ReadPageHeadsInOrder(s, pages, table, first / P, head_begin, head_end, D);
    // The next page's slots, prefetched as these are worked on.
    const int64_t next_page_id = first + P < run_end ? PageAt(s, table, first / P + 1) : -1;
    const T* next_page = next_page_id >= 0 ? pages + next_page_id * P * s.row_width : nullptr;
    for (int64_t chunk = first; chunk < std::min(first + P, run_end); chunk += kSlotSpan) {
      const int64_t n = std::min<int64_t>(kSlotSpan, first + P - chunk);
      const T* slots = pages + (page_id * P + chunk - first) * s.row_width;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kv_head = head_begin + h;
        const T* keys = slots + 2 * kv_head * D;
        // The first (token, query rows) to attend this span prefetches the head's rows of the next page's slots.
        const T* next_rows =
            next_page == nullptr ? nullptr : next_page + (chunk - first) * s.row_width + 2 * kv_head * D;
        const float* span_scales_or_null = nullptr;
        if constexpr (kInt8) {
          if (next_page_id >= 0) __builtin_prefetch(scales.Head(s, next_page_id, kv_head) + (chunk - first), 0, 2);
          UnpackSpanScales(scales.Head(s, page_id, kv_head) + (chunk - first), n, span_scales);
          span_scales_or_null = span_scales;
        }
        for (int64_t i = 0; i < count; ++i) {
          const int64_t lo = std::max(chunk, ranges[i].start) - chunk;
          const int64_t hi = std::min(chunk + n, ranges[i].end) - chunk;
          if (lo >= hi) continue;  // nothing of these slots is visible to the token
          const int64_t state = (h * count + i) * G;  // the token's first query head under this KV head
          // [G, D], or pairs' bits (read by memcpy): [G, D / 2], or [G, D] with kJoinedSlots.
          const int64_t head = i * s.num_q_heads + kv_head * G;
          const float* q_heads = kPairs ? reinterpret_cast<const float*>(q_pairs.data() + head * kQueryBits)
                                        : q + (first_token * s.num_q_heads + head) * D;
          float* acc_heads = acc.data() + state * D;
          constexpr int kRows = MaxSpanRows<kChunks>();
          int64_t g = 0;
          for (; g + kRows <= G; g += kRows) {
            AttendHeadsSpan<kChunks, kRows>(q_heads, keys, s.row_width, n, lo, hi, soft_cap, g,
                                            running_max.data() + state, running_sum.data() + state, acc_heads,
                                            next_rows, span_scales_or_null);
            next_rows = nullptr;
          }
          switch (G - g) {  // the rest of the group (fewer than kRows)
#define PAXKV_SPAN_ROWS_CASE(rows)                                                                        \
  case rows:                                                                                              \
    AttendHeadsSpan<kChunks, rows>(q_heads, keys, s.row_width, n, lo, hi, soft_cap, g, running_max.data() + state, \
                                   running_sum.data() + state, acc_heads, next_rows, span_scales_or_null); \
    next_rows = nullptr;                                                                                  \
    break;
            PAXKV_SPAN_ROWS_CASE(1)
            PAXKV_SPAN_ROWS_CASE(2)
            PAXKV_SPAN_ROWS_CASE(3)
#undef PAXKV_SPAN_ROWS_CASE
            default:
              break;
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    WriteRunOutputs(s, ranges, first_token, count, head_begin + h, acc.data() + h * count * G * D,
                    running_sum.data() + h * count * G, out);
  }
}

// AttendRunLanes for head_dim 32, 64 or 128; false (nothing done) for others.
template <typename T>
bool AttendRunLanesFor(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables,
                       int64_t first_token, int64_t count, int64_t head_begin, int64_t head_end, int32_t row,
                       const int32_t* positions, const int32_t* kv_lens, int64_t sliding_window, float soft_cap,
                       float* out, const ScaleWords& scales) {
#define PAXKV_LANES_CASE(head_dim)                                                                                  \
  case head_dim:                                                                                                    \
    AttendRunLanes<head_dim / kLanes>(s, q, pages, block_tables, first_token, count, head_begin, head_end, row,     \
                                      positions, kv_lens, sliding_window, soft_cap, out, scales);                   \
    return true;
  switch (s.head_dim) {  // the head_dims of the models paxkv runs (each case adds about 0.6 s to the build)
    PAXKV_LANES_CASE(32)
    PAXKV_LANES_CASE(64)
    PAXKV_LANES_CASE(128)
    default:
      return false;
  }
#undef PAXKV_LANES_CASE
}

#endif  // PAXKV_CPU_PAGED_ATTENTION_LANES_H_
