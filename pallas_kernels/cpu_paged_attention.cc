// Paged attention of short query runs on CPU, as an XLA FFI custom call (pallas_kernels/cpu_paged_attention.py).
//
// Consecutive tokens of one sequence row (a decode token, a token and its speculative drafts, a prefill chunk) form
// a run. Each run walks the row's pages in place, one page at a time, for each KV head: scores of the run's query
// heads that share the KV head against the page's keys they can see, an online-softmax rescale, then the values.
// Nothing is gathered into a fresh block first, which is what bounds XLA:CPU's version (its gather copies about
// 4 GB/s); each page comes from memory once per run. Work items are split over XLA's intra-op thread pool: one per
// run, covering all its KV heads, so that the run's pages are read front to back (one item per KV head read a third
// of each token row at a time, and the hardware prefetcher fetched the rest for nothing: decode at batch 8 and
// context 2048 took 30% longer), unless there are fewer than two runs a thread; then one per (run, KV head).
//
// Three ways to do one run's arithmetic:
// - short runs (fewer than kMinTiledRunTokens tokens: decodes, a token and its drafts) put a page's slots across
//   SIMD lanes when head_dim is 32, 64 or 128 (AttendRunLanes): each query row's scores against 16 slots are
//   one vector, so its softmax is vector work and its output stays in registers across the slots;
// - other short runs take one dot product per (query head, key), vectorized over head_dim and summed across lanes
//   by halving (AttendRun); both paths prefetch the next page's K and V rows while one page is worked on (the
//   lanes path a slot or two at a time beside its value updates, and its run's first page read in address order
//   first: decode reads a bf16 pool from memory at about twice the rate it did with a page's prefetches at once);
// - longer runs (prefill chunks) are tiled like a matrix product (AttendRunTiled): the run's query rows sit
//   across SIMD lanes, transposed once per run, so every score block, softmax statistic and output update is a
//   vertical vector operation with a key or value element broadcast; the score tile (8 keys by 48 rows) is reused
//   across head_dim and the value tile (6 rows by 64 output dims) across a block of pages' slots (64 positions,
//   aligned to multiples of 64 so that a token's arithmetic never depends on its band), and the rows go through
//   the blocks 96 at a time, so that their queries, sums and weights stay in the cache.
// An int8 pool (AttendInt8: its values' bits and its scale words; head_dim 32, 64 or 128) takes the same paths: short
// runs f32 arithmetic on the integers, each span's K scales applied to its scores and V scales to its weights;
// prompt chunks the tiled path's bf16 pairs, its blocks' integers copied as bf16 (exact) and scaled alike.
// Within one path each token's arithmetic is the same whatever run it is in. Every path reads f32 and bf16 pools
// exactly and sums in f32. Over a bf16 pool the two vectorized paths (AttendRunTiled, AttendRunLanes) multiply bf16
// pairs (DotPairs: VDPBF16PS on AVX-512 BF16, two multiply-adds per lane and instruction), rounding the queries and
// the softmax weights to bf16 once each, as bf16 matmul units do: half the multiply-adds, and no widening of the
// stored keys and values. AttendRun (other head_dims' short runs) keeps f32 queries and weights.
//
// Layout (pallas_kernels/kv_pages.py): kv_pages[num_pages, page_size, 2 * K * D], the key of head h in slot 2h
// and its value in slot 2h + 1 of each token row. Semantics are the XLA reference's per-token read
// (pallas_kernels/reference.py): a token sees positions p <= its position and p < its sequence's kv length, and,
// with a sliding window w, p > position - w; tokens of kv length 0 (padding) get zeros.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // cpu_native_vectors.h's intrinsics
#endif

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -0.7f * std::numeric_limits<float>::max();

struct Shapes {
  int64_t num_tokens, num_q_heads, head_dim, num_kv_heads, group, page_size, row_width, pages_per_seq, num_pages,
      num_rows;
};

#include "cpu_native_parallel.h"          // ParallelFor
#include "cpu_native_vectors.h"   // Vec, Exp, LoadValue(s), HorizontalSum

template <typename T>
inline float Dot(const float* q, const T* k, int64_t n) {
  if (n % kLanes == 0) {  // every head_dim the models use
    Vec even = {}, odd = {};
    int64_t i = 0;
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      even += LoadVec(q + i) * LoadValues(k + i);
      odd += LoadVec(q + i + kLanes) * LoadValues(k + i + kLanes);
    }
    if (i < n) even += LoadVec(q + i) * LoadValues(k + i);
    return HorizontalSum(even + odd);
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += q[i] * LoadValue(k + i);
  return sum;
}

