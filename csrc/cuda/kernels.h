// CUDA copy and reduction kernels: the device counterparts of reduce/reduce.h,
// enqueued on a caller's stream. A CPU and a GPU reduction of the same inputs
// give the same bits (left fold, float16/bfloat16 accumulated in float32 and
// rounded once to nearest even, NaN stored as the canonical quiet NaN, min/max
// propagate NaN, integers wrap): see reduce/reduce_generic.cc for the
// definition.
//
// The fused ring steps of NCCL's primitives are single calls, so that a ring
// step reads each input byte once and writes each output byte once:
//   send(in)                      copy(next_slot, nullptr, in)
//   recvReduceSend                reduce{srcs = {peer_slot, in}, dst0 = next_slot}
//   recvReduceCopySend            reduce{srcs = {peer_slot, in}, dst0 = next_slot, dst1 = out}
//   recvReduceCopy (last rank)    reduce{srcs = {peer_slot, in}, dst0 = out}
//   recvCopySend                  copy(next_slot, out, peer_slot)
//   recv                          copy(out, nullptr, peer_slot)
//   directRecvReduceCopySend etc. reduce with up to kMaxSrcs peer buffers as srcs
// where peer_slot / next_slot may be buffers of another process mapped with
// CUDA IPC. AVG is SUM followed by scale_avg on the final result.
//
// Every call validates its arguments (pyc::InvalidArgument), raises
// "pycollectives: no CUDA device" (pyc::Error) when the process has no usable
// CUDA device, does nothing when the count is 0, and checks the launch with
// cudaGetLastError (pyc::Error with file:line). Errors of the kernel itself
// surface on the stream, as for any CUDA work.
//
// Alignment: pointers of reduce/scale_avg must be aligned to the element size.
// When every pointer of a call has the same address modulo 16, the body runs
// on 16-byte vectors with scalar head and tail elements; otherwise element by
// element (copy: the widest access width that all its pointers share).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "reduce/reduce.h"  // pyc::ReduceArgs, DataType, ReduceOp

namespace pyc::cuda {

// Same semantics as pyc::reduce (reduce/reduce.h), on device memory, enqueued on `stream`.
// srcs: up to kMaxSrcs device pointers (the pointer array itself is host memory: pass it by value
// in a kernel-parameter struct). dst0/dst1/srcs may be memory of another process mapped by CUDA
// IPC.
constexpr int kMaxSrcs = 8;
void reduce(const ReduceArgs& args, cudaStream_t stream);
void scale_avg(void* x, DataType dtype, size_t count, int divisor, cudaStream_t stream);
// dst0 (and dst1 when not null) = src, `bytes` bytes, on `stream`.
void copy(void* dst0, void* dst1, const void* src, size_t bytes, cudaStream_t stream);

}  // namespace pyc::cuda
