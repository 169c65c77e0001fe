// The reduce kernels of the half dtypes (see kernels_device.cuh), in a file
// of their own so that nvcc compiles the dtype groups in parallel.
#include "cuda/kernels_device.cuh"

namespace pyc::cuda::detail {

void reduce_float16(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<Half>(p, op, vectorized, stream);
}

void reduce_bfloat16(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<BFloat16>(p, op, vectorized, stream);
}

}  // namespace pyc::cuda::detail
