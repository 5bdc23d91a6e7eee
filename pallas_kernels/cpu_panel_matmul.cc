// Activation rows times an f32 weight stored as column panels, as an XLA FFI custom call (pallas_kernels/
// cpu_panel_matmul.py; models.packed_weights packs a model's projections once, when an engine starts).
//
// A decode batch's f32 matmul at 8-64 rows is bound by arithmetic and by streaming its weights in about equal parts
// on a 2-core Xeon (SmolLM2's 30 MLPs at 32 rows: 5.1 GFLOP against 428 GFLOP/s of multiply-adds, 318 MB against 24
// GB/s), so the two have to overlap. The blocked kernel reads a [K, N] weight a band of columns at a time, each
// contraction row in another page, and packs it in cache before multiplying; its reads and its arithmetic
// take turns (43 ms for those MLPs). Here the weight was laid out once as panels[P, K, kPanelWidth] (column panel
// p holds w[:, p * kPanelWidth : (p + 1) * kPanelWidth], each row of it one run), so a work item streams one
// contiguous run of memory and multiplies straight from it; while a block of it is multiplied, the next block is
// prefetched one line per step of the contraction, spread over every tile, so the reads run beside the arithmetic
// (the same MLPs in 25 ms, measured with a standalone harness before this kernel).
//
// A register tile is kRowBlock x rows by kTileVectors vectors of outputs (AVX-512: 8 x 3 = 24 of the 32 registers;
// 8-lane machines: 4 x 3 of 16, a panel as two halves). A tile's sums run over a depth block in registers and
// continue through `out` across blocks, in the same order: each output sums over K in one order whatever the
// batch's other rows are (batch invariance).
//
// The tiles read x packed tile by tile, each step's rows side by side (PackRowTiles, once per call): broadcasting from
// one pointer at constant offsets. Read in place, a tile's 8 row pointers outgrew the general registers, and every
// step moved them through the stack and vector registers (30 SmolLM2 MLPs on a 2-core Zen 4, 32 / 256 / 2048 rows:
// 170 / 200 / 200 -> 179 / 214 / 208 GFLOP/s).
//
// int8 panels (weight-only quantization, PaxkvCpuPanelMatmulInt8) are widened to f32 as they are loaded, and carry
// an f32 scale and min per group of kGroupRows contraction rows and column (w = scale * q + min): a group's sums start
// from zero, and go into the total as scale * sums + min * (x's sum over the group), two fused multiply-adds spelled
// out so that every tile height rounds alike. Under kRowBlock rows, sums and totals stay in registers over kGroupsFew
// groups, in tiles of kGroupRowBlock rows; more rows take a block per group with kRowBlock-row tiles, the total
// through `out`. Both do the same operations in the same order.
//
// bf16 panels (PaxkvCpuPanelMatmulBf16) hold contraction rows in pairs, [P, ceil(K / 2), kPanelWidth, 2]: a step of
// the contraction is two rows, and a weight vector is kLanes columns' pairs, which AVX-512 BF16's VDPBF16PS multiplies
// by a pair of x's values rounded to bf16 (DotPairs): twice the multiply-adds per instruction and half the bytes of
// f32. x is rounded to bf16 as it is packed, once per call (PackRowTiles), and from there every path is the f32 one
// with Bf16Pair weights and half as many steps: the same tiles, blocks, packing and prefetches (a block of pairs holds
// as many bytes as an f32 block of as many steps).
//
// The several-weight call (PaxkvCpuPanelMatmuls*, an attention block's q, k and v) and the gated MLP can take an RMS
// norm's weight: the packing norms each row of x as it copies it (RowNorm), so a pre-norm block's norm costs no pass
// of its own over memory and no programs of XLA's (30 SmolLM2 layers' q/k/v and MLP on a 2-core Zen 4, against XLA's
// norm first: 1% faster in f32, 1.5-2% in bf16).

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
#include "cpu_native_vectors.h"         // Vec (the machine's width), Splat
#include "cpu_native_register_tile.h"   // AccumulateTile
#include "cpu_panel_tiles.h"            // PanelSplit, MatmulPanels
#include "cpu_panel_row_packing.h"      // PackRowTiles

