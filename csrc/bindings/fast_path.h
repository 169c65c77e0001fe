// The synchronous fast path for torch CPU tensors: the tensors are described
// through the C API (tensor_view.h) and the collective runs from a
// METH_FASTCALL method of a plain CPython type (no pybind11 dispatch), so an
// 8-byte all-reduce costs little more than its handshake. Anything unusual is
// declined and the Python layer handles it, errors included.
#pragma once

#include <pybind11/pybind11.h>

namespace pyc {

// Adds the FastPath type and fast_path(communicator), which makes one. Its
// methods all_reduce(tensor, op), reduce_scatter(output, input, op),
// all_gather(output, input), broadcast(tensor, src), reduce(tensor, dst, op),
// all_to_all(output, input), send(tensor, dst), recv(tensor, src) and
// batch_p2p(ops) run the operation synchronously with the default timeout and
// return True, or return False (nothing done) for anything the Python layer
// must handle.
void bind_fast_path(pybind11::module_& m);

// Adds the FastMethod type and fast_method(fast, method, self_ref,
// default_arg) (fast_method.cc): a communicator's method as a C callable that
// runs fast(a, b) for a call with one or two positional arguments and falls
// back to the Python method (keywords, anything the fast path declines), so
// that the common call has no Python frame. The communicator sets it on
// itself (Communicator.__init__), holding the communicator only weakly.
void bind_fast_method(pybind11::module_& m);

}  // namespace pyc
