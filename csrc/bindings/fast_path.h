// The synchronous fast path for torch CPU tensors: reads a tensor's dtype,
// device, contiguity, address and size through the C API (no Python frames),
// so an 8-byte all-reduce costs little more than its handshake. Anything
// unusual is declined and the Python layer handles it, errors included.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace pyc {

struct TensorView {
  uintptr_t ptr = 0;
  size_t numel = 0;
  int dtype = -1;
};

// Registers the torch dtype objects in DataType order (called once by Python).
void set_torch_dtypes(pybind11::sequence dtypes);

// Fills `out` and returns true for a contiguous CPU torch tensor of a
// supported dtype; returns false for anything else.
bool view_tensor(pybind11::handle obj, TensorView* out);

}  // namespace pyc
