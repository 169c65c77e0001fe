// Python access to the CUDA kernels (csrc/cuda/kernels.h) on raw device
// addresses, for tests and benchmarks, and the CUDA build/device queries.
// Compiled in every build: without CUDA the kernel entry points raise
// "pycollectives was built without CUDA".
#pragma once

#include <pybind11/pybind11.h>

namespace pyc {

// Adds cuda_built, cuda_device_count, _cuda_reduce, _cuda_scale_avg and
// _cuda_copy to the module.
void bind_cuda(pybind11::module_& m);

}  // namespace pyc
