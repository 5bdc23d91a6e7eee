// Activation rows times bf16 weights on Intel's AMX tile units, as an XLA FFI custom call (pallas_kernels/
// cpu_amx_matmul.py; models.layers.project gives it bf16 products of 8 to 64 rows on machines with AMX).
//
// AMX multiplies tiles of bf16: one TDPBF16PS adds a [16 x 32] by [32 x 16] product into a [16 x 16] tile of f32
// sums. At decode sizes a product is bound by streaming its weights, which XLA:CPU's bf16 matmuls (on AMX too) read
// at 8-14 GB/s on a 2-core Xeon; this kernel reads each weight row as one run across a work item's band of columns.
//
// Tiles: C (sums) in tmm0-3, A in tmm4-5, B in tmm6-7; a block is up to 2 x 2 C tiles (32 rows x 32 columns).
// - w[K, N] (every projection): A is x in bf16 ([T, K], rows of 32 contraction values), B is the weight re-laid in
//   pairs of contraction rows ("VNNI": B row r, column n holds w[2r, n] and w[2r + 1, n]), packed 128 weight rows of
//   a band of columns at a time by interleaving pairs of rows in the core's cache; C is out's rows, continued
//   through out (or a scratch with padded rows) from one packed block of rows to the next.
// - w[N, K] (the tied embedding as the lm_head): the weight's own rows are A tiles, loaded straight from memory,
//   and x^T in pairs is B; C is out^T, transposed into out as it is stored.
// Each output is one tile element's sum over K in increasing order, whatever the batch's other rows are (batch
// invariance). Products are exact in f32 and sums are f32 (TDPBF16PS flushes denormal inputs and sums to zero).
//
// The OS hands AMX's tile state to a process only when asked (Linux's ARCH_REQ_XCOMP_PERM): PaxkvAmxAvailable asks,
// once; every work item loads its tile configuration, since XLA's own kernels may use the tiles on the same threads.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define PAXKV_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

#include "cpu_native_matmul_shape.h"  // MatmulShapeOf
#include "cpu_native_parallel.h"      // ParallelFor, EvenItemSize

#if defined(PAXKV_AMX)

constexpr int64_t kTile = 16;          // rows of a tile; columns of a C or B tile
constexpr int64_t kTileDepth = 32;     // bf16 contraction values in an A tile row
constexpr int64_t kTileBytes = 1024;   // 16 rows of 64 bytes
constexpr int64_t kBlock = 2 * kTile;  // rows and columns of a block of 2 x 2 C tiles
constexpr int64_t kBandBlocks = 12;    // column blocks in a work item's band of w[K, N] (at most)
constexpr int64_t kBandDepth = 128;    // weight rows packed at a time
constexpr int64_t kRowBlocks = 64;     // blocks of w[N, K]'s rows in a work item (at most)

// The tile configuration LDTILECFG reads: palette 1, every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

TileConfig FullTiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.bytes_per_row[i] = 64, config.rows[i] = kTile;
  return config;
}

bool AskForTiles() {
  constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
  constexpr long kXfeatureTileData = 18;      // AMX's tile data
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}

bool TilesGranted() {
  static const bool granted = AskForTiles();
  return granted;
}

// x[T, K] (f32 holding bf16 values: project rounds x first) as bf16 [T_pad, K_pad], zero padded, for A tiles: the
// high halves of 32 values at a time.
void PackRows(const float* x, int64_t t_size, int64_t k_size, int64_t t_pad, int64_t k_pad, uint16_t* to) {
  alignas(64) uint16_t odd_words[32];
  for (int i = 0; i < 32; ++i) odd_words[i] = static_cast<uint16_t>(2 * i + 1);
  const __m512i high_halves = _mm512_load_si512(odd_words);
  std::memset(to + t_size * k_pad, 0, (t_pad - t_size) * k_pad * sizeof(uint16_t));
  for (int64_t t = 0; t < t_size; ++t) {
    const float* from = x + t * k_size;
    uint16_t* row = to + t * k_pad;
    int64_t k = 0;
    for (; k + 32 <= k_size; k += 32) {
      const __m512i low = _mm512_castps_si512(_mm512_loadu_ps(from + k));
      const __m512i high = _mm512_castps_si512(_mm512_loadu_ps(from + k + 16));
      _mm512_storeu_si512(row + k, _mm512_permutex2var_epi16(low, high_halves, high));
    }
    for (; k < k_pad; ++k) {
      uint32_t bits = 0;
      if (k < k_size) std::memcpy(&bits, from + k, sizeof(bits));
      row[k] = static_cast<uint16_t>(bits >> 16);
    }
  }
}

