// The CUDA path's bindings (see cuda_comm_bindings.h). Buffers arrive as
// integer device addresses, streams as integer cudaStream_t values (torch's
// `torch.cuda.current_stream().cuda_stream`); the core stays torch-free.
// Every call releases the GIL.
#include "bindings/cuda_comm_bindings.h"

#include <cstdint>

#include "bindings/convert.h"
#include "comm/communicator.h"
#include "core/error.h"

#ifdef PYCOLL_WITH_CUDA
#include "cuda/cuda_path.h"
#endif

namespace py = pybind11;

namespace pyc {
namespace {

#ifdef PYCOLL_WITH_CUDA

CudaCall call(int device, uintptr_t stream, bool async_op, double timeout) {
  CudaCall c;
  c.device = device;
  c.stream = stream;
  c.sync = !async_op;
  c.timeout_s = timeout;
  return c;
}
#endif

}  // namespace

void bind_cuda_comm(py::module_& m) {
#ifdef PYCOLL_WITH_CUDA
  using C = Communicator;
  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<CudaWork, std::shared_ptr<CudaWork>>(m, "CudaWork")
      .def("wait_stream", &CudaWork::wait_stream, py::arg("stream"), py::arg("timeout") = -1.0, G(),
           "Blocks until the operation's last kernel is enqueued, then makes `stream` wait for "
           "it on the GPU; False on timeout.")
      .def("wait", &CudaWork::wait_host, py::arg("timeout") = -1.0, G(),
           "Blocks until every kernel of the operation has completed; False on timeout.")
      .def("is_completed", &CudaWork::is_completed);
  m.def(
      "cuda_all_reduce",
      [](C& c, uintptr_t buf, size_t n, int dt, int op, int dev, uintptr_t stream, bool async_op,
         double to) {
        return cuda_all_reduce(c, address(buf), n, checked_dtype(dt, "cuda collective"),
                               checked_op(op, "cuda collective"), call(dev, stream, async_op, to));
      },
      G());
  m.def(
      "cuda_reduce_scatter",
      [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, int op, int dev, uintptr_t stream,
         bool async_op, double to) {
        return cuda_reduce_scatter(
            c, address(out), address(in), n, checked_dtype(dt, "cuda collective"),
            checked_op(op, "cuda collective"), call(dev, stream, async_op, to));
      },
      G());
  m.def(
      "cuda_all_gather",
      [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, int dev, uintptr_t stream,
         bool async_op, double to) {
        return cuda_all_gather(c, address(out), address(in), n,
                               checked_dtype(dt, "cuda collective"),
                               call(dev, stream, async_op, to));
      },
      G());
  m.def(
      "cuda_broadcast",
      [](C& c, uintptr_t buf, size_t n, int dt, int root, int dev, uintptr_t stream, bool async_op,
         double to) {
        return cuda_broadcast(c, address(buf), n, checked_dtype(dt, "cuda collective"), root,
                              call(dev, stream, async_op, to));
      },
      G());
  m.def(
      "cuda_reduce",
      [](C& c, uintptr_t buf, size_t n, int dt, int op, int root, int dev, uintptr_t stream,
         bool async_op, double to) {
        return cuda_reduce(c, address(buf), n, checked_dtype(dt, "cuda collective"),
                           checked_op(op, "cuda collective"), root,
                           call(dev, stream, async_op, to));
      },
      G());
  m.def(
      "cuda_all_to_all",
      [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, int dev, uintptr_t stream,
         bool async_op, double to) {
        return cuda_all_to_all(c, address(out), address(in), n,
                               checked_dtype(dt, "cuda collective"),
                               call(dev, stream, async_op, to));
      },
      G());
  m.def(
      "cuda_send",
      [](C& c, uintptr_t buf, size_t n, int dt, int peer, int dev, uintptr_t stream, bool async_op,
         double to) {
        return cuda_send(c, address(buf), n, checked_dtype(dt, "cuda collective"), peer,
                         call(dev, stream, async_op, to));
      },
      G());
  m.def(
      "cuda_recv",
      [](C& c, uintptr_t buf, size_t n, int dt, int peer, int dev, uintptr_t stream, bool async_op,
         double to) {
        return cuda_recv(c, address(buf), n, checked_dtype(dt, "cuda collective"), peer,
                         call(dev, stream, async_op, to));
      },
      G());
  m.def("cuda_pointer_device", &cuda_pointer_device, G(),
        "The CUDA device of a device or managed address, or -1 for host memory.");
#else
  for (const char* name :
       {"cuda_all_reduce", "cuda_reduce_scatter", "cuda_all_gather", "cuda_broadcast",
        "cuda_reduce", "cuda_all_to_all", "cuda_send", "cuda_recv", "cuda_pointer_device"}) {
    m.def(name, [name](const py::args&) { throw_built_without_cuda(name); });
  }
#endif
}

}  // namespace pyc
