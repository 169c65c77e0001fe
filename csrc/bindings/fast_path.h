// The synchronous fast path for torch CPU tensors: reads a tensor's dtype,
// device, contiguity, address and size through the C API (no Python frames;
// one call through torch's DLPack exchange table where torch has one),
// and runs the collective from a METH_FASTCALL method of a plain CPython type
// (no pybind11 dispatch), so an 8-byte all-reduce costs little more than its
// handshake. Anything unusual is declined and the Python layer handles it,
// errors included.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace pyc {

struct TensorView {
  uintptr_t ptr = 0;
  size_t numel = 0;
  int dtype = -1;
};

// Registers torch.Tensor and the torch dtype objects in DataType order
// (called once by Python).
void set_torch(pybind11::handle tensor_type, pybind11::sequence dtypes);

// Fills `out` and returns true for a contiguous CPU torch tensor of a
// supported dtype whose negative bit is clear; returns false for anything else.
bool view_tensor(PyObject* obj, TensorView* out);

// Adds the FastPath type and fast_path(communicator), which makes one: its
// methods all_reduce(tensor, op), reduce_scatter(output, input, op) and
// all_gather(output, input) run the collective synchronously with the default
// timeout and return True, or return False (nothing done) for anything the
// Python layer must handle.
void bind_fast_path(pybind11::module_& m);

}  // namespace pyc