// x^T in pairs for B tiles: pairs[r, t] holds x[t, 2r] (low half) and x[t, 2r + 1], for r < K / 2 (K even), t < T_pad.
void PackColumnPairs(const float* x, int64_t t_size, int64_t k_size, int64_t t_pad, uint32_t* pairs) {
  std::memset(pairs, 0, (k_size / 2) * t_pad * sizeof(uint32_t));
  for (int64_t t = 0; t < t_size; ++t) {
    const uint32_t* from = reinterpret_cast<const uint32_t*>(x + t * k_size);
    for (int64_t k = 0; k < k_size; ++k) {
      uint32_t half = from[k] >> 16;
      pairs[(k / 2) * t_pad + t] |= (k % 2 == 0) ? half : half << 16;
    }
  }
}

// Rows [k0, k0 + depth) of w[K, N]'s column blocks [b0, b1) as B tiles, [block][depth / 32][2][16 rows][64 bytes]:
// row r of a block's tile c holds (w[k0 + 2r, n], w[k0 + 2r + 1, n]) for its 16 columns; zeros past K and N. Each
// weight row is read as one run across the blocks (short runs, a block's 64 bytes a row apart, left the loads
// waiting on memory).
void PackBand(const uint16_t* w, int64_t k_size, int64_t n_size, int64_t k0, int64_t depth, int64_t b0, int64_t b1,
              uint8_t* band) {
  const __m512i first_half = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second_half = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const int64_t block_bytes = depth / kTileDepth * 2 * kTileBytes;
  for (int64_t k = k0; k < k0 + depth; k += 2) {
    const uint16_t* even_row = k < k_size ? w + k * n_size : nullptr;
    const uint16_t* odd_row = k + 1 < k_size ? w + (k + 1) * n_size : nullptr;
    uint8_t* row = band + ((k - k0) / kTileDepth) * 2 * kTileBytes + ((k % kTileDepth) / 2) * 64;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      const __mmask32 lanes = n_size - n0 >= kBlock ? ~__mmask32{0} : __mmask32{0xffff};
      const __m512i even = even_row ? _mm512_maskz_loadu_epi16(lanes, even_row + n0) : _mm512_setzero_si512();
      const __m512i odd = odd_row ? _mm512_maskz_loadu_epi16(lanes, odd_row + n0) : _mm512_setzero_si512();
      // Interleaved within each 128-bit lane: low = columns 0-3, 8-11, 16-19, 24-27; high = 4-7, 12-15, ...
      const __m512i low = _mm512_unpacklo_epi16(even, odd), high = _mm512_unpackhi_epi16(even, odd);
      uint8_t* to = row + (b - b0) * block_bytes;
      _mm512_storeu_si512(to, _mm512_permutex2var_epi64(low, first_half, high));
      _mm512_storeu_si512(to + kTileBytes, _mm512_permutex2var_epi64(low, second_half, high));
    }
  }
}

