// Part of the native CPU matmuls on panels (included inside their anonymous namespaces after cpu_native_vectors.h and
// cpu_panel_tiles.h, never on its own): activation rows packed tile by tile for the register tiles, and rounded to
// bf16 pairs for bf16 panels (cpu_panel_matmul.cc describes the layouts).

#ifndef PAXKV_CPU_PANEL_ROW_PACKING_H_
#define PAXKV_CPU_PANEL_ROW_PACKING_H_

// Rows [0, rows) of `from` (rows from_stride apart), steps [k0, k1), into `to` laid out [K, rows] (step k's values
// side by side at to + k * rows).
void PackSteps(const float* from, int64_t from_stride, int64_t rows, int64_t k0, int64_t k1, float* to) {
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t r = 0; r < rows; ++r) to[k * rows + r] = from[r * from_stride + k];
  }
}

// PackSteps for a full tile's steps [0, k_size), kLanes steps at a time as an in-register transpose: kRowBlock vectors
// in, their lanes out step by step (one value at a time, the copy cost about 1% of a 32-row matmul more).
void PackFullTile(const float* from, int64_t from_stride, int64_t k_size, float* to) {
  int64_t k = 0;
#if defined(__AVX512F__)
  static_assert(kRowBlock == 8 && kLanes == 16, "an AVX-512 tile is 8 rows of 16-lane vectors");
  for (; k + kLanes <= k_size; k += kLanes) {
    __m512 a[8], t[8], u[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm512_loadu_ps(from + r * from_stride + k);
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
    for (int r = 0; r < 4; ++r) a[r] = _mm256_loadu_ps(from + r * from_stride + k);
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
  PackSteps(from, from_stride, kRowBlock, k, k_size, to);
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

// Contraction steps of a tile's rows that PackRowTiles rounds to bf16 pairs, or norms (RowNorm), at a time (4 KiB of
// them for 8 rows).
constexpr int64_t kRoundSteps = 128;

// An RMS layer norm that PackRowTiles applies to x's rows as it packs them, so that the product takes norm(x) without
// the normed rows ever reaching memory: row * r * weight, r = 1 / sqrt(mean(row * row) + eps), in jnp's order
// (models.layers.RMSNorm). No weight: the rows are packed as they are.
struct RowNorm {
  const float* weight = nullptr;  // [K]
  float eps = 0.0f;
};

// The RowNorm of a native call's norm weight: f32[K] over x's K columns, or f32[0] for none (into `norm`).
inline ffi::Error NormOf(const ffi::Buffer<ffi::F32>& weight, int64_t k_size, float eps, RowNorm& norm) {
  const auto dims = weight.dimensions();
  if (dims.size() != 1 || (dims[0] != 0 && dims[0] != k_size)) {
    return ffi::Error::InvalidArgument("expected a norm weight f32[K] over x's K columns, or f32[0] for none");
  }
  norm = dims[0] == 0 ? RowNorm{} : RowNorm{weight.typed_data(), eps};
  return ffi::Error::Success();
}

// 1 / sqrt(mean(row[0:n] * row[0:n]) + eps), the squares summed kLanes partial sums at a time.
inline float NormScale(const float* row, int64_t n, float eps) {
  Vec lanes{};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const Vec v = LoadVec(row + k);
    lanes += v * v;
  }
  float sum = HorizontalSum(lanes);
  for (; k < n; ++k) sum += row[k] * row[k];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// to[0:n] = (row[0:n] * scale) * weight[0:n].
inline void NormValues(const float* row, const float* weight, float scale, int64_t n, float* to) {
  const Vec splat = Splat(scale);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) StoreVec(to + k, (LoadVec(row + k) * splat) * LoadVec(weight + k));
  for (; k < n; ++k) to[k] = (row[k] * scale) * weight[k];
}

// x[T, K]'s rows packed tile by tile into `packed` for the tiles' AccumulateTile: the tile of rows [t0, t0 + h) (h =
// tile_rows, or the rows left at the end) at + t0 * S, laid out [S, h], each step's h values side by side, over S
// steps a row. A step is one of x's values (S = K), or with `pairs` (bf16 panels) a pair of them rounded to bf16
// (nearest even), contraction rows 2k and 2k + 1 in pair k (2k low, 2k + 1 high), an odd K's last pair padded with a
// zero (S = ceil(K / 2)): a Bf16Pair viewed as a float, which the packing only moves. A tile rounds kRoundSteps of its
// rows' steps at a time into a buffer in the first-level cache and packs them from there. (Rounded whole rows first,
// then packed, took two more passes through memory over the rounded rows and two dispatches to the pool: on a 2-core
// Zen 4, 2048 x 576 x 192 in bf16 1.45 -> 1.37 ms, 2048 x 1536 x 576 10.0 -> 9.7.) One f32 row is its own packing. The
// copy is T x S floats (a few microseconds at a decode batch's 32 rows, beside 30-300 of multiply-adds). With a
// `norm`, each row's values are normed (RowNorm) kRoundSteps steps at a time into the first-level cache first.
const float* PackRowTiles(ffi::ThreadPool& pool, const float* x, int64_t t_size, int64_t k_size, int64_t tile_rows,
                          bool pairs, std::vector<float>& packed, RowNorm norm = {}) {
  if (t_size == 1 && !pairs && norm.weight == nullptr) return x;
  const int64_t steps = pairs ? (k_size + 1) / 2 : k_size;
  packed = packed_buffers.Take(t_size * steps);
  float* to = packed.data();
  auto pack = [&](int64_t tile) {
    const int64_t t0 = tile * tile_rows, rows = std::min(tile_rows, t_size - t0);
    float* tile_to = to + t0 * steps;
    float scales[kRowBlock];  // each row's RowNorm scale
    if (norm.weight != nullptr) {
      for (int64_t r = 0; r < rows; ++r) scales[r] = NormScale(x + (t0 + r) * k_size, k_size, norm.eps);
    }
    // Values [k, k + n) of tile row r: x's own, or normed into `buffer`.
    auto values_of = [&](int64_t r, int64_t k, int64_t n, float* buffer) -> const float* {
      const float* row = x + (t0 + r) * k_size + k;
      if (norm.weight == nullptr) return row;
      NormValues(row, norm.weight + k, scales[r], n, buffer);
      return buffer;
    };
    if (!pairs) {
      if (norm.weight == nullptr) {
        if (rows == kRowBlock) return PackFullTile(x + t0 * k_size, k_size, k_size, tile_to);
        return PackSteps(x + t0 * k_size, k_size, rows, 0, k_size, tile_to);
      }
      alignas(64) float normed[kRowBlock * kRoundSteps];  // [rows][kRoundSteps] values
      for (int64_t k0 = 0; k0 < steps; k0 += kRoundSteps) {
        const int64_t chunk = std::min(kRoundSteps, steps - k0);
        for (int64_t r = 0; r < rows; ++r) values_of(r, k0, chunk, normed + r * kRoundSteps);
        if (rows == kRowBlock) {
          PackFullTile(normed, kRoundSteps, chunk, tile_to + k0 * rows);
        } else {
          PackSteps(normed, kRoundSteps, rows, 0, chunk, tile_to + k0 * rows);
        }
      }
      return;
    }
    alignas(64) float rounded[kRowBlock * kRoundSteps];  // [rows][kRoundSteps] pairs
    alignas(64) float normed[2 * kRoundSteps];           // a row's values of a chunk, when normed
    for (int64_t k0 = 0; k0 < steps; k0 += kRoundSteps) {
      const int64_t chunk = std::min(kRoundSteps, steps - k0), values = std::min(2 * chunk, k_size - 2 * k0);
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* row_to = reinterpret_cast<uint16_t*>(rounded + r * kRoundSteps);
        RoundToBf16s(values_of(r, 2 * k0, values, normed), values, row_to);
        if (values % 2) row_to[values] = 0;
      }
      if (rows == kRowBlock) {
        PackFullTile(rounded, kRoundSteps, chunk, tile_to + k0 * rows);
      } else {
        PackSteps(rounded, kRoundSteps, rows, 0, chunk, tile_to + k0 * rows);
      }
    }
  };
  const int64_t tiles = (t_size + tile_rows - 1) / tile_rows;
  if (t_size <= kFewRows) {
    for (int64_t tile = 0; tile < tiles; ++tile) pack(tile);
  } else {
    ParallelFor(pool, tiles, pack);
  }
  return to;
}

#endif  // PAXKV_CPU_PANEL_ROW_PACKING_H_
