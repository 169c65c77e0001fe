// Test hooks for the CPU reduction kernels, exposed on pycollectives._C.
#pragma once

#include <pybind11/pybind11.h>

namespace pyc {

// Adds _reduce, _scale_avg and simd_level to the module.
void bind_reduce(pybind11::module_& m);

}  // namespace pyc
