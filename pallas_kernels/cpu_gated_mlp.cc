// A gated MLP, down(silu(x @ gate) * (x @ up)), with its three weights stored as column panels (f32, or bf16 pairs),
// in one XLA FFI call (pallas_kernels/cpu_gated_mlp.py).
//
// Through three panel matmuls and XLA, a 2048-row prompt chunk's MLP writes gate's and up's products to memory (12.6
// MB each at SmolLM2's 1536 columns), reads them back for silu(gate) * up, writes that, and reads it again to round
// and pack it for the down projection: about 90 MB of traffic a layer that the multiply-adds wait on. Here a work item
// multiplies a chunk of rows by one gate panel and by the same up panel into two small blocks in the first-level cache,
// and writes silu(gate) * up from them straight into the down projection's input, packed tile by tile (rounded to bf16
// pairs for bf16 panels) as PackRowTiles would have laid it out. x is rounded and packed once for gate and up. The
// down projection then runs as the panel matmul does.
//
// Numerics: gate's and up's sums, and the down projection's, are the panel matmul's bit for bit (the same tiles, blocks
// and order). silu is g * sigmoid(g) from e^-|g| by cpu_native_vectors.h's Exp (a degree-7 polynomial), not XLA's, so
// an element of h may differ from the unfused path's in its last bit (in bf16, rarely, its last bf16 bit). Each
// output row depends on its own input row alone, whatever the batch (batch invariance).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
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

#include "cpu_native_parallel.h"        // ParallelFor, EvenItemSize
#include "cpu_native_vectors.h"         // Vec (the machine's width), Exp
#include "cpu_native_register_tile.h"   // AccumulateTile
#include "cpu_panel_tiles.h"            // PanelSplit, MultiplyPanelRows, MatmulPanels
#include "cpu_panel_row_packing.h"      // PackRowTiles, PackFullTile

// silu(g) * u lane by lane: g * sigmoid(g) * u, the sigmoid from e = e^-|g| (Exp takes arguments <= 0) as 1 / (1 + e)
// for g >= 0 and e / (1 + e) below, so that neither overflows.
inline Vec SiluTimes(Vec g, Vec u) {
  const Vec e = Exp(g < Vec{} ? g : -g);
  const Vec sigmoid = (g < Vec{} ? e : Vec{} + 1.0f) / (e + 1.0f);
  return g * sigmoid * u;
}

// Rows [t0, t0 + rows) of h = silu(gate) * up at columns [c0, c0 + width), from gate's and up's sums (g and u, rows
// kPanelWidth apart), into `packed_h`: the down projection's input x[T, F] as PackRowTiles lays it out, over
// `h_steps` contraction steps a row (F; with kPairs, h rounded to bf16 pairs, ceil(F / 2), F odd padded with a zero).
// g is overwritten with h. Tiles start every kRowBlock rows from t0 (a multiple of kRowBlock), as PackRowTiles' do.
template <bool kPairs>
void WriteGatedRows(float* g, const float* u, int64_t t0, int64_t rows, int64_t t_size, int64_t c0, int64_t width,
                    int64_t h_steps, float* packed_h) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < kTileVectors * kTilesAcross; ++v) {
      float* at = g + r * kPanelWidth + v * kLanes;
      StoreVec(at, SiluTimes(LoadVec(at), LoadVec(u + r * kPanelWidth + v * kLanes)));
    }
  }
  const float* from = g;
  int64_t from_stride = kPanelWidth, steps = width, first_step = c0;
  alignas(64) uint16_t pairs[kFewRows * kPanelWidth];
  if constexpr (kPairs) {
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* row = pairs + r * kPanelWidth;
      RoundToBf16s(g + r * kPanelWidth, width, row);
      if (width % 2) row[width] = 0;
    }
    from = reinterpret_cast<const float*>(pairs);
    from_stride = kPanelWidth / 2;
    steps = (width + 1) / 2;
    first_step = c0 / 2;
  }
  for (int64_t t = t0; t < t0 + rows; t += kRowBlock) {
    const int64_t height = std::min(kRowBlock, t_size - t);
    float* to = packed_h + t * h_steps + first_step * height;
    const float* tile_from = from + (t - t0) * from_stride;
    if (height == kRowBlock) {
      PackFullTile(tile_from, from_stride, steps, to);
    } else {
      PackSteps(tile_from, from_stride, height, 0, steps, to);
    }
  }
}

