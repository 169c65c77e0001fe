// The reduce kernels of the float dtypes (see kernels_device.cuh), in a file
// of their own so that nvcc compiles the dtype groups in parallel.
#include "cuda/kernels_device.cuh"

namespace pyc::cuda::detail {

void reduce_float32(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<Native<float>>(p, op, vectorized, stream);
}

void reduce_float64(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<Native<double>>(p, op, vectorized, stream);
}

}  // namespace pyc::cuda::detail
