// Checked conversions of the integers Python passes to the bindings: raw
// addresses, dtype and reduce-op codes. A bad code raises InvalidArgument
// (ValueError in Python) naming the function.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "core/types.h"

namespace pyc {

inline void* address(uintptr_t p) { return reinterpret_cast<void*>(p); }

inline DataType checked_dtype(int v, const char* fn) {
  if (!valid_dtype(v))
    PYC_THROW(InvalidArgument, "pycollectives: " << fn << ": invalid dtype code " << v);
  return static_cast<DataType>(v);
}

inline ReduceOp checked_op(int v, const char* fn) {
  if (!valid_reduce_op(v))
    PYC_THROW(InvalidArgument, "pycollectives: " << fn << ": invalid reduce op code " << v);
  return static_cast<ReduceOp>(v);
}

// The kernels take sum, prod, min or max: avg is a sum followed by scale_avg.
inline ReduceOp checked_kernel_op(int v, const char* fn) {
  if (!valid_reduce_op(v) || static_cast<ReduceOp>(v) == ReduceOp::kAvg)
    PYC_THROW(InvalidArgument, "pycollectives: " << fn << ": invalid reduce kernel op code " << v
                                                 << " (sum, prod, min or max)");
  return static_cast<ReduceOp>(v);
}

// Source addresses as the pointers a ReduceArgs takes.
inline std::vector<const void*> addresses(const std::vector<uintptr_t>& v) {
  std::vector<const void*> out;
  out.reserve(v.size());
  for (uintptr_t p : v) out.push_back(address(p));
  return out;
}

// What every CUDA binding raises in a build without the CUDA sources.
[[noreturn]] inline void throw_built_without_cuda(const char* fn) {
  PYC_THROW(Error, "pycollectives: " << fn
                                     << ": pycollectives was built without CUDA (rebuild with "
                                        "nvcc on PATH or CUDA_HOME set, or PYCOLL_CUDA=1)");
}

}  // namespace pyc