// out[T, N] = (silu(x @ gate) * (x @ up)) @ down, for f32 x[T, K], gate and up [P, k_size, kPanelWidth] over F =
// mlp_width columns (k_size: K, or bf16 panels' ceil(K / 2) pair steps), and down [Pd, h_steps, kPanelWidth], N at
// most Pd * kPanelWidth. With a `norm`, x's rows are normed as they are packed (RowNorm).
template <typename Weight>
void GatedMlp(ffi::ThreadPool& pool, const float* x, int64_t t_size, int64_t x_width, int64_t k_size,
              int64_t num_panels, int64_t mlp_width, PanelOperand<Weight> gate, PanelOperand<Weight> up,
              PanelOperand<Weight> down, int64_t n_size, float* out, RowNorm norm) {
  constexpr bool kPairs = std::is_same_v<Weight, Bf16Pair>;
  const PanelSplit split(pool, t_size, k_size, num_panels * kPanelWidth, false);
  std::vector<float> packed_x_buffer;  // back to packed_buffers at the end
  const float* packed_x = PackRowTiles(pool, x, t_size, x_width, split.tile_rows, kPairs, packed_x_buffer, norm);
  const int64_t h_steps = kPairs ? (mlp_width + 1) / 2 : mlp_width;
  std::vector<float> packed_h = packed_buffers.Take(t_size * h_steps);
  auto item = [&](int64_t i) {
    int64_t p_begin, p_end, t_begin, t_end;
    split.ItemBounds(i, p_begin, p_end, t_begin, t_end);
    const Weight* gate_end = gate.panels + p_end * k_size * kPanelWidth;
    const Weight* up_end = up.panels + p_end * k_size * kPanelWidth;
    static_assert(kRowChunk <= kFewRows, "a chunk of rows (split.row_chunk) fits the blocks below");
    alignas(64) float g[kFewRows * kPanelWidth], u[kFewRows * kPanelWidth];  // a chunk's sums, rows kPanelWidth apart
    for (int64_t t0 = t_begin; t0 < t_end; t0 += split.row_chunk) {
      const int64_t rows = std::min(split.row_chunk, t_end - t0);
      for (int64_t p = p_begin; p < p_end; ++p) {
        const bool prefetching = t0 == t_begin;
        MultiplyPanelRows(split, packed_x, nullptr, gate, p, t0, rows, prefetching, gate_end, g, kPanelWidth);
        MultiplyPanelRows(split, packed_x, nullptr, up, p, t0, rows, prefetching, up_end, u, kPanelWidth);
        const int64_t c0 = p * kPanelWidth;
        WriteGatedRows<kPairs>(g, u, t0, rows, t_size, c0, std::min(kPanelWidth, mlp_width - c0), h_steps,
                               packed_h.data());
      }
    }
  };
  ParallelFor(pool, split.NumItems(), item);
  const PanelSplit down_split(pool, t_size, h_steps, n_size, false);
  MatmulPanels(pool, down_split, packed_h.data(), nullptr, down, out);
  packed_buffers.Give(std::move(packed_h));
  if (!packed_x_buffer.empty()) packed_buffers.Give(std::move(packed_x_buffer));
}

// Checks the weights' shapes against x[T, K] and the MLP's width F: gate and up [ceil(F / 48), steps(K), 48, pair...],
// down [Pd, steps(F), 48, pair...], where steps(n) is n (f32) or ceil(n / 2) (bf16 pairs, with a last axis of 2).
ffi::Error CheckGatedShapes(ffi::Span<const int64_t> x_dims, ffi::Span<const int64_t> gate_dims,
                            ffi::Span<const int64_t> up_dims, ffi::Span<const int64_t> down_dims, int64_t mlp_width,
                            bool pairs) {
  const size_t rank = pairs ? 4 : 3;
  auto steps = [pairs](int64_t n) { return pairs ? (n + 1) / 2 : n; };
  auto panel_shaped = [&](ffi::Span<const int64_t> dims) {
    return dims.size() == rank && dims[2] == kPanelWidth && (!pairs || dims[3] == 2);
  };
  if (x_dims.size() != 2 || !panel_shaped(gate_dims) || !panel_shaped(up_dims) || !panel_shaped(down_dims)) {
    return ffi::Error::InvalidArgument(pairs ? "expected x[T, K] and bf16 panels[P, ceil(K / 2), 48, 2]"
                                             : "expected x[T, K] and panels[P, K, 48]");
  }
  if (x_dims[1] < 1) return ffi::Error::InvalidArgument("x's contraction dimension is empty");
  if (!std::equal(gate_dims.begin(), gate_dims.end(), up_dims.begin()) || gate_dims[1] != steps(x_dims[1])) {
    return ffi::Error::InvalidArgument("gate and up must be panels of the same shape over x's contraction dimension");
  }
  const int64_t mlp_panels = (mlp_width + kPanelWidth - 1) / kPanelWidth;
  if (mlp_width < 1 || gate_dims[0] != mlp_panels || down_dims[1] != steps(mlp_width)) {
    return ffi::Error::InvalidArgument("gate's panels and down's contraction dimension do not match mlp_width");
  }
  return ffi::Error::Success();
}

