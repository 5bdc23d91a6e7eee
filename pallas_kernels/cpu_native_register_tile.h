// Part of the native CPU matmuls (included inside their anonymous namespaces after cpu_native_vectors.h, never on its
// own): the register tile's contraction loop, shared by the blocked and panel kernels.

#ifndef PAXKV_CPU_NATIVE_REGISTER_TILE_H_
#define PAXKV_CPU_NATIVE_REGISTER_TILE_H_

// acc[r][v] += x[r * k_size + k] * weights[k * weight_stride + v * kLanes] for k < depth, in order of k: each step
// loads kVectors weight vectors (f32, or int8 widened to f32: cpu_native_vectors.h's LoadValues) and broadcasts kRows
// values of x, for kRows * kVectors independent multiply-adds. `each_step(k)` runs once per step first (the panel
// kernel's prefetches ride on it). With kPackedX, x is the tile's rows packed step by step instead, x[k * kRows + r]
// (PackRowTiles in the panel kernel): one pointer and constant offsets, where kRows row pointers had outgrown the
// general registers and went through the stack and vector registers on every step (the same sums in the same order).
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
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] += value * loaded[v];
    }
  }
}

#endif  // PAXKV_CPU_NATIVE_REGISTER_TILE_H_
