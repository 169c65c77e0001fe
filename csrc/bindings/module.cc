// pycollectives._C: the Python bindings. Buffers arrive as integer addresses
// with element counts (the Python layer validates torch tensors and NumPy
// arrays); every blocking call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/convert.h"
#include "bindings/cuda_bindings.h"
#include "bindings/cuda_comm_bindings.h"
#include "bindings/fast_path.h"
#include "bindings/reduce_bindings.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace py = pybind11;
using namespace pyc;

namespace {

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// The fast paths' op argument: a valid ReduceOp code, or false (the Python
// path then handles it, errors included).
bool fast_op(py::handle op, ReduceOp* out) {
  if (!PyLong_Check(op.ptr()) || PyBool_Check(op.ptr())) return false;
  const long code = PyLong_AsLong(op.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (!valid_reduce_op(static_cast<int>(code))) return false;
  *out = static_cast<ReduceOp>(code);
  return true;
}

// The fast paths' pair of tensors: `big` holds nranks blocks of `small`'s
// size and dtype, and the two are disjoint or `small` is block `rank` of `big`
// (the in-place layout). False for anything else.
bool fast_pair(py::handle big, py::handle small, int nranks, int rank, TensorView* b,
               TensorView* s) {
  if (!view_tensor(big, b) || !view_tensor(small, s) || b->dtype != s->dtype ||
      b->numel != s->numel * static_cast<size_t>(nranks))
    return false;
  const size_t es = dtype_size(static_cast<DataType>(s->dtype));
  const uintptr_t b_end = b->ptr + b->numel * es, s_end = s->ptr + s->numel * es;
  const bool disjoint = s->numel == 0 || s_end <= b->ptr || b_end <= s->ptr;
  return disjoint || s->ptr == b->ptr + static_cast<size_t>(rank) * s->numel * es;
}

// Python exception classes from pycollectives.errors, looked up once.
py::object error_class(const char* name) {
  return py::module_::import("pycollectives.errors").attr(name);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pycollectives core: shared-memory collectives on raw buffers";
  bind_reduce(m);
  bind_cuda(m);
  bind_cuda_comm(m);

  static py::object timeout_cls = error_class("CollectiveTimeout");
  static py::object peer_cls = error_class("PeerFailure");
  static py::object mismatch_cls = error_class("CollectiveMismatch");
  static py::object aborted_cls = error_class("CommunicatorAborted");
  static py::object base_cls = error_class("PyCollectivesError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(timeout_cls.ptr(), e.what());
    } catch (const PeerFailure& e) {
      PyErr_SetString(peer_cls.ptr(), e.what());
    } catch (const Mismatch& e) {
      PyErr_SetString(mismatch_cls.ptr(), e.what());
    } catch (const Interrupted& e) {
      PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
    } catch (const Aborted& e) {
      PyErr_SetString(aborted_cls.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(base_cls.ptr(), e.what());
    }
  });

  // A blocking call releases the GIL; while it sleeps, this hook lets Ctrl-C
  // through: on a thread that Python knows (the caller's, never the progress
  // thread), take the GIL and run the signal handlers.
  set_interrupt_check([]() -> bool {
    if (PyGILState_GetThisThreadState() == nullptr || python_finalizing()) return false;
    PyGILState_STATE st = PyGILState_Ensure();
    const bool raised = PyErr_CheckSignals() != 0;
    if (raised) PyErr_Clear();  // re-raised as KeyboardInterrupt by the translator
    PyGILState_Release(st);
    return raised;
  });
  m.def("unique_segment_name", &ShmSegment::unique_name);
  m.def("set_torch_dtypes", &set_torch_dtypes);

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("wait", &Work::wait, py::arg("timeout") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &Work::is_completed);

  // A symmetric window's local buffer, exported as bytes (torch.frombuffer
  // keeps this object, hence the mapping, alive as long as the tensor).
  py::class_<ShmWindow, std::shared_ptr<ShmWindow>>(m, "Window", py::buffer_protocol())
      .def_property_readonly("nbytes", &ShmWindow::bytes)
      .def_property_readonly(
          "ptr", [](const ShmWindow& w) { return reinterpret_cast<uintptr_t>(w.local()); })
      .def_buffer([](ShmWindow& w) {
        return py::buffer_info(w.local(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(w.bytes())}, {1});
      });

  using C = Communicator;
  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<C, std::shared_ptr<C>>(m, "Communicator")
      .def(py::init([](int rank, int n, const std::string& name, bool creator, double timeout) {
             return std::make_shared<C>(rank, n, name, creator, CommConfig::from_env(), timeout);
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("name"), py::arg("creator"),
           py::arg("timeout"), G())
      .def("connect", &C::connect, G())
      .def("close", &C::close, G())
      .def_property_readonly("rank", &C::rank)
      .def_property_readonly("world_size", &C::world_size)
      .def_property_readonly("algo", &C::algo_name)
      .def_property_readonly("cma", &C::cma_enabled)
      .def(
          "all_reduce",
          [](C& c, uintptr_t buf, size_t n, int dt, int op, bool async, double to) {
            return c.all_reduce(address(buf), n, checked_dtype(dt, "Communicator"),
                                checked_op(op, "Communicator"), async, to);
          },
          G())
      .def("all_reduce_fast",
           // Synchronous all-reduce of a torch CPU tensor with the default
           // timeout; returns False (nothing done) when the tensor or op needs
           // the Python path.
           [](C& c, py::handle tensor, py::handle op) {
             TensorView v;
             ReduceOp code;
             if (!fast_op(op, &code) || !view_tensor(tensor, &v)) return false;
             py::gil_scoped_release nogil;
             c.all_reduce(address(v.ptr), v.numel, static_cast<DataType>(v.dtype), code, false,
                          -1.0);
             return true;
           })
      .def("reduce_scatter_fast",
           // As all_reduce_fast: synchronous, default timeout, torch CPU tensors.
           [](C& c, py::handle output, py::handle input, py::handle op) {
             TensorView out, in;
             ReduceOp code;
             if (!fast_op(op, &code) ||
                 !fast_pair(input, output, c.world_size(), c.rank(), &in, &out))
               return false;
             py::gil_scoped_release nogil;
             c.reduce_scatter(address(out.ptr), address(in.ptr), out.numel,
                              static_cast<DataType>(out.dtype), code, false, -1.0);
             return true;
           })
      .def("all_gather_fast",
           [](C& c, py::handle output, py::handle input) {
             TensorView out, in;
             if (!fast_pair(output, input, c.world_size(), c.rank(), &out, &in)) return false;
             py::gil_scoped_release nogil;
             c.all_gather(address(out.ptr), address(in.ptr), in.numel,
                          static_cast<DataType>(in.dtype), false, -1.0);
             return true;
           })
      .def(
          "reduce_scatter",
          [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, int op, bool async, double to) {
            return c.reduce_scatter(address(out), address(in), n, checked_dtype(dt, "Communicator"),
                                    checked_op(op, "Communicator"), async, to);
          },
          G())
      .def(
          "all_gather",
          [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, bool async, double to) {
            return c.all_gather(address(out), address(in), n, checked_dtype(dt, "Communicator"),
                                async, to);
          },
          G())
      .def(
          "broadcast",
          [](C& c, uintptr_t buf, size_t n, int dt, int root, bool async, double to) {
            return c.broadcast(address(buf), n, checked_dtype(dt, "Communicator"), root, async, to);
          },
          G())
      .def(
          "reduce",
          [](C& c, uintptr_t buf, size_t n, int dt, int op, int root, bool async, double to) {
            return c.reduce(address(buf), n, checked_dtype(dt, "Communicator"),
                            checked_op(op, "Communicator"), root, async, to);
          },
          G())
      .def(
          "all_to_all",
          [](C& c, uintptr_t out, uintptr_t in, size_t n, int dt, bool async, double to) {
            return c.all_to_all(address(out), address(in), n, checked_dtype(dt, "Communicator"),
                                async, to);
          },
          G())
      .def(
          "send",
          [](C& c, uintptr_t buf, size_t n, int dt, int peer, bool async, double to) {
            return c.send(address(buf), n, checked_dtype(dt, "Communicator"), peer, async, to);
          },
          G())
      .def(
          "recv",
          [](C& c, uintptr_t buf, size_t n, int dt, int peer, bool async, double to) {
            return c.recv(address(buf), n, checked_dtype(dt, "Communicator"), peer, async, to);
          },
          G())
      .def("batch_p2p",
           // items: (is_send, ptr, count, dtype, peer) tuples
           [](C& c, const std::vector<std::tuple<bool, uintptr_t, size_t, int, int>>& items,
              bool async, double to) {
             std::vector<Communicator::P2PItem> v;
             v.reserve(items.size());
             for (const auto& [is_send, p, n, dt, peer] : items)
               v.push_back({is_send, address(p), n, checked_dtype(dt, "Communicator"), peer});
             py::gil_scoped_release nogil;
             return c.batch_p2p(std::move(v), async, to);
           })
      .def("alloc_window", &C::alloc_window, py::arg("nbytes"), py::arg("timeout"), G())
      .def("barrier", &C::barrier, G())
      .def("split", &C::split, G())
      .def("stats", [](const C& c) {
        py::dict d;
        for (int k = 0; k < kNumOpKinds; ++k) {
          const OpStats& s = c.stats(static_cast<OpKind>(k));
          if (s.calls.load() == 0) continue;
          py::dict e;
          e["calls"] = s.calls.load();
          e["bytes_sent"] = s.bytes_sent.load();
          e["bytes_received"] = s.bytes_recv.load();
          e["time_s"] = static_cast<double>(s.time_ns.load()) * 1e-9;
          py::dict paths;  // how the calls moved their bytes
          for (int p = 0; p < kNumPaths; ++p)
            if (s.paths[p].load() > 0) paths[path_name(static_cast<Path>(p))] = s.paths[p].load();
          e["paths"] = paths;
          e["taken_over"] = s.taken_over.load();  // single copy: chunks done for a peer
          d[op_kind_name(static_cast<OpKind>(k))] = e;
        }
        return d;
      });
}
