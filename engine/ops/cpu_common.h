// Internal to engine/ops: dtype dispatch for the templated CPU kernels and Eigen views of tensors.
// Not part of the public interface.
#pragma once

#include "chunkwise_config.h"
#include "engine/error.h"
#include "engine/tensor.h"

// At a public op entry, after the op's contract is checked (every operand on the device of
// `tensor`): tensors on a GPU go to the CUDA implementation (engine/cuda/ops.h), which checks only
// its own limits; the rest of the function is the CPU path. In a build without CUDA a GPU tensor
// stops here with a clear error instead.
#if CW_HAVE_CUDA
#include "engine/cuda/ops.h"
#define CW_DISPATCH_GPU(tensor, call)                 \
  do {                                                \
    if (!(tensor).device.is_cpu()) return ::cw::gpu::call; \
  } while (0)
#else
#define CW_DISPATCH_GPU(tensor, call) ::cw::cpu::check_cpu(tensor, #call)
#endif

#include <Eigen/Core>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace cw::cpu {

template <class T> using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T> using MatrixMap = Eigen::Map<RowMatrix<T>, 0, Eigen::OuterStride<>>;
template <class T> using ConstMatrixMap = Eigen::Map<const RowMatrix<T>, 0, Eigen::OuterStride<>>;

// A [rows, cols] row-major view starting at p with `row_stride` elements between rows.
template <class T> MatrixMap<T> matrix(T* p, int64_t rows, int64_t cols, int64_t row_stride) {
  return MatrixMap<T>(p, rows, cols, Eigen::OuterStride<>(row_stride));
}
template <class T> ConstMatrixMap<T> cmatrix(const T* p, int64_t rows, int64_t cols, int64_t row_stride) {
  return ConstMatrixMap<T>(p, rows, cols, Eigen::OuterStride<>(row_stride));
}
// A contiguous 2-d tensor as a matrix.
template <class T> MatrixMap<T> matrix(const Tensor& t) {
  return matrix<T>(t.ptr<T>(), t.size(0), t.size(1), t.size(1));
}
template <class T> ConstMatrixMap<T> cmatrix(const Tensor& t) {
  return cmatrix<T>(t.ptr<T>(), t.size(0), t.size(1), t.size(1));
}

// Calls f(T{}) with T = double or float according to the dtype; the CPU has no bf16 compute path.
template <class F> void dispatch_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f64: f(double{}); return;
    case DType::f32: f(float{}); return;
    default:
      fail(fmt::format("{} on the CPU supports f64 and f32, not {}", op, dtype_name(dtype)),
           "run bf16 on a GPU, or choose --dtype f32");
  }
}

// OpenMP threads available to a parallel loop, and this thread's index in one (1 and 0 without OpenMP).
inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Below this much arithmetic a parallel region costs more than it saves (opening one on 16 threads
// takes tens of microseconds); `#pragma omp parallel for if(worth_threads(flops))`.
inline bool worth_threads(double flops) { return flops >= 4.0e6; }

// The dispatch of a build without CUDA (CW_DISPATCH_GPU): `call` names the op.
inline void check_cpu(const Tensor& t, const char* call) {
  CW_CHECK_HINT(t.device.is_cpu(), "rebuild with CUDA (meson finds nvcc and cuBLAS), or keep the tensors on the CPU",
                "{}: the operands are on {}, and this build has no CUDA", call, device_name(t.device));
}

}  // namespace cw::cpu
