// Part of the native CPU matmuls (included inside their anonymous namespaces, never on its own): the custom call's
// operand checks, shared by the small-row and blocked kernels.

#ifndef PAXKV_CPU_NATIVE_MATMUL_SHAPE_H_
#define PAXKV_CPU_NATIVE_MATMUL_SHAPE_H_

struct MatmulShape {
  int64_t t_size, k_size, n_size;  // x[T, K] @ w -> out[T, N]
};

// The sizes of x[T, K] times w ([K, N], or [N, K] if contraction_last), or an error naming what does not fit.
inline ffi::Error MatmulShapeOf(const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& w, bool contraction_last,
                                MatmulShape& shape) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2) return ffi::Error::InvalidArgument("expected x[T, K] and a 2-D w");
  shape = {x_dims[0], x_dims[1], contraction_last ? w_dims[0] : w_dims[1]};
  if ((contraction_last ? w_dims[1] : w_dims[0]) != shape.k_size) {
    return ffi::Error::InvalidArgument("the weight's contraction dimension does not match x's");
  }
  return ffi::Error::Success();
}

// Whether the product has nothing to multiply (no rows, columns or contraction); out, if it has any elements, is
// then zeros.
inline bool WroteEmptyProduct(const MatmulShape& shape, float* out) {
  if (shape.t_size > 0 && shape.n_size > 0 && shape.k_size > 0) return false;
  std::fill(out, out + shape.t_size * shape.n_size, 0.0f);
  return true;
}

#endif  // PAXKV_CPU_NATIVE_MATMUL_SHAPE_H_