// Checks the operands' shapes: x[T, K] and panels[P, K, 48].
ffi::Error CheckPanelShapes(ffi::Span<const int64_t> x_dims, ffi::Span<const int64_t> p_dims) {
  if (x_dims.size() != 2 || p_dims.size() != 3 || p_dims[2] != kPanelWidth) {
    return ffi::Error::InvalidArgument("expected x[T, K] and panels[P, K, 48]");
  }
  if (p_dims[1] != x_dims[1]) {
    return ffi::Error::InvalidArgument("the panels' contraction dimension does not match x's");
  }
  return ffi::Error::Success();
}

// Checks an output's shape against x's rows and its weight's P panels: f32[T, N], N at most P * 48 (the product's
// columns: the first ceil(N / 48) panels', the last one's perhaps in part).
ffi::Error CheckOutputShape(ffi::Span<const int64_t> out_dims, int64_t t_size, int64_t num_panels) {
  if (out_dims.size() != 2 || out_dims[0] != t_size || out_dims[1] > num_panels * kPanelWidth) {
    return ffi::Error::InvalidArgument("expected an output [T, N] with N at most the panels' P * 48 columns");
  }
  return ffi::Error::Success();
}

template <typename Weight>
ffi::Error RunPanelMatmul(ffi::ThreadPool& pool, const float* x, ffi::Span<const int64_t> x_dims, const Weight* panels,
                          ffi::Span<const int64_t> p_dims, const float* scales, const float* mins,
                          ffi::Result<ffi::Buffer<ffi::F32>>& out) {
  if (ffi::Error error = CheckPanelShapes(x_dims, p_dims); error.failure()) return error;
  const int64_t t_size = x_dims[0], k_size = x_dims[1];
  if (ffi::Error error = CheckOutputShape(out->dimensions(), t_size, p_dims[0]); error.failure()) return error;
  const int64_t n_size = out->dimensions()[1];
  float* result = out->typed_data();
  if (t_size == 0 || n_size == 0) return ffi::Error::Success();
  if (k_size == 0) {
    std::fill(result, result + t_size * n_size, 0.0f);
    return ffi::Error::Success();
  }
  const PanelSplit split(pool, t_size, k_size, n_size, scales != nullptr);
  const std::vector<float> x_sums =
      split.grouped ? GroupSums(pool, x, t_size, k_size, split.num_groups) : std::vector<float>();
  std::vector<float> packed;  // back to packed_buffers at the end
  const float* packed_x = PackRowTiles(pool, x, t_size, k_size, split.tile_rows, false, packed);
  MatmulPanels(pool, split, packed_x, x_sums.data(), PanelOperand<Weight>{panels, scales, mins}, result);
  if (!packed.empty()) packed_buffers.Give(std::move(packed));
  return ffi::Error::Success();
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                       ffi::ResultBuffer<ffi::F32> out) {
  return RunPanelMatmul(pool, x.typed_data(), x.dimensions(), panels.typed_data(), panels.dimensions(), nullptr,
                        nullptr, out);
}

ffi::Error PanelMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> panels,
                           ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> out) {
  auto p_dims = panels.dimensions();
  if (p_dims.size() == 3) {
    for (auto dims : {scales.dimensions(), mins.dimensions()}) {
      if (dims.size() != 3 || dims[0] != p_dims[0] || dims[1] != (p_dims[1] + kGroupRows - 1) / kGroupRows ||
          dims[2] != kPanelWidth) {
        return ffi::Error::InvalidArgument("expected scales and mins [P, ceil(K / 32), 48], one per group and column");
      }
    }
  }
  return RunPanelMatmul(pool, x.typed_data(), x.dimensions(), panels.typed_data(), p_dims, scales.typed_data(),
                        mins.typed_data(), out);
}