// kRows x kColumns C tiles of sums, continued over `steps` contraction steps: A tile (i, step) at a + i * a_next +
// step * a_step (rows a_stride bytes apart), B tiles likewise; C tile (i, j) at sums + i * 16 * stride + j * 16
// (rows `stride` floats apart), loaded from there unless `first` (then zeros) and stored back.
template <int kRows, int kColumns>
void Block(const uint8_t* a, int64_t a_next, int64_t a_step, int64_t a_stride, const uint8_t* b, int64_t b_next,
           int64_t b_step, int64_t b_stride, int64_t steps, float* sums, int64_t stride, bool first) {
  const int64_t c_stride = stride * 4, c_down = kTile * stride;
  if (first) {
    _tile_zero(0);
    if constexpr (kColumns > 1) _tile_zero(1);
    if constexpr (kRows > 1) _tile_zero(2);
    if constexpr (kRows > 1 && kColumns > 1) _tile_zero(3);
  } else {
    _tile_loadd(0, sums, c_stride);
    if constexpr (kColumns > 1) _tile_loadd(1, sums + kTile, c_stride);
    if constexpr (kRows > 1) _tile_loadd(2, sums + c_down, c_stride);
    if constexpr (kRows > 1 && kColumns > 1) _tile_loadd(3, sums + c_down + kTile, c_stride);
  }
  for (int64_t step = 0; step < steps; ++step) {
    _tile_loadd(4, a + step * a_step, a_stride);
    if constexpr (kRows > 1) _tile_loadd(5, a + a_next + step * a_step, a_stride);
    _tile_loadd(6, b + step * b_step, b_stride);
    if constexpr (kColumns > 1) _tile_loadd(7, b + b_next + step * b_step, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kColumns > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRows > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (kRows > 1 && kColumns > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, c_stride);
  if constexpr (kColumns > 1) _tile_stored(1, sums + kTile, c_stride);
  if constexpr (kRows > 1) _tile_stored(2, sums + c_down, c_stride);
  if constexpr (kRows > 1 && kColumns > 1) _tile_stored(3, sums + c_down + kTile, c_stride);
}

// Block<kRows, kColumns> for the counts known only at run time (each 1 or 2).
template <typename... Args>
void AnyBlock(int64_t rows, int64_t columns, Args... args) {
  if (rows == 2 && columns == 2) return Block<2, 2>(args...);
  if (rows == 2) return Block<2, 1>(args...);
  if (columns == 2) return Block<1, 2>(args...);
  Block<1, 1>(args...);
}

// out[T, N] = x[T, K] @ w[K, N]: work items of a band of column blocks, packed kBandDepth weight rows at a time
// (each row's run across the band read once) and multiplied into the band's sums for every 32 rows of x.
void MatmulRowsByColumns(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* out, const MatmulShape& s) {
  const int64_t t_pad = (s.t_size + kTile - 1) / kTile * kTile;
  const int64_t k_pad = (s.k_size + kTileDepth - 1) / kTileDepth * kTileDepth;
  std::vector<uint16_t> rows(t_pad * k_pad);
  PackRows(x, s.t_size, s.k_size, t_pad, k_pad, rows.data());
  // Sums of padded rows need room: then they gather in a scratch [T_pad, N] and their first T rows are copied out.
  std::vector<float> scratch(t_pad == s.t_size ? 0 : t_pad * s.n_size);
  float* sums = t_pad == s.t_size ? out : scratch.data();
  const int64_t blocks = (s.n_size + kBlock - 1) / kBlock;
  const int64_t item_blocks = EvenItemSize(pool, blocks, kBandBlocks);
  const int64_t items = (blocks + item_blocks - 1) / item_blocks;
  const TileConfig config = FullTiles();
  auto item = [&](int64_t i) {
    _tile_loadconfig(&config);
    thread_local std::vector<uint8_t> band;
    band.resize(kBandBlocks * kBandDepth / kTileDepth * 2 * kTileBytes);
    const int64_t b0 = i * item_blocks, b1 = std::min(blocks, b0 + item_blocks);
    for (int64_t k0 = 0; k0 < k_pad; k0 += kBandDepth) {
      const int64_t depth = std::min(kBandDepth, k_pad - k0), block_bytes = depth / kTileDepth * 2 * kTileBytes;
      PackBand(w, s.k_size, s.n_size, k0, depth, b0, b1, band.data());
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kBlock, column_tiles = std::min(kBlock, s.n_size - n0) / kTile;
        for (int64_t t0 = 0; t0 < t_pad; t0 += kBlock) {
          AnyBlock(std::min<int64_t>(2, (t_pad - t0) / kTile), column_tiles,
                   reinterpret_cast<const uint8_t*>(rows.data() + t0 * k_pad + k0), kTile * k_pad * 2,
                   kTileDepth * 2, k_pad * 2, band.data() + (b - b0) * block_bytes, kTileBytes, 2 * kTileBytes,
                   int64_t{64}, depth / kTileDepth, sums + t0 * s.n_size + n0, s.n_size, k0 == 0);
        }
      }
    }
    _tile_release();
  };
  ParallelFor(pool, items, item);
  if (sums != out) std::copy(sums, sums + s.t_size * s.n_size, out);
}

// out[T, N] = x[T, K] @ w[N, K]^T (K a multiple of 32): out^T's tiles, w's rows as A tiles straight from memory,
// transposed into out from a block's scratch.
void MatmulRowsByRows(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* out, const MatmulShape& s) {
  const int64_t t_pad = (s.t_size + kTile - 1) / kTile * kTile;
  std::vector<uint32_t> pairs(s.k_size / 2 * t_pad);
  PackColumnPairs(x, s.t_size, s.k_size, t_pad, pairs.data());
  const int64_t blocks = (s.n_size + kBlock - 1) / kBlock;
  const int64_t item_blocks = EvenItemSize(pool, blocks, kRowBlocks);
  const int64_t items = (blocks + item_blocks - 1) / item_blocks;
  const TileConfig config = FullTiles();
  const __m512i column = _mm512_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448, 480);
  auto item = [&](int64_t i) {
    _tile_loadconfig(&config);
    alignas(64) float block_sums[kBlock * kBlock];  // [n][t]
    for (int64_t b = i * item_blocks; b < std::min(blocks, (i + 1) * item_blocks); ++b) {
      const int64_t n0 = b * kBlock, n_tiles = std::min(kBlock, s.n_size - n0) / kTile;
      for (int64_t t0 = 0; t0 < t_pad; t0 += kBlock) {
        const int64_t t_tiles = std::min<int64_t>(2, (t_pad - t0) / kTile);
        AnyBlock(n_tiles, t_tiles, reinterpret_cast<const uint8_t*>(w + n0 * s.k_size), kTile * s.k_size * 2,
                 kTileDepth * 2, s.k_size * 2, reinterpret_cast<const uint8_t*>(pairs.data() + t0), kTile * 4,
                 kTile * t_pad * 4, t_pad * 4, s.k_size / kTileDepth, block_sums, kBlock, true);
        for (int64_t t = t0; t < std::min(s.t_size, t0 + kBlock); ++t) {
          for (int64_t n = 0; n < n_tiles; ++n) {
            _mm512_storeu_ps(out + t * s.n_size + n0 + n * kTile,
                             _mm512_i32gather_ps(column, block_sums + n * kTile * kBlock + (t - t0), 4));
          }
        }
      }
    }
    _tile_release();
  };
  ParallelFor(pool, items, item);
}