template <typename T>
inline void Axpy(float a, const T* v, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += a * LoadValue(v + i);
}

// Tokens of one row that one work item attends together: each page is read from memory once for all of them.
constexpr int64_t kMaxRunTokens = 16;

// Where one token reads: positions [start, end) of its row.
struct TokenRange {
  int64_t start, end;
};

TokenRange VisibleRange(int32_t position, int32_t kv_len, int64_t sliding_window) {
  const int64_t end = std::min<int64_t>(static_cast<int64_t>(position) + 1, kv_len);
  int64_t start = 0;
  if (sliding_window > 0) start = std::max<int64_t>(0, static_cast<int64_t>(position) - sliding_window + 1);
  if (kv_len <= 0 || end <= start) return {0, 0};
  return {start, end};
}

// A row's block table, and the pool index of the page at one of its columns. Indices are clamped as XLA clamps a
// gather's, so bad metadata reads a wrong page, never outside the pool.
inline const int32_t* RowTable(const Shapes& s, const int32_t* block_tables, int32_t row) {
  return block_tables + std::clamp<int64_t>(row, 0, s.num_rows - 1) * s.pages_per_seq;
}
inline int64_t PageAt(const Shapes& s, const int32_t* table, int64_t column) {
  return std::clamp<int64_t>(table[std::min(column, s.pages_per_seq - 1)], 0, s.num_pages - 1);
}

// Calls visit(line) for each cache line of the K and V rows of KV heads [head_begin, head_end) (head_dim D,
// contiguous in each token row) in the page at `column` of a row's block table, slot by slot, front to back.
template <typename T, typename Visit>
inline void ForEachLineOfPageHeads(const Shapes& s, const T* pages, const int32_t* table, int64_t column,
                                   int64_t head_begin, int64_t head_end, int64_t D, Visit visit) {
  const char* page = reinterpret_cast<const char*>(pages + PageAt(s, table, column) * s.page_size * s.row_width +
                                                   2 * head_begin * D);
  const int64_t bytes = 2 * (head_end - head_begin) * D * static_cast<int64_t>(sizeof(T));
  for (int64_t slot = 0; slot < s.page_size; ++slot) {
    for (int64_t byte = 0; byte < bytes; byte += 64) visit(page + slot * s.row_width * sizeof(T) + byte);
  }
}

// Prefetches those rows into L2, while the page before them is worked on (AttendRun). (Into L1, a whole page of
// three heads is 384 lines: at batch 8 and context 2048 that measured 10-15% slower.)
template <typename T>
inline void PrefetchPageHeads(const Shapes& s, const T* pages, const int32_t* table, int64_t column,
                              int64_t head_begin, int64_t head_end, int64_t D) {
  ForEachLineOfPageHeads(s, pages, table, column, head_begin, head_end, D,
                         [](const char* line) { __builtin_prefetch(line, 0, 2); });
}

// Reads those rows front to back, one load a cache line, before the page is worked on: for a run's first page, which
// nothing prefetched. The lanes path's own order (one KV head's keys, then its values, at the row stride) keeps few
// misses in flight; a run of independent loads in address order has them arrive together (the decode kernel alone
// over 30 layers' pools at batch 32 and context 192: 6% faster). Each line's first word is read; where head_dim is
// not a multiple of 4, a row's last line might hold less than a word, and nothing is read (the lanes path's head_dims
// are 32, 64 and 128).
template <typename T>
inline void ReadPageHeadsInOrder(const Shapes& s, const T* pages, const int32_t* table, int64_t column,
                                 int64_t head_begin, int64_t head_end, int64_t D) {
  if (D % 4 != 0) return;
  uint64_t sink = 0;
  ForEachLineOfPageHeads(s, pages, table, column, head_begin, head_end, D, [&sink](const char* line) {
    uint64_t word;
    std::memcpy(&word, line, sizeof(word));
    sink |= word;
  });
  asm volatile("" : : "r"(sink));  // the loads stay: nothing else reads them
}

// Prefetches one slot's K and V rows of a KV head (2 * D values from `rows`) into L2. The lanes path calls it for the
// next page's slots one or two at a time as it reads the current page's values: spread out so, the prefetches keep
// the memory busy beside the arithmetic, where a whole page's worth at once (PrefetchPageHeads) measured no faster
// than none (the decode kernel alone over 30 layers' pools: a bf16 pool read at 13-14 GB/s with either, 22-27 GB/s
// spread out; a burst of 192 prefetches presumably outruns the misses the core can hold, and the rest are dropped).
template <typename T>
inline void PrefetchSlotRows(const T* rows, int64_t D) {
  const char* bytes = reinterpret_cast<const char*>(rows);
  const int64_t count = 2 * D * static_cast<int64_t>(sizeof(T));
  for (int64_t byte = 0; byte < count; byte += 64) __builtin_prefetch(bytes + byte, 0, 2);
}

