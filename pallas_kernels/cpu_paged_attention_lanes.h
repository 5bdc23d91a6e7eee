// Part of cpu_paged_attention.cc (included inside its anonymous namespace, after Shapes, VisibleRange, kMaxRunTokens
// and the vector helpers, never on its own): the path that short runs (decode tokens, a token and its drafts) take
// when head_dim is 32, 64 or 128.
//
// A page's slots lie across SIMD lanes, kLanes at a time: each query row's scores against those slots are one
// vector (its dot products with the keys, summed by a butterfly across the lanes), so the softmax's maximum,
// exponentials and sum are vector operations, and the value update keeps the row's output in registers while it
// walks the slots. The softmax is updated once per 16 slots (kSlotSpan). One query row at a time, and each row's
// arithmetic never depends on the other rows of its run.

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

// One query row against slots [chunk, chunk + n) of a page (n <= kSlotSpan), those in [lo, hi) visible: updates the
// row's running maximum, sum and output accumulator acc[kChunks * kLanes] (online softmax).
template <int kChunks, typename T>
inline void AttendSlotSpan(const Vec (&q)[kChunks], const T* keys, const T* values, int64_t row_width, int64_t n,
                           int64_t lo, int64_t hi, float soft_cap, float& running_max, float& running_sum,
                           float* acc) {
  Vec scores[kSlotVecs];
#pragma GCC unroll 4
  for (int64_t b = 0; b < kSlotVecs; ++b) {
    Vec partial[kLanes];
#pragma GCC unroll 16
    for (int64_t j = 0; j < kLanes; ++j) {
      Vec dot = {};
      if (b * kLanes + j < n) {
        const T* key = keys + (b * kLanes + j) * row_width;
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) dot += q[c] * LoadValues(key + c * kLanes);
      }
      partial[j] = dot;
    }
    scores[b] = SumEachLane(partial);  // lane j: slot b * kLanes + j's score
  }
  const IntVec lanes = LaneIndices();
  IntVec visible[kSlotVecs];
  Vec block_max = Splat(kMaskValue);
  for (int64_t b = 0; b < kSlotVecs; ++b) {
    if (soft_cap > 0.0f) {
      for (int j = 0; j < kLanes; ++j) scores[b][j] = soft_cap * std::tanh(scores[b][j] / soft_cap);
    }
    const IntVec slot = lanes + static_cast<int32_t>(b * kLanes);
    visible[b] = (slot >= static_cast<int32_t>(lo)) & (slot < static_cast<int32_t>(hi));
    scores[b] = visible[b] ? scores[b] : Splat(kMaskValue);  // a select: garbage in unused slots never reaches the sums
    block_max = Max(block_max, scores[b]);
  }
  const float new_max = std::max(running_max, HorizontalMax(block_max));
  const float rescale = std::exp(running_max - new_max);
  float weight[kSlotSpan];
  Vec total = {};
  for (int64_t b = 0; b < kSlotVecs; ++b) {
    Vec weights = Exp(scores[b] - Splat(new_max));
    weights = visible[b] ? weights : Vec{};
    total += weights;
    StoreVec(weight + b * kLanes, weights);
  }
  running_sum = running_sum * rescale + HorizontalSum(total);
  running_max = new_max;
  Vec out[kChunks];
#pragma GCC unroll 16
  for (int c = 0; c < kChunks; ++c) out[c] = LoadVec(acc + c * kLanes) * rescale;
  for (int64_t j = lo; j < hi; ++j) {
    const Vec w = Splat(weight[j]);
    const T* value = values + j * row_width;
#pragma GCC unroll 16
    for (int c = 0; c < kChunks; ++c) out[c] += w * LoadValues(value + c * kLanes);
  }
#pragma GCC unroll 16
  for (int c = 0; c < kChunks; ++c) StoreVec(acc + c * kLanes, out[c]);
}

// Tokens [first, first + count) of one row against one KV head, head_dim = kChunks * kLanes: AttendRun's contract.
template <int kChunks, typename T>
void AttendRunLanes(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables, int64_t first_token,
                    int64_t count, int64_t kv_head, int32_t row, const int32_t* positions, const int32_t* kv_lens,
                    int64_t sliding_window, float soft_cap, float* out) {
  constexpr int64_t D = kChunks * kLanes;
  const int64_t G = s.group, P = s.page_size;
  TokenRange ranges[kMaxRunTokens];
  const auto [run_start, run_end] = RunRanges(positions, kv_lens, first_token, count, sliding_window, ranges);
  // [count * G, D] accumulators and [count * G] running maxima and sums, token-major.
  std::vector<float> acc(count * G * D, 0.0f), running_max(count * G, kMaskValue), running_sum(count * G, 0.0f);
  const int32_t* table = RowTable(s, block_tables, row);
  for (int64_t first = run_start - run_start % P; first < run_end; first += P) {
    const int64_t page_id = PageAt(s, table, first / P);
    const T* page = pages + page_id * P * s.row_width + 2 * kv_head * D;  // this head's key in slot 0
    if (first + P < run_end) PrefetchPage(s, pages, table, first / P + 1, kv_head, D);
    for (int64_t chunk = first; chunk < std::min(first + P, run_end); chunk += kSlotSpan) {
      const int64_t n = std::min<int64_t>(kSlotSpan, first + P - chunk);
      const T* keys = page + (chunk - first) * s.row_width;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t lo = std::max(chunk, ranges[i].start) - chunk;
        const int64_t hi = std::min(chunk + n, ranges[i].end) - chunk;
        if (lo >= hi) continue;  // nothing of these slots is visible to the token
        for (int64_t g = 0; g < G; ++g) {
          const int64_t state = i * G + g;
          const float* q_row = q + ((first_token + i) * s.num_q_heads + kv_head * G + g) * D;
          Vec q_vecs[kChunks];
          for (int c = 0; c < kChunks; ++c) q_vecs[c] = LoadVec(q_row + c * kLanes);
          AttendSlotSpan<kChunks>(q_vecs, keys, keys + D, s.row_width, n, lo, hi, soft_cap, running_max[state],
                                  running_sum[state], acc.data() + state * D);
        }
      }
    }
  }
  WriteRunOutputs(s, ranges, first_token, count, kv_head, acc.data(), running_sum.data(), out);
}

// AttendRunLanes for head_dim 32, 64 or 128; false (nothing done) for others.
template <typename T>
bool AttendRunLanesFor(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables,
                       int64_t first_token, int64_t count, int64_t kv_head, int32_t row, const int32_t* positions,
                       const int32_t* kv_lens, int64_t sliding_window, float soft_cap, float* out) {
#define PAXKV_LANES_CASE(head_dim)                                                                                  \
  case head_dim:                                                                                                    \
    AttendRunLanes<head_dim / kLanes>(s, q, pages, block_tables, first_token, count, kv_head, row, positions,       \
                                      kv_lens, sliding_window, soft_cap, out);                                      \
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