ffi::Error AmxMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, bool contraction_last,
                     ffi::ResultBuffer<ffi::F32> out) {
  MatmulShape shape;
  if (ffi::Error error = MatmulShapeOf(x, w, contraction_last, shape); error.failure()) return error;
  if (WroteEmptyProduct(shape, out->typed_data())) return ffi::Error::Success();
  if (!TilesGranted()) return ffi::Error::Internal("the OS did not grant this process AMX's tile state");
  if (shape.n_size % kTile != 0 || (contraction_last && shape.k_size % kTileDepth != 0)) {
    return ffi::Error::InvalidArgument("the AMX matmul takes N a multiple of 16 (and K of 32 for an [N, K] weight)");
  }
  const uint16_t* w_data = reinterpret_cast<const uint16_t*>(w.untyped_data());
  if (contraction_last) {
    MatmulRowsByRows(pool, x.typed_data(), w_data, out->typed_data(), shape);
  } else {
    MatmulRowsByColumns(pool, x.typed_data(), w_data, out->typed_data(), shape);
  }
  return ffi::Error::Success();
}

#else  // no AMX in this build

ffi::Error AmxMatmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::AnyBuffer, bool, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("this build of the native kernels has no AMX (the machine lacks amx_bf16)");
}

#endif

}  // namespace

// 1 when this build has the AMX kernel and the OS granted the process AMX's tile state, else 0.
extern "C" int PaxkvAmxAvailable() {
#if defined(PAXKV_AMX)
  return TilesGranted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuAmxMatmulBF16, AmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K], values already bf16
                                  .Arg<ffi::AnyBuffer>()         // w: bf16[K, N], or [N, K] if contraction_last
                                  .Attr<bool>("contraction_last")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N]