// A run's outputs for one KV head from its accumulators [count * G, D] and softmax sums [count * G]: out = acc / sum,
// zeros for tokens that see nothing (padding).
inline void WriteRunOutputs(const Shapes& s, const TokenRange* ranges, int64_t first_token, int64_t count,
                            int64_t kv_head, const float* acc, const float* running_sum, float* out) {
  const int64_t G = s.group, D = s.head_dim;
  for (int64_t i = 0; i < count; ++i) {
    float* out_heads = out + ((first_token + i) * s.num_q_heads + kv_head * G) * D;  // [G, D]
    if (ranges[i].end <= ranges[i].start) {  // padding, or nothing visible: zeros
      std::fill(out_heads, out_heads + G * D, 0.0f);
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t state = i * G + g;
      const float inverse = 1.0f / std::max(running_sum[state], 1e-30f);
      for (int64_t j = 0; j < D; ++j) out_heads[g * D + j] = acc[state * D + j] * inverse;
    }
  }
}

// Each of a run's tokens' visible positions, into ranges[0, count); returns the span [start, end) that covers them
// all (empty, start > end, when no token sees anything).
inline TokenRange RunRanges(const int32_t* positions, const int32_t* kv_lens, int64_t first_token, int64_t count,
                            int64_t sliding_window, TokenRange* ranges) {
  TokenRange run = {std::numeric_limits<int64_t>::max(), 0};
  for (int64_t i = 0; i < count; ++i) {
    ranges[i] = VisibleRange(positions[first_token + i], kv_lens[first_token + i], sliding_window);
    if (ranges[i].end > ranges[i].start) {
      run.start = std::min(run.start, ranges[i].start);
      run.end = std::max(run.end, ranges[i].end);
    }
  }
  return run;
}

// Tokens [first, first + count) of one row against one KV head: their G query heads, all visible positions.
template <typename T>
void AttendRun(const Shapes& s, const float* q, const T* pages, const int32_t* block_tables, int64_t first_token,
               int64_t count, int64_t kv_head, int32_t row, const int32_t* positions, const int32_t* kv_lens,
               int64_t sliding_window, float soft_cap, float* out) {
  const int64_t G = s.group, D = s.head_dim, P = s.page_size;
  TokenRange ranges[kMaxRunTokens];
  const auto [run_start, run_end] = RunRanges(positions, kv_lens, first_token, count, sliding_window, ranges);
  // [count, G, D] accumulators and [count, G] running maxima and sums, token-major.
  std::vector<float> acc(count * G * D, 0.0f), running_max(count * G, kMaskValue), running_sum(count * G, 0.0f);
  std::vector<float> scores(P);
  const int32_t* table = RowTable(s, block_tables, row);
  for (int64_t first = run_start - run_start % P; first < run_end; first += P) {
    const int64_t page_id = PageAt(s, table, first / P);
    const T* page = pages + page_id * P * s.row_width;
    if (first + P < run_end) PrefetchPageHeads(s, pages, table, first / P + 1, kv_head, kv_head + 1, D);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t lo = std::max(first, ranges[i].start) - first, hi = std::min(first + P, ranges[i].end) - first;
      if (lo >= hi) continue;  // nothing of this page is visible to the token
      const float* q_heads = q + ((first_token + i) * s.num_q_heads + kv_head * G) * D;  // [G, D]
      for (int64_t g = 0; g < G; ++g) {
        const int64_t state = i * G + g;
        float block_max = kMaskValue;
        for (int64_t slot = lo; slot < hi; ++slot) {
          float score = Dot(q_heads + g * D, page + slot * s.row_width + 2 * kv_head * D, D);
          if (soft_cap > 0.0f) score = soft_cap * std::tanh(score / soft_cap);
          scores[slot] = score;
          block_max = std::max(block_max, score);
        }
        const float new_max = std::max(running_max[state], block_max);
        const float rescale = std::exp(running_max[state] - new_max);
        float* acc_g = acc.data() + state * D;
        if (rescale != 1.0f) {
          for (int64_t j = 0; j < D; ++j) acc_g[j] *= rescale;
        }
        float sum = running_sum[state] * rescale;
        for (int64_t slot = lo; slot < hi; ++slot) {
          const float weight = std::exp(scores[slot] - new_max);
          sum += weight;
          Axpy(weight, page + slot * s.row_width + (2 * kv_head + 1) * D, acc_g, D);
        }
        running_max[state] = new_max;
        running_sum[state] = sum;
      }
    }
  }
  WriteRunOutputs(s, ranges, first_token, count, kv_head, acc.data(), running_sum.data(), out);
}

