// The reduce kernels of the int dtypes (see kernels_device.cuh), in a file
// of their own so that nvcc compiles the dtype groups in parallel.
#include "cuda/kernels_device.cuh"

namespace pyc::cuda::detail {

void reduce_int8(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<Native<int8_t>>(p, op, vectorized, stream);
}

void reduce_uint8(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<Native<uint8_t>>(p, op, vectorized, stream);
}

void reduce_int32(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<Native<int32_t>>(p, op, vectorized, stream);
}

void reduce_int64(const ReduceParams& p, ReduceOp op, bool vectorized, cudaStream_t stream) {
  launch_reduce<Native<int64_t>>(p, op, vectorized, stream);
}

}  // namespace pyc::cuda::detail