template <typename Weight>
ffi::Error RunGatedMlp(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, const ffi::Buffer<ffi::F32>& norm_weight,
                       const Weight* gate, const Weight* up, const Weight* down, ffi::Span<const int64_t> gate_dims,
                       ffi::Span<const int64_t> down_dims, int64_t mlp_width, float norm_eps,
                       ffi::Result<ffi::Buffer<ffi::F32>>& out) {
  const int64_t t_size = x.dimensions()[0], x_width = x.dimensions()[1];
  RowNorm norm;
  if (ffi::Error error = NormOf(norm_weight, x_width, norm_eps, norm); error.failure()) return error;
  const auto out_dims = out->dimensions();
  if (out_dims.size() != 2 || out_dims[0] != t_size || out_dims[1] > down_dims[0] * kPanelWidth) {
    return ffi::Error::InvalidArgument("expected an output [T, N] with N at most down's Pd * 48 columns");
  }
  if (t_size == 0 || out_dims[1] == 0) return ffi::Error::Success();
  GatedMlp(pool, x.typed_data(), t_size, x_width, gate_dims[1], gate_dims[0], mlp_width, PanelOperand<Weight>{gate},
           PanelOperand<Weight>{up}, PanelOperand<Weight>{down}, out_dims[1], out->typed_data(), norm);
  return ffi::Error::Success();
}

ffi::Error GatedMlpF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm_weight,
                       ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> up, ffi::Buffer<ffi::F32> down,
                       ffi::ResultBuffer<ffi::F32> out, int64_t mlp_width, float norm_eps) {
  const auto gate_dims = gate.dimensions(), down_dims = down.dimensions();
  if (ffi::Error error = CheckGatedShapes(x.dimensions(), gate_dims, up.dimensions(), down_dims, mlp_width, false);
      error.failure()) {
    return error;
  }
  return RunGatedMlp(pool, x, norm_weight, gate.typed_data(), up.typed_data(), down.typed_data(), gate_dims,
                     down_dims, mlp_width, norm_eps, out);
}

ffi::Error GatedMlpBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm_weight,
                        ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down, ffi::ResultBuffer<ffi::F32> out,
                        int64_t mlp_width, float norm_eps) {
  for (const ffi::AnyBuffer* weight : {&gate, &up, &down}) {
    if (weight->element_type() != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("expected bf16 panels for gate, up and down");
    }
  }
  const auto gate_dims = gate.dimensions(), down_dims = down.dimensions();
  if (ffi::Error error = CheckGatedShapes(x.dimensions(), gate_dims, up.dimensions(), down_dims, mlp_width, true);
      error.failure()) {
    return error;
  }
  auto pairs_of = [](const ffi::AnyBuffer& weight) { return reinterpret_cast<const Bf16Pair*>(weight.untyped_data()); };
  return RunGatedMlp(pool, x, norm_weight, pairs_of(gate), pairs_of(up), pairs_of(down), gate_dims, down_dims,
                     mlp_width, norm_eps, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuGatedMlpF32, GatedMlpF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm_weight: [K], or [0] for no norm
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate: [ceil(F / 48), K, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // up: [ceil(F / 48), K, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down: [Pd, F, 48]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out: [T, N], N <= Pd * 48
                                  .Attr<int64_t>("mlp_width")    // F
                                  .Attr<float>("norm_eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuGatedMlpBf16, GatedMlpBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm_weight: [K], or [0] for no norm
                                  .Arg<ffi::AnyBuffer>()         // gate: bf16[ceil(F / 48), ceil(K / 2), 48, 2]
                                  .Arg<ffi::AnyBuffer>()         // up: the same
                                  .Arg<ffi::AnyBuffer>()         // down: bf16[Pd, ceil(F / 2), 48, 2]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out: [T, N], N <= Pd * 48
                                  .Attr<int64_t>("mlp_width")    // F
                                  .Attr<float>("norm_eps"));
