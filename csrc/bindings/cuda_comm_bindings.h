// Bindings of the CUDA path of the Communicator (cuda/cuda_path.h): module
// functions cuda_all_reduce(comm, ...) etc. and the CudaWork handle. In a
// build without CUDA the same functions raise "built without CUDA".
#pragma once

#include <pybind11/pybind11.h>

namespace pyc {

void bind_cuda_comm(pybind11::module_& m);

}  // namespace pyc