ffi::Error PanelMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer panels,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto x_dims = x.dimensions();
  auto p_dims = panels.dimensions();
  if (panels.element_type() != ffi::DataType::BF16 || x_dims.size() != 2 || p_dims.size() != 4 ||
      p_dims[2] != kPanelWidth || p_dims[3] != 2) {
    return ffi::Error::InvalidArgument("expected x[T, K] and bf16 panels[P, ceil(K / 2), 48, 2]");
  }
  if (p_dims[1] != (x_dims[1] + 1) / 2) {
    return ffi::Error::InvalidArgument("the panels' contraction pairs do not match x's contraction dimension");
  }
  const int64_t t_size = x_dims[0], k_size = x_dims[1];
  if (ffi::Error error = CheckOutputShape(out->dimensions(), t_size, p_dims[0]); error.failure()) return error;
  const int64_t n_size = out->dimensions()[1];
  float* result = out->typed_data();
  if (t_size == 0 || n_size == 0) return ffi::Error::Success();
  if (k_size == 0) {
    std::fill(result, result + t_size * n_size, 0.0f);
    return ffi::Error::Success();
  }
  std::vector<float> packed;  // back to packed_buffers at the end
  const PanelSplit split(pool, t_size, (k_size + 1) / 2, n_size, false);
  const float* packed_x = PackRowTiles(pool, x.typed_data(), t_size, k_size, split.tile_rows, true, packed);
  MatmulPanels(pool, split, packed_x, nullptr,
               PanelOperand<Bf16Pair>{reinterpret_cast<const Bf16Pair*>(panels.untyped_data())}, result);
  packed_buffers.Give(std::move(packed));
  return ffi::Error::Success();
}

