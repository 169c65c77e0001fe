// What the fast path knows of a torch CPU tensor (address, size, dtype),
// read through the CPython C API with no Python frames: one call through
// torch's DLPack exchange table where torch has one, attribute reads
// otherwise. Anything it does not recognise is declined, and the Python layer
// handles it, errors included.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

namespace pyc {

struct TensorView {
  uintptr_t ptr = 0;
  size_t numel = 0;
  int dtype = -1;
};

// Registers torch.Tensor, the torch dtype objects in DataType order and
// torch.UntypedStorage (called once by Python).
void set_torch(pybind11::handle tensor_type, pybind11::sequence dtypes,
               pybind11::handle storage_type);

// Fills `out` and returns true for a contiguous CPU torch tensor of a
// supported dtype whose negative bit is clear and whose bytes are in memory:
// a storage resized to 0 (as FSDP frees parameters) is declined; a storage
// shrunk to less than the tensor needs is declined too, except for an exact
// torch.Tensor, where only the Python layer checks it (tensor_view.cc says
// why). Returns false for anything else (the Python layer then says why).
bool view_tensor(PyObject* obj, TensorView* out);

// Adds set_torch, view_tensor(obj) (METH_O: (address, numel, dtype code) or
// None) and dlpack_exchange() to the module.
void bind_tensor_view(pybind11::module_& m);

}  // namespace pyc