#include "cpu_paged_attention_lanes.h"  // AttendRunLanes, for short runs when head_dim is 32, 64 or 128
#include "cpu_paged_attention_tiled.h"  // AttendRunTiled, for runs of kMinTiledRunTokens or more

// The runs of a batch: maximal stretches of consecutive tokens with one row, cut every max_tokens tokens. Padding
// tokens (kv length 0; they may share the last live row) run apart, so a live token's path never depends on the
// padding after it.
struct Run {
  int64_t first, count;
};

std::vector<Run> RowRuns(const int32_t* rows, const int32_t* kv_lens, int64_t num_tokens, int64_t max_tokens) {
  std::vector<Run> runs;
  for (int64_t token = 0; token < num_tokens; ++token) {
    const bool continues = !runs.empty() && rows[runs.back().first] == rows[token] &&
                          (kv_lens[runs.back().first] > 0) == (kv_lens[token] > 0);
    if (continues && runs.back().count < max_tokens) {
      ++runs.back().count;
    } else {
      runs.push_back({token, 1});
    }
  }
  return runs;
}

// The runs' indices, the costliest first (tokens times the positions the last one sees): the threads claim items in
// order, so the last items claimed are the cheapest and the threads finish together. (In the order of the batch, a
// causal prompt's runs come cheapest first, and one thread ran the last and largest alone: one 256-token prompt's
// attention over 30 SmolLM2 layers took 24.9 and 25.8 ms in two runs, against 22.8 and 22.1 this way.)
std::vector<int64_t> LongestRunsFirst(const std::vector<Run>& runs, const int32_t* positions) {
  std::vector<int64_t> order(runs.size());
  std::vector<int64_t> cost(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    order[i] = static_cast<int64_t>(i);
    cost[i] = runs[i].count * (static_cast<int64_t>(positions[runs[i].first + runs[i].count - 1]) + 1);
  }
  std::stable_sort(order.begin(), order.end(), [&cost](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

// How many items each run's KV heads split into: one (each page's rows read front to back by one thread) unless
// that leaves too few items to share over the threads.
inline int64_t HeadGroups(ffi::ThreadPool& pool, const Shapes& s, int64_t num_runs) {
  return num_runs >= 2 * std::max<int64_t>(1, pool.num_threads()) ? 1 : s.num_kv_heads;
}

// Every run of the batch, over a pool of T (float, bf16 bits, or int8 with `scales`).
template <typename T>
ffi::Error AttendPool(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                      ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> positions,
                      ffi::Buffer<ffi::S32> kv_lens, int64_t sliding_window, float soft_cap,
                      ffi::ResultBuffer<ffi::F32> out, ScaleWords scales) {
  constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  auto q_dims = q.dimensions();
  auto page_dims = kv_pages.dimensions();
  auto table_dims = block_tables.dimensions();
  if (q_dims.size() != 3 || page_dims.size() != 3 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("expected q[T, N, D], kv_pages[pages, P, 2KD] and block_tables[S, W]");
  }
  Shapes s;
  s.num_tokens = q_dims[0];
  s.num_q_heads = q_dims[1];
  s.head_dim = q_dims[2];
  s.page_size = page_dims[1];
  s.row_width = page_dims[2];
  s.num_kv_heads = s.row_width / (2 * s.head_dim);
  s.pages_per_seq = table_dims[1];
  s.num_rows = table_dims[0];
  s.num_pages = page_dims[0];
  if (s.pages_per_seq <= 0 || s.num_rows <= 0 || s.num_pages <= 0) {
    return ffi::Error::InvalidArgument("empty block tables or page pool");
  }
  if (s.num_kv_heads <= 0 || s.num_q_heads % s.num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("query heads must be a multiple of the pool's KV heads");
  }
  s.group = s.num_q_heads / s.num_kv_heads;
  if (kInt8 && s.head_dim != 32 && s.head_dim != 64 && s.head_dim != 128) {
    return ffi::Error::InvalidArgument("an int8 pool's kernel takes head_dim 32, 64 or 128");
  }
  const float* q_data = q.typed_data();
  const T* page_data = reinterpret_cast<const T*>(kv_pages.untyped_data());
  const int32_t* table_data = block_tables.typed_data();
  const int32_t* row_data = rows.typed_data();
  const int32_t* position_data = positions.typed_data();
  const int32_t* kv_len_data = kv_lens.typed_data();
  float* out_data = out->typed_data();
  const bool tiled = soft_cap <= 0.0f && s.head_dim % kLanes == 0;
  const std::vector<Run> runs =
      RowRuns(row_data, kv_len_data, s.num_tokens, tiled ? kMaxTiledRunTokens : kMaxRunTokens);
  const std::vector<int64_t> order = LongestRunsFirst(runs, position_data);
  const int64_t head_groups = HeadGroups(pool, s, static_cast<int64_t>(runs.size()));
  auto attend = [&](int64_t item) {
    const Run& run = runs[order[item / head_groups]];
    const int64_t group = item % head_groups;
    const int64_t head_begin = group * s.num_kv_heads / head_groups;
    const int64_t head_end = (group + 1) * s.num_kv_heads / head_groups;
    const int32_t row = row_data[run.first];
    if (tiled && run.count >= kMinTiledRunTokens) {
      for (int64_t kv_head = head_begin; kv_head < head_end; ++kv_head) {
        AttendRunTiled(s, q_data, page_data, table_data, run.first, run.count, kv_head, row, position_data,
                       kv_len_data, sliding_window, out_data, scales);
      }
    } else if constexpr (kInt8) {  // head_dim 32, 64 or 128, checked above
      AttendRunLanesFor(s, q_data, page_data, table_data, run.first, run.count, head_begin, head_end, row,
                        position_data, kv_len_data, sliding_window, soft_cap, out_data, scales);
    } else if (!AttendRunLanesFor(s, q_data, page_data, table_data, run.first, run.count, head_begin, head_end, row,
                                  position_data, kv_len_data, sliding_window, soft_cap, out_data, scales)) {
      for (int64_t kv_head = head_begin; kv_head < head_end; ++kv_head) {  // other head_dims
        AttendRun(s, q_data, page_data, table_data, run.first, run.count, kv_head, row, position_data, kv_len_data,
                  sliding_window, soft_cap, out_data);
      }
    }
  };
  ParallelFor(pool, static_cast<int64_t>(runs.size()) * head_groups, attend);
  return ffi::Error::Success();
}

template <typename T>
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                  ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> positions,
                  ffi::Buffer<ffi::S32> kv_lens, int64_t sliding_window, float soft_cap,
                  ffi::ResultBuffer<ffi::F32> out) {
  return AttendPool<T>(pool, q, kv_pages, block_tables, rows, positions, kv_lens, sliding_window, soft_cap, out, {});
}

// An int8 pool (its values' bits) and its scale words u32[num_pages, G, lanes].
ffi::Error AttendInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                      ffi::Buffer<ffi::U32> scale_words, ffi::Buffer<ffi::S32> block_tables,
                      ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> kv_lens,
                      int64_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  auto page_dims = kv_pages.dimensions();
  auto scale_dims = scale_words.dimensions();
  if (page_dims.size() != 3 || scale_dims.size() != 3 || scale_dims[0] != page_dims[0] || scale_dims[1] <= 0 ||
      q.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("expected kv_pages[pages, P, 2KD] and scales[pages, G, lanes]");
  }
  const int64_t num_kv_heads = page_dims[2] / (2 * q.dimensions()[2]);
  if (num_kv_heads % scale_dims[1] != 0 || num_kv_heads / scale_dims[1] * page_dims[1] > scale_dims[2]) {
    return ffi::Error::InvalidArgument("the scales' groups and lanes do not hold a word per KV head and token");
  }
  const ScaleWords scales{scale_words.typed_data(), scale_dims[1], scale_dims[2]};
  return AttendPool<int8_t>(pool, q, kv_pages, block_tables, rows, positions, kv_lens, sliding_window, soft_cap, out,
                            scales);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPagedAttentionF32, Attend<float>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q, scaled: [T, N, D]
                                  .Arg<ffi::AnyBuffer>()         // kv_pages: f32[pages, P, 2KD]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables: [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions: [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens: [T]
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPagedAttentionBF16, Attend<uint16_t>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q, scaled: [T, N, D]
                                  .Arg<ffi::AnyBuffer>()         // kv_pages: bf16[pages, P, 2KD]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables: [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions: [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens: [T]
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPagedAttentionInt8, AttendInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q, scaled: [T, N, D]
                                  .Arg<ffi::AnyBuffer>()         // kv_pages: the int8 values' bits, u8[pages, P, 2KD]
                                  .Arg<ffi::Buffer<ffi::U32>>()  // scales: [pages, G, lanes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables: [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows: [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions: [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens: [T]
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