// x[T, K] times several weights of one kind (f32 panels [P_i, K, 48], or bf16 pairs [P_i, ceil(K / 2), 48, 2]), into
// out_i[T, N_i] (N_i at most P_i * 48): x packed once, and every product's work items in one pass over the pool. Each
// product keeps the split that a call of its own makes, so each output is that call's, bit for bit. (An attention
// block's q, k and v on SmolLM2, bf16 panels on a 2-core Zen 4: as one 960-column product, 2048 rows took 6.1 ms
// against 3.6 + 1.5 + 1.5 in three calls, and 16 rows 0.072 against 0.093: x packed three times, and k's and v's 4
// panels split finely.)
// norm_weight: an RMS norm's weight f32[K], applied to x's rows as they are packed (RowNorm), or f32[0] for none.
template <typename Weight>
ffi::Error RunPanelMatmuls(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm_weight,
                           ffi::RemainingArgs weights, ffi::RemainingRets outs, float norm_eps) {
  constexpr bool kPairs = std::is_same_v<Weight, Bf16Pair>;
  const ffi::DataType weight_type = kPairs ? ffi::DataType::BF16 : ffi::DataType::F32;
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || weights.size() == 0 || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument("expected x[T, K], then one or more weights' panels and an output for each");
  }
  const int64_t t_size = x_dims[0], x_width = x_dims[1], k_size = kPairs ? (x_width + 1) / 2 : x_width;
  const size_t rank = kPairs ? 4 : 3;
  RowNorm norm;
  if (ffi::Error error = NormOf(norm_weight, x_width, norm_eps, norm); error.failure()) return error;
  struct Product {
    PanelOperand<Weight> weight;
    float* out;
    int64_t n_size;
  };
  std::vector<Product> products;
  for (size_t i = 0; i < weights.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> weight = weights.get<ffi::AnyBuffer>(i);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = outs.get<ffi::AnyBuffer>(i);
    if (weight.has_error() || out.has_error()) return ffi::Error::InvalidArgument("a weight or output is no buffer");
    const auto p_dims = weight->dimensions(), out_dims = (*out)->dimensions();
    if (weight->element_type() != weight_type || p_dims.size() != rank || p_dims[1] != k_size ||
        p_dims[2] != kPanelWidth || (kPairs && p_dims[3] != 2)) {
      return ffi::Error::InvalidArgument(kPairs ? "expected bf16 panels[P, ceil(K / 2), 48, 2] over x's K"
                                                : "expected f32 panels[P, K, 48] over x's K");
    }
    if ((*out)->element_type() != ffi::DataType::F32 || out_dims.size() != 2 || out_dims[0] != t_size ||
        out_dims[1] > p_dims[0] * kPanelWidth) {
      return ffi::Error::InvalidArgument("expected f32 outputs [T, N_i], one per weight, N_i at most its P_i * 48");
    }
    products.push_back({{reinterpret_cast<const Weight*>(weight->untyped_data())},
                        reinterpret_cast<float*>((*out)->untyped_data()), out_dims[1]});
  }
  if (t_size == 0) return ffi::Error::Success();
  if (k_size == 0) {
    for (const Product& product : products) {
      std::fill(product.out, product.out + t_size * product.n_size, 0.0f);
    }
    return ffi::Error::Success();
  }
  std::vector<PanelSplit> splits;
  std::vector<int64_t> first_items = {0};  // product i's items are [first_items[i], first_items[i + 1])
  for (const Product& product : products) {
    splits.emplace_back(pool, t_size, k_size, product.n_size, false);
    first_items.push_back(first_items.back() + splits.back().NumItems());
  }
  std::vector<float> packed;  // back to packed_buffers at the end
  const float* packed_x =
      PackRowTiles(pool, x.typed_data(), t_size, x_width, splits[0].tile_rows, kPairs, packed, norm);
  auto item = [&](int64_t i) {
    size_t p = 0;
    while (i >= first_items[p + 1]) ++p;
    MultiplyPanelItem(splits[p], packed_x, nullptr, products[p].weight, products[p].out, i - first_items[p]);
  };
  ParallelFor(pool, first_items.back(), item);
  if (!packed.empty()) packed_buffers.Give(std::move(packed));
  return ffi::Error::Success();
}

ffi::Error PanelMatmulsF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm_weight,
                           ffi::RemainingArgs weights, ffi::RemainingRets outs, float norm_eps) {
  return RunPanelMatmuls<float>(pool, x, norm_weight, weights, outs, norm_eps);
}

ffi::Error PanelMatmulsBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> norm_weight,
                            ffi::RemainingArgs weights, ffi::RemainingRets outs, float norm_eps) {
  return RunPanelMatmuls<Bf16Pair>(pool, x, norm_weight, weights, outs, norm_eps);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulF32, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // panels: [P, K, 48]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N], N <= P * 48

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulInt8, PanelMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()     // panels: [P, K, 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scales: [P, ceil(K / 32), 48]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // mins: [P, ceil(K / 32), 48]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N], N <= P * 48

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulBf16, PanelMatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: [T, K]
                                  .Arg<ffi::AnyBuffer>()           // panels: bf16[P, ceil(K / 2), 48, 2]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: [T, N], N <= P * 48

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulsF32, PanelMatmulsF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm_weight: [K], or [0] for no norm
                                  .RemainingArgs()               // each weight's panels: [P_i, K, 48]
                                  .RemainingRets()               // each product: [T, N_i <= P_i * 48]
                                  .Attr<float>("norm_eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PaxkvCpuPanelMatmulsBf16, PanelMatmulsBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // norm_weight: [K], or [0] for no norm
                                  .RemainingArgs()               // each weight's panels: bf16[P_i, ceil(K / 2), 48, 2]
                                  .RemainingRets()               // each product: [T, N_i <= P_i * 48]
                                  .Attr<float>("norm_eps"));
