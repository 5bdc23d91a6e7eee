// Part of the native CPU matmuls (included inside their anonymous namespaces after cpu_native_vectors.h, never on its
// own): the register tile's contraction loop, shared by the blocked and panel kernels.

#ifndef PAXKV_CPU_NATIVE_REGISTER_TILE_H_
#define PAXKV_CPU_NATIVE_REGISTER_TILE_H_

// acc + x * w for one loaded weight vector: a product per lane (f32, or bf16 and int8 widened to f32), or, for bf16
// pairs (the bf16 panel layout; x then holds a pair of x's values rounded to bf16 per lane), two (DotPairs).
template <typename Weight>
inline Vec AddProducts(Vec acc, Vec x, Vec w, const Weight*) {
  return acc + x * w;
}
inline Vec AddProducts(Vec acc, Vec x, Vec w, const Bf16Pair*) { return DotPairs(acc, x, w); }

// acc[r][v] += x[r * k_size + k] * weights[k * weight_stride + v * kLanes] for k < depth, in order of k: each step
// loads kVectors weight vectors (f32, or int8 widened to f32: cpu_native_vectors.h's LoadValues) and broadcasts kRows
// values of x, for kRows * kVectors independent multiply-adds. With bf16 pairs a step is two contraction rows, x's
// values are pairs rounded to bf16 too, and each multiply-add is a DotPairs. `each_step(k)` runs once per step first
// (the panel kernel's prefetches ride on it). With kPackedX, x is the tile's rows packed step by step instead,
// x[k * kRows + r] (PackRowTiles in the panel kernel): one pointer and constant offsets, where kRows row pointers had
// outgrown the general registers and went through the stack and vector registers on every step (the same sums in the
// same order).
template <int64_t kRows, int64_t kVectors, bool kPackedX = false, typename Weight, typename EachStep>
inline void AccumulateTile(Vec (&acc)[kRows][kVectors], const float* x, int64_t k_size, const Weight* weights,
                           int64_t weight_stride, int64_t depth, EachStep&& each_step) {
  for (int64_t k = 0; k < depth; ++k) {
    each_step(k);
    const Weight* row = weights + k * weight_stride;
    Vec loaded[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) loaded[v] = LoadValues(row + v * kLanes);
    for (int64_t r = 0; r < kRows; ++r) {
      const Vec value = Splat(kPackedX ? x[k * kRows + r] : x[r * k_size + k]);
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = AddProducts(acc[r][v], value, loaded[v], row);
    }
  }
}

#endif  // PAXKV_CPU_NATIVE_REGISTER_TILE_H_
